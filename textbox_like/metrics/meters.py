"""Meters and log output.

Statistics are sums (loss sums, correct counts, sample counts), kept as
tensors on the device between log events so the training step never waits
for a host sync; at a log event they are summed over ranks once and turned
into metrics by the task. Only rank 0 prints; the records' files are
callbacks/records.py's.
"""
from __future__ import annotations

import math
import sys
import time

from textbox_like.core.errors import say


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


def formatted(value) -> str:
    """A figure as a log line shows it: 4 decimals, or 4 significant digits where that hides it."""
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}" if not math.isinf(value) else str(value)
    return str(value)


class Logger:
    """Lines for people (the progress bar or log lines); the run's records
    (``log``, ``event``) go to its callbacks (``records``: metrics.jsonl,
    the trackers and the progress are callbacks/records.py's)."""

    def __init__(self, cfg, is_main: bool):
        self.is_main = is_main
        fmt = cfg.logging.log_format
        if fmt is None:
            fmt = "tqdm" if sys.stderr.isatty() else "simple"
        self.format = fmt
        self.bar = None
        self.records = None   # training/callbacks.Callbacks, once the run's are built: has log(kind, record)

    def info(self, message, everywhere=False):
        """A line for people (rank 0's; ``everywhere``: any rank's, for what only that rank knows)."""
        if (self.is_main or everywhere) and self.format != "none":
            if self.bar is not None:
                self.bar.write(message, file=sys.stderr)
            else:
                say(message)

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
        """A record of the run (kind: 'train', 'train_epoch', 'valid' or
        'valid_<subset>'), on every rank at the same point: to its callbacks."""
        self.records.log(kind, record)

    def event(self, kind, record: dict, line: str):
        """Something that happened once (a re-split): ``record`` to the
        callbacks (metrics.jsonl and the trackers keep it), ``line`` in every
        log format."""
        self.records.log(kind, record)
        self.info(line)

    def close(self):
        self.end_epoch()
        if self.records is not None:
            self.records.close()
