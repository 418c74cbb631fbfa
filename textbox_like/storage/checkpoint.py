"""Checkpoints: one manager saves and restores a dict of stateful parts.

Every resumable piece of a run (model, optimizer, LR schedule, data position,
training progress, loss scaler, RNG streams) is a *part*: an object with
``state_dict()`` and ``load_state_dict(state)``. The manager gathers them into
one plain dict of tensors, numbers, strings, lists and dicts, so
``torch.load(weights_only=True)`` reads it back, writes it atomically
(:mod:`textbox_like.storage.fileio`) and copies it to the other names of the same state
(``checkpoint_last.pt``, ``checkpoint3.pt``, ...): copies, not hard links, so
damage at rest to one file leaves the others readable. On restore it applies the
``--reset-*`` policy in one place: a reset part keeps its fresh state.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np

from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import SaveFailed, failed_writing, os_reason
from textbox_like.storage.fileio import atomic_copy, atomic_write, remove, what_file_holds

FORMAT = "textbox_like-checkpoint-2"

# What --reset-X leaves out of a restore, and the hint when a part does not fit.
RESET_FLAGS = {"optimizer": "reset_optimizer", "scheduler": "reset_lr_scheduler",
               "iterator": "reset_dataloader", "rng": "reset_dataloader"}
MISFIT_HINTS = {"model": "use the model options it was trained with",
                "optimizer": "pass --reset-optimizer to start the optimizer afresh",
                "scheduler": "pass --reset-lr-scheduler",
                "iterator": "pass --reset-dataloader"}


# Settings that change the numbers of a resumed run, and the --reset-* options
# under which --resume may change them (none: the same value, or --restore-file
# to start a new run from the weights). Extending a run (--max-update,
# --max-epoch), another batch size or world size (re-planned from the same
# offset), logging, saving and paths may change.
CHANGES_NUMBERS = {
    "seed": ("reset_dataloader",), "no_shuffle": ("reset_dataloader",), "shuffle_block": ("reset_dataloader",),
    "optimizer": ("reset_optimizer",), "weight_decay": ("reset_optimizer",), "epsilon": ("reset_optimizer",),
    "optim_conf": ("reset_optimizer",), "lr": ("reset_optimizer", "reset_lr_scheduler"),
    "lr_scheduler": ("reset_lr_scheduler",), "warmup_updates": ("reset_lr_scheduler",),
    "total_num_update": ("reset_lr_scheduler",), "scheduler_conf": ("reset_lr_scheduler",),
    "update_freq": (), "clip_norm": (), "train_dtype": (), "model_conf": (), "dim_final_feedforward": (),
    "dimension": (), "num_heads": (), "dim_feedforward": (), "num_layers": (), "activation_function": (),
    "dropout": (), "max_pred_length": (), "freeze_encoder": (),
    "peft": (), "lora_r": (), "lora_alpha": (), "lora_dropout": (), "lora_target_modules": (), "prefix_length": (),
    "prefix_mid_dim": (), "prefix_dropout": (), "prompt_length": (),
}

#: settings printed only where used (their group's switch on): a configuration
#: without one had this value, and a resume compares it all the same
ABSENT_MEANS = {"peft": "none"}

MISSING = object()

#: how a refusal of a setting without a --reset-* option ends
NEW_RUN_FIX = ", or start a new run from its weights with --restore-file and another --save-dir"

#: entries of a dict setting that mirror a setting compared on its own
MIRRORED = {"optim_conf": ("lr", "weight_decay", "eps")}


def device_fallback(was: dict, is_: dict) -> bool:
    """The same flags chose fp16 on one side and bf16 on the other: the
    only way is accelerator.precision's CPU fallback (fp16 needs CUDA)."""
    return was.get("source") == is_.get("source") and {was.get("mixed"), is_.get("mixed")} == {"fp16", "bf16"}


def describe_precision(precision: dict) -> str:
    """A checkpoint's precision record (``{"mixed": "bf16", "source": "--bf16"}``) in words."""
    mixed = precision.get("mixed")
    words = {"no": "float32 (no mixed precision)", "bf16": "bf16 mixed precision",
             "fp16": "fp16 mixed precision"}.get(mixed, mixed)
    source = precision.get("source")
    return f"{words} (from {source})" if source and source != "default" else str(words)


