"""run_hyper.py and run_multi_seed.py without training: space files in both
formats with hyperopt's meaning, labels, algorithms, the grid, resume and
parallel scheduling with a fake trial runner, statistics, one-line errors.
Real training runs are in test_search_e2e.py."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from textbox_like import search as S
from textbox_like.resolve.options import build_options
from textbox_like.core.errors import UserError
from textbox_like.search import space as SP
from textbox_like.config.schema import SearchConfig


BASE = ["--task", "mnist", "--max-update", "1"]

BASE_B = BASE + ["--max-sentences", "8"]

TEXTBOX_EXAMPLE = """\
# TextBox's documented example, embedding_size replaced by an option of ours
learning_rate loguniform (-8, 0)
optimizer choice ['adam', 'adamw', 'sgd']
train_batch_size choice [512, 1024, 2048]
"""

YAML_EXAMPLE = """\
learning_rate: {loguniform: [-8, 0]}
optimizer: {choice: [adam, adamw, sgd]}
train_batch_size: {choice: [512, 1024, 2048]}
"""


@pytest.fixture(scope="module")
def options():
    return build_options()


def quiet(*_a, **_k):
    pass


# ---------------------------------------------------------------- a fake trial runner
class FakeHandle:
    def __init__(self, runner, cfg, save_dir, polls):
        self.runner, self.cfg, self.save_dir, self.left = runner, cfg, Path(save_dir), polls
        self.stopping = False
        runner.running += 1
        runner.max_running = max(runner.max_running, runner.running)

    def poll(self):
        self.left -= 1
        if self.left > 0:
            return None
        return self._finish()

    def wait(self, timeout=None):
        return self._finish()

    def _finish(self):
        self.runner.running -= 1
        n = len(self.runner.finished) + 1
        self.runner.finished.append(self.cfg)
        if n in self.runner.fail:
            return S.Outcome(1, "error: boom")
        value = self.runner.score(self.cfg)
        (self.save_dir / "results.json").write_text(json.dumps(
            {"best": {"accuracy": value, "loss": 1 - value}, "final": {"accuracy": value, "loss": 1 - value},
             "num_updates": 1}))
        return S.Outcome(0, interrupted=self.stopping)

    def stop(self):
        self.stopping = True

    def kill(self):
        pass


class FakeRunner:
    """Writes a results.json whose accuracy is score(cfg), cfg the trial's
    resolved configuration; trial n fails if n in fail."""

    def __init__(self, score=None, fail=(), polls=1, interrupt_at=None):
        self.score = score or (lambda cfg: float(flag(cfg, "lr") or 0.5) % 1)
        self.fail, self.polls, self.interrupt_at = set(fail), polls, interrupt_at
        self.started, self.finished, self.running, self.max_running = [], [], 0, 0

    def start(self, cfg, save_dir, env=None):
        self.started.append(cfg)
        if self.interrupt_at is not None and len(self.started) == self.interrupt_at:
            handle = FakeHandle(self, cfg, save_dir, self.polls)
            raise_after = handle.poll

            def poll():
                raise KeyboardInterrupt
            handle.poll = poll
            handle._real_poll = raise_after
            return handle
        return FakeHandle(self, cfg, save_dir, self.polls)


def flag(cfg, name):
    """A trial's setting as the trainer gets it (--lr: the first of its list)."""
    value = cfg.get(name)
    return value[0] if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------- space files
def test_textbox_example_parses_with_aliases_and_real_units(tmp_path, options):
    path = tmp_path / "hyperopt_example.test"
    path.write_text(TEXTBOX_EXAMPLE)
    assert SP.detect_format(TEXTBOX_EXAMPLE) == "textbox" and SP.detect_format(YAML_EXAMPLE) == "yaml"
    space = S.load_space(path, options)
    assert list(space) == ["lr", "optimizer", "max_sentences"]      # TextBox names -> ours
    assert [p.kind for p in space.values()] == ["loguniform", "choice", "choice"]
    assert space["lr"].describe().startswith("learning_rate: loguniform(-8, 0) = 0.000335 .. 1")
    assert space["max_sentences"].values() == [512, 1024, 2048]
    (tmp_path / "s.yaml").write_text(YAML_EXAMPLE)
    yspace = S.load_space(tmp_path / "s.yaml", options)
    assert [(p.name, p.kind, p.args) for p in yspace.values()] == [(p.name, p.kind, p.args) for p in space.values()]


