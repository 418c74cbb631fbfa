"""Exact, crash-safe checkpoints and resume (issue 3).

A run killed at a random update and resumed with --resume must end with model
and optimizer state bitwise identical to an uninterrupted run."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_bitwise_equal, write_mnist


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_resume")
    write_mnist(directory, n_train=384, n_test=64)
    return directory


def command(data, save_dir, *extra):
    return [sys.executable, str(REPO / "run_hetseq.py"), "--task", "mnist", "--data", str(data),
            "--save-dir", str(save_dir), "--max-sentences", "16", "--optimizer", "adam", "--lr", "0.001",
            "--max-update", "60", "--max-epoch", "0", "--save-interval-updates", "5",
            "--log-format", "none", "--threads", "1", *extra]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def kill_after_checkpoint(cmd, save_dir, sig, min_checkpoint="checkpoint_1_5.pt", seed=0, group=False, max_delay=1.0,
                          poll=0.02):
    """Start ``cmd``, wait for a first checkpoint, then send ``sig`` at a random
    moment up to ``max_delay`` s later (to the whole process group, every rank
    at once, with ``group``); the checkpoint is looked for every ``poll`` s."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=group)
    deadline = time.monotonic() + 180
    while not (save_dir / min_checkpoint).exists():
        assert proc.poll() is None, f"run ended before its first checkpoint: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(poll)
    time.sleep(random.Random(seed).uniform(0.0, max_delay))
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def compare_final(final, ref):
    assert final["train"]["num_updates"] == ref["train"]["num_updates"] == 60
    assert_bitwise_equal(final["model"], ref["model"], "model")
    assert_bitwise_equal(final["optimizer"], ref["optimizer"], "optimizer")
    assert final["scheduler"] == ref["scheduler"]
    assert final["iterator"] == ref["iterator"]


def test_atomic_save_keeps_previous_file_when_write_fails(tmp_path, monkeypatch):
    from textbox_like.storage import checkpoint as ck
    target = tmp_path / "checkpoint_last.pt"
    ck.atomic_save({"format": ck.FORMAT, "x": torch.ones(3)}, target)

    def broken_save(obj, handle):
        handle.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        ck.atomic_save({"format": ck.FORMAT, "x": torch.zeros(3)}, target)
    monkeypatch.undo()
    assert torch.equal(ck.load_checkpoint(target)["x"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]