def changes_numbers(cfg) -> dict:
    """setting -> the --reset-* options that allow changing it on --resume,
    for this run's settings (its optimizer's and scheduler's own options too)."""
    found = {key: resets for key, resets in CHANGES_NUMBERS.items() if key in cfg.keys or key in ABSENT_MEANS}
    found.update((key, ("reset_optimizer",)) for key in vars(cfg.optimizer_options))
    found.update((key, ("reset_lr_scheduler",)) for key in vars(cfg.scheduler_options))
    return found


def check_trained_keys(trained, saved, where) -> None:
    """Under --peft a checkpoint holds exactly the weights that train
    (``trained``: their names): a full model's state (a run without
    --peft) or another method's is one line, not a silent partial load."""
    extra = sorted(set(saved) - set(trained))
    if extra:
        raise UserError(f"{where} holds weights this run does not train (e.g. {extra[0]}): it was saved by a run "
                        f"without --peft, or with another method; resume it with the --peft options it was trained "
                        f"with, or start a new run in another --save-dir")
    missing = sorted(set(trained) - set(saved))
    if missing:
        raise UserError(f"{where} lacks weights this run trains (e.g. {missing[0]}): it was saved with other --peft "
                        f"options; resume with the ones it was trained with")


def checkpoints_newest_first(directory) -> list:
    """The checkpoints in a directory, newest first (hard links share a time:
    checkpoint_last.pt first among equals)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("checkpoint*.pt") if p.is_file()]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name == "checkpoint_last.pt"), reverse=True)


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


# ------------------------------------------------------------- read / write
def digest(obj) -> str:
    """A hash of a checkpoint's contents (every tensor's bytes, dtype and
    shape, every key and value), stored in it and checked on load: a flipped
    byte inside a tensor passes torch.load but not this."""
    import hashlib

    import torch
    h = hashlib.blake2b(digest_size=16)

    def walk(value):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            h.update(b"{")
            for key in sorted(value, key=repr):
                h.update(repr(key).encode())
                walk(value[key])
            h.update(b"}")
        elif isinstance(value, (list, tuple)):
            h.update(b"[")
            for item in value:
                walk(item)
            h.update(b"]")
        else:
            h.update(repr(value).encode())

    walk({k: v for k, v in obj.items() if k != "digest"})
    return h.hexdigest()


def atomic_save(state: dict, path, make_parents=True) -> None:
    """Write a checkpoint dict with its digest, atomically. On a full disk
    torch's writer raises an OSError, then a RuntimeError while closing:
    :func:`~textbox_like.core.faults.failed_writing` tells them from a bug."""
    import torch
    state = {**state, "digest": digest(state)}
    atomic_write(path, lambda handle: torch.save(state, handle), make_parents=make_parents)


def unreadable_weights_reason(exc) -> str:
    """Why torch.load(weights_only=True) or safetensors refused a file, in a
    few words for an error line. torch's own message on a pickle that the
    safe load refuses advises loading it with ``weights_only=False``, which
    would run the code it holds: that advice is never passed on."""
    text = str(exc).strip()
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused or "Weights only load failed" in text:
        what = f" ({refused.group(1)})" if refused else ""
        return (f"it holds a Python object{what} besides tensors, which the safe (weights-only) load refuses "
                f"because loading it could run code; it was not loaded: re-save the weights as tensors only "
                f"(save_pretrained writes model.safetensors)")
    if type(exc).__name__ == "SafetensorError":
        return f"not a valid safetensors file ({first_line(text, empty='unreadable header')})"
    if isinstance(exc, OSError) and exc.errno == 22 or "PytorchStreamReader" in text or "zip archive" in text:
        return "truncated or not a torch file (its zip archive cannot be read)"
    return first_line(exc, 160)


def load_checkpoint(path, verify=True) -> dict:
    """Load one of our checkpoints (memory-mapped: ranks do not each hold a
    full host copy) and check its digest; one clear error for anything else."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    kind = what_file_holds(path)
    if not kind.startswith("a zip archive"):  # what torch.save writes
        raise UserError(f"checkpoint {path} is {kind}, not a checkpoint; pass a checkpoint_*.pt file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # truncated, foreign pickle, not a zip file ...
        raise UserError(f"checkpoint {path} cannot be read ({unreadable_weights_reason(exc)}); "
                        f"it is truncated or not a textbox_like checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path} is not a textbox_like checkpoint (no '{FORMAT}' marker)")
    if verify and state.get("digest") != digest(state):
        raise UserError(f"checkpoint {path} fails its digest check: its contents were changed or corrupted "
                        f"after it was written")
    return state


# ------------------------------------------------------------------ manager
class CheckpointManager:
    """Decides which names a save writes, writes them, prunes old ones, and
    restores the parts under the reset policy.

    ``parts``: name -> stateful object; ``metadata``: plain values stored
    beside them (task, config) and checked on restore. ``save`` is called on
    every rank (parts may gather over ranks); only the main process writes.
    """

    def __init__(self, cfg, parts: dict, metadata: dict, is_main: bool):
        self.cfg = cfg
        self.parts = parts
        self.metadata = metadata
        self.dir = Path(cfg.save_dir)
        self.is_main = is_main
        self.enabled = not cfg.no_save
        self.last_saved = None
        if self.enabled and is_main and self.dir.is_dir():
            # half-written files of a writer that was killed; one writer per save dir
            for leftover in self.dir.glob(".checkpoint*"):
                if leftover.suffix in (".tmp", ".lnk"):
                    remove(leftover)
            # the claim and shard files of an earlier run's survivors of a lost peer, left where one was
            # killed (torchrun kills a worker 30 s after its SIGTERM): that run is over
            for leftover in [*self.dir.glob(".emergency-*"), *self.dir.glob("..emergency-*.tmp")]:
                remove(leftover)

    def file_name(self, name: str) -> str:
        """What a save under ``name`` (``checkpoint_last.pt``) is called on disk by this manager."""
        return name

    # when --------------------------------------------------------------
    def names(self, epoch, updates, end_of_epoch, is_best, final=False, snapshot=False):
        """``snapshot``: kanachan's --snapshot-interval was crossed (an interval checkpoint)."""
        cfg = self.cfg
        if not self.enabled:
            return []
        names = []
        if end_of_epoch and not cfg.no_epoch_checkpoints and epoch % cfg.save_interval == 0:
            names.append(f"checkpoint{epoch:0{cfg.num_epoch_digits or 1}d}.pt")
        # a --snapshot-interval crossing is kept also at an epoch's end
        if snapshot or not end_of_epoch and cfg.save_interval_updates > 0 \
                and updates % cfg.save_interval_updates == 0:
            names.append(f"checkpoint_{epoch}_{updates}.pt")
        if is_best:
            names.append("checkpoint_best.pt")
        if (names or final or end_of_epoch) and not cfg.no_last_checkpoints:
            names.append("checkpoint_last.pt")
        return names

    # save ----------------------------------------------------------------
    def save(self, names) -> list:
        """Write the parts' state under ``names`` (on every rank; the main one writes)."""
        if not names:
            return []
        state = {"format": FORMAT, **self.metadata,
                 **{name: part.state_dict() for name, part in self.parts.items()}}
        if not self.is_main:
            return []
        target = self.dir / names[0]
        try:  # each write first proves the run still owns the directory (savelock.check_owner)
            # never recreated: a save directory removed under a run is a fault, not a fresh start
            atomic_save(state, target, make_parents=False)
            for name in names[1:]:
                target = self.dir / name
                atomic_copy(self.dir / names[0], target, make_parents=False)
        except Exception as exc:
            if not failed_writing(exc):
                raise
            if not self.dir.is_dir():
                raise SaveFailed(f"could not write {target}: the save directory {self.dir} was removed during the "
                                 f"run, with its checkpoints, config.yaml and metrics.jsonl; stopping (nothing "
                                 f"is recreated)") from None
            last = self.newest_good()
            raise SaveFailed(f"could not write {target} ({os_reason(exc)}); "
                             + (f"the last good checkpoint is {last}: free space or fix the directory, then "
                                f"rerun with --resume" if last else "no checkpoint was saved before this one")) \
                from None
        self.prune_after_save()
        self.last_saved = self.dir / names[0]
        return [self.dir / n for n in names]

    def newest_good(self):
        """The newest checkpoint written by this run or found on disk, by name only (no load)."""
        if self.last_saved is not None and self.last_saved.exists():
            return self.last_saved
        found = self.candidates()
        return found[0] if found else None

    def candidates(self) -> list:
        """Checkpoints in the save dir, newest first (hard links share a time:
        checkpoint_last.pt first among equals)."""
        return checkpoints_newest_first(self.dir)

    def prune_after_save(self):
        """--keep-interval-updates and --keep-last-epochs after a file save,
        over this directory's file checkpoints (the trainer's manager,
        sharded_checkpoint.ShardedCheckpointManager, counts its .dcp
        checkpoints with them)."""
        cfg = self.cfg
        for pattern, keep, index in ((r"checkpoint_(\d+)_(\d+)\.pt", cfg.keep_interval_updates, 1),
                                     (r"checkpoint(\d+)\.pt", cfg.keep_last_epochs, 0)):
            if keep <= 0:
                continue
            found = [(int(m.group(index + 1)), path) for path in self.dir.iterdir()
                     if (m := re.fullmatch(pattern, path.name)) and path.is_file()]
            for _, path in sorted(found, reverse=True)[keep:]:
                remove(path)

    # restore -------------------------------------------------------------
    def resume_path(self):
        cfg = self.cfg
        if cfg.restore_file:
            path = Path(cfg.restore_file)
            if not path.is_absolute() and not path.exists() and (self.dir / path).exists():
                path = self.dir / path
            if not self.is_checkpoint(path):
                raise UserError(f"--restore-file {cfg.restore_file}: {self.why_not_a_checkpoint(path)}")
            return path
        if cfg.resume:
            return self.newest_to_resume(self.candidates())
        return None

    def newest_to_resume(self, found):
        """Of a save directory's checkpoints (``found``: newest first), the
        one --resume continues: checkpoint_last (of the highest update
        recorded inside, where both formats hold one), unless a checkpoint
        written after it records a later update (checkpoint_last is copied
        from a save's first name: a run killed in between leaves that one
        newer). By update, not by time alone: a stale checkpoint touched
        later (copied back, restored from a backup) does not win; by time
        too: after --restore-file of an earlier checkpoint, the later
        updates of the abandoned branch do not win either."""
        if not found:
            return None
        updates = {p: self.recorded_update(p) for p in found}

        def newest(p):
            return updates[p], os.lstat(p).st_mtime_ns, p.stem == "checkpoint_last"
        lasts = [p for p in found if p.stem == "checkpoint_last"]
        last = max(lasts, key=newest) if lasts else None
        if self.cfg.no_last_checkpoints:
            return last
        written_after = [p for p in found if last is None or os.lstat(p).st_mtime_ns >= os.lstat(last).st_mtime_ns]
        return max(written_after, key=newest)

    def recorded_update(self, path) -> int:
        """The update a checkpoint file records (its small train state read
        through a memory map, not the weights); -1 where it cannot be read
        (the load that follows says why)."""
        import torch
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return int(state["train"]["num_updates"])
        except Exception:
            return -1

    def is_checkpoint(self, path) -> bool:
        """Whether ``path`` is a checkpoint this manager reads (a file; the sharded manager's directories too)."""
        return Path(path).is_file()

    def why_not_a_checkpoint(self, path) -> str:
        """What ``path``, which :meth:`is_checkpoint` refused, is instead."""
        if Path(path).is_dir():
            return "is a directory, not a checkpoint (a checkpoint_*.pt file, or a --fsdp run's checkpoint_*.dcp)"
        return "no such checkpoint"

    def read(self, path) -> dict:
        """A checkpoint's state, verified (sharded_checkpoint.py's manager reads its directories too)."""
        return load_checkpoint(path)

    def load_newest(self, path, log):
        """(state, path): ``path`` if it loads and verifies; under --resume
        (not an explicit --restore-file) else the newest checkpoint that does."""
        try:
            return self.read(path), path
        except UserError as exc:
            if self.cfg.restore_file:
                raise
            skipped = [str(exc)]  # each names its file
            for other in self.candidates():
                if other.samefile(path):
                    continue
                try:
                    state = self.read(other)
                except UserError as also:
                    skipped.append(str(also))
                    continue
                log(f"warning: skipped {len(skipped)} checkpoint(s): {'; '.join(skipped)}; resuming from {other}, "
                    f"the newest checkpoint that verifies")
                return state, other
            raise UserError(f"{'; '.join(skipped)}; no other checkpoint in {self.dir} verifies: start without "
                            f"--resume") from None

    def check_task(self, state, path, resuming=False) -> None:
        """A checkpoint of another task fits nothing of this run: said before
        any setting it differs in (each would be a symptom of this)."""
        task, saved = self.metadata.get("task"), state.get("task")
        if saved == task:
            return
        if resuming:
            raise UserError(f"--resume: {path} is a checkpoint of task {saved!r}, and this run is task {task!r}; "
                            f"continue it with --task {saved}, or start this {task} run in another --save-dir")
        raise UserError(f"{path} is a checkpoint of task {saved!r}, not {task!r}")

    def check_resumed_config(self, state, path, settings: dict, defaults=None, log=print) -> None:
        """--resume continues the same run: refuse a checkpoint of another task,
        or whose configuration differs in a setting that changes the numbers
        (``settings``: see :func:`changes_numbers`) or in the precision chosen,
        naming it, unless a --reset-* option given allows the change.
        ``defaults``: setting -> the values a dict setting's missing entries
        take (``--model_conf hidden=128`` is the default, not a change).
        A move between CUDA and CPU under the same --fp16 (CPU runs it in
        bf16) is the one precision change allowed, with a warning through ``log``:
        refusing it would strand a run whose GPU is gone."""
        import yaml
        self.check_task(state, path, resuming=True)
        saved, now = state.get("config"), self.metadata.get("config")
        if not isinstance(saved, str) or not isinstance(now, str):
            return  # a checkpoint of an older version: nothing to compare
        saved, now = yaml.safe_load(saved) or {}, yaml.safe_load(now) or {}
        for key, filled in (defaults or {}).items():
            for config in (saved, now):
                if isinstance(config.get(key), dict):
                    config[key] = {**filled, **config[key]}
        overrides = self.cfg.optimizer_overrides or {}
        for key, resets in settings.items():
            was, is_ = (config.get(key, ABSENT_MEANS.get(key, MISSING)) for config in (saved, now))
            if was is MISSING or is_ is MISSING:
                continue
            flag = f"--{key.replace('_', '-')}"
            if isinstance(was, dict) and isinstance(is_, dict):
                # one entry at a time; the entries that mirror a setting of their own are compared there
                mirrored = MIRRORED.get(key, ())
                entry = next((k for k in sorted(set(was) | set(is_), key=str)
                              if k not in mirrored and was.get(k) != is_.get(k)), None)
                if entry is None:
                    continue
                flag, was, is_ = f"{flag} {entry}=", was.get(entry), is_.get(entry)
            elif was == is_:
                continue
            if any(getattr(self.cfg, reset) for reset in resets) or key in overrides:
                continue
            fix = (" or pass " + " or ".join(f"--{r.replace('_', '-')}" for r in resets)) if resets else NEW_RUN_FIX
            raise UserError(f"--resume: {path} was trained with {flag}{'' if flag.endswith('=') else ' '}{was!r}, "
                            f"this run has {is_!r}, which changes the numbers; use the same value{fix}")
        # the precision chosen (--fp16, --bf16, --train_dtype or Accelerate's
        # --mixed_precision, and the CPU's fallback), not the flags that chose it
        was, is_ = state.get("precision"), self.metadata.get("precision")
        if isinstance(was, dict) and isinstance(is_, dict) and was.get("mixed") != is_.get("mixed"):
            if device_fallback(was, is_):
                log(f"warning: --resume: {path} was trained in {describe_precision(was)}, this run has "
                    f"{describe_precision(is_)}: the same flags on another device (a CPU runs fp16 as bf16), "
                    f"going on; the numbers change")
                return
            raise UserError(f"--resume: {path} was trained in {describe_precision(was)}, this run has "
                            f"{describe_precision(is_)}, which changes the numbers; use the same precision"
                            f"{NEW_RUN_FIX}")

    def restore(self, state, path) -> list:
        """Load every part that the reset policy keeps; returns the names of
        the parts left fresh."""
        self.check_task(state, path)
        fresh = []
        for name, part in self.parts.items():
            flag = RESET_FLAGS.get(name)
            if (flag and getattr(self.cfg, flag)) or state.get(name) is None:
                fresh.append(name)
                continue
            try:
                part.load_state_dict(state[name])
            except UserError:
                raise
            except (ValueError, KeyError, RuntimeError, TypeError) as exc:
                reason = first_line(exc, 150)
                raise UserError(f"the {name} state in {path} does not fit this run ({reason}); "
                                f"{MISFIT_HINTS.get(name, 'start without --resume')}") from None
        return fresh
