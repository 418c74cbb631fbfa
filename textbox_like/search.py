"""Hyperparameter search (``run_hyper.py``) and repeated runs over seeds
(``run_multi_seed.py``), both on top of the ordinary trainer.

Space file
----------
YAML (read with ``yaml.safe_load`` only; nothing in it is ever evaluated), one
trainer option per key (``lr`` or ``max-sentences``; any option of
``run_hetseq.py``), each a mapping of exactly one *kind* to its arguments::

    lr: {loguniform: [1.0e-4, 1.0e-2]}      # exp(uniform(log low, log high))
    max_sentences: {choice: [32, 64]}       # one of the listed values (any YAML values)
    optimizer: {choice: [adam, adadelta]}
    weight_decay: {uniform: [0.0, 0.01]}    # uniform in [low, high]
    warmup_updates: {quniform: [0, 20, 5]}  # round(uniform(low, high) / q) * q; also {quniform: [0, 20], q: 5}
    update_freq: {randint: [1, 3]}          # integer in [low, high) (upper bound excluded, like hyperopt/numpy)

Supported kinds: choice, uniform, loguniform, quniform, randint. A quniform
whose bounds and q are all integers yields integers. Anything else, an option
the trainer does not know (the message names the closest one), or a value the
trainer would reject is an error before the first trial starts. Options fixed
for every trial go on the command line, not into the space file; an option in
both is an error (the command line would silently win).

Algorithms
----------
``exhaustive``: every combination of the ``choice`` values, in file order, each
once (only ``choice`` is allowed; ``--max_evals`` caps the grid). ``random``:
``hyperopt.rand``; ``bayes``: ``hyperopt.tpe`` (default 10 trials). ``--seed``
seeds the sampler, so the same seed gives the same trial sequence (the trainer's
own seed stays the configured one, default 1; set it with ``--train_seed``).

Trials
------
Trial *k* is one ``run_hetseq.py`` run in a **subprocess** with
``--save-dir OUTPUT/trial_<k>``; its command line is written to
``trial_<k>/command.txt`` and its output to ``trial_<k>/stdout.log`` and
``stderr.log``. A subprocess rather than ``cli.main`` in this process because a
trial leaves state behind that the next must not see: Accelerate's singleton
state, ``RANK``/``WORLD_SIZE`` and thread settings published in ``os.environ``,
torch's thread count and RNGs, signal handlers, and memory a crash or a CUDA
error may leave; a trial that segfaults or is OOM-killed also fails alone
instead of ending the search. The cost (about 3 s of start-up per trial) is
small next to a real training run.

The objective is ``results.json``'s ``best[METRIC]``: the search passes
``--best-checkpoint-metric METRIC`` and the direction on to each trial, so
``best`` is the best validation of that metric. METRIC defaults to the
configured ``--best-checkpoint-metric`` or the task's default; the direction to
the configured or the task's, overridden by ``--maximize``/``--minimize``.
A trial that exits non-zero (or has no such metric) is recorded as failed
(hyperopt ``STATUS_FAIL``) and the search goes on; Ctrl-C stops the search after
the running trial ends, and the summary is still written.

Output: a line per trial, ``OUTPUT/hyper_results.jsonl`` (one record per
trial, rewritten after each), ``OUTPUT/hyper_best.json`` (params, value, trial
directory and command of the best trial). Exit code 0 when at least one trial
succeeded, 1 when none did, 130 after Ctrl-C, 2 on bad input.

Multiple seeds
--------------
``run_multi_seed.py --multi_seed N`` (seeds 1..N) or ``--seeds 3,7,11`` runs
the same configuration once per seed in ``OUTPUT/seed_<s>`` (subprocesses, as
above), then writes ``OUTPUT/multi_seed_summary.json``: for every metric of
``final`` and ``best``: n, mean, std (sample, ddof=1), min, max, median and the
95% confidence interval of the mean (Student's t; the quantile comes from a
table for df 1..30 and a Cornish-Fisher expansion beyond, no scipy). Failed
seeds are listed and left out of the statistics, and make the exit code 1
after the summary.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import UserError, closest

KINDS = ("choice", "uniform", "loguniform", "quniform", "randint")
ALGOS = ("exhaustive", "random", "bayes")
INTERRUPTED = 130


# ====================================================================== space
@dataclass
class Param:
    name: str                       # trainer option, underscore spelling
    kind: str
    args: list = field(default_factory=list)

    def probes(self):
        """A few values the trainer must accept (checked before the first trial)."""
        if self.kind == "choice":
            return list(self.args)
        if self.kind == "randint":
            return [self.args[0], self.args[1] - 1]
        if self.kind == "quniform":
            return [self.quantize(self.args[0]), self.quantize(self.args[1])]
        return [self.args[0], self.args[1]]

    def quantize(self, value):
        low, high, q = self.args
        value = round(value / q) * q
        if all(isinstance(v, int) for v in (low, high, q)):
            return int(round(value))
        return float(value)

    def hyperopt(self):
        from hyperopt import hp
        if self.kind == "choice":
            return hp.choice(self.name, list(self.args))
        if self.kind == "uniform":
            return hp.uniform(self.name, *self.args)
        if self.kind == "loguniform":
            return hp.loguniform(self.name, math.log(self.args[0]), math.log(self.args[1]))
        if self.kind == "quniform":
            return hp.quniform(self.name, *self.args)
        return hp.randint(self.name, *self.args)

    def clean(self, value):
        """hyperopt's value -> plain Python (numpy scalars, quniform floats)."""
        if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
            value = value.item()
        if self.kind == "quniform":
            return self.quantize(value)
        if self.kind == "randint":
            return int(value)
        if self.kind in ("uniform", "loguniform"):
            return float(value)
        return value


