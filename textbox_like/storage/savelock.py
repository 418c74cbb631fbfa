"""One run per save directory.

Two runs writing one ``--save-dir`` (a typo, a job resubmitted while the first
still runs) would mix their checkpoints, configs and metrics, and ``--resume``
would continue the wrong one. The first process of a run holds the directory's
lock file, ``run.lock``: a small JSON file naming its host, pid and start time,
made with a hard link (atomic on NFS and Lustre, where ``O_EXCL`` is not
always) and touched every :data:`REFRESH_S` seconds by a background thread.

Another run finds the file and is refused with one line naming the holder,
unless the holder is gone: a dead pid on this host (or the pid now belongs to
another process), or, from any host, a file not refreshed for
:data:`STALE_AFTER_S` seconds. Such a lock is taken over with a line.

While the run goes on the thread also notices the lock removed (the directory
removed or emptied) or replaced (another run took it over).

The lock's token is also the run's *fencing token*: every rank learns it at
start (:func:`own`), and each write into the save directory first proves
that ``run.lock`` still holds it (:func:`check_owner`, called by the write
primitives of :mod:`~textbox_like.storage.fileio`, the metrics log and the emergency
claim). A rank stopped (SIGSTOP, a frozen VM, a cut-off node) and declared lost
by its peers may wake up while a newer run, started with ``--resume`` on the
same directory, holds the lock with its own token: it then writes nothing
and exits 77 (:class:`~textbox_like.core.faults.Superseded`), as a process whose
lease expired does in lease-based systems. The lock holder whose lock file
disappeared (the directory removed or emptied) stops with 74 instead.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref
from pathlib import Path

from textbox_like.core.errors import UserError, note
from textbox_like.core.faults import SaveFailed, Superseded
from textbox_like.core.threads import start_thread

LOCK_NAME = "run.lock"
REFRESH_S = 30.0
STALE_AFTER_S = 600.0


def _process_start(pid: int):
    """The start time of ``pid`` in clock ticks since boot (Linux), or None:
    tells a live holder from another process that got its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("ascii", "replace")
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # kill(0 or -1) would ask about whole process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return True


def _read(path: Path):
    """(holder dict or None if unreadable, mtime) or None when the file is gone."""
    try:
        mtime = path.stat().st_mtime
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw.decode("utf-8"))
        if not isinstance(holder, dict):
            holder = None
    except (UnicodeDecodeError, ValueError):
        holder = None
    return holder, mtime


def describe(holder) -> str:
    if not holder:
        return "an unknown run (the lock file is unreadable)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {started}"


def stale_reason(holder, mtime, now=None, agent=None, save_dir=None):
    """Why the run named by a lock file is gone, or None if it may be alive.
    ``agent``: torchrun's (elastic.Agent) when this process runs under one."""
    now = time.time() if now is None else now
    age = now - mtime
    earlier_group = _earlier_worker_group(holder, agent, save_dir)
    if earlier_group:
        return earlier_group
    if holder and holder.get("host") == socket.gethostname():
        try:
            pid = int(holder.get("pid", -1))
        except (TypeError, ValueError):
            pid = -1
        if pid == os.getpid():
            return "this process's own earlier run"
        if not _pid_alive(pid):
            return f"pid {pid} is no longer running"
        start = _process_start(pid)
        if holder.get("proc_start") is not None and start is not None and start != holder["proc_start"]:
            return f"pid {pid} now belongs to another process"
        return None
    if age > STALE_AFTER_S:
        return f"not refreshed for {age:.0f}s (a live run refreshes it every {REFRESH_S:.0f}s)"
    return None


def _earlier_worker_group(holder, agent, save_dir):
    """A lock of a worker of this elastic run's earlier worker group (on any
    host) is stale once torchrun has started a new group: after a failure
    (a higher restart count), or after the old group's hand-off note."""
    if not holder or agent is None or holder.get("elastic_run") != agent.run_id:
        return None
    if int(holder.get("elastic_restart", 0)) < agent.restart_count:
        return f"a worker of torchrun's worker group {holder.get('elastic_restart', 0)} of this run, since restarted"
    from textbox_like.core.torchrun_env import read_handoff
    note = read_handoff(save_dir) if save_dir is not None else None
    if note and note.get("run_id") == agent.run_id and float(note.get("written", 0)) >= float(holder.get("started", 0)):
        return f"a worker of this run's worker group that stopped at update {note.get('update')} for torchrun"
    return None


