"""Stopping cleanly when the batch system asks.

SIGTERM and SIGUSR1 (what Slurm and SGE send before a kill) set a flag; the
loop finishes the current update, saves and exits with 75 (EX_TEMPFAIL, "try
again": a requeue script reruns the command with ``--resume``). A second
signal during the stop (Slurm and torchrun send SIGTERM again) only sets the
flag again: the save completes. A signal before training starts (loading
data, building the model) stops at once with 75: there is nothing to save yet
(:func:`guard_startup` covers the moments before the trainer exists).

Every rank must stop at the same update, whichever got the signal. The flags
are summed on the host (a CPU tensor over a gloo group, never a CUDA tensor,
so a CUDA step never waits for it), asynchronously, every ``every`` updates,
and read at the next update: no collective on most updates, no wait on any.
"""
from __future__ import annotations

import signal

from .faults import StoppedEarly

PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


def _stop_now(signum, _frame):
    for sig in SIGNALS:  # a second signal must not interrupt the way out
        signal.signal(sig, _ignore)
    raise StoppedEarly(f"stopped by {signal.Signals(signum).name} during start-up, before training began; "
                       f"nothing to save: rerun the same command")


def guard_startup():
    """Until a Preemption takes over: SIGTERM/SIGUSR1 stop with 75 and a
    line, not by the signal (which a requeue script does not recognise)."""
    for sig in SIGNALS:
        try:
            signal.signal(sig, _stop_now)
        except ValueError:  # not the main thread: its caller's handlers stay
            pass


class Preemption:
    def __init__(self, host_group=None, world_size: int = 1, every: int = 10):
        self.requested = False   # this process got a signal
        self.agreed = False      # all ranks know some rank got one
        self.signal = None
        self.group = host_group
        self.world_size = world_size
        self.every = max(1, every)
        self._pending = None
        self.started = False     # set when training begins
        self.absorbed = 0        # signals that arrived while the stop was under way
        for sig in SIGNALS:
            try:
                signal.signal(sig, self._handler)
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
        return (f"stopped by {self.signal or 'a signal'}"
                + (f" ({self.absorbed} more signal(s) during the stop, absorbed)" if self.absorbed else "")
                + (f"; {last_name} saved: rerun the same command with --resume" if saved
                   else "; nothing was saved (--no-save or --no-last-checkpoints)"))
