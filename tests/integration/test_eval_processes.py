"""The tests of test_eval.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json

import pytest

from conftest import N_TEST, run_cli
from test_eval import manual, trained  # noqa: F401 (fixtures)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_cli_json_matches_manual(trained, mnist_dir):
    ckpt = trained / "checkpoint_last.pt"
    proc = run_cli(["--model_ckpt", ckpt, "--data", mnist_dir, "--subset", "test", "--json",
                    "--batch-size", "64"], module="textbox_like.tools.eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = manual(ckpt, mnist_dir, "test")
    assert N_TEST % 64 != 0
    assert record["samples"] == N_TEST
    assert record["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-5)
    assert record["accuracy"] == pytest.approx(expected["accuracy"])
