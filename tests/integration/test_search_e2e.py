"""run_hyper.py with real trainer runs on tiny MNIST: resume after kill -9 in
the middle of a trial, parallel trials with a failing one, and the reports
(run_multi_seed.py's seeds drawn from --seed with scipy's interval: in
test_user_code_everywhere_processes.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, write_mnist
from textbox_like import search as S

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

TRAIN = ["--task", "mnist", "--log-format", "none", "--valid-subset", "test", "--warmup-updates", "0"]


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_tiny")
    write_mnist(directory, n_train=64, n_test=20, seed=3)
    return directory


def script(name, args, cwd, timeout=240):
    return subprocess.run([sys.executable, str(REPO / name), *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def records(out):
    return {r["trial"]: r for r in S.hyper.read_jsonl(Path(out) / "hyper_results.jsonl")}


def processes_writing(log):
    """The processes whose standard output is the file ``log`` (a trial's stdout.log: forked or fresh, a trial
    writes there; its search holds the file open too, but not as its stdout)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/fd/1") == str(log):
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_resume_after_kill_9_in_the_middle_of_trial_2(tmp_path, tiny_mnist):
    (tmp_path / "space.test").write_text("learning_rate loguniform (-7, -4)\noptimizer choice ['adam', 'adamw']\n")
    out = tmp_path / "out"
    args = ["--space", "space.test", "--algo", "tpe", "--max_evals", "3", "--seed", "5", "--output", out,
            "--data", tiny_mnist, "--max-sentences", "8", "--max-update", "24", "--max-epoch", "3",
            "--save-interval-updates", "2",
            "--log-interval", "2", "--threads", "1", *TRAIN]
    search = subprocess.Popen([sys.executable, str(REPO / "run_hyper.py"), *map(str, args)], cwd=tmp_path,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        rec = records(out)
        if rec.get(2, {}).get("status") == "running" and (out / "trial_2" / "checkpoint_last.pt").exists():
            break
        assert search.poll() is None, search.communicate()
        time.sleep(0.05)
    else:
        pytest.fail("trial 2 never started")
    trial = processes_writing(out / "trial_2" / "stdout.log")
    assert trial
    search.kill()                     # kill -9 the search in the middle of trial 2
    search.wait()
    assert records(out)[2]["status"] == "running" and 3 not in records(out)
    # the orphaned trial got SIGTERM (PR_SET_PDEATHSIG): it saves checkpoint_last.pt and ends within
    # seconds (measured: about 2 s from the kill to the process gone), not after training on
    deadline = time.time() + 10
    while processes_writing(out / "trial_2" / "stdout.log") and time.time() < deadline:
        time.sleep(0.1)
    assert not processes_writing(out / "trial_2" / "stdout.log"), \
        "the trial still runs 10 s after its search was killed"
    assert "stopped by SIGTERM" in (out / "trial_2" / "stderr.log").read_text()
    trial1_log = (out / "trial_1" / "stdout.log").stat().st_mtime_ns

    proc = script("run_hyper.py", args + ["--resume"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--resume: 1 finished trial(s) kept, 1 to continue (2), 1 new" in proc.stdout
    rec = records(out)
    assert sorted(rec) == [1, 2, 3] and all(r["status"] == "ok" for r in rec.values())
    assert rec[1]["attempts"] == 1 and (out / "trial_1" / "stdout.log").stat().st_mtime_ns == trial1_log
    assert rec[2]["attempts"] == 2 and "--resume" in (out / "trial_2" / "command.txt").read_text()
    assert rec[2]["num_updates"] == 24
    # each trial ran the configuration the search resolved for it, not a command line to re-parse
    from textbox_like.resolve.resolution import read_resolved
    for k in (1, 2):
        cfg = read_resolved(out / f"trial_{k}" / "trial_config.yaml")
        assert cfg.optim.lr == [rec[k]["params"]["lr"]] and cfg.optim.optimizer == rec[k]["params"]["optimizer"]
        assert cfg.source("lr") == "the search" and cfg.source("max_update") == "command line"
        assert cfg.checkpoint.save_dir == str(out / f"trial_{k}") and cfg.checkpoint.resume == (k == 2)
    updates = [r["update"] for r in S.hyper.read_jsonl(out / "trial_2" / "metrics.jsonl") if r["kind"] == "train"]
    assert updates == sorted(set(updates))            # continued, not restarted
    # the same trials as an uninterrupted search with the same seed (TPE's first trials depend on the seed only)
    from textbox_like.resolve.options import build_options
    space = S.load_space(tmp_path / "space.test", build_options())
    sampler = S.Sampler(space, "tpe", 5)
    expected = []
    for k in range(1, 4):
        params, _ = sampler.ask(k)
        sampler.tell(k, 0.5)
        expected.append(params)
    assert [rec[k]["params"] for k in (1, 2, 3)] == expected
    # the reports
    best = json.loads((out / "hyper_best.json").read_text())
    assert best["n_trials"] == 3 and best["value"] == max(r["value"] for r in rec.values())
    assert f"*{best['trial']}" in proc.stdout and "wall_s" in proc.stdout
    csv = (out / "hyper_results.csv").read_text().splitlines()
    assert csv[0].startswith("trial,lr,optimizer,accuracy,status,wall_time") and len(csv) == 4
    assert (out / "hyper_report.png").stat().st_size > 20000
    assert "learning_rate: loguniform(-7, -4) = 0.000912 .. 0.0183" in proc.stdout


def test_parallel_exhaustive_with_a_failing_trial(tmp_path, tiny_mnist):
    (tmp_path / "space.yaml").write_text("valid_subset: {choice: [test, nosuch]}\n")
    proc = script("run_hyper.py", ["--space", "space.yaml", "--algo=exhaustive", "--parallel", "2",
                                   "--data", tiny_mnist, "--output", "out", "--max-update", "2",
                                   "--max-sentences", "16", "--task", "mnist", "--log-format", "none"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 trial(s) at once" in proc.stdout
    rec = records(tmp_path / "out")
    assert rec[1]["status"] == "ok" and rec[2]["status"] == "fail" and rec[2]["returncode"] == 2
    assert rec[2]["error"].startswith("error:")
    assert "--threads=1" in (tmp_path / "out" / "trial_1" / "command.txt").read_text()


# run_multi_seed.py's seeds drawn from --seed and scipy's interval (was test_multi_seed_draws_from_seed_and_uses_
# scipys_interval here): test_user_code_everywhere_processes.py::test_multi_seed_runs_each_seed_with_the_user_dir_
# and_eval_and_export_read_a_seeds_checkpoint runs that command (its seeds two at once) and asserts them