def _number(value, where):
    from .config import _numbers
    value = _numbers(value)   # YAML 1.1 reads 1e-4 as a string
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where}: expects a number, got {value!r}")
    return value


def parse_space(data, source="space file", options=None):
    """A mapping {option: {kind: args}} -> {option: Param}. ``options`` (the
    trainer's ``Options``) checks the names."""
    if not isinstance(data, dict) or not data:
        raise UserError(f"{source} must hold a mapping of option: {{kind: args}}, e.g. "
                        f"'lr: {{loguniform: [1.0e-4, 1.0e-2]}}'; got {type(data).__name__ if data else 'nothing'}")
    space = {}
    for raw_name, spec in data.items():
        name = str(raw_name).replace("-", "_")
        where = f"{source}: {raw_name}"
        if options is not None and name not in options.actions:
            raise UserError(f"{where}: unknown option {raw_name!r}{closest(name, options.actions)}; "
                            f"run run_hetseq.py --help for the valid options")
        if name in space:
            raise UserError(f"{where}: given twice")
        q = None
        if isinstance(spec, dict) and "q" in spec and len(spec) == 2:
            spec = dict(spec)
            q = spec.pop("q")
        if not isinstance(spec, dict) or len(spec) != 1:
            raise UserError(f"{where}: expects a mapping of one kind to its arguments, like "
                            f"{{choice: [a, b]}} or {{uniform: [low, high]}}; got {spec!r}; supported kinds: "
                            f"{', '.join(KINDS)}")
        kind, args = next(iter(spec.items()))
        if kind not in KINDS:
            raise UserError(f"{where}: unsupported kind {kind!r}{closest(kind, KINDS)}; supported kinds: "
                            f"{', '.join(KINDS)}")
        if q is not None and kind != "quniform":
            raise UserError(f"{where}: 'q' belongs to quniform only")
        if kind == "choice":
            if not isinstance(args, list) or not args:
                raise UserError(f"{where}: choice expects a non-empty list of values, got {args!r}")
            space[name] = Param(name, kind, list(args))
            continue
        if not isinstance(args, list):
            raise UserError(f"{where}: {kind} expects a list [low, high{', q' if kind == 'quniform' else ''}], "
                            f"got {args!r}")
        if kind == "quniform" and q is not None:
            args = list(args) + [q]
        want = 3 if kind == "quniform" else 2
        if len(args) != want:
            shape = "[low, high, q] (or [low, high] with q: Q)" if kind == "quniform" else "[low, high]"
            raise UserError(f"{where}: {kind} expects {shape}, got {args!r}")
        args = [_number(v, where) for v in args]
        low, high = args[0], args[1]
        if kind == "randint":
            if not all(isinstance(v, int) for v in args):
                raise UserError(f"{where}: randint expects integers [low, high), got {args!r}")
            if high <= low:
                raise UserError(f"{where}: randint needs low < high (high is excluded), got {args!r}")
        elif high < low:
            raise UserError(f"{where}: {kind} needs low <= high, got {args!r}")
        if kind == "loguniform" and low <= 0:
            raise UserError(f"{where}: loguniform needs 0 < low <= high, got {args!r}")
        if kind == "quniform" and args[2] <= 0:
            raise UserError(f"{where}: quniform needs q > 0, got {args!r}")
        space[name] = Param(name, kind, args)
    return space


