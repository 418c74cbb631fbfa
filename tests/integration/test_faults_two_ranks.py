"""Faults on two ranks (issue 13 item 5): every rank stops with the same
one-line reason and exit code, none hangs. Faults are injected through the
file system only (no hooks in the source): a learning rate that diverges, a
directory standing where a checkpoint must be written.

The launcher (run_hetseq.py --distributed-world-size 2) is not what is tested:
the three runs are its two ranks as it starts them (RANK, WORLD_SIZE, ...,
a file:// rendezvous of their own), one run after another in ONE pair of rank
processes (_runs_runs.run_plan), each rank's exit code and output kept."""
from __future__ import annotations

import pytest
import torch

from _runs_runs import spawned, run_plan
from conftest import N_SMALL_TEST, N_SMALL_TRAIN, write_mnist
from textbox_like.storage.checkpoint import load_checkpoint

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


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """The module's three two-rank runs in one pair of rank processes: {name: (Ranks, save dir)}."""
    where = tmp_path_factory.mktemp("two_ranks")
    diverging = ["--optimizer", "sgd", "--lr", "1e4", "--max-update", "40", "--max-nonfinite-updates", "3"]
    # host: the norm read before each step; device: a fused optimizer skips in its kernel and both ranks
    # read the norm one update late, alike
    extras = {"host": diverging, "device": [*diverging, "--optim_conf", "fused=true", "--log-interval", "7"],
              "save_failure": ["--save-interval-updates", "2", "--max-update", "8"]}
    (where / "save_failure").mkdir()
    (where / "save_failure" / "checkpoint_1_4.pt").mkdir()  # the second interval checkpoint cannot be written
    found = {name: (spawned(two_ranks(data, where / name, *extra), 2, where / f"rdzv_{name}"), where / name)
             for name, extra in extras.items()}
    run_plan([run for run, _ in found.values()], where / "plan", timeout=600)
    return found


@pytest.mark.timeout(660)
@pytest.mark.parametrize("guard", ["host", "device"])
def test_divergence_stops_both_ranks_with_65(runs, guard):
    """host: the norm read before each step; device: a fused optimizer skips in
    its kernel and both ranks read the norm one update late, alike."""
    run, out = runs[guard]
    assert run.codes == {0: 65, 1: 65}, run.stderr[-3000:]
    assert max(run.seconds.values()) < 150   # none hangs (the bound each run's process had)
    lines = errors(run.stderr)
    assert lines and all("diverged" in line for line in lines), lines
    for path in out.glob("checkpoint*.pt"):
        assert all(torch.isfinite(t).all() for t in load_checkpoint(path)["model"].values()), path


@pytest.mark.timeout(660)
def test_save_failure_stops_both_ranks_with_74(runs):
    run, out = runs["save_failure"]
    assert run.codes == {0: 74, 1: 74}, run.stderr[-3000:]
    assert max(run.seconds.values()) < 150   # none hangs (the bound each run's process had)
    lines = errors(run.stderr)
    assert any("could not write" in line and "checkpoint_1_4.pt" in line and "checkpoint_1_2.pt" in line
               for line in lines), lines
    assert load_checkpoint(out / "checkpoint_1_2.pt")["train"]["num_updates"] == 2
    assert not list(out.glob(".checkpoint*")), list(out.iterdir())
