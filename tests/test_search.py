"""run_hyper.py and run_multi_seed.py: space files, algorithms, failures,
summaries, statistics, and one-line errors. Most tests use a fake trial runner;
two end-to-end runs train tiny MNIST for 2 updates per trial."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, clean_env, write_mnist
from textbox_like import search as S
from textbox_like.cli import build_options
from textbox_like.errors import UserError

TRAIN = ["--max-update", "2", "--threads", "1", "--log-format", "none", "--valid-subset", "test",
         "--warmup-updates", "0", "--max-sentences", "16"]


@pytest.fixture(scope="module")
def options():
    return build_options()


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_tiny")
    write_mnist(directory, n_train=64, n_test=20, seed=3)
    return directory


def script(name, args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, str(REPO / name), *map(str, args)], cwd=cwd or REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(proc, *needles):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


class FakeRunner:
    """Writes a results.json whose metric comes from ``score(params-argv)``; fails where asked."""

    def __init__(self, score, fail=()):
        self.score, self.fail, self.calls = score, set(fail), []

    def __call__(self, argv, save_dir):
        self.calls.append(list(argv))
        if len(self.calls) in self.fail:
            return S.Outcome(1, "error: boom")
        value = self.score(argv)
        Path(save_dir, "results.json").write_text(json.dumps(
            {"best": {"accuracy": value, "loss": 1 - value}, "final": {"accuracy": value, "loss": 1 - value}}))
        return S.Outcome(0)


def flag_value(argv, name):
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return values[-1] if values else None


# ---------------------------------------------------------------- space parsing
def test_space_kinds(options):
    space = S.parse_space({
        "lr": {"loguniform": [1.0e-4, "1e-2"]},
        "max-sentences": {"choice": [32, 64]},
        "optimizer": {"choice": ["adam", "adadelta"]},
        "weight_decay": {"uniform": [0, 0.01]},
        "warmup_updates": {"quniform": [0, 20, 5]},
        "total_num_update": {"quniform": [0, 100], "q": 10},
        "update_freq": {"randint": [1, 4]},
    }, options=options)
    assert space["max_sentences"].kind == "choice" and space["max_sentences"].args == [32, 64]
    assert space["lr"].args == [1.0e-4, 1.0e-2]          # YAML 1.1's string '1e-2' read as a number
    assert space["warmup_updates"].args == [0, 20, 5]
    assert space["total_num_update"].args == [0, 100, 10]
    assert space["warmup_updates"].clean(np.float64(12.0)) == 10 and \
        isinstance(space["warmup_updates"].clean(12.0), int)
    assert space["update_freq"].clean(np.int64(2)) == 2
    assert isinstance(space["lr"].clean(np.float64(0.001)), float)
    for param in space.values():
        param.hyperopt()


@pytest.mark.parametrize("spec, needle", [
    ({"lr": {"normal": [0, 1]}}, "supported kinds: choice, uniform, loguniform, quniform, randint"),
    ({"lr": 0.1}, "supported kinds"),
    ({"lr": {"choice": []}}, "non-empty list"),
    ({"lr": {"uniform": [1]}}, "[low, high]"),
    ({"lr": {"uniform": [1, 0]}}, "low <= high"),
    ({"lr": {"loguniform": [0, 1]}}, "0 < low"),
    ({"lr": {"uniform": ["a", 1]}}, "expects a number"),
    ({"warmup_updates": {"quniform": [0, 10]}}, "q"),
    ({"update_freq": {"randint": [1.5, 3]}}, "integers"),
    ({"max_sentencs": {"choice": [1]}}, "did you mean 'max_sentences'"),
    ([1, 2], "mapping"),
])
def test_space_errors(options, spec, needle):
    with pytest.raises(UserError) as info:
        S.parse_space(spec, options=options)
    assert needle in str(info.value)


def test_exhaustive_grid_covers_each_combination_once(tmp_path):
    space = S.parse_space({"lr": {"choice": [0.1, 0.2, 0.3]}, "max_sentences": {"choice": [16, 32]},
                           "optimizer": {"choice": ["adam", "sgd"]}})
    points = S.grid(space)
    combos = [(p["lr"], p["max_sentences"], p["optimizer"]) for p in points]
    assert len(combos) == 12 and len(set(combos)) == 12
    assert set(combos) == {(a, b, c) for a in (0.1, 0.2, 0.3) for b in (16, 32) for c in ("adam", "sgd")}
    runner = FakeRunner(lambda argv: float(flag_value(argv, "lr")))
    code, summary = S.run_search(space, "exhaustive", None, 1, ["--max-update", "1"], tmp_path, runner=runner,
                                 out=lambda *a: None)
    assert code == 0 and len(runner.calls) == 12
    ran = {(flag_value(a, "lr"), flag_value(a, "max_sentences"), flag_value(a, "optimizer")) for a in runner.calls}
    assert len(ran) == 12
    with pytest.raises(UserError, match="choice values only"):
        S.grid(S.parse_space({"lr": {"uniform": [0.1, 0.2]}, "optimizer": {"choice": ["adam"]}}))


def test_random_is_reproducible_with_seed(tmp_path):
    space = S.parse_space({"lr": {"loguniform": [1.0e-4, 1.0e-2]}, "max_sentences": {"choice": [16, 32, 64]},
                           "warmup_updates": {"randint": [0, 50]}})

    def sequence(seed, algo="random"):
        runner = FakeRunner(lambda argv: float(flag_value(argv, "lr")))
        S.run_search(space, algo, 5, seed, ["--max-update", "1"], tmp_path / f"{algo}{seed}", runner=runner,
                     out=lambda *a: None)
        return [[a for a in argv if a.split("=")[0] in ("--lr", "--max_sentences", "--warmup_updates")]
                for argv in runner.calls]

    first = sequence(7)
    assert len(first) == 5 and first == sequence(7)
    assert first != sequence(8)
    assert sequence(7, "bayes") == sequence(7, "bayes")
    lines = (tmp_path / "random7" / "hyper_results.jsonl").read_text().splitlines()
    assert len(lines) == 5


def test_failed_trial_does_not_stop_search_and_best_is_chosen(tmp_path):
    space = S.parse_space({"lr": {"choice": [0.1, 0.5, 0.9, 0.3]}})
    runner = FakeRunner(lambda argv: float(flag_value(argv, "lr")), fail={3})   # lr 0.9 fails
    lines = []
    code, summary = S.run_search(space, "exhaustive", None, 1, ["--max-update", "1"], tmp_path, runner=runner,
                                 out=lines.append)
    assert code == 0 and len(runner.calls) == 4
    records = [json.loads(l) for l in (tmp_path / "hyper_results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok", "ok", "fail", "ok"]
    assert records[2]["error"] == "error: boom" and records[2]["value"] is None
    best = json.loads((tmp_path / "hyper_best.json").read_text())
    assert best["params"] == {"lr": 0.5} and best["trial"] == 2 and best["value"] == 0.5
    assert best["save_dir"] == str(tmp_path / "trial_2") and best["n_failed"] == 1
    assert any("FAILED" in l for l in lines) and lines[-2].startswith("best: trial 2")
    # minimizing the same metric picks the smallest
    code, summary = S.run_search(space, "exhaustive", None, 1, ["--max-update", "1"], tmp_path / "min",
                                 maximize=False, runner=FakeRunner(lambda a: float(flag_value(a, "lr"))),
                                 out=lambda *a: None)
    assert summary["params"] == {"lr": 0.1}
    # hyperopt algorithms: a failure is STATUS_FAIL and the search goes on
    runner = FakeRunner(lambda argv: float(flag_value(argv, "lr")), fail={1, 2})
    code, summary = S.run_search(S.parse_space({"lr": {"uniform": [0.1, 0.9]}}), "bayes", 4, 1,
                                 ["--max-update", "1"], tmp_path / "tpe", runner=runner, out=lambda *a: None)
    assert code == 0 and len(runner.calls) == 4 and summary["n_failed"] == 2 and summary["n_ok"] == 2
    # every trial failing: exit 1, summary still written
    code, summary = S.run_search(space, "exhaustive", None, 1, ["--max-update", "1"], tmp_path / "none",
                                 runner=FakeRunner(lambda a: 0.0, fail={1, 2, 3, 4}), out=lambda *a: None)
    assert code == 1 and summary["params"] is None and (tmp_path / "none" / "hyper_best.json").is_file()


def test_interrupt_stops_search_and_writes_summary(tmp_path):
    space = S.parse_space({"lr": {"choice": [0.1, 0.2, 0.3]}})
    runner = FakeRunner(lambda argv: float(flag_value(argv, "lr")))

    def interrupting(argv, save_dir):
        if len(runner.calls) == 2:
            raise KeyboardInterrupt
        return runner(argv, save_dir)

    code, summary = S.run_search(space, "exhaustive", None, 1, ["--max-update", "1"], tmp_path,
                                 runner=interrupting, out=lambda *a: None)
    assert code == 130 and summary["interrupted"] and summary["params"] == {"lr": 0.2}
    records = [json.loads(l) for l in (tmp_path / "hyper_results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok", "ok", "interrupted"]


def test_values_reach_the_trainer_as_options(options):
    argv = S.to_argv(options, {"lr": 0.001, "fp16": True, "no_shuffle": False, "optim_conf": {"rho": 0.8},
                               "update_freq": [2, 1], "optimizer": "adadelta"})
    assert argv == ["--lr=0.001", "--fp16", "--optim_conf={rho: 0.8}", "--update_freq=2,1",
                    "--optimizer=adadelta"]
    from textbox_like.cli import parse
    _, ns, _ = parse(argv)
    assert ns.lr == [0.001] and ns.fp16 and ns.optim_conf == {"rho": 0.8} and ns.update_freq == [2, 1]


# ---------------------------------------------------------------- no code execution
@pytest.mark.parametrize("text", [
    "lr: __import__('os').system('touch PWNED')\n",
    "lr: {choice: [\"__import__('os').system('touch PWNED')\"]}\n",
    "optimizer: {choice: [\"__import__('os').system('touch PWNED')\"]}\n",
    "lr: !!python/object/apply:os.system ['touch PWNED']\n",
    "__import__('os').system('touch PWNED'): {choice: [1]}\n",
])
def test_space_file_is_never_executed(tmp_path, tiny_mnist, text):
    (tmp_path / "space.yaml").write_text(text)
    proc = script("run_hyper.py", ["--space", tmp_path / "space.yaml", "--algo", "random", "--max_evals", "1",
                                   "--data", tiny_mnist, "--output", tmp_path / "out", *TRAIN], cwd=tmp_path)
    one_error_line(proc)
    assert not (tmp_path / "PWNED").exists() and not (REPO / "PWNED").exists()


# ---------------------------------------------------------------- statistics
def test_describe_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 16, 31, 45):
        values = rng.normal(0.9, 0.05, size=n)
        s = S.describe(values)
        assert s["n"] == n
        assert s["mean"] == pytest.approx(np.mean(values))
        assert s["std"] == pytest.approx(np.std(values, ddof=1))
        assert s["median"] == pytest.approx(np.median(values))
        assert (s["min"], s["max"]) == (pytest.approx(values.min()), pytest.approx(values.max()))
        half = S.t_quantile_975(n - 1) * np.std(values, ddof=1) / math.sqrt(n)
        assert s["ci95"] == [pytest.approx(np.mean(values) - half), pytest.approx(np.mean(values) + half)]
    one = S.describe([0.5])
    assert one["mean"] == 0.5 and one["std"] is None and one["ci95"] is None
    assert S.describe([])["n"] == 0
    # known quantiles
    assert S.t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)
    assert S.t_quantile_975(15) == pytest.approx(2.1314, abs=1e-4)
    assert S.t_quantile_975(1000) == pytest.approx(1.9623, abs=1e-4)


def test_t_quantile_against_published_table():
    # two-sided 95% critical values of Student's t (any statistics table)
    table = {2: 4.3027, 3: 3.1824, 5: 2.5706, 10: 2.2281, 20: 2.0860, 29: 2.0452, 30: 2.0423, 31: 2.0395,
             40: 2.0211, 60: 2.0003, 120: 1.9799}
    for df, value in table.items():
        assert S.t_quantile_975(df) == pytest.approx(value, abs=1e-4), df


def test_multi_seed_failed_seed_is_excluded(tmp_path):
    scores = {1: 0.8, 2: 0.9, 3: None, 4: 0.7}

    def runner(argv, save_dir):
        seed = int(flag_value(argv, "seed"))
        if scores[seed] is None:
            return S.Outcome(2, "error: bad seed")
        Path(save_dir, "results.json").write_text(json.dumps(
            {"best": {"accuracy": scores[seed] + 0.01}, "final": {"accuracy": scores[seed], "loss": seed}}))
        return S.Outcome(0)

    code, summary = S.run_multi_seed([1, 2, 3, 4], ["--max-update", "1"], tmp_path, runner=runner,
                                     out=lambda *a: None)
    assert code == 1
    written = json.loads((tmp_path / "multi_seed_summary.json").read_text())
    assert written["ok_seeds"] == [1, 2, 4] and [f["seed"] for f in written["failed"]] == [3]
    acc = written["final"]["accuracy"]
    assert acc["n"] == 3 and acc["mean"] == pytest.approx(0.8) and acc["std"] == pytest.approx(0.1)
    assert written["best"]["accuracy"]["mean"] == pytest.approx(0.81)
    assert written["final"]["loss"]["median"] == 2


# ---------------------------------------------------------------- end to end
def test_hyper_end_to_end(tmp_path, tiny_mnist):
    """Two real trials; the second asks for a split that does not exist and fails at run time."""
    (tmp_path / "space.yaml").write_text("valid_subset: {choice: [test, nosuch]}\n")
    proc = script("run_hyper.py", ["--space", tmp_path / "space.yaml", "--algo=exhaustive",
                                   "--data", tiny_mnist, "--output", tmp_path / "out", *TRAIN[:6], *TRAIN[8:]])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trial 1/2 | valid_subset=test | accuracy" in proc.stdout
    assert "trial 2/2 | valid_subset=nosuch | FAILED (exit 2): error:" in proc.stdout
    best = json.loads((tmp_path / "out" / "hyper_best.json").read_text())
    results = json.loads((tmp_path / "out" / "trial_1" / "results.json").read_text())
    assert best["trial"] == 1 and best["value"] == results["best"]["accuracy"]
    assert "--valid_subset=test" in (tmp_path / "out" / "trial_1" / "command.txt").read_text()
    assert f"best: trial 1 | accuracy {best['value']:.4f}" in proc.stdout


def test_multi_seed_end_to_end(tmp_path, tiny_mnist):
    proc = script("run_multi_seed.py", ["--multi_seed=2", "--data", tiny_mnist, "--output", tmp_path / "out",
                                        *TRAIN])
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "multi_seed_summary.json").read_text())
    assert summary["ok_seeds"] == [1, 2] and summary["failed"] == []
    finals = [json.loads((tmp_path / "out" / f"seed_{s}" / "results.json").read_text())["final"] for s in (1, 2)]
    for metric in ("loss", "accuracy"):
        values = [f[metric] for f in finals]
        assert summary["final"][metric]["n"] == 2
        assert summary["final"][metric]["mean"] == pytest.approx(np.mean(values))
        assert summary["final"][metric]["std"] == pytest.approx(np.std(values, ddof=1))
    config = (tmp_path / "out" / "seed_2" / "config.yaml").read_text()
    assert "seed: 2" in config.splitlines()
    assert "final accuracy" in proc.stdout and "95% CI" in proc.stdout


# ---------------------------------------------------------------- command-line errors
@pytest.fixture(scope="module")
def spaces(tmp_path_factory):
    root = tmp_path_factory.mktemp("spaces")
    (root / "good.yaml").write_text("lr: {choice: [0.001, 0.01]}\n")
    (root / "uniform.yaml").write_text("lr: {uniform: [0.001, 0.01]}\n")
    (root / "broken.yaml").write_text("lr: {choice: [0.1\n")
    (root / "kind.yaml").write_text("lr: {gaussian: [0, 1]}\n")
    (root / "name.yaml").write_text("learning_rat: {choice: [0.1]}\n")
    (root / "value.yaml").write_text("update_freq: {choice: [1, 0]}\n")
    return root


def test_cli_errors(spaces, tiny_mnist, tmp_path):
    common = ["--data", tiny_mnist, "--output", tmp_path / "out", *TRAIN]
    cases = [
        ("run_hyper.py", ["--space", spaces / "missing.yaml"], ["does not exist"]),
        ("run_hyper.py", ["--algo", "random"], ["--space"]),
        ("run_hyper.py", ["--space", spaces / "broken.yaml"], ["not valid YAML"]),
        ("run_hyper.py", ["--space", spaces / "good.yaml", "--algo", "grid"], ["unknown --algo 'grid'"]),
        ("run_hyper.py", ["--space", spaces / "uniform.yaml", "--algo", "exhaustive"], ["choice values only"]),
        ("run_hyper.py", ["--space", spaces / "kind.yaml"], ["supported kinds"]),
        ("run_hyper.py", ["--space", spaces / "name.yaml"], ["did you mean"]),
        ("run_hyper.py", ["--space", spaces / "value.yaml", "--algo", "exhaustive"], ["update_freq=0"]),
        ("run_hyper.py", ["--space", spaces / "good.yaml", "--max_evals", "0"], ["positive integer"]),
        ("run_hyper.py", ["--space", spaces / "good.yaml", "--lr", "0.1"], ["both in the space file"]),
        ("run_hyper.py", ["--space", spaces / "good.yaml", "--metric", "acc"], ["did you mean 'accuracy'"]),
        ("run_hyper.py", ["--space", spaces / "good.yaml", "--max-updat", "3"], ["unknown option --max-updat"]),
        ("run_multi_seed.py", ["--multi_seed", "0"], ["positive integer"]),
        ("run_multi_seed.py", [], ["--multi_seed N"]),
        ("run_multi_seed.py", ["--multi_seed", "2", "--seed", "3"], ["--seeds"]),
        ("run_multi_seed.py", ["--seeds", "1,x"], ["3,7,11"]),
        ("run_multi_seed.py", ["--multi_seed", "2", "--save-dir", "x"], ["--output"]),
    ]
    for name, args, needles in cases:
        proc = script(name, [*args, *common], cwd=tmp_path)
        one_error_line(proc, *needles)
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), (name, args)


@pytest.mark.parametrize("name", ["run_hyper.py", "run_multi_seed.py"])
def test_help_is_fast(name):
    start = time.time()
    proc = script(name, ["--help"])
    assert proc.returncode == 0 and "usage:" in proc.stdout
    assert time.time() - start < 2.0
    proc = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.argv = ['{name}', '--help'];\n"
                           f"try:\n    runpy.run_path('{REPO / name}', run_name='__main__')\n"
                           f"except SystemExit:\n    pass\nprint('torch' in sys.modules)"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert proc.stdout.strip().endswith("False"), proc.stdout[-500:]