def test_labels_resolve_through_the_trainers_parser(options):
    # the parser's own aliases (--batch-size, --accum_grad, --wd) and both spellings; TextBox's names
    for label, dest in [("batch-size", "max_sentences"), ("accum_grad", "update_freq"), ("wd", "weight_decay"),
                        ("max-update", "max_update"), ("learning_rate", "lr"), ("eval_batch_size",
                                                                                  "max_sentences_valid"),
                        ("epochs", "max_epoch"), ("grad_clip", "clip_norm"), ("accumulation_steps", "update_freq"),
                        ("seed", "seed")]:
        assert SP.resolve_label(label, options, "f line 1") == dest, label
    assert SP.resolve_label("embedding_size", options, "f line 1") == "model_conf.hidden_size"   # BERT's width
    with pytest.raises(UserError, match=r"f line 3: 'beam_size' is not an option of run_hetseq.py \(the closest "
                                        r"option is '"):
        SP.resolve_label("beam_size", options, "f line 3")

ALL_KINDS = [
    ("choice", "[1, 2, 3]", [[1, 2, 3]]),
    ("pchoice", "[(0.25, 'a'), (0.75, 'b')]", [[(0.25, "a"), (0.75, "b")]]),
    ("randint", "(3, 9)", [3, 9]),
    ("uniform", "(-1, 2)", [-1, 2]),
    ("quniform", "(0, 10, 2)", [0, 10, 2]),
    ("loguniform", "(-8, 0)", [-8, 0]),
    ("qloguniform", "(0, 3, 1)", [0, 3, 1]),
    ("normal", "(0, 2)", [0, 2]),
    ("qnormal", "(5, 2, 1)", [5, 2, 1]),
    ("lognormal", "(0, 1)", [0, 1]),
    ("qlognormal", "(1, 1, 1)", [1, 1, 1]),
    ("uniformint", "(2, 6)", [2, 6]),
]


@pytest.mark.parametrize("kind,text,args", ALL_KINDS, ids=[k[0] for k in ALL_KINDS])
def test_every_kind_has_hyperopts_meaning_in_both_formats(kind, text, args):
    from hyperopt import hp
    from hyperopt.pyll import stochastic
    tb = S.parse_textbox(f"x {kind} {text}\n", "f")["x"]
    yaml_args = json.dumps([list(a) for a in args[0]]) if kind == "pchoice" else json.dumps(args[0] if kind ==
                                                                                               "choice" else args)
    ym = S.parse_yaml(f"x: {{{kind}: {yaml_args}}}\n", "f")["x"]
    ours = [SP.sample({"x": tb}, ["x"], np.random.default_rng(s))["x"] for s in range(200)]
    ours_yaml = [SP.sample({"x": ym}, ["x"], np.random.default_rng(s))["x"] for s in range(200)]
    direct = getattr(hp, kind)("x", *(args if kind not in ("choice", "pchoice") else args))
    theirs = [stochastic.sample(direct, rng=np.random.default_rng(s)) for s in range(200)]
    theirs = [t.item() if hasattr(t, "item") else t for t in theirs]
    assert ours == ours_yaml
    assert [float(v) if isinstance(v, (int, float)) else v for v in ours] == \
           [float(v) if isinstance(v, (int, float)) else v for v in theirs]
    if tb.finite:          # the grid holds every value drawn, and nothing impossible
        assert set(ours) <= set(tb.values())
        assert len(set(ours)) >= min(len(tb.values()), 3)
    if kind == "loguniform":
        assert all(math.exp(-8) <= v <= 1 for v in ours)
    assert "=" in tb.describe()


def test_yaml_q_key_and_comments(options):
    space = S.parse_yaml("# c\nwarmup_updates: {quniform: [0, 100], q: 25}\n", "f", options)
    assert space["warmup_updates"].values() == [0, 25, 50, 75, 100]
    space = S.parse_textbox("# comment\n\nwarmup_updates quniform (0, 100, 25)  # trailing\n", "f", options)
    assert space["warmup_updates"].args == [0, 100, 25]