class SaveDirLock:
    """The lock of one save directory, held by this process until :meth:`release`.
    A search's ``--output`` is locked the same way (``option``, ``kind``,
    ``name``: how its lines name the directory, its owner and the file)."""

    def __init__(self, directory, option="--save-dir", kind="run", name=LOCK_NAME):
        self.dir = Path(directory)
        self.option, self.kind, self.name = option, kind, name
        self.path = self.dir / name
        self.token = uuid.uuid4().hex
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                       "proc_start": _process_start(os.getpid()), "token": self.token}
        from textbox_like.core.torchrun_env import Agent
        self.agent = Agent.from_env()
        if self.agent is not None:  # lets the next worker group of this run take the lock over
            self.holder.update(elastic_run=self.agent.run_id, elastic_restart=self.agent.restart_count)
        self._stop = threading.Event()
        self._busy = threading.Lock()   # held while the thread works: a fork waits for it (_pause_refreshers)
        self._lost = None
        self._thread = None

    # -------------------------------------------------------------- acquire
    @classmethod
    def acquire(cls, directory) -> "SaveDirLock":
        lock = cls(directory)
        lock.take()
        return lock

    def take(self):
        """Make the lock file (or take over a stale one) and keep it fresh.
        A signal handler may raise anywhere in here, after the file exists:
        whoever holds this object before calling take() can always
        :meth:`release` it (it removes the file only if it holds our token)."""
        self._acquire()
        self._thread = threading.Thread(target=self._refresh, name="textbox_like-save-lock", daemon=True)
        self._thread.safe_to_fork = True  # what processes.children.can_fork asks: it pauses across a fork
        _REFRESHING.add(self)
        start_thread(self._thread)

    def _acquire(self):
        for _ in range(5):
            if self._create():
                return
            found = _read(self.path)
            if found is None:
                continue  # released meanwhile
            holder, mtime = found
            why = stale_reason(holder, mtime, agent=self.agent, save_dir=self.dir)
            if why is None:
                raise UserError(f"{self.option} {self.dir} is in use by another {self.kind} ({describe(holder)}; "
                                f"lock file {self.path}); choose another {self.option}, or wait for that "
                                f"{self.kind} to end (a lock not refreshed for {STALE_AFTER_S:.0f}s is taken over)")
            if self._break(holder, mtime) and holder and holder.get("pid") != os.getpid():
                note(f"took over the lock of {self.option} {self.dir} from {describe(holder)}: {why}")
        raise UserError(f"{self.option} {self.dir}: could not take its lock file {self.path} (other "
                        f"{self.kind}s keep taking it); choose another {self.option}")

    def _create(self) -> bool:
        """Make the lock file with our content, atomically; False if it exists.
        A hard link is atomic on NFS; its reply may be lost, so the link count
        of our own temporary file says whether it took."""
        # named as a temporary file (``.tmp``): a taker killed before its unlink leaves one, as a killed save does
        tmp = self.dir / f".{self.name}.{self.holder['host']}.{os.getpid()}.{self.token[:8]}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self.holder, handle)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise UserError(f"{self.option} {self.dir} cannot be written ({exc.strerror or exc}); choose a writable "
                            f"directory" + (" or pass --no-save" if self.kind == "run" else "")) from None
        try:
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError:
                if os.stat(tmp).st_nlink != 2:
                    return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _break(self, holder, mtime) -> bool:
        """Remove a stale lock file, unless another taker was faster (then the
        file moved aside is not the one judged stale, and goes back)."""
        aside = self.dir / f".{self.name}.stale.{os.getpid()}.{self.token[:8]}.tmp"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            found = _read(aside)
            if found is not None and found[0] != holder:
                try:
                    os.link(aside, self.path)  # a fresh lock of another run: put it back
                except OSError:
                    pass
                return False
            return True
        finally:
            aside.unlink(missing_ok=True)

    # --------------------------------------------------------------- refresh
    def _refresh(self):
        while not self._stop.wait(REFRESH_S):
            with self._busy:
                self.check()
                if self._lost:
                    return
                try:
                    os.utime(self.path)
                except OSError:
                    pass  # checked again next time

    def check(self):
        """Whether the file is still ours; records why not (see :meth:`lost`)."""
        if not self._lost:
            lost = not_owner(self.path, self.token, holds_lock=True)
            self._lost = lost[1] if lost else None

    def lost(self):
        """None while the lock is ours; else one line saying what happened."""
        self.check()
        return self._lost

    def release(self):
        self._stop.set()
        _REFRESHING.discard(self)
        # not alive: a signal ended take() while the thread was starting (a thread not yet
        # started cannot be joined); once running it sees the stop at once, touching nothing
        if self._thread is not None and self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=5)
        found = _read(self.path)
        if found is not None and found[0] and found[0].get("token") == self.token:
            try:
                self.path.unlink()
            except OSError:
                pass


