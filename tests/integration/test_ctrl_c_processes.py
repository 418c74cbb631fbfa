"""The tests of test_ctrl_c.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring. The Ctrl-C is a real
SIGINT to the run's process group, as a terminal sends it; the resume after
it is a run like any other: main() in this process (_runs_runs.in_process),
whose torch is imported already (a run of two ranks has its launcher here and
its ranks spawned as processes)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _runs_runs import argv_of, ok_in_process
from conftest import REPO, clean_env, write_mnist


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ctrl_c_mnist")
    write_mnist(directory, n_train=512, n_test=32, seed=5)
    return directory


def command(data, save_dir, *extra):
    return [sys.executable, str(REPO / "run_hetseq.py"), "--task", "mnist", "--data", str(data), "--max-sentences",
            "8", "--max-epoch", "0", "--log-format", "simple", "--log-interval", "1", "--disable-validation",
            "--save-dir", str(save_dir), "--save-interval-updates", "3", *map(str, extra)]


@pytest.fixture
def start_in_a_terminals_group():
    """Starts the run as a shell starts a foreground job: a process group of
    its own; a group still alive when the test ends (a failed wait) is
    killed, so a failure leaves no run training beside the next tests."""
    started = []

    def start(cmd, **env):
        proc = subprocess.Popen(cmd, cwd=REPO, env={**clean_env(), **env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        return proc
    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group: a launcher's ranks too
        except ProcessLookupError:
            pass                                 # the whole group has ended
        proc.wait(timeout=60)


def wait_for_updates(proc, save_dir, n, timeout=180):
    """Until metrics.jsonl holds ``n`` training records (an update's record
    is written once it is done)."""
    deadline = time.monotonic() + timeout
    metrics = save_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= n):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the run did not reach its updates"
        time.sleep(0.05)


def asleep_in_update_7(proc, timeout=120):
    """Until the run's main thread has slept for a second on end: inside
    update 7's hour (the hook's sleep), past update 6's end and its check
    for a stop (a Ctrl-C before that check stops at update 6, on a loaded
    machine too)."""
    deadline, since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        state = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        since = (since or time.monotonic()) if state == "S" else None
        if since is not None and time.monotonic() - since >= 1.0:
            return
        time.sleep(0.05)
    raise AssertionError("the run never settled into update 7's sleep")


def updates_in(checkpoint):
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["train"]["num_updates"]


def stop_line(err):
    lines = [line for line in err.splitlines() if line.startswith("stopped by Ctrl-C")]
    assert lines, err[-3000:]
    return lines


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_saves_the_update_under_way_says_how_to_resume_and_the_resume_goes_on(data, tmp_path, ranks, capfd,
                                                                                     start_in_a_terminals_group):
    save = tmp_path / "run"
    spread = ["--distributed-world-size", 2, "--threads", 1] if ranks == 2 else []
    run = start_in_a_terminals_group(command(data, save, "--max-update", 100000, *spread))
    wait_for_updates(run, save, 5)
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=180)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("interrupted (Ctrl-C): finishing this update")], \
        err[-3000:]
    lines = stop_line(err)
    assert len(lines) == ranks and all(line == "stopped by Ctrl-C (SIGINT); checkpoint_last.pt saved: rerun the "
                                              "same command with --resume" for line in lines), lines
    results = json.loads((save / "results.json").read_text())
    stopped_at = results["num_updates"]
    assert stopped_at >= 5 and results["stopped"] == "preempted"
    assert updates_in(save / "checkpoint_last.pt") == stopped_at   # the last completed update, not the last interval's

    out = ok_in_process(argv_of(command(data, save, "--max-update", stopped_at + 3, "--resume", *spread)), capfd)
    assert f"resumed from {save / 'checkpoint_last.pt'}: epoch 1, update {stopped_at}" in out.stderr
    assert updates_in(save / "checkpoint_last.pt") == stopped_at + 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_ctrl_c_aborts_at_once_without_saving(data, tmp_path, start_in_a_terminals_group):
    """Update 7 takes hours (the test-only slow-rank hook): the first Ctrl-C
    waits for it; the second, a moment later, aborts at once. The checkpoint
    of update 6 stays the newest; nothing of update 7 is saved."""
    save = tmp_path / "run"
    run = start_in_a_terminals_group(command(data, save, "--max-update", 100), TEXTBOX_LIKE_SLOW_RANK="0:1000@7")
    wait_for_updates(run, save, 6)
    asleep_in_update_7(run)
    os.killpg(run.pid, signal.SIGINT)
    time.sleep(1.5)   # a person's second Ctrl-C (within a second it is the first one, forwarded)
    assert run.poll() is None   # still in update 7: the first one waits for it
    aborted_at = time.monotonic()
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert time.monotonic() - aborted_at < 30
    assert run.returncode == 130, err[-3000:]
    assert err.splitlines()[-1] == "interrupted", err[-3000:]
    assert "Traceback" not in err
    assert updates_in(save / "checkpoint_last.pt") == 6
    assert not (save / "results.json").exists()