BAD = [
    ("lr loguniform (-8, 0)\nmax_sentences\n", "line 2", "<label> <algorithm> <space>"),
    ("lr gaussian (0, 1)\n", "line 1", "unknown kind 'gaussian'"),
    ("beam_size choice [4, 8]\n", "line 1", "'beam_size' is not an option"),     # TextBox's, no counterpart
    ("lr choice __import__('os')\n", "line 1", "not a Python literal"),
    ("lr choice [0.1]\nlearning_rate choice [0.2]\n", "line 2", "again"),
    ("lr uniform (1, 0)\n", "line 1", "low <= high"),
    ("lr randint (1.5, 3)\n", "line 1", "integers"),
    ("lr pchoice [(0.5, 1), (0.2, 2)]\n", "line 1", "sum to 1"),
    ("lr: {choice: [0.1\n", "line 2", "not valid YAML"),
    ("lr: {choice: [0.1]}\nbogus: {choice: [1]}\n", "line 2", "'bogus' is not an option"),
    ("lr: {gaussian: [0, 1]}\n", "line 1", "unknown kind"),
]


@pytest.mark.parametrize("text,line,needle", BAD)
def test_space_errors_name_file_and_line(tmp_path, options, text, line, needle):
    path = tmp_path / "space.txt"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        S.load_space(path, options)
    message = str(info.value)
    assert f"space file {path} {line}" in message and needle in message, message
    assert "\n" not in message


def test_space_file_is_never_executed(tmp_path, options):
    marker = tmp_path / "pwned"
    for text in (f"lr choice __import__('os').system('touch {marker}')\n",
                 f"lr: !!python/object/apply:os.system ['touch {marker}']\n"):
        (tmp_path / "s").write_text(text)
        with pytest.raises(UserError):
            S.load_space(tmp_path / "s", options)
    assert not marker.exists()


def test_atpe_runs_or_says_how_to_install(tmp_path, options):
    space = S.parse_textbox(TEXTBOX_EXAMPLE, "f", options)
    try:
        code, summary = S.run_search(space, "atpe", 2, 1, BASE, tmp_path / "o", runner=FakeRunner(), out=quiet)
        assert code == 0
    except UserError as exc:
        assert "pip install lightgbm scikit-learn" in str(exc)


def test_unknown_algo(options):
    with pytest.raises(UserError, match="unknown --algo 'grad'"):
        S.canonical_algo("grad")


def test_failed_trial_is_recorded_and_best_chosen(tmp_path, options):
    space = S.parse_yaml("lr: {choice: [0.1, 0.3, 0.2]}\n", "f", options)
    runner = FakeRunner(fail={2})
    code, summary = S.run_search(space, "exhaustive", None, 1, BASE_B, tmp_path, runner=runner, out=quiet)
    records = S.hyper.read_jsonl(tmp_path / "hyper_results.jsonl")
    assert [r["status"] for r in records] == ["ok", "fail", "ok"]
    assert summary["trial"] == 3 and summary["value"] == pytest.approx(0.2) and code == 0
    csv = (tmp_path / "hyper_results.csv").read_text().splitlines()
    assert csv[0].startswith("trial,lr,accuracy,status") and len(csv) == 4
    assert (tmp_path / "hyper_report.png").stat().st_size > 10000


def test_parallel_runs_n_trials_at_once(tmp_path, options):
    space = S.parse_textbox(TEXTBOX_EXAMPLE, "f", options)
    runner = FakeRunner(polls=3)
    code, summary = S.run_search(space, "tpe", 5, 1, BASE, tmp_path, runner=runner, out=quiet, parallel=2)
    assert code == 0 and summary["n_trials"] == 5 and runner.max_running == 2
    assert all(c.get("threads") == 1 for c in runner.started)   # 2 cores split between 2 trials (or 1 each)
    assert all(c.source("threads") == "the search" and c.source("lr") == "the search" for c in runner.started)


def test_gpus_per_trial_without_cuda_is_one_line(tmp_path, options):
    space = S.parse_yaml("lr: {choice: [0.1]}\n", "f", options)
    with pytest.raises(UserError, match="no CUDA GPU"):
        S.run_search(space, "random", 1, 1, BASE_B, tmp_path, runner=FakeRunner(), out=quiet, gpus_per_trial=1)


