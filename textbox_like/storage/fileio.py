"""Atomic file writes: the one way this project writes a file that must never
be seen half-written (checkpoints, config.yaml, results.json, metrics.jsonl
rewrites, plots, search results).

The content goes to a temporary file in the target's directory, is flushed
and fsynced, then renamed over the target, and the directory is fsynced: a
crash at any moment leaves either the old or the new file. A failure (a full
disk, a removed directory) leaves no temporary file behind and re-raises.

:func:`what_file_holds` names what a file a user passed really is (empty,
text, HDF5, a zip archive ...), for the one line that refuses it.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from textbox_like.storage.savelock import check_owner

# mkstemp/mkdtemp make 0600/0700 files; what we write is for others to read,
# so it gets the mode a plain open/mkdir would give (read once: umask is process-wide)
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


def atomic_write(path, write, make_parents=True) -> Path:
    """Call ``write(binary_file)`` on a temporary file and move it to ``path``.
    ``make_parents=False``: a missing directory is an error (FileNotFoundError),
    not recreated: a run's save directory removed under it is a fault."""
    with atomic_path(path, make_parents) as tmp, open(tmp, "wb") as handle:
        write(handle)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path, make_parents=True):
    """For a library that writes by file name (h5py, matplotlib): yields a
    temporary path beside ``path``; on success the file is synced and moved
    to ``path``, on failure removed."""
    path = Path(path)
    check_owner(path)
    if make_parents:
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
        check_owner(path)  # writing took a while: a newer run may own the directory by now
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


class TargetTaken(OSError):
    """The finished temporary directory could not be renamed onto its target
    (something filled the target meanwhile)."""


@contextlib.contextmanager
def atomic_directory(target):
    """atomic_path for a directory a library fills (save_pretrained): yields
    a temporary directory beside ``target``; on success its files are synced
    and it is renamed to ``target`` (an empty directory there is replaced),
    on failure it is removed. So ``target`` is never half written. A failed
    rename raises TargetTaken."""
    target = Path(target)
    check_owner(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                os.chmod(path, 0o666 & ~_UMASK)  # safetensors writes 0600
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        fsync_dir(tmp)
        os.chmod(tmp, 0o777 & ~_UMASK)
        check_owner(target)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise TargetTaken(exc.errno, exc.strerror) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)


def remove(path) -> None:
    """Remove a file of the run (a claim, the hand-off note, a pruned
    checkpoint, the rendezvous file) if it is there, once the run is proven
    still this process's (:func:`~textbox_like.storage.savelock.check_owner`; a file
    outside the save directory is the run's rendezvous file, checked too)."""
    check_owner(path, anywhere=True)
    Path(path).unlink(missing_ok=True)


def atomic_write_text(path, text: str, make_parents=True) -> Path:
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")), make_parents=make_parents)


def atomic_copy(source, target, make_parents=True) -> Path:
    """``target`` becomes a copy of ``source``, atomically: its own bytes, not a
    hard link, so damage at rest to one leaves the other readable."""
    def copy(handle):
        with open(source, "rb") as src:
            shutil.copyfileobj(src, handle, 1 << 22)
    return atomic_write(target, copy, make_parents=make_parents)


# leading bytes -> what a file of them is
MAGIC = ((b"PK\x03\x04", "a zip archive (a torch checkpoint?)"), (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
         (b"\x1f\x8b", "gzip-compressed data"), (b"\x80", "a pickle (an old torch.save format?)"),
         (b"\x93NUMPY", "a numpy .npy array"))


def what_file_holds(path) -> str:
    """What ``path`` is, from its first bytes, for an error line: 'empty (0
    bytes)', 'text (YAML?), first line ...', 'an HDF5 file', 'a zip archive
    (a torch checkpoint?)', ... or 'binary data'."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not head:
        return "empty (0 bytes)"
    for magic, kind in MAGIC:
        if head.startswith(magic):
            return kind
    if b"\0" not in head:
        text = head.decode("utf-8", errors="ignore")
        if text.strip() and len(text) >= len(head) - 3:  # allow a character cut at the 4096th byte
            first = text.strip().splitlines()[0][:60]
            yaml_like = re.match(r"^[\w.-]+\s*:", first) or first.startswith(("---", "- "))
            return f"a text file{' (YAML?)' if yaml_like else ''}, first line {first!r}"
    return "binary data"