def load_space(path, options=None):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"space file {str(path)!r} does not exist; check the path")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"space file {str(path)!r} is not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"space file {str(path)!r} cannot be read: {exc}") from None
    return parse_space(data, f"space file {path.name}", options)


def grid(space):
    """Every combination of the choice values, in file order."""
    bad = [p.name for p in space.values() if p.kind != "choice"]
    if bad:
        raise UserError(f"--algo exhaustive searches a grid of choice values only; "
                        f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a choice "
                        f"(use --algo random or bayes, or list the values with {{choice: [...]}})")
    names = list(space)
    return [dict(zip(names, values)) for values in itertools.product(*(space[n].args for n in names))]


# ====================================================================== argv
def _option_dest(parser, token):
    if not token.startswith("--"):
        return None
    action = parser._option_string_actions.get(token.split("=", 1)[0])
    return action.dest if action is not None else None


def given_dests(options, argv):
    return {d for d in (_option_dest(options.parser, t) for t in argv) if d}


def to_argv(options, params):
    """Sampled values -> trainer flags ('--name=value'; store_true: the flag or nothing)."""
    out = []
    for name, value in params.items():
        action = options.actions[name]
        flag = "--" + name
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise UserError(f"option {name} is a switch: use {{choice: [true, false]}}, got {value!r}")
            if value:
                out.append(flag)
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, dict):
            text = yaml.safe_dump(value, default_flow_style=True).strip()
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, float):
            text = repr(value)
        else:
            text = str(value)
        out.append(f"{flag}={text}")
    return out


def format_params(params):
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    return " ".join(f"{k}={fmt(v)}" for k, v in params.items())


def validate(argv):
    """parse + check, as the trainer does before anything heavy; UserError if bad."""
    from . import cli
    options, ns, keys = cli.parse(argv)
    cli.check(options, ns)
    return options, ns


# ====================================================================== trials
@dataclass
class Outcome:
    returncode: int
    error: str = ""
    interrupted: bool = False


