"""Stopping cleanly when the batch system asks.

SIGTERM and SIGUSR1 (what Slurm and SGE send before a kill) set a flag; the
loop finishes the current update, saves and exits with 75 (EX_TEMPFAIL, "try
again": a requeue script reruns the command with ``--resume``). A second
signal during the stop (Slurm and torchrun send SIGTERM again) only sets the
flag again: the save completes. A signal before training starts (loading
data, building the model) stops at once with 75: there is nothing to save yet
(:func:`guard_startup` covers the moments before the trainer exists).

Ctrl-C (SIGINT) in training stops the same way, with Ctrl-C's exit code
(130): the update under way finishes and is saved, and the line says how to
resume. A Ctrl-C reaches a rank twice, from the terminal (the whole
foreground process group) and from its launcher (which forwards it), within
moments: a second SIGINT within ``SAME_CTRL_C_S`` of the first is that same
one; a later one aborts at once, without saving (Python's KeyboardInterrupt).
Where SIGINT was not Python's default (ignored, or the user's own handler),
it is left alone; and the run hands it back when it ends (a notebook's
interrupt is the notebook's again).

Every rank must stop at the same update, whichever got the signal. The flags
are summed on the host (a CPU tensor over a gloo group, never a CUDA tensor,
so a CUDA step never waits for it), asynchronously, every ``every`` updates,
and read at the next update: no collective on most updates, no wait on any.
"""
from __future__ import annotations

import signal

from textbox_like.core.errors import say
from textbox_like.core.faults import StoppedEarly

PREEMPTED_EXIT_CODE = 75
INTERRUPTED_EXIT_CODE = 130   # the shell's code for death by SIGINT, kept for a Ctrl-C that saved
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAME_CTRL_C_S = 1.0


def leaving(code):
    """The process exits with ``code`` now: from here SIGTERM/SIGUSR1 are
    ignored. (While shutting down, Python restores the default action, and a
    second signal a second after the first would turn the 75 of a saved stop
    into death by the signal, 143, which a requeue script does not retry.)"""
    for sig in SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:
            pass
    return code


def _ignore(_signum, _frame):
    pass


#: the signal that stopped start-up, kept after its exception was raised:
#: code it was raised in may swallow it (numpy's lazy import of numpy.random,
#: under set_seed, cleared it, and the run went on to load its data and train)
_stopped_by = None


def _stopped_early(signum) -> StoppedEarly:
    return StoppedEarly(f"stopped by {signal.Signals(signum).name} during start-up, before training began; "
                        f"nothing to save: rerun the same command")


def _stop_now(signum, _frame):
    global _stopped_by
    for sig in SIGNALS:  # a second signal must not interrupt the way out
        signal.signal(sig, _ignore)
    _stopped_by = signum
    raise _stopped_early(signum)


def raise_if_stopped():
    """Raise again the stop of a start-up signal whose exception the code it
    landed in swallowed (a library's broad except, C code clearing errors):
    called between the phases of start-up, and as training begins."""
    if _stopped_by is not None:
        raise _stopped_early(_stopped_by)


def _quiet_swallowed_stop(unraisable):
    """``sys.unraisablehook`` while start-up may be stopped: a start-up stop
    raised where Python cannot raise it (a finalizer, a weakref callback that
    the garbage collector ran when the signal came) is not printed as
    "Exception ignored ... Traceback": :func:`raise_if_stopped` raises it
    again at the next phase. Everything else goes to the previous hook."""
    if isinstance(unraisable.exc_value, StoppedEarly) and _stopped_by is not None:
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = None


def _quiet_swallowed_stops():
    global _previous_unraisablehook
    import sys
    if sys.unraisablehook is not _quiet_swallowed_stop:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _quiet_swallowed_stop


def guard_startup():
    """Until a Preemption takes over: SIGTERM/SIGUSR1 stop with 75 and a
    line, not by the signal (which a requeue script does not recognise)."""
    global _stopped_by
    _stopped_by = None   # a new command in this process (the Python API, the tests)
    _quiet_swallowed_stops()
    for sig in SIGNALS:
        try:
            signal.signal(sig, _stop_now)
        except ValueError:  # not the main thread: its caller's handlers stay
            pass


