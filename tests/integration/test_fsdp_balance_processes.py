"""The tests of test_fsdp_balance.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from textbox_like.training import balance
from textbox_like.training.balance import Balancer, RankTimer

from conftest import read_jsonl, write_mnist
from test_fsdp import assert_close, checkpoint, in_process
from _fsdp_runs import run_plan, spawned


PY = sys.executable

GLOBAL = 128

#: rank 1's extra seconds per sample (2.56 s an update on an even split). Sleep does not
#: slow down with the machine's load, compute does: at a load average of 11.6 on this
#: 2-core machine rank 0 computed 0.019 s per sample under --fsdp, so rank 1 measured
#: about 3 times slower (share about 0.25); its share stays below 0.4 up to about 4 times that load
SLOW = 0.04


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_fsdp_balance")
    write_mnist(directory, n_train=1280, n_test=64)
    return directory


def mnist_args(data, save_dir, *extra):
    return ["run_hetseq.py", "--task", "mnist", "--data", data, "--save-dir", save_dir, "--optimizer", "sgd",
            "--lr", "0.05", "--lr-scheduler", "constant", "--max-epoch", "0", "--max-update", "16",
            "--global-batch-size", GLOBAL, "--max-sentences", GLOBAL, "--log-format", "json",
            "--log-interval", "4", "--threads", "1", "--distributed-timeout", "120", "--disable-validation",
            "--no-epoch-checkpoints", "--model_conf", "dropout1=0", "--model_conf", "dropout2=0", *extra]


@pytest.fixture(scope="module")
def two_rank_runs(mnist, tmp_path_factory):
    """Both tests' runs of two --fsdp ranks, one after the other in one pair of rank processes
    (_fsdp_runs.run_plan), each with the variables run_hetseq.py's spawned ranks get: "slow", rank 1
    sleeping SLOW s per sample; "none", --fsdp-sharding none. {name: its _fsdp_runs.Run}, under the root."""
    root = tmp_path_factory.mktemp("fsdp_balance_runs")
    runs = {"slow": spawned(mnist_args(mnist, root / "fsdp", "--distributed-world-size", "2", "--fsdp", "--balance",
                                       "--balance-interval", "4", "--max-update", "12")[1:], 2, root / "rdzv_slow",
                            env={balance.SLOW_RANK_ENV: f"1:{SLOW}@0"}),
            "none": spawned(mnist_args(mnist, root / "none", "--distributed-world-size", "2", "--fsdp",
                                       "--fsdp-sharding", "none", "--balance", "--balance-interval", "2",
                                       "--max-update", "6")[1:], 2, root / "rdzv_none")}
    run_plan(list(runs.values()), root / "plan")
    return root, runs


def balance_records(save_dir):
    return [r for r in read_jsonl(Path(save_dir) / "metrics.jsonl") if r["kind"] == "balance"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_balance_moves_samples_away_from_a_slow_rank(mnist, two_rank_runs, tmp_path):
    """Rank 1 sleeps SLOW s per sample: its measured speed, its compute
    without the time in FSDP's collectives, is far below rank 0's, the
    first exchange moves to the proportional split and says why, the slowed
    rank ends with under 0.4 of the global batch (as under DDP), and the
    weights are one process's over the same 128 samples an update (two_rank_runs' "slow")."""
    in_process([PY, *map(str, mnist_args(mnist, tmp_path / "one", "--max-update", "12"))])   # the reference
    root, runs = two_rank_runs
    out, stderr = root / "fsdp", runs["slow"].check()
    records = balance_records(out)
    assert records, stderr[-3000:]
    first = records[0]
    # without leaving the collectives out both ranks measured about the same speed (the fast one
    # waited for the slow one in every all-gather), no proportional move was taken, and the
    # search alone stayed near [64, 64]
    assert first["reason"] == f"proportional to the ranks' measured speed ({RankTimer.COMPUTE_WITHOUT_COLLECTIVES})", \
        records
    fast, slow = first["samples_per_s"]
    assert fast > 1.5 * slow, records
    assert first["batch_sizes"][1] < 0.4 * GLOBAL, records
    assert first["reason"] in stderr  # the log line says why
    assert records[-1]["batch_sizes"][1] < 0.4 * GLOBAL, records  # the search kept it there
    # the time left out of compute is the rank's wait: the fast rank waited for the slow one
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert train and train[0]["wait_s_per_rank"][0] > train[0]["wait_s_per_rank"][1], train[0]
    fsdp = checkpoint(out)
    assert fsdp["train"]["num_updates"] == 12
    assert_close(fsdp["model"], checkpoint(tmp_path / "one")["model"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_sharding_none_balances_on_whole_update_time_and_says_why(two_rank_runs):
    """--fsdp-sharding none: FSDP2's gradient all-reduce over the replicated
    dimension has no hook, so the ranks' compute times hold their waits: the
    first exchange takes no proportional start and its line says why, and the
    last line names no slowest rank (two_rank_runs' "none")."""
    root, runs = two_rank_runs
    stderr = runs["none"].check()
    records = balance_records(root / "none")
    assert records and records[0]["reason"].startswith(Balancer.UNCOMPARED), records
    assert Balancer.UNCOMPARED in stderr
    assert not any(r["reason"].startswith("proportional") for r in records), records
    # nor does the run's last line (rank 0's, the one that prints it) compare them to name a slowest rank
    last = runs["none"].errs[0].strip().splitlines()[-1]
    assert last.startswith("slowest rank not named: under --fsdp"), stderr[-800:]
