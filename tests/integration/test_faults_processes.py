"""The tests of test_faults.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring. None of these faults is
the OS's (a learning rate that diverges, a file truncated or changed, a shard
renamed away between two reads): their runs train in this process
(_runs_runs.in_process: main(), its exit code and output), whose torch is
imported already; the refusals of a save directory stay whole processes, whose
entire output is one line."""
from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest
import torch

from _runs_runs import in_process
from conftest import _reset_accelerate, assert_bitwise_equal, read_jsonl, run_cli, run_main
from test_faults import (  # noqa: F401 (fixtures)
    FUSED, bert_args, bert_data, build_trainer, data, error_lines, load, mnist_args)


# ------------------------------------------------------------ divergence
@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, 3])
def test_divergence_stops_with_65_and_keeps_finite_checkpoints(data, tmp_path, limit, capfd):
    out = tmp_path / "out"
    extra = ["--optimizer", "sgd", "--lr", "1e4", "--save-interval-updates", "2", "--keep-interval-updates", "2",
             "--log-interval", "1"] + (["--max-nonfinite-updates", str(limit)] if limit else [])
    proc = in_process(mnist_args(data, out, *extra, max_update=30), capfd)
    assert proc.returncode == 65, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "learning rate" in errors[0], errors[0]
    limit = limit or 10
    skipped = [int(m.group(1)) for m in re.finditer(r"^update (\d+): gradient norm \S+ is not finite; update skipped",
                                                   proc.stderr, re.M)]
    assert skipped, proc.stderr[-3000:]
    # the run stops at the limit-th consecutive skip, no later
    assert len(skipped) == limit, proc.stderr[-3000:]
    assert f"update {skipped[0]}" in errors[0]
    updates = [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert max(updates) == skipped[0] - 1  # no update was counted after the first skipped one
    # the last finite checkpoint is named, and exists
    named = re.search(r"last finite checkpoint is (\S+\.pt)", errors[0])
    assert named and Path(named.group(1)).is_file(), errors[0]
    kept = sorted(out.glob("checkpoint*.pt"))
    assert kept, "no checkpoint left"
    from textbox_like.storage.checkpoint import load_checkpoint
    for path in kept:
        state = load_checkpoint(path)
        for name, tensor in state["model"].items():
            if torch.is_floating_point(tensor):
                assert torch.isfinite(tensor).all(), (path.name, name)
        assert state["train"]["num_updates"] < skipped[0]


@pytest.mark.slow
def test_device_skip_divergence_stops_with_65(data, tmp_path, capfd):
    """The lagged read still stops at the limit-th consecutive skip, and every
    checkpoint stays finite."""
    out = tmp_path / "out"
    proc = in_process(mnist_args(data, out, "--optimizer", "sgd", "--lr", "1e4", *FUSED, "--log-interval", "5",
                                 "--save-interval-updates", "2", "--keep-interval-updates", "2",
                                 "--max-nonfinite-updates", "3", max_update=30), capfd)
    assert proc.returncode == 65, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "learning rate" in errors[0], proc.stderr[-3000:]
    skipped = [int(m.group(1)) for m in re.finditer(r"^update (\d+): gradient norm \S+ is not finite; update skipped",
                                                   proc.stderr, re.M)]
    assert skipped == [skipped[0]] * 3, proc.stderr[-3000:]  # the same update, retried on new batches
    from textbox_like.storage.checkpoint import load_checkpoint
    kept = sorted(out.glob("checkpoint*.pt"))
    assert kept
    for path in kept:
        state = load_checkpoint(path)
        assert all(torch.isfinite(t).all() for t in state["model"].values() if torch.is_floating_point(t))
        assert state["train"]["num_updates"] < skipped[0]


# ------------------------------------------------- corrupt newest checkpoint
@pytest.mark.slow
def test_truncated_last_checkpoint_falls_back_bitwise(data, tmp_path, capfd):
    out = tmp_path / "out"
    common = ["--save-interval-updates", "3", "--disable-validation", "--log-interval", "1"]
    proc = in_process(mnist_args(data, out, *common, max_update=7), capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoint_1_6.pt").is_file()
    direct = tmp_path / "direct"
    shutil.copytree(out, direct)
    last = out / "checkpoint_last.pt"
    size = last.stat().st_size
    with open(last, "r+b") as handle:
        handle.truncate(size // 2)

    resumed = in_process(mnist_args(data, out, *common, "--resume", max_update=12), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if "checkpoint_1_6.pt" in line and "warning" in line]
    assert len(warnings) == 1, resumed.stderr[-3000:]
    assert "checkpoint_last.pt" in warnings[0]
    assert "resumed from" in resumed.stderr and "update 6" in resumed.stderr

    from_file = in_process(mnist_args(data, direct, *common, "--restore-file", direct / "checkpoint_1_6.pt",
                                      max_update=12), capfd)
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    a, b = load(out / "checkpoint_last.pt"), load(direct / "checkpoint_last.pt")
    assert a["train"]["num_updates"] == b["train"]["num_updates"] == 12
    assert_bitwise_equal(a["model"], b["model"], "model")
    assert_bitwise_equal(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_explicit_restore_file_failing_digest_is_an_error(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert run_main(mnist_args(data, out, "--disable-validation", "--log-format", "none", max_update=2)) == 0
    state = load(out / "checkpoint_last.pt")
    name = next(k for k, v in state["model"].items() if torch.is_floating_point(v))
    state["model"][name] = state["model"][name].clone()
    state["model"][name].view(-1)[0] += 1.0  # one changed weight, the old digest kept
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    proc = in_process(mnist_args(data, tmp_path / "out2", "--restore-file", bad, max_update=4), capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "digest" in errors[0] and "bad.pt" in errors[0], proc.stderr[-3000:]
    assert "resuming from" not in proc.stderr
    assert not (tmp_path / "out2" / "checkpoint_last.pt").exists()


@pytest.mark.slow
def test_unwritable_save_dir_subprocess_one_line(data, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_cli(mnist_args(data, blocker / "out", max_update=2))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(error_lines(proc.stderr)) == 1
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr


@pytest.mark.slow
def test_shard_vanishing_mid_epoch_exits_75_and_resume_skips_nothing(bert_data, tmp_path, capfd):
    shards = sorted((bert_data / "shards").glob("*train*.hdf5"))
    assert len(shards) >= 2, shards
    fail_at = 4  # the 4th training read: update 4 (update_freq 1, no read-ahead)
    out = tmp_path / "out"
    trainer, _, _ = build_trainer(bert_args(bert_data, out, "--num-workers", "0", max_update=8))
    dataset = trainer.train_data
    real_get = dataset.get_batch
    calls = {"n": 0}
    offsets = []
    moved = []

    def get_batch(indices):
        calls["n"] += 1
        offsets.append((trainer.state.num_updates, trainer.iterator.offset))
        if calls["n"] == fail_at:
            # the files go away: rename every train shard, and drop open handles and cached blocks
            for shard in shards:
                shard.rename(shard.with_name(shard.name + ".gone"))
                moved.append(shard)
            dataset.close()
        return real_get(indices)

    dataset.get_batch = get_batch
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            from textbox_like.training import outcome as trainer_module
            original = trainer_module.Trainer
            trainer_module.Trainer = lambda *given, **named: trainer
            try:
                rc = trainer_module.train(trainer.cfg)
            finally:
                trainer_module.Trainer = original
                _reset_accelerate()
    finally:
        for shard in moved:  # the data is back
            shard.with_name(shard.name + ".gone").rename(shard)
    stderr = err.getvalue()
    assert rc == 75, stderr[-3000:]
    errors = error_lines(stderr)
    assert len(errors) == 1, stderr[-3000:]
    assert ".hdf5" in errors[0] and "rows" in errors[0], errors[0]
    assert "--resume" in errors[0]
    state = load(out / "checkpoint_last.pt")
    assert state["train"]["num_updates"] == fail_at - 1
    updates_before, offset_before = offsets[fail_at - 1]
    assert updates_before == fail_at - 1
    assert state["iterator"]["offset"] == offset_before == (fail_at - 1) * 4
    assert state["iterator"]["epoch"] == 1

    # rerun with --resume once the data is back, against an uninterrupted run
    resumed = in_process(bert_args(bert_data, out, "--resume", max_update=8), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"update {fail_at - 1}" in resumed.stderr
    whole = in_process(bert_args(bert_data, tmp_path / "whole", max_update=8), capfd)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a, b = load(out / "checkpoint_last.pt"), load(tmp_path / "whole" / "checkpoint_last.pt")
    assert a["train"]["num_updates"] == b["train"]["num_updates"] == 8
    assert a["iterator"]["offset"] == b["iterator"]["offset"]
    assert_bitwise_equal(a["model"], b["model"], "model")
    assert_bitwise_equal(a["optimizer"], b["optimizer"], "optimizer")


@pytest.mark.slow
def test_save_dir_that_is_a_file_refused(data, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run_cli(mnist_args(data, blocker, max_update=2))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(blocker) in lines[0], proc.stderr
    assert blocker.read_text() == "x"


@pytest.mark.slow
def test_snapshot_interval_counts_an_epochs_last_update(data, tmp_path, capfd):
    """kanachan's --snapshot-interval counts every trained sample, the last
    update of an epoch too: 256 samples per epoch at batch 8, a snapshot every
    256 samples lands on updates 32 and 64 (the epochs' ends)."""
    out = tmp_path / "out"
    proc = in_process(mnist_args(data, out, "--snapshot-interval", "256", "--max-epoch", "2", "--log-interval",
                                 "100", "--disable-validation", "--no-epoch-checkpoints", max_update=0), capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint_*_*.pt")) == ["checkpoint_1_32.pt", "checkpoint_2_64.pt"]
    assert load(out / "checkpoint_last.pt")["train"]["samples_trained"] == 512
