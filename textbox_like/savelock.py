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
removed or emptied) or replaced (another run took it over); the next save then
stops the run (exit 74) instead of writing into a directory it no longer owns.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from .errors import UserError, note

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
    from .elastic import read_handoff
    note = read_handoff(save_dir) if save_dir is not None else None
    if note and note.get("run_id") == agent.run_id and float(note.get("written", 0)) >= float(holder.get("started", 0)):
        return f"a worker of this run's worker group that stopped at update {note.get('update')} for torchrun"
    return None


class SaveDirLock:
    """The lock of one save directory, held by this process until :meth:`release`."""

    def __init__(self, directory):
        self.dir = Path(directory)
        self.path = self.dir / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                       "proc_start": _process_start(os.getpid()), "token": self.token}
        from .elastic import Agent
        self.agent = Agent.from_env()
        if self.agent is not None:  # lets the next worker group of this run take the lock over
            self.holder.update(elastic_run=self.agent.run_id, elastic_restart=self.agent.restart_count)
        self._stop = threading.Event()
        self._lost = None
        self._thread = None

    # -------------------------------------------------------------- acquire
    @classmethod
    def acquire(cls, directory) -> "SaveDirLock":
        lock = cls(directory)
        lock._acquire()
        lock._thread = threading.Thread(target=lock._refresh, name="textbox_like-save-lock", daemon=True)
        lock._thread.start()
        return lock

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
                raise UserError(f"--save-dir {self.dir} is in use by another run ({describe(holder)}; lock file "
                                f"{self.path}); choose another --save-dir, or wait for that run to end (a lock "
                                f"not refreshed for {STALE_AFTER_S:.0f}s is taken over)")
            if self._break(holder, mtime) and holder and holder.get("pid") != os.getpid():
                note(f"took over the lock of --save-dir {self.dir} from {describe(holder)}: {why}")
        raise UserError(f"--save-dir {self.dir}: could not take its lock file {self.path} (other runs keep "
                        f"taking it); choose another --save-dir")

    def _create(self) -> bool:
        """Make the lock file with our content, atomically; False if it exists.
        A hard link is atomic on NFS; its reply may be lost, so the link count
        of our own temporary file says whether it took."""
        tmp = self.dir / f".{LOCK_NAME}.{self.holder['host']}.{os.getpid()}.{self.token[:8]}"
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self.holder, handle)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise UserError(f"--save-dir {self.dir} cannot be written ({exc.strerror or exc}); choose a writable "
                            f"directory or pass --no-save") from None
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
        aside = self.dir / f".{LOCK_NAME}.stale.{os.getpid()}.{self.token[:8]}"
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
            self.check()
            if self._lost:
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # checked again next time

    def check(self):
        """Whether the file is still ours; records why not (see :meth:`lost`)."""
        if self._lost:
            return
        if not self.dir.is_dir():
            self._lost = f"the save directory {self.dir} was removed during the run"
            return
        found = _read(self.path)
        if found is None:
            self._lost = (f"the lock file {self.path} was removed during the run (was the directory emptied?); "
                          f"config.yaml and metrics.jsonl may be gone too")
        elif not found[0] or found[0].get("token") != self.token:
            self._lost = f"another run took over --save-dir {self.dir} ({describe(found[0])})"

    def lost(self):
        """None while the lock is ours; else one line saying what happened."""
        self.check()
        return self._lost

    def release(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        found = _read(self.path)
        if found is not None and found[0] and found[0].get("token") == self.token:
            try:
                self.path.unlink()
            except OSError:
                pass