def subprocess_runner(argv, save_dir, timeout=None):
    """One trainer run in a child process; output to save_dir/{stdout,stderr}.log."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "import sys; from textbox_like.cli import main; sys.exit(main())", *argv]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    interrupted = False
    with open(save_dir / "stdout.log", "w") as out, open(save_dir / "stderr.log", "w") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            return Outcome(-9, f"timed out after {timeout} s")
        except KeyboardInterrupt:
            # the child is in our process group and got the SIGINT too: let it end
            interrupted = True
            try:
                rc = child.wait(timeout=30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                child.kill()
                rc = child.wait()
    lines = [line for line in (save_dir / "stderr.log").read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    message = (errors or lines or [""])[-1][:300] if rc else ""
    return Outcome(rc, message, interrupted)


def read_results(save_dir):
    path = Path(save_dir) / "results.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_one(runner, argv, save_dir):
    """Run a trial; returns (outcome, results or None). A stale results.json goes first."""
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    (Path(save_dir) / "command.txt").write_text(
        " ".join(_quote(a) for a in ["python", "run_hetseq.py", *argv]) + "\n")
    stale = Path(save_dir) / "results.json"
    if stale.exists():
        stale.unlink()
    outcome = runner(argv, save_dir)
    if outcome.interrupted:
        raise KeyboardInterrupt
    results = read_results(save_dir) if outcome.returncode == 0 else None
    if outcome.returncode == 0 and results is None:
        outcome = Outcome(1, "the run wrote no results.json")
    return outcome, results


def _quote(arg):
    import shlex
    return shlex.quote(str(arg))


def _write_json(path, data):
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _write_jsonl(path, records):
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


# ====================================================================== metric
def resolve_metric(ns, metric=None, maximize=None):
    """(metric, maximize) from --metric/--maximize/--minimize, the configured
    --best-checkpoint-metric, or the task's defaults."""
    from .tasks import TASKS
    task = TASKS.get(ns.task)
    configured = ns.best_checkpoint_metric or task.default_best_metric
    metric = metric or configured
    if task.metric_names and metric not in task.metric_names:
        raise UserError(f"--metric {metric!r} is not a metric of task {ns.task}"
                        f"{closest(metric, task.metric_names)}; choose from: {', '.join(task.metric_names)}")
    if maximize is None:
        if metric == configured and ns.maximize_best_checkpoint_metric is not None:
            maximize = bool(ns.maximize_best_checkpoint_metric)
        elif metric == task.default_best_metric:
            maximize = task.default_maximize_best_metric
        else:
            maximize = not any(s in metric for s in ("loss", "ppl", "perplexity", "error", "wer", "cer"))
    return metric, maximize