#: the locks whose thread runs in this process; a fork (a forked rank or trial,
#: processes/children.py) waits until none of them is between its wait and its
#: next, so the child starts with no lock or stream held by a thread it lacks
_REFRESHING = weakref.WeakSet()
_paused = []


def _pause_refreshers():
    for lock in list(_REFRESHING):
        lock._busy.acquire()
        _paused.append(lock)


def _resume_refreshers():
    while _paused:
        _paused.pop()._busy.release()


os.register_at_fork(before=_pause_refreshers, after_in_parent=_resume_refreshers,
                    after_in_child=_resume_refreshers)


def not_owner(path, token, holds_lock):
    """None while the lock file ``path`` holds ``token``; else (taken over:
    whether another run's lock is there now, why this process's run no
    longer owns the directory). ``holds_lock``: this process made the file
    (then its disappearance is a fault, not the run's end)."""
    directory = Path(path).parent
    if not directory.is_dir():
        return False, f"the save directory {directory} was removed during the run"
    found = _read(Path(path))
    if found is None:
        if holds_lock:
            return False, (f"the lock file {path} was removed during the run (was the directory emptied?); "
                           f"config.yaml and metrics.jsonl may be gone too")
        return False, f"its lock file {path} is gone (the run ended, or the directory was emptied)"
    if not found[0] or found[0].get("token") != token:
        return True, f"another run took over --save-dir {directory} ({describe(found[0])})"
    return None


# ------------------------------------------------------------------ fencing
_owned = None  # the run this process writes for: {"lock": path, "real": its directory resolved, "token", ...}


def own(directory, token, holds_lock: bool, who: str) -> None:
    """From here on this process writes into ``directory`` only while its
    lock file holds ``token`` (the run's owner token, rank 0's lock).
    ``who``: this process in the line of a refusal ('rank 1')."""
    global _owned
    _owned = {"lock": Path(directory) / LOCK_NAME, "real": Path(os.path.realpath(directory)), "token": token,
              "holds_lock": holds_lock, "who": who}


def owner_token():
    """The token of the run this process writes for (``own``), or None."""
    return _owned["token"] if _owned else None


def disown() -> None:
    """The run is over for this process: no more writes to check."""
    global _owned
    _owned = None


def check_owner(writing, anywhere=False) -> None:
    """The fence: before a write, prove that this process's run still owns its
    save directory. ``writing``: the file about to be written or removed; one
    outside the save directory is not checked (data a rank prepares, a search's
    results) unless ``anywhere`` (a file of the run kept elsewhere: its
    ``file://`` rendezvous). Raises
    :class:`~textbox_like.core.faults.Superseded` (77) when a newer run holds the
    lock or the run ended, :class:`~textbox_like.core.faults.SaveFailed` (74) when
    the lock this process made was removed with its directory."""
    owned = _owned
    if owned is None:
        return
    if not anywhere and Path(os.path.realpath(writing)).parent != owned["real"]:
        return
    lost = not_owner(owned["lock"], owned["token"], owned["holds_lock"])
    if lost is None:
        return
    taken_over, why = lost
    if owned["holds_lock"] and not taken_over:
        raise SaveFailed(f"not writing {writing}: {why}; stopping (nothing is recreated)")
    raise Superseded(f"{owned['who']} (pid {os.getpid()}): not writing {writing}: this process no longer owns the "
                     f"run in {owned['lock'].parent}: {why}; exiting without writing anything", taken_over)
