"""Meters and log output.

Statistics are sums (loss sums, correct counts, sample counts), kept as
tensors on the device between log events so the training step never waits
for a host sync; at a log event they are summed over ranks once and turned
into metrics by the task. Only rank 0 prints and writes files.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from textbox_like.storage.fileio import atomic_write_text
from textbox_like.storage.savelock import check_owner


class StatSums:
    """Running sums of a task's stats; a state_dict of floats."""

    def __init__(self):
        self.sums = {}

    def add(self, stats: dict):
        for key, value in stats.items():
            current = self.sums.get(key)
            if current is None:
                self.sums[key] = value.detach().clone() if hasattr(value, "detach") else value
            elif hasattr(current, "add_"):
                current.add_(value)  # in place: no allocation per step
            else:
                self.sums[key] = current + value

    def reduce(self, accelerator) -> dict:
        """Floats summed over all ranks (one collective)."""
        import torch
        keys = sorted(self.sums)
        if not keys:
            return {}
        values = torch.stack([torch.as_tensor(self.sums[k], dtype=torch.float64, device=accelerator.device)
                              for k in keys])
        if accelerator.num_processes > 1:
            values = accelerator.reduce(values, reduction="sum")
        return dict(zip(keys, values.tolist()))

    def reset(self):
        self.sums = {}

    def state_dict(self):
        return {k: float(v) for k, v in self.sums.items()}

    def load_state_dict(self, state):
        self.sums = dict(state)


class TrainClock:
    """Wall time and throughput, carried across restarts; per log window, the
    time spent waiting for data against the rest of the update (compute)."""

    def __init__(self):
        self.elapsed_before = 0.0
        self.start = time.perf_counter()
        self.mark_time = self.start
        self.mark_samples = 0
        self.mark_updates = 0
        self.data_wait = 0.0     # seconds blocked on the next batch in this window
        self.paused = 0.0        # seconds of validation and saving in this window

    def elapsed(self):
        return self.elapsed_before + time.perf_counter() - self.start

    def window(self, samples, updates) -> dict:
        """Throughput since the last call: samples/s, updates/s, and seconds per
        update split into data wait and compute."""
        now = time.perf_counter()
        dt = max(now - self.mark_time - self.paused, 1e-9)
        n = max(updates - self.mark_updates, 1)
        out = {"samples_per_s": (samples - self.mark_samples) / dt,
               "updates_per_s": (updates - self.mark_updates) / dt,
               "data_s_per_update": self.data_wait / n,
               "compute_s_per_update": max(dt - self.data_wait, 0.0) / n}
        self.mark_time, self.mark_samples, self.mark_updates = now, samples, updates
        self.data_wait = self.paused = 0.0
        return out

    def state_dict(self):
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state):
        self.elapsed_before = float(state["elapsed"])
        self.start = time.perf_counter()


def _fmt(value):
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}" if not math.isinf(value) else str(value)
    return str(value)


class Logger:
    """Progress bar or log lines for people, metrics.jsonl for programs."""

    def __init__(self, cfg, is_main: bool, accelerator=None):
        self.is_main = is_main
        self.accelerator = accelerator  # its trackers get every record as scalars
        fmt = cfg.logging.log_format
        if fmt is None:
            fmt = "tqdm" if sys.stderr.isatty() else "simple"
        self.format = fmt
        self.bar = None
        self.jsonl = None          # metrics.jsonl, opened at the first record: a run refused before leaves none
        self.jsonl_path = None
        if is_main and not cfg.checkpoint.no_save and cfg.checkpoint.save_dir:
            Path(cfg.checkpoint.save_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl_path = Path(cfg.checkpoint.save_dir) / "metrics.jsonl"

    def forget_after(self, update):
        """On resume: drop the records of updates after the checkpoint, which
        the resumed run is about to log again."""
        path = self.jsonl_path
        if path is None or not path.exists():
            return
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("update", 0) <= update]
        try:
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        except OSError as exc:
            self.jsonl = open(path, "a", buffering=1)
            self.jsonl_failed(exc)

    def jsonl_failed(self, exc):
        """metrics.jsonl could not be written: one line (SaveFailed, exit 74);
        the file is closed here, so that nothing retries the failed write at exit."""
        from textbox_like.core.faults import SaveFailed, os_reason
        path, handle, self.jsonl = self.jsonl.name, self.jsonl, None
        try:
            handle.close()  # closes the file even when flushing the failed line fails again
        except OSError:
            pass
        raise SaveFailed(f"could not write {path} ({os_reason(exc)}); stopping: the checkpoints saved so far are "
                         f"kept; free space, then rerun with --resume") from None

    def info(self, message, everywhere=False):
        """A line for people (rank 0's; ``everywhere``: any rank's, for what only that rank knows)."""
        if (self.is_main or everywhere) and self.format != "none":
            if self.bar is not None:
                self.bar.write(message, file=sys.stderr)
            else:
                print(message, file=sys.stderr, flush=True)

    def start_epoch(self, epoch, total_steps, done_steps):
        if self.is_main and self.format == "tqdm":
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch:03d}",
                            dynamic_ncols=True, leave=False, file=sys.stderr)

    def advance(self, steps=1):
        if self.bar is not None:
            self.bar.update(steps)

    def end_epoch(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log(self, kind, record: dict):
        """kind: 'train' or 'valid' (or 'valid_<subset>')."""
        if not self.is_main:
            return
        self.record(kind, record)
        if self.format == "none":
            return
        if self.format == "json":
            print(json.dumps({"kind": kind, **record}), file=sys.stderr, flush=True)
            return
        if self.format == "tqdm" and self.bar is not None and kind == "train":
            self.bar.set_postfix({k: _fmt(v) for k, v in record.items()
                                  if k in ("loss", "accuracy", "lr", "gnorm", "samples_per_s")}, refresh=False)
            return
        text = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items())
        self.info(f"{kind} | {text}")

    def event(self, kind, record: dict, line: str):
        """Something that happened once (a re-split): ``line`` in every log
        format, ``record`` in metrics.jsonl and the trackers."""
        if not self.is_main:
            return
        self.record(kind, record)
        self.info(line)

    def record(self, kind, record: dict):
        """One record to metrics.jsonl and the trackers."""
        if self.jsonl_path is not None:
            check_owner(self.jsonl_path)  # a process woken after its run was taken over appends nothing
            try:
                if self.jsonl is None:
                    self.jsonl = open(self.jsonl_path, "a", buffering=1)
                self.jsonl.write(json.dumps({"kind": kind, **record}) + "\n")
            except OSError as exc:  # a full disk, a file size limit: a fault like a checkpoint's
                self.jsonl_failed(exc)
        if self.accelerator is not None and self.accelerator.trackers:
            from textbox_like.metrics.trackers import scalars
            self.accelerator.log(scalars(kind, record), step=record.get("update"))

    def close(self):
        self.end_epoch()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
