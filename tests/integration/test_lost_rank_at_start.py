"""A rank killed as a node dies (SIGKILL) before training began, while rank
0 tokenised the data and the others waited for it (issue 51, item 11): the
survivor says the run lost a process and exits 75 (EX_TEMPFAIL: the same
command can be run again), and the launcher of the node exits with the
survivor's 75, not the killed rank's 137 (it took the first child's code,
the signal's), which no requeue script retries."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, clean_env
from test_hf_task import write_long_text_data, write_model


def children_of(pid):
    """The processes ``pid`` started, in the order it started them (the kernel lists a task's children so)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_rank_0_killed_while_tokenising_the_survivor_and_the_launcher_exit_75(tmp_path):
    model = write_model(tmp_path / "model", "sequence_classification")
    data = write_long_text_data(tmp_path / "data")
    launcher = subprocess.Popen([sys.executable, "run_hetseq.py", "--task", "hf", "--model_name_or_path", str(model),
                                 "--data", str(data), "--max-sentences", "4", "--max-update", "2", "--log-format",
                                 "none", "--num-workers", "1", "--distributed-world-size", "2", "--distributed-timeout",
                                 "60", "--save-dir", str(tmp_path / "run"), "--cache-dir", str(data / ".hf_cache")],
                                cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list((data / ".hf_cache").glob("tmp*")):   # rank 0 is writing the tokenised train split
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    # the launcher starts its ranks in rank order; forked ranks set RANK after their start, which
    # /proc/PID/environ (the environment a process started with) does not show
    ranks = dict(enumerate(children_of(launcher.pid)))
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[0], signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: another process of this run died or is "
                                                     "unreachable"), err[-3000:]
    assert errors[0].endswith("; stopping (exit 75: the same command can be run again)"), errors[0]
    assert "Traceback" not in err