def test_gpu_slots_give_each_trial_its_own_devices(monkeypatch):
    from textbox_like.search import trials as T
    monkeypatch.setattr(T, "gpu_ids", lambda: ["0", "1", "2", "3"])
    slots = T.plan_slots(2, 2, set(), quiet)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3"]
    assert all(s.settings == {"distributed_world_size": 2} for s in slots)
    with pytest.raises(UserError, match="needs 6 GPUs"):
        T.plan_slots(3, 2, set(), quiet)


# ---------------------------------------------------------------- seeds and statistics
def test_seeds_are_drawn_from_the_seed():
    seeds = S.draw_seeds(3, 5)
    rng = random.Random(5)
    assert seeds == [rng.randint(0, 2 ** 32 - 1) for _ in range(3)]
    assert S.draw_seeds(3, 5) == seeds and S.draw_seeds(3, 6) != seeds and len(S.draw_seeds(16, 5)) == 16


def test_describe_is_scipy():
    from scipy import stats
    values = [0.91, 0.935, 0.94, 0.902, 0.95]
    d = S.describe(values)
    assert d["n"] == 5 and d["mean"] == pytest.approx(np.mean(values))
    assert d["std"] == pytest.approx(np.std(values, ddof=1)) and d["median"] == 0.935
    low, high = stats.t.interval(0.95, 4, loc=np.mean(values), scale=stats.sem(values))
    assert d["ci95"] == pytest.approx([low, high])
    assert S.describe([1.0])["ci95"] is None and S.describe([])["n"] == 0


# ---------------------------------------------------------------- command lines
def cli_error(capsys, main, args):
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_command_line_errors_are_one_line(tmp_path, capsys):
    good = tmp_path / "good.test"
    good.write_text("lr choice [0.1, 0.2]\n")
    bad = tmp_path / "bad.test"
    bad.write_text("lr loguniform (-8, 0)\nlr2 choice [1]\n")
    out = tmp_path / "out"
    common = ["--task", "mnist", "--max-update", "1", "--max-sentences", "8", "--output", out]
    for args, needle in [
        (["--space", bad], f"space file {bad} line 2: 'lr2' is not an option"),
        (["--space", good, "--algo", "grid_search"], "unknown --algo"),
        (["--space", good, "--lr", "0.3"], "both in the space file"),
        (["--space", good, "--backend", "slurm"], "unknown --backend"),
        (["--space", good, "--scheduler", "asha"], "needs --backend ray"),
        (["--space", good, "--gpus-per-trial", "1"], "no CUDA GPU"),
        (["--space", good, "--metric", "acc"], "did you mean 'accuracy'"),
    ]:
        assert needle in cli_error(capsys, S.hyper_main, args + common), needle
    assert not out.exists() or not any(out.iterdir())
    for args, needle in [([], "--multi_seed N"), (["--seeds", "1,x"], "3,7,11"),
                         (["--seeds", "1,2", "--seed", "3"], "--seed seeds the generator"),
                         (["--multi_seed", "2", "--save-dir", "x"], "--output")]:
        assert needle in cli_error(capsys, S.multi_seed_main, args + common), needle