# ====================================================================== search
class Search:
    def __init__(self, space, algo, max_evals, seed, base_argv, output, metric, maximize, runner, out=print):
        self.space, self.algo, self.seed = space, algo, seed
        self.base_argv, self.output = list(base_argv), Path(output)
        self.metric, self.maximize = metric, maximize
        self.runner, self.out = runner, out
        self.records = []
        from . import cli
        self.options = cli.build_options()
        self.max_evals = max_evals

    def trial_argv(self, params, save_dir):
        return self.base_argv + to_argv(self.options, params) + [
            f"--save-dir={save_dir}", f"--best-checkpoint-metric={self.metric}",
            f"--maximize-best-checkpoint-metric={'true' if self.maximize else 'false'}"]

    def evaluate(self, params):
        k = len(self.records) + 1
        save_dir = self.output / f"trial_{k}"
        argv = self.trial_argv(params, save_dir)
        start = time.time()
        record = {"trial": k, "params": params, "status": "fail", "metric": self.metric, "value": None,
                  "loss": None, "returncode": None, "error": "", "save_dir": str(save_dir), "wall_time": None}
        try:
            validate(argv)
        except UserError as exc:       # a sampled value the trainer rejects: this trial fails
            record.update(returncode=2, error=f"error: {exc}", wall_time=0.0)
        else:
            try:
                outcome, results = run_one(self.runner, argv, save_dir)
            except KeyboardInterrupt:
                record.update(status="interrupted", error="interrupted (Ctrl-C)",
                              wall_time=round(time.time() - start, 3))
                self._add(record)
                raise
            record.update(returncode=outcome.returncode, error=outcome.error,
                          wall_time=round(time.time() - start, 3))
            if results is not None:
                record["best"], record["final"] = results.get("best") or {}, results.get("final") or {}
                record["num_updates"] = results.get("num_updates")
                value = record["best"].get(self.metric)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    record.update(status="ok", value=float(value),
                                  loss=-float(value) if self.maximize else float(value))
                else:
                    record["error"] = f"results.json has no finite best[{self.metric!r}] (was there validation?)"
        self._add(record)
        return record

    def _add(self, record):
        self.records.append(record)
        total = self.max_evals if self.max_evals else "?"
        head = f"trial {record['trial']}/{total} | {format_params(record['params'])} | "
        if record["status"] == "ok":
            self.out(head + f"{self.metric} {record['value']:.4f} | {record['wall_time']:.1f}s")
        elif record["status"] == "interrupted":
            self.out(head + "interrupted")
        else:
            self.out(head + f"FAILED (exit {record['returncode']}): {record['error']}")
        self.output.mkdir(parents=True, exist_ok=True)
        _write_jsonl(self.output / "hyper_results.jsonl", self.records)

    def run(self):
        """Runs the trials; returns True if interrupted."""
        try:
            if self.algo == "exhaustive":
                points = grid(self.space)
                if self.max_evals and self.max_evals < len(points):
                    self.out(f"grid of {len(points)} points; running the first {self.max_evals} (--max_evals)")
                    points = points[:self.max_evals]
                self.max_evals = len(points)
                for params in points:
                    self.evaluate(dict(params))
            else:
                self._hyperopt()
        except KeyboardInterrupt:
            return True
        return False

    def _hyperopt(self):
        import numpy as np
        from hyperopt import STATUS_FAIL, STATUS_OK, Trials, fmin, rand, tpe
        hspace = {name: p.hyperopt() for name, p in self.space.items()}

        def objective(sampled):
            params = {name: self.space[name].clean(sampled[name]) for name in self.space}
            record = self.evaluate(params)
            if record["status"] == "ok":
                return {"status": STATUS_OK, "loss": record["loss"], "trial": record["trial"]}
            return {"status": STATUS_FAIL, "trial": record["trial"]}

        algo = rand.suggest if self.algo == "random" else tpe.suggest
        fmin(objective, hspace, algo=algo, max_evals=self.max_evals, trials=Trials(),
             rstate=np.random.default_rng(self.seed), show_progressbar=False, verbose=False,
             catch_eval_exceptions=False)

    def best(self):
        ok = [r for r in self.records if r["status"] == "ok"]
        if not ok:
            return None
        return min(ok, key=lambda r: (r["loss"], r["trial"]))

    def summary(self, interrupted):
        best = self.best()
        failed = sum(r["status"] == "fail" for r in self.records)
        data = {"metric": self.metric, "maximize": self.maximize, "algo": self.algo, "seed": self.seed,
                "n_trials": len(self.records), "n_ok": sum(r["status"] == "ok" for r in self.records),
                "n_failed": failed, "interrupted": interrupted,
                "value": best["value"] if best else None, "params": best["params"] if best else None,
                "trial": best["trial"] if best else None, "save_dir": best["save_dir"] if best else None,
                "command": (Path(best["save_dir"]) / "command.txt").read_text().strip() if best else None,
                "best": best.get("best") if best else None, "final": best.get("final") if best else None}
        self.output.mkdir(parents=True, exist_ok=True)
        _write_jsonl(self.output / "hyper_results.jsonl", self.records)
        _write_json(self.output / "hyper_best.json", data)
        return data


