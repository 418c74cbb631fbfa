"""The tests of test_trainer.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import pytest

from test_trainer import records, train


@pytest.mark.slow
def test_log_interval(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--log-interval", "3", "--disable-validation", max_update=7)
    assert [r["update"] for r in records(out, "train")] == [3, 6]
