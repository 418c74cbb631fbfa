"""run_hyper.py / run_multi_seed.py --backend ray on a local Ray instance:
a 6-trial TPE search with ASHA (at least one trial stopped early; the local
backend's files), seeds on Ray, and one-line errors for a dead address and
GPUs that are not there. Skipped only where ray is not installed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, write_mnist

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")

TRAIN = ["--task", "mnist", "--log-format", "none", "--valid-subset", "test", "--warmup-updates", "0",
         "--max-sentences", "8"]


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_ray")
    write_mnist(directory, n_train=96, n_test=40, seed=4)
    return directory


def ray_temp_dir(cwd) -> Path:
    """The Ray temp dir of the test running in ``cwd``: under /tmp, as Ray's
    socket paths must stay short (not under pytest's long tmp_path)."""
    return Path(f"/tmp/ray_tbl_test_{abs(hash(str(cwd))) % 10 ** 6}")


@pytest.fixture(autouse=True)
def ray_temp_dir_removed(tmp_path):
    """After each test its Ray instance is gone and so is its temp dir."""
    temp = ray_temp_dir(tmp_path)
    yield temp
    deadline = time.time() + 60
    while not no_ray_left(tmp_path) and time.time() < deadline:   # a raylet still exiting keeps files open
        time.sleep(0.5)
    shutil.rmtree(temp, ignore_errors=True)
    assert not temp.exists(), f"{temp} is left behind"


def script(name, args, cwd, timeout=300, **env):
    e = clean_env()
    e["TEXTBOX_LIKE_RAY_TMP"] = str(ray_temp_dir(cwd))
    e.update(env)
    return subprocess.run([sys.executable, str(REPO / name), *map(str, args)], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def no_ray_left(cwd):
    """Every test's Ray instance was shut down: no raylet of it is left."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return f"ray_tbl_test_{abs(hash(str(cwd))) % 10 ** 6}" not in out


#: the ASHA search's trials: a short run each, yet long after its first rung (update 4) for ASHA's stop to
#: reach a trial while it still trains (a trial that ends first is recorded `ok`, as it should)
ASHA_MAX_UPDATE = 40


@pytest.mark.timeout(900)
def test_ray_tpe_asha_six_trials(tmp_path, tiny_mnist):
    """--seed 0 draws (TPE's first 20 trials are random, so the draws depend on
    the seed only) adam 10^-4.3, sgd 10^-2.6, adam 10^-3.9, sgd 10^-5.7,
    sgd 10^-2.5, sgd 10^-3.8: trial 4's loss at the first rung (2.310) is
    worse than that of every other trial but 6 (2.29 at most), and trial 6
    starts after trial 4's rung: whichever trials reported there before it,
    ASHA stops trial 4 at update 4 of 40, a stop that does not depend on
    which of two parallel trials reports first (measured: 2, 4 and 6 stopped
    at update 4, 5 at 8)."""
    (tmp_path / "space.test").write_text("learning_rate loguniform (-14, -2)\noptimizer choice ['adam', 'sgd']\n")
    args = ["--backend", "ray", "--space", "space.test", "--algo", "tpe", "--max_evals", "6", "--parallel", "2",
            "--scheduler", "asha", "--grace-updates", "4", "--seed", "0", "--output", "out", "--data", tiny_mnist,
            "--metric", "loss", "--max-update", ASHA_MAX_UPDATE, "--max-epoch", "40", "--validate-interval-updates",
            "4", "--log-interval", "4", *TRAIN]
    proc = script("run_hyper.py", args, tmp_path, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "hyper_results.jsonl").read_text().splitlines()]
    assert sorted(r["trial"] for r in records) == [1, 2, 3, 4, 5, 6]
    statuses = [r["status"] for r in records]
    assert set(statuses) <= {"ok", "stopped"} and "stopped" in statuses and "ok" in statuses, statuses
    for r in records:                                 # the local backend's record format
        assert {"trial", "params", "status", "value", "save_dir", "wall_time", "metric"} <= set(r)
        assert set(r["params"]) == {"lr", "optimizer"} and r["value"] is not None
        if r["status"] == "stopped":
            assert r["num_updates"] < ASHA_MAX_UPDATE and not (Path(r["save_dir"]) / "results.json").exists() or \
                json.loads((Path(r["save_dir"]) / "results.json").read_text())["stopped"] != "completed"
    best = json.loads((out / "hyper_best.json").read_text())
    assert best["backend"] == "ray" and best["n_trials"] == 6 and best["n_stopped"] == statuses.count("stopped")
    assert best["value"] == min(r["value"] for r in records if r["status"] == "ok")
    assert (out / "hyper_results.csv").read_text().splitlines()[0].startswith("trial,lr,optimizer,loss,status")
    assert (out / "hyper_report.png").stat().st_size > 20000
    assert (out / "ray").is_dir()                     # Tune's own files
    assert "stopped" in proc.stdout and "(* best)" in proc.stdout
    assert no_ray_left(tmp_path)


def test_ray_exhaustive_runs_the_local_backends_trials(tmp_path, tiny_mnist):
    from textbox_like import search as S
    from textbox_like.resolve.options import build_options
    (tmp_path / "s.test").write_text("learning_rate loguniform (-8, -4)\noptimizer choice ['adam', 'sgd']\n")
    proc = script("run_hyper.py", ["--backend", "ray", "--space", "s.test", "--algo", "exhaustive", "--seed", "2",
                                   "--parallel", "2", "--output", "out", "--data", tiny_mnist, "--max-update", "2",
                                   *TRAIN], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["trial"]: r for r in map(json.loads, (tmp_path / "out" / "hyper_results.jsonl").read_text()
                                          .splitlines())}
    sampler = S.Sampler(S.load_space(tmp_path / "s.test", build_options()), "exhaustive", 2)
    assert [records[k]["params"] for k in (1, 2)] == [sampler.ask(k)[0] for k in (1, 2)]
    for k in (1, 2):
        command = (tmp_path / "out" / f"trial_{k}" / "command.txt").read_text()
        assert f"--optimizer={records[k]['params']['optimizer']}" in command


def test_ray_multi_seed(tmp_path, tiny_mnist):
    proc = script("run_multi_seed.py", ["--backend", "ray", "--seeds", "4,9", "--parallel", "2", "--output", "out",
                                        "--data", tiny_mnist, "--max-update", "4", "--validate-interval-updates",
                                        "2", *TRAIN], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "multi_seed_summary.json").read_text())
    assert summary["ok_seeds"] == [4, 9] and summary["final"]["accuracy"]["n"] == 2
    assert (tmp_path / "out" / "multi_seed_curves.png").exists()
    assert (tmp_path / "out" / "multi_seed_summary.csv").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--ray-address", "127.0.0.1:9"], "--ray-address 127.0.0.1:9: nothing answers there"),
    (["--gpus-per-trial", "2"], "--gpus-per-trial 2: the Ray cluster has 0 GPU(s)"),
])
def test_ray_bad_input_is_one_line_without_waiting(tmp_path, extra, needle, capfd, monkeypatch):
    """Refused before any trial runs; the timeout is the hang check (a
    loaded machine may take longer to start Ray, so no timing is asserted).
    A dead address is refused before Ray starts: that refusal runs
    in-process (its one line and exit code are run_hyper.py's main's); the
    GPUs are counted on a Ray instance the script starts."""
    (tmp_path / "s.test").write_text("lr choice [0.1, 0.2]\n")
    argv = ["--backend", "ray", "--space", "s.test", "--output", "out", "--task", "mnist", "--max-update", "1",
            "--max-sentences", "8", *extra]
    if "--ray-address" in extra:
        from textbox_like.search import hyper_main
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("TEXTBOX_LIKE_RAY_TMP", str(ray_temp_dir(tmp_path)))
        capfd.readouterr()
        code = hyper_main(argv)
        out, err = capfd.readouterr()
        proc = subprocess.CompletedProcess(argv, code, out, err)
    else:
        proc = script("run_hyper.py", argv, tmp_path, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert not list((tmp_path / "out").glob("trial_*")) if (tmp_path / "out").exists() else True
    assert no_ray_left(tmp_path)


def test_ray_search_stopped_by_ctrl_c_resumes_with_resume(tmp_path, tiny_mnist):
    """Ctrl+C (SIGINT to the whole foreground process group) in the middle of
    trial 2: the search ends with 130 and trial 2 recorded `interrupted`;
    `--resume` continues Tune's experiment: trial 1 is not rerun, trial 2
    resumes from its own checkpoint, and the search completes."""
    import os
    import signal
    (tmp_path / "space.test").write_text("learning_rate loguniform (-7, -4)\n")
    out = tmp_path / "out"
    # 32 updates: Ctrl+C comes at trial 2's first checkpoint (update 4); it stops at about update 8 (measured
    # on a loaded machine), long before its end
    args = ["--backend", "ray", "--space", "space.test", "--algo", "random", "--max_evals", "3", "--parallel", "1",
            "--seed", "5", "--output", "out", "--data", tiny_mnist, "--metric", "loss", "--max-update", "32",
            "--max-epoch", "10", "--validate-interval-updates", "20", "--save-interval-updates", "4",
            "--log-interval", "4", *TRAIN]
    e = clean_env()
    e["TEXTBOX_LIKE_RAY_TMP"] = str(ray_temp_dir(tmp_path))
    search = subprocess.Popen([sys.executable, str(REPO / "run_hyper.py"), *map(str, args)], cwd=tmp_path, env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        if (out / "trial_1" / "results.json").exists() and (out / "trial_2" / "checkpoint_last.pt").exists():
            break
        assert search.poll() is None, search.communicate()
        time.sleep(0.1)
    else:
        search.kill()
        pytest.fail("trial 2 never saved a checkpoint")
    os.killpg(search.pid, signal.SIGINT)              # what Ctrl+C in a terminal does
    stdout, stderr = search.communicate(timeout=180)
    assert search.returncode == 130, stdout[-3000:] + stderr[-3000:]
    first = {r["trial"]: r for r in map(json.loads, (out / "hyper_results.jsonl").read_text().splitlines())}
    assert first[1]["status"] == "ok" and first[2]["status"] == "interrupted", first
    assert "--resume" in stdout + stderr
    trial1_mtime = (out / "trial_1" / "metrics.jsonl").stat().st_mtime_ns

    proc = script("run_hyper.py", args + ["--resume"], tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--resume: continuing the Ray search" in proc.stdout
    records = {r["trial"]: r for r in map(json.loads, (out / "hyper_results.jsonl").read_text().splitlines())}
    assert sorted(records) == [1, 2, 3] and all(r["status"] == "ok" for r in records.values()), records
    assert records[1]["attempts"] == 1 and (out / "trial_1" / "metrics.jsonl").stat().st_mtime_ns == trial1_mtime
    assert records[1]["params"] == first[1]["params"] and records[2]["params"] == first[2]["params"]
    info = json.loads((out / "trial_2" / "ray_trial.json").read_text())
    assert info["attempts"][-1]["resume"] is True      # from its own checkpoint_last.pt
    updates = [json.loads(line)["update"] for line in (out / "trial_2" / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train"]
    assert updates == sorted(set(updates)) and records[2]["num_updates"] == 32
    assert json.loads((out / "hyper_best.json").read_text())["n_trials"] == 3
    assert no_ray_left(tmp_path)