def run_search(space, algo="random", max_evals=None, seed=1, base_argv=(), output="checkpoints/hyper",
               metric=None, maximize=None, runner=None, out=print):
    """Validates, runs the search, writes the summary. Returns (exit code, summary dict)."""
    if algo not in ALGOS:
        raise UserError(f"unknown --algo {algo!r}{closest(algo, ALGOS)}; choose from: {', '.join(ALGOS)}")
    if max_evals is not None and max_evals < 1:
        raise UserError(f"--max_evals expects a positive integer, got {max_evals}")
    if algo == "exhaustive":
        points = grid(space)
    elif max_evals is None:
        max_evals = 10
    base_argv = list(base_argv)
    from . import cli
    options = cli.build_options()
    given = given_dests(options, base_argv)
    for name in ("save_dir", "no_save", "print_config", "disable_validation"):
        if name in given:
            hint = "the search sets it per trial: use --output DIR" if name == "save_dir" else \
                "the search needs each trial's results.json and validation metrics"
            raise UserError(f"--{name.replace('_', '-')} cannot be used here: {hint}")
    both = sorted(given & set(space))
    if both:
        raise UserError(f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} both in the space file and on "
                        f"the command line; keep one (the command line would win in every trial)")
    # the options as configured, with each space value the trainer must accept
    representative = {name: p.probes()[0] for name, p in space.items()}
    _, ns = validate(base_argv + to_argv(options, representative))
    if ns.disable_validation or ns.no_save:
        raise UserError("the search needs validation metrics and results.json: "
                        "remove disable_validation / no_save from the configuration")
    metric, maximize = resolve_metric(ns, metric, maximize)
    probes = [dict(p) for p in points] if algo == "exhaustive" else \
        [{**representative, name: v} for name, p in space.items() for v in p.probes()]
    for params in probes:
        try:
            validate(base_argv + to_argv(options, params))
        except UserError as exc:
            raise UserError(f"space file: {format_params(params)}: {exc}") from None
    search = Search(space, algo, max_evals, seed, base_argv, output, metric, maximize,
                    runner or subprocess_runner, out)
    out(f"search: {algo}, {'all ' + str(len(points)) if algo == 'exhaustive' and not max_evals else max_evals} "
        f"trials, {'maximize' if maximize else 'minimize'} {metric}, output {output}")
    interrupted = search.run()
    summary = search.summary(interrupted)
    if interrupted:
        out("interrupted: stopping the search")
    if summary["params"] is None:
        out(f"no trial succeeded ({summary['n_failed']} failed); see {output}/hyper_results.jsonl")
    else:
        out(f"best: trial {summary['trial']} | {metric} {summary['value']:.4f} | "
            f"{format_params(summary['params'])} | {summary['save_dir']}")
    out(f"wrote {Path(output) / 'hyper_results.jsonl'} and {Path(output) / 'hyper_best.json'}")
    code = INTERRUPTED if interrupted else (0 if summary["params"] is not None else 1)
    return code, summary


# ====================================================================== statistics
# two-sided 95%: the 0.975 quantile of Student's t for df = 1..30
T975 = (12.706204736, 4.30265273, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252,
        2.306004135, 2.262157163, 2.228138852, 2.20098516, 2.17881283, 2.160368656, 2.144786688,
        2.131449546, 2.119905299, 2.109815578, 2.10092204, 2.093024054, 2.085963447, 2.079613845,
        2.073873068, 2.06865761, 2.063898562, 2.059538553, 2.055529439, 2.051830516, 2.048407142,
        2.045229642, 2.042272456)
Z975 = 1.959963984540054


def t_quantile_975(df):
    """0.975 quantile of Student's t with ``df`` degrees of freedom: the table
    up to 30, beyond it the Cornish-Fisher expansion around the normal value
    (error < 1e-6 for df > 30)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= 30 and df == int(df):
        return T975[int(df) - 1]
    z = Z975
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def describe(values):
    """n, mean, std (ddof=1), min, max, median, 95% CI of the mean (t). Undefined
    entries (std and CI of one value) are None."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None, "median": None,
                "ci95": None, "ci95_half_width": None}
    mean = math.fsum(values) / n
    ordered = sorted(values)
    mid = n // 2
    median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    std = half = ci = None
    if n > 1:
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
        half = t_quantile_975(n - 1) * std / math.sqrt(n)
        ci = [mean - half, mean + half]
    return {"n": n, "mean": mean, "std": std, "min": ordered[0], "max": ordered[-1], "median": median,
            "ci95": ci, "ci95_half_width": half}


def summarize_runs(results):
    """{'final': {metric: describe}, 'best': {...}} over a list of results.json dicts."""
    out = {}
    for part in ("final", "best"):
        names = []
        for r in results:
            for name in (r.get(part) or {}):
                if name not in names:
                    names.append(name)
        out[part] = {name: describe([r[part][name] for r in results
                                     if isinstance((r.get(part) or {}).get(name), (int, float))])
                     for name in names}
    return out


def _fmt(v, digits=4):
    return "-" if v is None else f"{v:.{digits}f}"


