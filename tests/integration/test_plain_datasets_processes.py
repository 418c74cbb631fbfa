"""The tests of test_plain_datasets.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_bitwise_equal, clean_env, refusal_in_process
from test_plain_datasets import train_args, user_dir  # noqa: F401 (fixtures)


def start(args, env=None):
    return subprocess.Popen([sys.executable, str(REPO / "run_hetseq.py"), *map(str, args)], cwd=REPO,
                            env={**clean_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def trained(args, env=None):
    proc = start(args, env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return err


def checkpoint(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)


def assert_params_close(a, b, rtol=1e-5):
    for key in a:
        x, y = a[key].double(), b[key].double()
        assert ((x - y).abs().max() / y.abs().max().clamp(min=1e-12)).item() <= rtol, key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_of_3_and_5_and_micro_batches_equal_one_process_of_8(user_dir, tmp_path, capfd):
    """A TensorDataset's [x, y] batches: two 'nodes' with --max-sentences 3
    and 5, and one process cutting a global batch of 8 into micro-batches of
    at most 3, each equal one process of 8 after 9 updates. 57 samples: the
    epoch's last step holds one sample, which rank 0 gets none of."""
    one, het, cut = tmp_path / "one", tmp_path / "het", tmp_path / "cut"
    common = ["--max-update", "9", "--disable-validation"]
    ranks = ["--distributed-init-method", f"file://{tmp_path / 'rdzv'}", "--distributed-world-size", "2",
             "--distributed-gpus", "1", "--distributed-timeout", "120"]
    nodes = [start(train_args(user_dir, "plain_tensors", het, *common, *ranks, "--max-sentences", size,
                              "--distributed-rank", rank)) for size, rank in (("3", "0"), ("5", "1"))]
    # the one-process runs in-process while the ranks start: a process is what the ranks test, not these
    reference = refusal_in_process(train_args(user_dir, "plain_tensors", one, *common), capfd)
    split = refusal_in_process(train_args(user_dir, "plain_tensors", cut, *common, "--global-batch-size", "8",
                                          "--max-sentences", "3"), capfd)
    errors = [proc.communicate(timeout=300)[1] for proc in nodes]
    assert [reference.returncode, split.returncode] == [0, 0], reference.stderr[-2000:] + split.stderr[-2000:]
    assert [proc.returncode for proc in nodes] == [0] * 2, "\n".join(e[-2000:] for e in errors)
    assert "batch sizes per rank [3, 5]" in errors[0]
    assert "micro-batch caps [3]" in split.stderr
    expected = checkpoint(one)
    assert expected["train"]["num_updates"] == 9 and expected["iterator"]["epoch"] == 2
    for run in (het, cut):
        assert_params_close(checkpoint(run)["model"], expected["model"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_mid_epoch_then_resume_is_bitwise_identical(user_dir, tmp_path):
    """The user's own Dataset and collate, dropout on: killed (SIGKILL, from
    its own forward) in update 5 of an 8-update epoch, after the save at
    update 3; resumed, it ends bitwise equal to the uninterrupted run."""
    dropout = {"PLAIN_DROPOUT": "0.2"}
    args = ["--max-update", "12", "--save-interval-updates", "3", "--optimizer", "adam", "--lr", "0.01"]
    reference = start(train_args(user_dir, "plain_collate", tmp_path / "whole", *args), env=dropout)
    killed = start(train_args(user_dir, "plain_collate", tmp_path / "run", *args),
                   env={**dropout, "PLAIN_KILL_AT": "5"})
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    saved = checkpoint(tmp_path / "run")
    assert saved["train"]["num_updates"] == 3 and saved["iterator"]["offset"] == 24  # mid-epoch
    resumed = trained(train_args(user_dir, "plain_collate", tmp_path / "run", *args, "--resume"), env=dropout)
    assert "resumed from" in resumed
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-2000:]
    final, whole = checkpoint(tmp_path / "run"), checkpoint(tmp_path / "whole")
    assert final["train"]["num_updates"] == whole["train"]["num_updates"] == 12
    for part in ("model", "optimizer", "iterator"):
        assert_bitwise_equal(final[part], whole[part], part)
