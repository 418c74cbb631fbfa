"""Faults on two ranks (issue 13 item 5): every rank stops with the same
one-line reason and exit code, none hangs. Faults are injected through the
file system only (no hooks in the source): a learning rate that diverges, a
directory standing where a checkpoint must be written."""
from __future__ import annotations

import pytest
import torch

from conftest import N_SMALL_TEST, N_SMALL_TRAIN, run_cli, write_mnist
from textbox_like.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_faults_2")
    write_mnist(directory, n_train=N_SMALL_TRAIN, n_test=N_SMALL_TEST, seed=11)
    return directory


def two_ranks(data, out, *extra):
    return ["--task", "mnist", "--data", str(data), "--max-sentences", "8", "--save-dir", str(out),
            "--distributed-world-size", "2", "--threads", "1", "--log-format", "simple", "--report_to", "none",
            "--distributed-timeout", "60", *map(str, extra)]


def errors(stderr):
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("guard", ["host", "device"])
def test_divergence_stops_both_ranks_with_65(data, tmp_path, guard):
    """host: the norm read before each step; device: a fused optimizer skips in
    its kernel and both ranks read the norm one update late, alike."""
    out = tmp_path / "out"
    extra = ["--optim_conf", "fused=true", "--log-interval", "7"] if guard == "device" else []
    proc = run_cli(two_ranks(data, out, "--optimizer", "sgd", "--lr", "1e4", "--max-update", "40",
                             "--max-nonfinite-updates", "3", *extra), timeout=150)
    assert proc.returncode == 65, proc.stderr[-3000:]
    lines = errors(proc.stderr)
    assert lines and all("diverged" in line for line in lines), lines
    for path in out.glob("checkpoint*.pt"):
        assert all(torch.isfinite(t).all() for t in load_checkpoint(path)["model"].values()), path


@pytest.mark.timeout(180)
def test_save_failure_stops_both_ranks_with_74(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint_1_4.pt").mkdir()  # the second interval checkpoint cannot be written
    proc = run_cli(two_ranks(data, out, "--save-interval-updates", "2", "--max-update", "8"), timeout=150)
    assert proc.returncode == 74, proc.stderr[-3000:]
    lines = errors(proc.stderr)
    assert any("could not write" in line and "checkpoint_1_4.pt" in line and "checkpoint_1_2.pt" in line
               for line in lines), lines
    assert load_checkpoint(out / "checkpoint_1_2.pt")["train"]["num_updates"] == 2
    assert not list(out.glob(".checkpoint*")), list(out.iterdir())