def run_multi_seed(seeds, base_argv=(), output="checkpoints/multi_seed", metric=None, maximize=None,
                   runner=None, out=print):
    """Runs every seed; returns (exit code, summary dict)."""
    from . import cli
    base_argv = list(base_argv)
    options = cli.build_options()
    given = given_dests(options, base_argv)
    for name, hint in (("seed", "use --seeds 3,7,11 or --multi_seed N"), ("save_dir", "use --output DIR"),
                       ("no_save", "each run's results.json is needed"),
                       ("print_config", "run run_hetseq.py --print_config instead")):
        if name in given:
            raise UserError(f"--{name.replace('_', '-')} cannot be used here: {hint}")
    _, ns = validate(base_argv)
    if ns.no_save:
        raise UserError("each run's results.json is needed: remove no_save from the configuration")
    metric, maximize = resolve_metric(ns, metric, maximize)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    runner = runner or subprocess_runner
    runs, interrupted = [], False
    extra = [f"--best-checkpoint-metric={metric}", f"--maximize-best-checkpoint-metric={'true' if maximize else 'false'}"]
    out(f"multi-seed: seeds {','.join(map(str, seeds))}, {metric} ({'max' if maximize else 'min'}), output {output}")
    for i, seed in enumerate(seeds, 1):
        save_dir = output / f"seed_{seed}"
        argv = base_argv + [f"--save-dir={save_dir}", f"--seed={seed}"] + extra
        start = time.time()
        try:
            outcome, results = run_one(runner, argv, save_dir)
        except KeyboardInterrupt:
            interrupted = True
            runs.append({"seed": seed, "status": "interrupted", "save_dir": str(save_dir)})
            out(f"seed {seed} ({i}/{len(seeds)}) | interrupted")
            break
        run = {"seed": seed, "status": "ok" if results is not None else "fail", "save_dir": str(save_dir),
               "returncode": outcome.returncode, "error": outcome.error, "wall_time": round(time.time() - start, 3)}
        if results is not None:
            run.update(final=results.get("final") or {}, best=results.get("best") or {},
                       num_updates=results.get("num_updates"))
            value = run["final"].get(metric)
            out(f"seed {seed} ({i}/{len(seeds)}) | final {metric} {_fmt(value)} | best {metric} "
                f"{_fmt(run['best'].get(metric))} | {run['wall_time']:.1f}s")
        else:
            out(f"seed {seed} ({i}/{len(seeds)}) | FAILED (exit {outcome.returncode}): {outcome.error}")
        runs.append(run)
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [{"seed": r["seed"], "returncode": r.get("returncode"), "error": r.get("error", "interrupted")}
              for r in runs if r["status"] != "ok"]
    stats = summarize_runs(ok)
    summary = {"metric": metric, "maximize": maximize, "seeds": list(seeds), "ok_seeds": [r["seed"] for r in ok],
               "failed": failed, "not_run": list(seeds[len(runs):]), "interrupted": interrupted,
               "final": stats["final"], "best": stats["best"], "runs": runs}
    _write_json(output / "multi_seed_summary.json", summary)
    out(f"{len(ok)} of {len(seeds)} runs succeeded" + (f"; failed seeds: {', '.join(str(f['seed']) for f in failed)}"
                                                         if failed else ""))
    for part in ("final", "best"):
        for name, s in stats[part].items():
            ci = f"[{_fmt(s['ci95'][0])}, {_fmt(s['ci95'][1])}]" if s["ci95"] else "-"
            out(f"{part:5s} {name:14s} n={s['n']:<3d} mean {_fmt(s['mean'])} ± {_fmt(s['std'])} (std) "
                f"95% CI {ci} | min {_fmt(s['min'])} median {_fmt(s['median'])} max {_fmt(s['max'])}")
    out(f"wrote {output / 'multi_seed_summary.json'}")
    if interrupted:
        return INTERRUPTED, summary
    return (1 if failed or not ok else 0), summary


# ====================================================================== command lines
def _parser(prog, description, epilog):
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(message):
        raise UserError(message)

    parser.error = error
    return parser