# ---------------------------------------------------------------- the typed search section
def test_command_lines_become_one_typed_search_section(capsys):
    from dataclasses import FrozenInstanceError

    from textbox_like.search.commands import parse_search
    from textbox_like.config.schema import SearchConfig
    # TextBox's documented spellings (the shell has taken the quotes off --algo='exhaustive')
    search, rest = parse_search("run_hyper.py", ["--space=s.test", "--algo=exhaustive", "--max-evals", "3",
                                                 "--task", "mnist", "--max-update", "20", "--resume"])
    assert isinstance(search, SearchConfig) and search.space == "s.test" and search.algo == "exhaustive"
    assert search.max_evals == 3 and search.seed == 1 and search.output == "checkpoints/hyper" and search.resume
    assert rest == ["--task", "mnist", "--max-update", "20"]        # the trainer's, for every trial
    with pytest.raises(FrozenInstanceError):
        search.algo = "tpe"
    search, rest = parse_search("run_multi_seed.py", ["--multi_seed=16", "--seed", "5", "--minimize",
                                                      "--task", "mnist"])
    assert (search.multi_seed, search.seed, search.seeds, search.maximize) == (16, 5, None, False)
    assert search.output == "checkpoints/multi_seed" and rest == ["--task", "mnist"]
    assert parse_search("run_multi_seed.py", ["--seeds", "3,7,11"])[0].seeds == [3, 7, 11]
    for argv, needle in [(["--seeds", "1,4294967296"], "2**32 - 1"), (["--seeds", "3,3"], "twice"),
                         (["--multi_seed", "2", "--seeds", "1"], "give one of them"),
                         (["--multi_seed", "2", "--backend", "rey"], "did you mean 'ray'"),
                         (["--multi_seed", "2", "--cpus-per-trial", "0"], "a number > 0")]:
        with pytest.raises(UserError, match=needle.replace("*", r"\*").replace("(", r"\(")):
            parse_search("run_multi_seed.py", argv)
    assert "--space FILE" in cli_error(capsys, S.hyper_main, ["--task", "mnist"])


# ---------------------------------------------------------------- the space, checked once
def count_resolves(monkeypatch):
    from textbox_like.search import trials as T
    calls = []
    real = T.TrialConfigs.resolve

    def counting(self, settings=None):
        calls.append(dict(settings or {}))
        return real(self, settings)
    monkeypatch.setattr(T.TrialConfigs, "resolve", counting)
    return calls


@pytest.mark.parametrize("text,line,value", [
    ("learning_rate choice [-0.1, 0.1]\n", 1, "-0.1"),                         # the first value
    ("optimizer choice ['adam', 'sgd']\nlearning_rate choice [0.1, -0.1]\n", 2, "-0.1"),
    ("lr: {choice: [-0.1]}\n", 1, "-0.1"),                                     # YAML, the only value
    ("warmup_updates choice [0, 1]\nlr quniform (-5, 5, 1)\n", 2, "-5"),        # a range's end
])
def test_space_value_refused_by_an_option_check_names_the_space_file_and_line(tmp_path, options, text, line, value):
    path = tmp_path / ("s.yaml" if text.startswith("lr:") else "s.test")
    path.write_text(text)
    runner = FakeRunner()
    with pytest.raises(UserError) as info:
        S.run_search(S.load_space(path, options), "exhaustive", None, 1, BASE_B, tmp_path / "out", runner=runner,
                     out=quiet)
    message = str(info.value)
    assert message.startswith(f"space file {path} line {line}: ") and f"= {value}: " in message, message
    assert "Invalid learning rate" in message and "\n" not in message
    assert not runner.started and not (tmp_path / "out").exists()


def test_space_is_checked_once_every_value_typed_and_a_value_past_the_50th_is_caught(tmp_path, options,
                                                                                  monkeypatch):
    calls = count_resolves(monkeypatch)
    space = S.parse_textbox("warmup_updates quniform (0, 1000, 1)\noptimizer choice ['adam', 'sgd', 'adamw']\n"
                            "lr loguniform (-8, 0)\n", "f", options)
    S.hyper.Setup(space, SearchConfig.for_command("run_hyper.py", output=str(tmp_path)), BASE_B, quiet)
    # the first values together, then one per other choice and the range's other end: not one per value
    assert len(calls) == 1 + 2 + 1, calls
    assert [c["warmup_updates"] for c in calls].count(1000) == 1
    values = list(range(1, 61))
    values[55] = -1
    bad = S.parse_textbox(f"max_sentences choice {values}\n", "space.test", options)
    with pytest.raises(UserError, match=r"space.test line 1: max_sentences = -1: option max_sentences: expects a "
                                        r"positive integer"):
        S.hyper.Setup(bad, SearchConfig.for_command("run_hyper.py", output=str(tmp_path)), BASE, quiet)


def test_a_base_command_line_the_trainer_refuses_is_not_blamed_on_the_space(tmp_path, options):
    space = S.parse_textbox("lr choice [0.1, 0.2]\n", "space.test", options)
    with pytest.raises(UserError) as info:
        S.run_search(space, "exhaustive", None, 1, BASE_B + ["--optimizer", "adamx"], tmp_path, runner=FakeRunner(),
                     out=quiet)
    assert "space.test" not in str(info.value) and "adamx" in str(info.value)


