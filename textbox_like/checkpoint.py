"""One checkpointer for everything a restart needs, written atomically.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so
``torch.load(weights_only=True)`` reads it. It is written to a temporary file
in the target's directory, fsynced, and renamed over the target: a crash at
any moment leaves either the old or the new file, never a torn one. Several
names for the same state (``checkpoint_last.pt``, ``checkpoint3.pt``, ...)
are hard links of one write, falling back to copies.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import UserError

FORMAT = "textbox_like-checkpoint-1"
_UMASK = os.umask(0)
os.umask(_UMASK)


# --------------------------------------------------------------------- RNG
def rng_state() -> dict:
    import torch
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------ writing
def _fsync_dir(directory: Path) -> None:
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


def atomic_save(obj, path) -> None:
    import torch
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _atomic_link(source: Path, target: Path) -> None:
    """``target`` becomes the same content as ``source``, atomically."""
    tmp = target.parent / f".{target.name}.{os.getpid()}.lnk"
    try:
        if tmp.exists():
            tmp.unlink()
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(target.parent)


def load_checkpoint(path) -> dict:
    """Load one of our checkpoints; one clear error for anything else."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, foreign pickle, not a zip file ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"checkpoint {path} cannot be read ({reason[:160]}); "
                        f"it is truncated or not a textbox_like checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a textbox_like checkpoint (no '{FORMAT}' marker)")
    return state


# -------------------------------------------------------------- checkpointer
class Checkpointer:
    """Decides when to save, which names to write and which old ones to drop."""

    def __init__(self, cfg, is_main: bool):
        self.cfg = cfg
        self.dir = Path(cfg.save_dir)
        self.is_main = is_main
        self.enabled = not cfg.no_save
        if self.enabled and is_main and self.dir.is_dir():
            # half-written files of a writer that was killed; one writer per save dir
            for leftover in self.dir.glob(".checkpoint*"):
                if leftover.suffix in (".tmp", ".lnk"):
                    leftover.unlink(missing_ok=True)

    # when --------------------------------------------------------------
    def names(self, epoch, updates, end_of_epoch, is_best, final=False):
        cfg = self.cfg
        names = []
        if end_of_epoch and not cfg.no_epoch_checkpoints and epoch % cfg.save_interval == 0:
            names.append(f"checkpoint{epoch}.pt")
        if not end_of_epoch and cfg.save_interval_updates > 0 and updates % cfg.save_interval_updates == 0:
            names.append(f"checkpoint_{epoch}_{updates}.pt")
        if is_best:
            names.append("checkpoint_best.pt")
        if names or final or end_of_epoch:
            if not cfg.no_last_checkpoints:
                names.append("checkpoint_last.pt")
        return names

    def save(self, state: dict, names) -> list:
        if not (self.enabled and self.is_main and names):
            return []
        first = self.dir / names[0]
        atomic_save(state, first)
        for name in names[1:]:
            _atomic_link(first, self.dir / name)
        self._prune()
        return [self.dir / n for n in names]

    def _prune(self):
        cfg = self.cfg
        if cfg.keep_interval_updates > 0:
            found = self._matching(r"checkpoint_(\d+)_(\d+)\.pt")
            for path in [p for _, p in sorted(found, key=lambda t: t[0][1], reverse=True)][cfg.keep_interval_updates:]:
                path.unlink(missing_ok=True)
        if cfg.keep_last_epochs > 0:
            found = self._matching(r"checkpoint(\d+)\.pt")
            for path in [p for _, p in sorted(found, key=lambda t: t[0][0], reverse=True)][cfg.keep_last_epochs:]:
                path.unlink(missing_ok=True)

    def _matching(self, pattern):
        regex = re.compile(pattern)
        out = []
        for path in self.dir.iterdir():
            match = regex.fullmatch(path.name)
            if match:
                out.append((tuple(int(g) for g in match.groups()), path))
        return out

    # which to load --------------------------------------------------------
    def resume_path(self):
        cfg = self.cfg
        if cfg.restore_file:
            path = Path(cfg.restore_file)
            if not path.is_absolute() and not path.exists() and (self.dir / path).exists():
                path = self.dir / path
            if not path.is_file():
                raise UserError(f"--restore-file {cfg.restore_file}: no such checkpoint")
            return path
        if cfg.resume:
            path = self.dir / "checkpoint_last.pt"
            return path if path.is_file() else None
        return None