def _both(flag):
    body = flag[2:]
    return sorted({"--" + body, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")}, key=flag.__ne__)


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects a positive integer, got {text!r}")
    return value


def _seed_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expects integers like 3,7,11, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists a seed twice: {text!r}")
    return values


def _direction(parser):
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--maximize", dest="maximize", action="store_const", const=True, default=None,
                       help="higher METRIC is better (default: the configured or the task's direction)")
    group.add_argument("--minimize", dest="maximize", action="store_const", const=False,
                       help="lower METRIC is better")


def _entry(fn, argv):
    try:
        return fn(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 1


def hyper_main(argv=None):
    return _entry(_hyper, sys.argv[1:] if argv is None else list(argv))


def _hyper(argv):
    p = _parser("run_hyper.py", "Hyperparameter search over a space file, one run_hetseq.py run per trial.",
                "Any other option goes to every trial's run_hetseq.py run (e.g. --task mnist --max-update 100\n"
                "--threads 1). Space file format and outputs: docs/search.md, properties/hyperopt_example.yaml.")
    p.add_argument(*_both("--space"), dest="space", required=True, metavar="FILE", help="YAML space file")
    p.add_argument(*_both("--algo"), dest="algo", default="random", metavar="ALGO",
                   help=f"one of: {', '.join(ALGOS)} (default: random)")
    p.add_argument(*_both("--max_evals"), dest="max_evals", type=_positive, default=None, metavar="N",
                   help="number of trials (default: 10; exhaustive: the whole grid)")
    p.add_argument(*_both("--metric"), dest="metric", default=None,
                   help="validation metric to optimize (default: --best-checkpoint-metric or the task's)")
    _direction(p)
    p.add_argument(*_both("--seed"), dest="seed", type=int, default=1, help="seed of the search (default 1)")
    p.add_argument(*_both("--train_seed"), dest="train_seed", type=int, default=None,
                   help="--seed of every trial's training run (default: the configured one)")
    p.add_argument(*_both("--output"), dest="output", default="checkpoints/hyper", metavar="DIR",
                   help="where trial_<k>/ and the summaries go (default: checkpoints/hyper)")
    args, rest = p.parse_known_args(argv)
    if args.algo not in ALGOS:
        raise UserError(f"unknown --algo {args.algo!r}{closest(args.algo, ALGOS)}; choose from: {', '.join(ALGOS)}")
    if args.train_seed is not None:
        rest = rest + [f"--seed={args.train_seed}"]
    from . import cli
    space = load_space(args.space, cli.build_options())
    code, _ = run_search(space, args.algo, args.max_evals, args.seed, rest, args.output, args.metric,
                         args.maximize)
    return code


def multi_seed_main(argv=None):
    return _entry(_multi_seed, sys.argv[1:] if argv is None else list(argv))


def _multi_seed(argv):
    p = _parser("run_multi_seed.py", "Run one configuration with several seeds and summarize the metrics.",
                "Any other option goes to every run_hetseq.py run. Output: OUTPUT/seed_<s>/ and\n"
                "OUTPUT/multi_seed_summary.json (n, mean, std, min, max, median, 95% CI per metric).")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument(*_both("--multi_seed"), dest="multi_seed", type=_positive, default=None, metavar="N",
                       help="run seeds 1..N")
    seeds.add_argument(*_both("--seeds"), dest="seeds", type=_seed_list, default=None, metavar="LIST",
                       help="run these seeds, e.g. 3,7,11")
    p.add_argument(*_both("--metric"), dest="metric", default=None,
                   help="headline metric, also chooses each run's best (default: the configured or the task's)")
    _direction(p)
    p.add_argument(*_both("--output"), dest="output", default="checkpoints/multi_seed", metavar="DIR",
                   help="where seed_<s>/ and multi_seed_summary.json go (default: checkpoints/multi_seed)")
    args, rest = p.parse_known_args(argv)
    if args.multi_seed is None and args.seeds is None:
        raise UserError("say which seeds: --multi_seed N (seeds 1..N) or --seeds 3,7,11")
    chosen = args.seeds or list(range(1, args.multi_seed + 1))
    code, _ = run_multi_seed(chosen, rest, args.output, args.metric, args.maximize)
    return code