@pytest.mark.parametrize("content,what", [
    (b"", "is empty (0 bytes)"),
    (b"lr choice [0.1]\n\x00\x01\x02", "is binary data"),
    (b"PK\x03\x04rest of a torch checkpoint", "is a zip archive"),
    (b"lr choice [0.1]  # caf\xe9\n", "is not UTF-8 text (byte 0xe9 on line 1)"),
])
def test_a_space_file_that_is_not_text_is_one_line_naming_it(tmp_path, capsys, content, what):
    path = tmp_path / "space.test"
    path.write_bytes(content)
    line = cli_error(capsys, S.hyper_main, ["--space", path, "--output", tmp_path / "out", *BASE_B])
    assert line.startswith(f"error: space file {str(path)!r} {what}"), line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- seeds: one check, one resolve
def test_multi_seed_resolves_once_and_draws_from_the_configured_seed(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("seed: 5\n")
    calls = count_resolves(monkeypatch)
    runner = FakeRunner(score=lambda cfg: 0.5)
    search = SearchConfig.for_command("run_multi_seed.py", multi_seed=3, output=str(tmp_path / "out"))
    code, summary = S.multi_seed.seeds_locally(search, BASE_B + ["--config", tmp_path / "c.yaml"], runner, quiet)
    assert code == 0 and summary["seeds"] == S.draw_seeds(3, 5)
    assert [c.get("seed") for c in calls] == [None] + S.draw_seeds(3, 5)    # the base once, then each run's
    assert [flag(c, "seed") for c in runner.started] == S.draw_seeds(3, 5)


def test_multi_seed_refuses_an_output_holding_an_earlier_run_of_a_seed_before_any_starts(tmp_path):
    earlier = tmp_path / "out" / "seed_7"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"kind": "train", "update": 3}\n')
    runner = FakeRunner(score=lambda cfg: 0.5)
    search = SearchConfig.for_command("run_multi_seed.py", seeds=[3, 7], output=str(tmp_path / "out"))
    with pytest.raises(UserError, match=r"already holds a run of seed 7 in seed_7 \(metrics.jsonl\); choose another --output"):
        S.multi_seed.seeds_locally(search, BASE_B, runner, quiet)
    assert runner.started == [] and not (tmp_path / "out" / "seed_3").exists()
    assert (earlier / "metrics.jsonl").read_text() == '{"kind": "train", "update": 3}\n'


# ---------------------------------------------------------------- Ray: trials get the resolved configuration
def test_ray_trials_get_a_configuration_resolved_in_the_driver(tmp_path):
    import pickle

    from textbox_like.resolve.resolution import read_resolved
    from textbox_like.search.ray_backend import TrialPreparer
    spec = {"base_argv": BASE_B, "settings": {"best_checkpoint_metric": "loss"}, "names": ["lr"],
            "output": str(tmp_path)}
    prepare = TrialPreparer(spec)
    assert prepare(  # the searcher's suggestion: a trial directory claimed, its configuration written there
        "abc_00001", {"lr": np.float64(0.25)}) == {"__dir__": "trial_1", "__refused__": None}
    cfg = read_resolved(tmp_path / "trial_1" / "trial_config.yaml")
    assert cfg.optim.lr == [0.25] and cfg.checkpoint.save_dir == str(tmp_path / "trial_1")
    assert cfg.validation.best_checkpoint_metric == "loss" and cfg.source("lr") == "the search"
    assert "--lr=0.25" in (tmp_path / "trial_1" / "command.txt").read_text()
    refused = prepare.prepare(tmp_path / "trial_2", {"lr": -1.0})
    assert refused.startswith("error: optimizer adam: Invalid learning rate: -1.0")
    assert (tmp_path / "trial_2" / "stderr.log").read_text() == refused + "\n"
    assert not (tmp_path / "trial_2" / "trial_config.yaml").exists()
    again = pickle.loads(pickle.dumps(prepare))       # Tune pickles it with the searcher: plain data only
    assert again.spec == spec and again._configs is None
