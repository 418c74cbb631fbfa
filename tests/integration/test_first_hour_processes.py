"""The tests of test_first_hour.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import pytest

from test_first_hour import NO_CUDA


# ------------------------------------------------------------------ frictions
@pytest.mark.slow
def test_threads_follow_the_cpus_this_process_may_use(small_mnist_dir, tmp_path):
    """Under taskset -c 0 the run takes 1 thread and says so (not the machine's count)."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO, clean_env
    if not shutil.which("taskset"):
        pytest.fail("taskset (util-linux) is needed for this test")
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, str(REPO / "run_hetseq.py"), "--task", "mnist",
                           "--data", str(small_mnist_dir), "--max-update", "1", "--max-sentences", "8",
                           "--no-save", "--disable-validation", "--log-format", "simple"],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "device cpu (1 thread)" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not NO_CUDA, reason="on a GPU machine the launcher may start GPU processes")
def test_accelerate_launch_num_processes_2_on_cpu_warns(small_mnist_dir, tmp_path):
    import shutil
    import subprocess

    from conftest import REPO, clean_env
    accelerate = shutil.which("accelerate") or str(REPO / ".venv" / "bin" / "accelerate")
    proc = subprocess.run([accelerate, "launch", "--num_processes", "2", "--cpu", str(REPO / "run_hetseq.py"),
                           "--task", "mnist", "--data", str(small_mnist_dir), "--max-update", "1",
                           "--max-sentences", "8", "--no-save", "--disable-validation"],
                          env=clean_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: accelerate launch started one process" in proc.stderr


@pytest.mark.slow
def test_slow_updates_log_by_wall_time_as_well(small_mnist_dir, tmp_path, monkeypatch):
    """Updates slowed (the test-only TEXTBOX_LIKE_SLOW_RANK) log more often
    than --log-interval alone would, and every --log-interval-th update still
    logs (the user's interval is the longest spacing)."""
    from conftest import base_args, read_jsonl, run_main
    from textbox_like.training import balance
    from textbox_like.training import reporting
    monkeypatch.setattr(reporting, "LOG_EVERY_S", 0.2)                  # a few seconds, scaled to a short test
    monkeypatch.setenv(balance.SLOW_RANK_ENV, "0:0.02")              # 0.16 s an update of 8 samples
    out = tmp_path / "o"
    assert run_main(base_args(small_mnist_dir, out, "--log-interval", "5", "--disable-validation",
                              "--max-sentences", "8", max_update=12)) == 0
    updates = [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert {5, 10} <= set(updates) and len(updates) >= 6, updates       # the count schedule alone: [5, 10]
    assert updates == sorted(set(updates)) and max(b - a for a, b in zip([0] + updates, updates)) <= 5, updates
