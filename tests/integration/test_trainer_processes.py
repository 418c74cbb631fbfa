"""The tests of test_trainer.py (tests/unit) that start processes: the slow tier.

The training loop: stopping, accumulation, precision, clipping, validation,
logging, outputs in --save-dir, checkpoints, seeding.
"""
from __future__ import annotations

import pytest

from test_trainer import records, train


@pytest.mark.slow
def test_log_interval(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--log-interval", "3", "--disable-validation", max_update=7)
    assert [r["update"] for r in records(out, "train")] == [3, 6]
