"""How a trainer process this one starts comes to be: a node's ranks
(distributed.run_local_ranks) and a search's trials (search/trials.py).

Where nothing stands in the way (:func:`can_fork`), the child is a fork of
this process: torch and the trainer are imported already, where a fresh
interpreter spends ~3 CPU-s importing them again (most of a short run's start,
and, with more ranks than cores, of its wall time). Otherwise, and always
with ``TEXTBOX_LIKE_FORK=0``, it is a fresh interpreter. Both run the same
resolved configuration file the same way and are supervised the same way
(a ``subprocess.Popen`` or a :class:`ForkedChild`, which answers as one does),
and both get SIGTERM when this process dies (Linux ``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
import warnings

PR_SET_PDEATHSIG = 1
#: a fresh interpreter's program: run the resolved configuration file argv[1]
TRAINER = "import sys; from textbox_like.cli import leave, run_resolved; leave(run_resolved(sys.argv[1]))"


def signal_when_parent_dies(signum, parent: int) -> None:
    """Ask the kernel (Linux; elsewhere nothing happens) to send this process
    ``signum`` when ``parent``, the process that started it, dies, instead of
    leaving it to run on as an orphan. A parent that died before the request
    has already gone (this process was reparented: getppid differs), and the
    signal would never come: the process exits now, as the signal would end it."""
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no C library to load, or no prctl in it
        return
    if os.getppid() != parent:
        os._exit(128 + int(signum))


def die_with_parent():
    """A ``preexec_fn`` for a child of this process (this thread: the kernel
    ties PR_SET_PDEATHSIG to the thread that forks): SIGTERM (save and stop)
    when the parent dies, instead of training on as an orphan; a parent that
    died between the fork and the prctl has already gone, so the child
    stops before it starts."""
    parent = os.getpid()

    def preexec():
        signal_when_parent_dies(signal.SIGTERM, parent)
    return preexec


def can_fork(environment=None) -> bool:
    """Whether a trainer may start as a fork of this process: on Linux, from
    the main thread, with no other Python thread (a lock another thread held
    at the fork would stay held in the child) but those that pause across a
    fork (``safe_to_fork``: a save directory's lock refresher), no CUDA on
    this machine (a CUDA driver the parent touched does not work in its
    forks: GPU ranks start fresh), and nothing the child needs at its start
    (``environment``: a PYTHONPATH, read by a new interpreter only).
    ``TEXTBOX_LIKE_FORK=0`` says no always."""
    import threading
    if os.environ.get("TEXTBOX_LIKE_FORK", "1") == "0" or environment or not sys.platform.startswith("linux") \
            or threading.current_thread() is not threading.main_thread() \
            or not all(t is threading.main_thread() or getattr(t, "safe_to_fork", False)
                       for t in threading.enumerate()):
        return False
    import torch
    return not torch.cuda.is_initialized() and not torch.cuda.is_available()


def start_trainer(resolved, env, fork, stdout=None, stderr=None, new_session=False):
    """A trainer process for the resolved configuration file ``resolved``, with
    ``env`` as its whole environment: a fork of this process (``fork``: what
    :func:`can_fork` said) or a fresh interpreter. ``stdout``/``stderr``: open
    files for its output (None: this process's); ``new_session``: its own
    session, out of reach of a terminal's Ctrl-C."""
    if not fork:
        return subprocess.Popen([sys.executable, "-c", TRAINER, str(resolved)], env=env, stdout=stdout,
                                stderr=stderr, start_new_session=new_session, preexec_fn=die_with_parent())
    return ForkedChild.start(resolved, env, stdout, stderr, new_session)


def prepare_forks():
    """Before this process forks its ranks: what every rank would import
    otherwise, imported once here (DDP's constructor imports torch's compiler,
    ~1.3 CPU-s)."""
    import torch._dynamo  # noqa: F401


class ForkedChild:
    """A trainer forked from this process, supervised as a ``subprocess.Popen``
    is: pid, poll, wait, returncode (-N for a signal), send_signal, kill."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    @classmethod
    def start(cls, resolved, env, stdout=None, stderr=None, new_session=False):
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            _flush(stream)
        with warnings.catch_warnings():
            # Python 3.12+ warns of any other thread; can_fork let only those through that pause across it
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _run_forked_trainer(resolved, env, parent, stdout, stderr, new_session)
        return cls(pid)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked trainer {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _run_forked_trainer(resolved, env, parent, stdout, stderr, new_session):
    """The forked child: what a fresh interpreter would have (its environment,
    output, session, argv, signals at their defaults, death with its parent),
    then the same program (TRAINER); it never returns into the parent's code."""
    code = 1
    try:
        if new_session:
            os.setsid()
        for target, file in ((1, stdout), (2, stderr)):
            if file is not None:
                os.dup2(file.fileno(), target)
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal_when_parent_dies(signal.SIGTERM, parent)
        sys.argv = ["-c", str(resolved)]   # the fresh interpreter's program, run here as it would run it
        exec(compile(TRAINER, "<string>", "exec"), {"__name__": "__main__"})  # our own constant, not user text
        code = 0
    except SystemExit as exc:   # sys.exit's rules, as the interpreter would apply them
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  a fresh interpreter would print it and exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
        os._exit(code)


def _flush(stream):
    try:
        stream.flush()
    except (AttributeError, OSError, ValueError):  # no stream (None), or closed
        pass
