"""The tests of test_mnist.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hetseq_documented_mnist_command(mnist_dir, tmp_path):
    out = tmp_path / "OUT"
    proc = run_cli(["--task", "mnist", "--optimizer", "adadelta", "--lr-scheduler", "PolynomialDecayScheduler",
                    "--data", mnist_dir, "--clip-norm", "100", "--max-sentences", "64", "--fast-stat-sync",
                    "--max-epoch", "1", "--update-freq", "1", "--valid-subset", "test", "--num-workers", "2",
                    "--warmup-updates", "0", "--total-num-update", "50000", "--lr", "1.01", "--save-dir", out,
                    "--max-update", "3", "--log-format", "simple", "--log-interval", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for name in ("checkpoint_last.pt", "checkpoint_best.pt", "config.yaml", "metrics.jsonl", "results.json"):
        assert (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    assert results["num_updates"] == 3
    assert 0.0 <= results["final"]["accuracy"] <= 1.0
