"""The tests of test_search.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from textbox_like import search as S
from textbox_like.core.errors import UserError

from conftest import REPO, clean_env
from test_search import (  # noqa: F401 (fixtures)
    BASE, FakeRunner, TEXTBOX_EXAMPLE, YAML_EXAMPLE, flag, options, quiet)


def params_of(out):
    return [r["params"] for r in sorted(S.hyper.read_jsonl(Path(out) / "hyper_results.jsonl"),
                                        key=lambda r: r["trial"])]


# ---------------------------------------------------------------- algorithms
@pytest.mark.slow
def test_exhaustive_runs_each_combination_once_and_yaml_gives_the_same_trials(tmp_path, options):
    (tmp_path / "a.test").write_text(TEXTBOX_EXAMPLE)
    (tmp_path / "b.yaml").write_text(YAML_EXAMPLE)
    ran = []
    for name in ("a.test", "b.yaml"):
        runner = FakeRunner()
        code, summary = S.run_search(S.load_space(tmp_path / name, options), "exhaustive", None, 7, BASE,
                                     tmp_path / name.replace(".", "_"), runner=runner, out=quiet)
        assert code == 0 and summary["n_trials"] == 9 and len(runner.started) == 9
        combos = {(flag(a, "optimizer"), flag(a, "max_sentences")) for a in runner.started}
        assert combos == {(o, b) for o in ("adam", "adamw", "sgd") for b in (512, 1024, 2048)}
        ran.append(params_of(tmp_path / name.replace(".", "_")))
    assert ran[0] == ran[1]                                   # same seed, same trials
    assert all(math.exp(-8) <= p["lr"] <= 1 for p in ran[0])
    assert len({p["lr"] for p in ran[0]}) == 9                # continuous values sampled per trial


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rand", "tpe", "anneal", "tpe.suggest", "hyperopt.rand.suggest", "bayes"])
def test_algorithms_run_and_are_reproducible(tmp_path, options, algo):
    space = S.parse_textbox(TEXTBOX_EXAMPLE, "f", options)
    got = []
    for i in range(2):
        runner = FakeRunner()
        code, summary = S.run_search(space, algo, 4, 3, BASE, tmp_path / f"o{i}", runner=runner, out=quiet)
        assert code == 0 and summary["n_trials"] == 4
        got.append(params_of(tmp_path / f"o{i}"))
    assert got[0] == got[1]
    assert S.canonical_algo(algo) in ("random", "tpe", "anneal")


# ---------------------------------------------------------------- resume and parallel
@pytest.mark.slow
def test_resume_after_interrupt_keeps_finished_trials_and_the_same_parameters(tmp_path, options):
    space = S.parse_textbox(TEXTBOX_EXAMPLE, "f", options)
    reference = tmp_path / "ref"
    S.run_search(space, "tpe", 4, 5, BASE, reference, runner=FakeRunner(), out=quiet)
    out = tmp_path / "out"
    code, summary = S.run_search(space, "tpe", 4, 5, BASE, out, runner=FakeRunner(interrupt_at=2), out=quiet)
    assert code == S.INTERRUPTED and summary["n_interrupted"] == 1
    with pytest.raises(UserError, match="--resume"):
        S.run_search(space, "tpe", 4, 5, BASE, out, runner=FakeRunner(), out=quiet)
    with pytest.raises(UserError, match="another seed"):
        S.run_search(space, "tpe", 4, 6, BASE, out, runner=FakeRunner(), out=quiet, resume=True)
    runner = FakeRunner()
    code, summary = S.run_search(space, "tpe", 4, 5, BASE, out, runner=runner, out=quiet, resume=True)
    assert code == 0 and summary["n_trials"] == 4 and len(runner.started) == 3     # trial 1 not rerun
    assert params_of(out) == params_of(reference)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pt", "dcp"])
def test_an_interrupted_trial_with_only_interval_checkpoints_is_resumed(tmp_path, options, kind):
    """A trial run with --no-last-checkpoints (or stopped in its first save)
    holds interval checkpoints only: it is continued from them, not started
    afresh in a directory that holds a run (which the trainer refuses), its
    metrics.jsonl kept; an --fsdp trial's are sharded (a published
    checkpoint_1_10.dcp link to its data directory)."""
    space = S.parse_textbox(TEXTBOX_EXAMPLE, "f", options)
    out = tmp_path / "out"
    code, _ = S.run_search(space, "tpe", 4, 5, BASE, out, runner=FakeRunner(interrupt_at=2), out=quiet)
    assert code == S.INTERRUPTED
    trial = out / "trial_2"
    if kind == "pt":
        (trial / "checkpoint_1_10.pt").write_bytes(b"a checkpoint")
    else:
        (trial / ".checkpoint_1_10.dcp.0123abcd").mkdir()
        (trial / "checkpoint_1_10.dcp").symlink_to(".checkpoint_1_10.dcp.0123abcd")
    (trial / "metrics.jsonl").write_text('{"update": 10}\n')
    runner = FakeRunner()
    S.run_search(space, "tpe", 4, 5, BASE, out, runner=runner, out=quiet, resume=True)
    resumed = [cfg for cfg in runner.started if Path(flag(cfg, "save_dir")).name == "trial_2"]
    assert resumed and flag(resumed[0], "resume") is True
    assert (trial / "metrics.jsonl").read_text().startswith('{"update": 10}\n')


@pytest.mark.slow
def test_bad_space_file_through_the_script_is_one_line_and_runs_nothing(tmp_path):
    (tmp_path / "s.test").write_text("learning_rate loguniform (-8, 0)\nlr2 choice __import__('os')\n")
    proc = subprocess.run([sys.executable, str(REPO / "run_hyper.py"), "--space", "s.test", "--output", "out",
                           "--task", "mnist", "--max-update", "1", "--max-sentences", "8"], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("error: space file s.test line 2: the space \"__import__('os')\" is not a "
                                   "Python literal (a list like [32, 64] or a tuple like (-8, 0)); space files "
                                   "are read, never executed")
    assert not (tmp_path / "out").exists()


@pytest.mark.fresh_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("name", ["run_hyper.py", "run_multi_seed.py"])
def test_help_is_fast_and_imports_no_torch(name):
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.argv = ['{name}', '--help'];\n"
                           f"try:\n    runpy.run_path('{REPO / name}', run_name='__main__')\n"
                           f"except SystemExit:\n    pass\nprint('torch' in sys.modules)"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert "usage:" in proc.stdout and proc.stdout.strip().endswith("False"), proc.stdout[-500:] + proc.stderr
    assert time.time() - start < 5.0