class Preemption:
    def __init__(self, host_group=None, world_size: int = 1, every: int = 10, announce: bool = True):
        self.requested = False   # this process got a signal
        self.agreed = False      # all ranks know some rank got one
        self.signal = None
        self.group = host_group
        self.world_size = world_size
        self.every = max(1, every)
        self.announce = announce  # this rank says that a Ctrl-C was heard (the main one)
        self._pending = None
        self.started = False     # set when training begins
        self.absorbed = 0        # signals that arrived while the stop was under way
        self._first_ctrl_c = None
        for sig in SIGNALS:
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        self._interrupt_handler = None   # SIGINT's handler before this run, while this run holds it
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._interrupt_handler = signal.signal(signal.SIGINT, self._on_ctrl_c)
        except ValueError:  # not the main thread
            pass

    def _handler(self, signum, frame):
        if not self.started:
            _stop_now(signum, frame)
        if self.requested:  # a second signal changes nothing: the stop under way completes
            self.absorbed += 1
        else:
            self.requested = True
            self.signal = signal.Signals(signum).name

    def _on_ctrl_c(self, signum, frame):
        import time
        now = time.monotonic()
        if not self.started:
            raise KeyboardInterrupt  # nothing trained yet: stop at once, as Python does
        if self._first_ctrl_c is None:
            self._first_ctrl_c = now
            if not self.requested:
                self.requested, self.signal = True, "SIGINT"
                if self.announce:
                    say("interrupted (Ctrl-C): finishing this update, saving it and stopping; Ctrl-C again to "
                        "abort at once without saving")
            else:
                self.absorbed += 1
        elif now - self._first_ctrl_c < SAME_CTRL_C_S:
            pass  # the same Ctrl-C, forwarded by the launcher
        else:
            self.hand_back_interrupt()
            raise KeyboardInterrupt

    def hand_back_interrupt(self):
        """SIGINT's handler as it was before this run (the run has ended, or a
        second Ctrl-C aborts it)."""
        if self._interrupt_handler is not None:
            try:
                signal.signal(signal.SIGINT, self._interrupt_handler)
            except ValueError:
                pass
            self._interrupt_handler = None

    @property
    def exit_code(self) -> int:
        """A stop's exit code: 130 for a Ctrl-C (as the shell reports one), 75 for the batch system's signals."""
        return INTERRUPTED_EXIT_CODE if self.signal == "SIGINT" else PREEMPTED_EXIT_CODE

    def poll(self, num_updates: int) -> bool:
        """Called once after every update on every rank; True once all ranks agree to stop."""
        if self.world_size == 1:
            self.agreed = self.requested
            return self.agreed
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag[0] > 0:
                self.agreed = True
        if not self.agreed and num_updates % self.every == 0:
            import torch
            import torch.distributed as dist
            flag = torch.tensor([1.0 if self.requested else 0.0])  # host memory, on purpose
            self._pending = (dist.all_reduce(flag, group=self.group, async_op=True), flag)
        return self.agreed

    def due(self, num_updates: int) -> bool:
        """Whether poll() after this update may stop the run or start a collective."""
        if self.world_size == 1:
            return self.requested
        # only what every rank sees alike: a signal reaches one rank
        return self.agreed or self._pending is not None or num_updates % self.every == 0

    def close(self):
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def message(self, saved: bool, last_name: str = "checkpoint_last.pt") -> str:
        """The stop's line; ``last_name``: the file the save wrote (``checkpoint_last.dcp`` under --fsdp)."""
        return (f"stopped by {'Ctrl-C (SIGINT)' if self.signal == 'SIGINT' else self.signal or 'a signal'}"
                + (f" ({self.absorbed} more signal(s) during the stop, absorbed)" if self.absorbed else "")
                + (f"; {last_name} saved: rerun the same command with --resume" if saved
                   else "; nothing was saved (--no-save or --no-last-checkpoints)"))
