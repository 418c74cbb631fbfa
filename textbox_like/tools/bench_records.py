"""Figures the benchmarks read from a trainer run's metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def train_records(save_dir) -> list:
    """The run's train records, in order."""
    with open(Path(save_dir) / "metrics.jsonl") as handle:
        return [r for r in map(json.loads, handle) if r["kind"] == "train"]


def steady_rate(train: list, key: str, where="the run") -> float:
    """``key`` (a per-second rate: samples_per_s, tokens_per_s) over every
    train log window after the first (start-up and compilation left out),
    weighted by the window's length."""
    seconds = amount = 0.0
    for prev, rec in zip(train, train[1:]):
        dt = (rec["update"] - prev["update"]) / rec["updates_per_s"]
        seconds += dt
        amount += rec[key] * dt
    if seconds <= 0:
        raise SystemExit(f"too few log windows in {where}'s metrics.jsonl (raise --updates)")
    return amount / seconds
