"""Faults that end a run with a one-line message and an exit code a script can
act on (sysexits.h), as opposed to :class:`~textbox_like.core.errors.UserError`
(bad input, exit 2) and preemption (exit 75, see :mod:`preemption`)."""
from textbox_like.core.errors import first_line


class RunStopped(Exception):
    """The run stopped on a fault; ``str()`` is the one line for the user."""
    exit_code = 1


class Diverged(RunStopped):
    """Too many consecutive non-finite updates."""
    exit_code = 65  # EX_DATAERR


class SaveFailed(RunStopped):
    """A checkpoint could not be written (full disk, I/O error, permissions)."""
    exit_code = 74  # EX_IOERR


class Superseded(RunStopped):
    """This process's run no longer owns its save directory (savelock.py): a
    newer run holds its lock, or the run ended while this process was stopped
    (SIGSTOP, a frozen machine) and declared lost by its peers. It writes
    nothing more and exits at once (cli.exit_code: no clean-up either, since
    even leaving the process group writes into the rendezvous file, which may
    be the newer run's now)."""
    exit_code = 77  # EX_NOPERM: no longer allowed to write; not 75, which a requeue script would rerun

    def __init__(self, message: str, taken_over: bool = False):
        """``taken_over``: a newer run holds the lock (else the run ended)."""
        super().__init__(message)
        self.taken_over = taken_over


class DataUnavailable(RunStopped):
    """A data file became unreadable mid-run: the state before the failing
    batch is saved, and a rerun with --resume continues from it."""
    exit_code = 75  # EX_TEMPFAIL: a requeue script retries


class DataCorrupt(RunStopped):
    """A data file failed again at the very position where the previous
    attempt failed: damage at rest, not a transient outage; a retry loop
    would never end."""
    exit_code = 65  # EX_DATAERR


class OutOfMemory(RunStopped):
    """An allocation failed during training (host or device memory): the
    state of the last completed update is saved where it can be (one
    process); a retry of the same command would fail again at the same
    batch, so not 75."""
    exit_code = 71  # EX_OSERR


class StoppedEarly(RunStopped):
    """A SIGTERM/SIGUSR1 arrived before training started: nothing to save."""
    exit_code = 75  # EX_TEMPFAIL


def _chain(exc):
    """``exc`` and the exceptions it was raised from or during, newest first."""
    seen = []
    while exc is not None and exc not in seen and len(seen) < 16:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def os_reason(exc: BaseException) -> str:
    """'No space left on device' rather than a serializer's traceback: the
    operating system's words where an OSError is anywhere in the chain."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.strerror:
            return link.strerror
    return first_line(exc, 200)


def failed_writing(exc: BaseException) -> bool:
    """Whether ``exc`` is how a file write fails for reasons of the system
    (full disk, I/O error, permissions, a removed directory): an OSError, or
    torch's zip writer's RuntimeError ('unexpected pos', 'PytorchStreamWriter
    failed writing file') that it raises while closing after one."""
    if isinstance(exc, OSError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(isinstance(link, OSError) for link in _chain(exc)) or any(
            s in text for s in ("inline_container", "PytorchStreamWriter", "unexpected pos", "iostream error"))
    return False


def allocation_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is how an allocation fails: Python's or numpy's
    MemoryError, torch's OutOfMemoryError (CUDA, MPS), or the RuntimeError of
    torch's CPU allocator ('DefaultCPUAllocator: can't allocate memory')."""
    if isinstance(exc, MemoryError):
        return True
    import torch
    if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("can't allocate memory", "Cannot allocate memory", "out of memory"))


def allocation_reason(exc: BaseException) -> str:
    """The allocator's own words, short: 'DefaultCPUAllocator: can't allocate
    memory: you tried to allocate 123 bytes' rather than its enforce prefix."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    for start in ("DefaultCPUAllocator", "CUDA out of memory"):
        if start in text:
            text = text[text.index(start):]
    return text.split(". Error code")[0].split(" Of the allocated")[0][:200].rstrip(". ")


DELAY_ENV = "TEXTBOX_LIKE_TEST_DELAY"


def test_delay(where: str) -> float:
    """Seconds to wait at ``where`` ('start': while loading the data, after
    the save directory's lock; 'save': before each save; 'finish': the main
    process at the run's end, after writing results.json, before removing
    the kept copies and before the end's collectives; 'lock_looks': how long
    a rank looks again for rank 0's lock file instead of LOCK_LOOKS) under
    ``TEXTBOX_LIKE_TEST_DELAY=start=30,save=4``, else 0. Test-only: a slow
    file system, so that a test's signal surely arrives at that moment."""
    import os
    for item in os.environ.get(DELAY_ENV, "").split(","):
        name, _, seconds = item.partition("=")
        if name.strip() == where:
            return float(seconds)
    return 0.0


MEMORY_LIMIT_ENV = "TEXTBOX_LIKE_TEST_MEMORY_LIMIT"


def memory_limit_hook():
    """(megabytes, update) under ``TEXTBOX_LIKE_TEST_MEMORY_LIMIT=MB@UPDATE``,
    else None: a test-only hook that makes host allocations really fail
    (see :func:`limit_address_space`), as a machine whose memory runs out does."""
    import os
    text = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if not text:
        return None
    megabytes, _, update = text.partition("@")
    return int(megabytes), int(update or 0)


def limit_address_space(extra_megabytes: int) -> None:
    """Lower this process's soft RLIMIT_AS to its current size plus
    ``extra_megabytes``: from here on the kernel refuses mappings beyond it,
    and malloc and torch's CPU allocator fail for real (the test hook above)."""
    import resource
    with open("/proc/self/statm") as handle:
        size = int(handle.read().split()[0]) * resource.getpagesize()
    soft = size + (extra_megabytes << 20)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


class HostCopy:
    """A device scalar on its way to the host: the copy is queued behind the
    work that computes it, and ``value()`` waits only if the device has not
    got that far yet (read one update later, it has)."""

    def __init__(self, tensor):
        import torch
        tensor = tensor.detach()
        self.ready = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = tensor.to("cpu")  # CPU: already there; other devices: a plain copy

    def value(self) -> float:
        if self.ready is not None:
            self.ready.synchronize()
        return float(self.host)


def check_writable(directory, create=True) -> None:
    """Refuse a save directory that cannot be written, before any data is
    loaded. ``create``: this process is the run's writer and makes the
    directory; another rank only tests the directory, or where it would be
    made (its nearest existing parent), so that on a shared file system every
    rank refuses at once, and on a node of its own no empty directory is left."""
    import os
    import tempfile
    from pathlib import Path

    from textbox_like.core.errors import UserError
    where = Path(directory)
    try:
        if create:
            os.makedirs(directory, exist_ok=True)
        else:
            while not where.exists() and where != where.parent:
                where = where.parent
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise UserError(f"--save-dir {directory} cannot be written ({os_reason(exc)}); choose a writable "
                        f"directory or pass --no-save") from None
