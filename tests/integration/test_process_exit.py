"""How a process that trained leaves (cli.leave).

A rank of a process group exits without the interpreter's teardown: DDP's
reducer keeps the group's gloo threads alive past destroy_process_group
(torch 2.14), and destroying them while the interpreter shut down aborted,
now and then on a loaded machine, a rank of a run that had finished and
saved everything (SIGABRT, "terminate called without an active exception",
exit 134: the project's CI saw it). Tested by its effect: an atexit
handler (what the interpreter's teardown runs) is not run in a rank, the
run's output is whole, and a process of one rank keeps its teardown.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, base_args, clean_env, read_jsonl

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

#: a sitecustomize that leaves a file per process when the interpreter tears down
MARK_TEARDOWN = textwrap.dedent('''
    import atexit, os

    def _mark():
        with open(os.path.join(os.environ["TEARDOWN_MARKS"], str(os.getpid())), "w") as out:
            out.write(os.environ.get("RANK", "-"))

    atexit.register(_mark)
''')


def marked_run(tmp_path, data, *extra, command=("run_hetseq.py",)):
    site, marks, save = tmp_path / "site", tmp_path / "marks", tmp_path / "save"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(MARK_TEARDOWN)
    env = clean_env()
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    env["TEARDOWN_MARKS"] = str(marks)
    done = subprocess.run([sys.executable, *command, *base_args(data, save, "--log-format", "simple", *extra)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return done, sorted(p.read_text() for p in marks.iterdir()), save


@pytest.mark.timeout(300)
def test_the_ranks_of_a_run_leave_without_the_interpreters_teardown_and_lose_nothing(small_mnist_dir, tmp_path):
    done, marks, save = marked_run(tmp_path, small_mnist_dir, "--distributed-world-size", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marks == ["-"]  # the launching process tore down; neither rank did
    results = json.loads((save / "results.json").read_text())
    assert (results["world_size"], results["num_updates"]) == (2, 4)
    assert [r["update"] for r in read_jsonl(save / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert "done | updates 4" in done.stderr + done.stdout  # rank 0's last line, flushed before it left
    assert "terminate called" not in done.stderr


@pytest.mark.timeout(300)
def test_a_process_of_one_rank_keeps_its_teardown(small_mnist_dir, tmp_path):
    done, marks, _ = marked_run(tmp_path, small_mnist_dir, command=("-m", "textbox_like", "train"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert marks == ["-"]


@pytest.mark.timeout(300)
def test_two_nodes_over_file_leave_no_rendezvous_file_and_the_same_command_runs_again(small_mnist_dir, tmp_path):
    """Ranks started by hand (--distributed-no-spawn) over file://: torch's
    FileStore removes its file only in its destructor, which a rank's way
    out no longer runs (and DDP kept from running before): the run removes
    it at its end, and the same command run again at once trains (with the
    file left, its rendezvous hung until the timeout)."""
    rdzv = tmp_path / "rdzv"

    def two_nodes(save):
        common = ["--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", "2",
                  "--distributed-gpus", "1", "--distributed-no-spawn", "--distributed-timeout", "60"]
        procs = [subprocess.Popen([sys.executable, "run_hetseq.py", *base_args(small_mnist_dir, save, *common,
                                                                              "--distributed-rank", rank)],
                                  cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for rank in ("0", "1")]
        errs = [p.communicate(timeout=200)[1] for p in procs]
        return [p.returncode for p in procs], errs

    for save in (tmp_path / "first", tmp_path / "again"):
        codes, errs = two_nodes(save)
        assert codes == [0, 0], errs[0][-2000:] + errs[1][-2000:]
        assert not rdzv.exists()
        assert json.loads((save / "results.json").read_text())["num_updates"] == 4
