"""A launcher's ranks on a CPU-only Linux machine are forks of it (its torch and trainer imports done once, not once
a rank); TEXTBOX_LIKE_FORK=0 (and every case children.can_fork turns down: CUDA, a Python thread, a task
class's PYTHONPATH) starts fresh interpreters. Either way is the same run: the same weights, bit for bit, and the
ranks are the launcher's children, which it supervises (the Ctrl-C, SIGTERM and lost-rank tests of the other files
run on forked ranks now). The rules themselves: tests/unit/test_rank_start.py."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow

CALLBACK = textwrap.dedent("""
    import json, os
    from textbox_like import Callback, register_callback

    @register_callback("how_this_rank_started")
    class HowThisRankStarted(Callback):
        def on_train_start(self, run):
            argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
            record = {"ppid": os.getppid(), "argv": [a.decode() for a in argv if a]}
            with open(os.path.join(run.config.checkpoint.save_dir, f"start_rank{run.rank}.json"), "w") as f:
                json.dump(record, f)
""")


def two_ranks(data, save, cwd, fork):
    env = clean_env()
    env.pop("TEXTBOX_LIKE_FORK", None)
    if not fork:
        env["TEXTBOX_LIKE_FORK"] = "0"
    argv = [sys.executable, str(REPO / "run_hetseq.py"), "--task", "mnist", "--data", str(data),
            "--max-sentences", "16", "--max-update", "6", "--log-format", "none", "--distributed-world-size", "2",
            "--user-dir", "rank_start", "--callbacks", "how_this_rank_started", "--save-dir", str(save)]
    launcher = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    starts = [json.loads((save / f"start_rank{rank}.json").read_text()) for rank in (0, 1)]
    return launcher.pid, argv, starts


@pytest.mark.fresh_interpreter
def test_forked_and_fresh_ranks_train_the_same_weights_and_are_the_launchers_children(small_mnist_dir, tmp_path):
    package = tmp_path / "outside" / "rank_start"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(CALLBACK)
    pid, argv, starts = two_ranks(small_mnist_dir, tmp_path / "forked", package.parent, fork=True)
    for start in starts:
        assert start == {"ppid": pid, "argv": argv}   # a fork: the launcher's own command line
    pid, argv, starts = two_ranks(small_mnist_dir, tmp_path / "fresh", package.parent, fork=False)
    for start in starts:
        assert start["ppid"] == pid
        assert start["argv"][:2] == [sys.executable, "-c"] and "run_resolved" in start["argv"][2]

    forked = torch.load(tmp_path / "forked" / "checkpoint_last.pt", weights_only=True)
    fresh = torch.load(tmp_path / "fresh" / "checkpoint_last.pt", weights_only=True)
    assert forked["train"]["num_updates"] == fresh["train"]["num_updates"] == 6
    for key in fresh["model"]:
        assert torch.equal(forked["model"][key], fresh["model"][key]), key


@pytest.mark.fresh_interpreter
def test_a_searchs_trials_are_forks_of_it_with_their_own_session_and_output(small_mnist_dir, tmp_path):
    package = tmp_path / "outside" / "rank_start"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(CALLBACK)
    env = clean_env()
    env.pop("TEXTBOX_LIKE_FORK", None)
    argv = [sys.executable, str(REPO / "run_multi_seed.py"), "--multi_seed=2", "--output", str(tmp_path / "seeds"),
            "--task", "mnist", "--data", str(small_mnist_dir), "--max-sentences", "16", "--max-update", "2",
            "--user-dir", "rank_start", "--callbacks", "how_this_rank_started"]
    search = subprocess.Popen(argv, cwd=package.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    out, err = search.communicate(timeout=300)
    assert search.returncode == 0, err[-3000:]
    seeds = sorted((tmp_path / "seeds").glob("seed_*"))
    assert len(seeds) == 2
    for folder in seeds:
        assert json.loads((folder / "start_rank0.json").read_text()) == {"ppid": search.pid, "argv": argv}
        # its output went to its own files, as a fresh trial's does, not to the search's
        assert "done | updates 2" in (folder / "stderr.log").read_text() + (folder / "stdout.log").read_text()
    assert "done | updates 2" not in out + err


def test_a_fork_waits_while_a_save_directorys_lock_refresher_is_at_work(tmp_path):
    """The refresher (a search's --output lock) may be writing its file; a fork then waits until it is done, so
    the child holds no lock or stream that a thread it does not have was using."""
    import os
    import threading
    import time

    from textbox_like.storage.savelock import SaveDirLock
    lock = SaveDirLock.acquire(tmp_path)
    try:
        lock._busy.acquire()   # what the refresher holds while it checks and touches the file
        threading.Timer(1.0, lock._busy.release).start()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        waited = time.monotonic() - started
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert waited >= 0.9, waited
        with lock._busy:        # and the refresher goes on after the fork
            pass
    finally:
        lock.release()
