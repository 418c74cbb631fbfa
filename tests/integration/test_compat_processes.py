"""The tests of test_compat.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import pytest
import yaml

from test_compat import train_records


@pytest.mark.slow
def test_espnet2_batch_size_is_over_all_processes(tmp_path, small_mnist_dir):
    """--batch_size 10 --ngpu 2 (two processes, on CPU here) trains 10 samples
    per update in all, 5 per process, as ESPnet2 does."""
    from conftest import run_cli
    out = run_cli(["--task", "mnist", "--data", small_mnist_dir, "--batch_size", "10", "--ngpu", "2",
                   "--max-update", "2", "--log-interval", "1", "--log-format", "none", "--save-dir", tmp_path / "run",
                   "--disable-validation"], timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--batch_size 10 is ESPnet2's batch over all 2 processes, so --max-sentences 5 per process" in out.stderr
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["max_sentences"] == 5 and saved["distributed_world_size"] == 2
    records = train_records(tmp_path / "run")
    assert [round(r["samples_per_s"] / r["updates_per_s"]) for r in records] == [10, 10]
