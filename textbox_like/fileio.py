"""Atomic file writes: the one way this project writes a file that must never
be seen half-written (checkpoints, config.yaml, results.json, metrics.jsonl
rewrites, plots, search results).

The content goes to a temporary file in the target's directory, is flushed
and fsynced, then renamed over the target, and the directory is fsynced: a
crash at any moment leaves either the old or the new file. A failure (a full
disk, a removed directory) leaves no temporary file behind and re-raises.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(directory) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, write) -> Path:
    """Call ``write(binary_file)`` on a temporary file and move it to ``path``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        write(handle)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path):
    """For a library that writes by file name (h5py, matplotlib): yields a
    temporary path beside ``path``; on success the file is synced and moved
    to ``path``, on failure removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would make results unreadable to the group
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path, text: str) -> Path:
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def atomic_link(source, target) -> None:
    """``target`` becomes the same content as ``source``, atomically (a hard
    link where the file system has them, else a copy)."""
    source, target = Path(source), Path(target)
    tmp = target.parent / f".{target.name}.{os.getpid()}.lnk"
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)
