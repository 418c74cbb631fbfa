"""Two searches on one --output (issue 51, item 7): while a search runs, it
holds its output's ``search.lock`` as a run holds its save directory's
``run.lock``; a second search there (a fresh one, or ``--resume``, or seeds)
is refused in one line naming the first, exit 2, and changes nothing of its
records. Real processes: the first search and its trial, and the second
search, started while the trial trains; the first then stopped by Ctrl-C
and continued with --resume once it is gone."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, write_mnist

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)


@pytest.mark.timeout(600)
def test_a_second_search_on_a_running_searchs_output_is_refused_and_the_first_records_its_trials(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=64, n_test=20, seed=3)
    (tmp_path / "space.test").write_text("learning_rate loguniform (-7, -4)\n")
    out = tmp_path / "out"
    train = ["--data", tmp_path / "mnist", "--task", "mnist", "--log-format", "none", "--valid-subset", "test",
             "--max-sentences", "8", "--max-update", "30", "--max-epoch", "0", "--threads", "1"]
    search = ["--space", "space.test", "--max_evals", "1", "--seed", "5", "--output", out, *train]
    first = subprocess.Popen([sys.executable, str(REPO / "run_hyper.py"), *map(str, search)], cwd=tmp_path,
                             # from update 3 each update takes 2 s (the test-only slow-rank hook): the trial
                             # trains for a minute, while the second searches start
                             env={**clean_env(), "TEXTBOX_LIKE_SLOW_RANK": "0:0.25@3"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "trial_1" / "metrics.jsonl").exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert (out / "search.lock").is_file()
        records_before = (out / "hyper_results.jsonl").read_text()
        for script, extra in (("run_hyper.py", ["--resume"]), ("run_hyper.py", []), ("run_multi_seed.py", [])):
            args = search + extra if script == "run_hyper.py" else ["--multi_seed", 2, "--output", out, *train]
            second = subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=tmp_path,
                                    env=clean_env(), capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, (script, extra, second.stderr[-3000:])
            lines = [line for line in second.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith(f"error: --output {out} is in use by another search ("), \
                (script, extra, second.stderr[-3000:])
            assert f"pid {first.pid}" in lines[0] and "choose another --output, or wait for that search" in lines[0]
            assert (out / "hyper_results.jsonl").read_text().count('"trial"') == records_before.count('"trial"')
            assert first.poll() is None, "the trial ended before the second search was refused: slow it more"
        first.send_signal(signal.SIGINT)   # Ctrl-C: the trial saves and stops, its record says interrupted
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 130, err[-3000:]

    def statuses():
        return [(r["trial"], r["status"]) for r in map(json.loads, (out / "hyper_results.jsonl").read_text().splitlines())]
    assert statuses() == [(1, "interrupted")]
    assert not (out / "search.lock").exists()   # released at the end: --resume may continue it now
    resumed = subprocess.run([sys.executable, str(REPO / "run_hyper.py"), *map(str, search), "--resume"],
                             cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "0 finished trial(s) kept, 1 to continue (1)" in resumed.stdout + resumed.stderr
    assert statuses() == [(1, "ok")]
    assert json.loads((out / "trial_1" / "results.json").read_text())["stopped"] == "completed"
