"""The search: trials proposed by the sampler, run by the pool (local backend)
or by Ray Tune (``ray_backend``), recorded in ``hyper_results.jsonl`` after
every change, summarized in ``hyper_best.json``, ``hyper_results.csv``,
``hyper_report.png`` and a table on stdout."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from textbox_like.core.errors import UserError, closest
from textbox_like.storage.sharded_checkpoint import checkpoints_of_both_formats_newest_first
from textbox_like.search.algos import DEFAULT_EVALS, Sampler, canonical_algo
from textbox_like.search.report import format_params, search_png, search_table, write_search_csv
from textbox_like.search.trials import (
    Job,
    SubprocessRunner,
    TrialConfigs,
    TrialRecord,
    plan_slots,
    read_json,
    read_jsonl,
    run_pool,
    write_json,
    write_jsonl)

INTERRUPTED = 130
DONE = ("ok", "fail", "stopped")
STATE_FILE = "hyper_search.json"


# ====================================================================== metric
def resolve_metric(ns, metric=None, maximize=None):
    """(metric, maximize) from --metric/--maximize/--minimize, the configured
    --best-checkpoint-metric, or the task's defaults."""
    from textbox_like.tasks import TASKS
    from textbox_like.tasks.base import higher_is_better
    task = TASKS.get(ns.data.task)
    configured = ns.validation.best_checkpoint_metric or task.default_best_metric
    metric = metric or configured
    if task.metric_names and metric not in task.metric_names:
        raise UserError(f"--metric {metric!r} is not a metric of task {ns.data.task}"
                        f"{closest(metric, task.metric_names)}; choose from: {', '.join(task.metric_names)}")
    if maximize is None:
        if metric == configured and ns.validation.maximize_best_checkpoint_metric is not None:
            maximize = bool(ns.validation.maximize_best_checkpoint_metric)
        else:
            maximize = higher_is_better(metric)
    return metric, maximize


def objective(results, metric):
    """best[metric] of a results.json, or None."""
    value = ((results or {}).get("best") or {}).get(metric)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


# ====================================================================== the space against the trainer
def typed_value(options, name, value):
    """A space value as its option's declaration types it (the trainer's
    parser: type, choices), without resolving a configuration. ``OPTION.KEY``
    (one key of a dict option) has no declaration of its own: as given."""
    import argparse
    action = options.actions.get(name)
    if action is None:
        return value
    try:
        if action.type is not None and action.type is not str and value is not None:
            value = action.type(value)
    except (TypeError, ValueError, OverflowError, argparse.ArgumentTypeError) as exc:
        raise UserError(f"option {name}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise UserError(f"option {name}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def space_candidates(space, options):
    """{parameter: [(value, typed value), ...]}: every finite value typed
    through its declaration (one pass, no configuration resolved); kept for
    the whole-configuration check are the values that can change its
    verdict: each distinct choice, a range's two ends (the trainer's checks
    of a number are bounds), and for a continuous parameter one draw."""
    import numpy as np

    from textbox_like.search.space import sample
    drawn = sample(space, [n for n, p in space.items() if not p.finite], np.random.default_rng(0))
    out = {}
    for name, p in space.items():
        values = p.values() if p.finite else [drawn[name]]
        typed = {}
        for v in values:
            try:
                typed.setdefault(repr(typed_value(options, name, v)), v)
            except UserError as exc:
                raise UserError(f"{p.where}: {p.label} = {v!r}: {exc}") from None
        kept = list(typed.values())
        out[name] = kept if p.kind in ("choice", "pchoice") else list(dict.fromkeys([kept[0], kept[-1]]))
    return out


def check_space(space, configs):
    """The space checked once against the typed configuration; returns the
    configuration resolved with the first value of each parameter. A value
    the trainer refuses is one line naming the space file and its line."""
    candidates = space_candidates(space, configs.options)
    first = {n: values[0] for n, values in candidates.items()}
    try:
        cfg = configs.resolve(first)
    except UserError as exc:
        raise blame(space, candidates, first, configs, exc) from None
    for name, values in candidates.items():
        for v in values[1:]:
            try:
                configs.resolve({**first, name: v})
            except UserError as exc:
                p = space[name]
                raise UserError(f"{p.where}: {p.label} = {v!r}: {exc}") from None
    return cfg


def blame(space, candidates, first, configs, error):
    """The first values together were refused: the parameter whose value is
    refused (the configuration passes without it, or with another of its
    values) is named with its line; else the base command line is at fault."""
    for name, p in space.items():
        others = {n: v for n, v in first.items() if n != name}
        for trial in [others] + [{**others, name: v} for v in candidates[name][1:]]:
            try:
                configs.resolve(trial)
            except UserError:
                continue
            return UserError(f"{p.where}: {p.label} = {first[name]!r}: {error}")
    return error


# ====================================================================== setup
def holds_checkpoint(save_dir) -> bool:
    """Whether a trial's directory holds a checkpoint of its own, of any kind,
    to resume from: file (.pt) or sharded (--fsdp's .dcp); a trial run with
    --no-last-checkpoints, or stopped in its first save, has interval ones
    only. A fresh start there would be refused as a rerun (and its
    metrics.jsonl deleted first)."""
    return bool(checkpoints_of_both_formats_newest_first(save_dir))


class Setup:
    """Everything checked before the first trial."""

    def __init__(self, space, search, base_argv, out=print):
        """``search``: the typed config.schema.SearchConfig of run_hyper.py."""
        self.space, self.search, self.algo, self.seed = space, search, canonical_algo(search.algo), int(search.seed)
        self.base_argv, self.output = list(base_argv), Path(search.output)
        self.parallel, self.gpus_per_trial, self.resume, self.out = \
            search.parallel, search.gpus_per_trial, search.resume, out
        max_evals = search.max_evals
        if max_evals is not None and max_evals < 1:
            raise UserError(f"--max_evals expects a positive integer, got {max_evals}")
        self.configs = TrialConfigs(self.base_argv)
        self.given = given = self.configs.given
        for name in ("save_dir", "no_save", "print_config", "disable_validation", "resume", "restore_file"):
            if name in given:
                hint = {"save_dir": "the search sets it per trial: use --output DIR",
                        "resume": "give --resume to run_hyper.py itself (it continues the search in --output)",
                        "restore_file": "trials start fresh or continue their own checkpoint_last.pt"}.get(
                    name, "the search needs each trial's results.json and validation metrics")
                raise UserError(f"--{name.replace('_', '-')} cannot be used here: {hint}")
        self.check_widths(space)
        both = sorted(given & set(space))
        if both:
            raise UserError(f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} both in the space file and on "
                            f"the command line; keep one (the command line would win in every trial)")
        self.sampler = Sampler(space, self.algo, self.seed)
        if self.algo == "exhaustive":
            size = self.sampler.grid_size
            if max_evals and max_evals < size:
                out(f"grid of {size} combinations; running the first {max_evals} (--max_evals)")
            self.max_evals = min(max_evals, size) if max_evals else size
        else:
            self.max_evals = max_evals or DEFAULT_EVALS
        ns = check_space(space, self.configs)
        if ns.validation.disable_validation or ns.checkpoint.no_save:
            raise UserError("the search needs validation metrics and results.json: "
                            "remove disable_validation / no_save from the configuration")
        self.metric, self.maximize = resolve_metric(ns, search.metric, search.maximize)
        self.ns = ns

    def check_widths(self, space):
        """TextBox's embedding_size is the model width: one line where the
        task's model has none."""
        task = None
        for name, p in space.items():
            if name.startswith("model_conf.") and p.label.replace("-", "_") == "embedding_size":
                task = task or self.configs.task()
                if task.width_key is None:
                    raise UserError(f"{p.where}: embedding_size: the {task.name} model has no embedding or width "
                                    f"to search (TextBox's embedding_size is the model width of --task bert, its "
                                    f"hidden_size); remove the line")
                if name != f"model_conf.{task.width_key}":
                    raise UserError(f"{p.where}: embedding_size: the {task.name} model's width is "
                                    f"model_conf.{task.width_key}; use that label")

    def trial_settings(self, params, save_dir, resume=False):
        """A trial's own trainer settings, on top of the base command line."""
        return {**params, "save_dir": str(save_dir), "best_checkpoint_metric": self.metric,
                "maximize_best_checkpoint_metric": self.maximize, **({"resume": True} if resume else {})}

    def state(self):
        return {"algo": self.algo, "seed": self.seed, "metric": self.metric, "maximize": self.maximize,
                "space": {n: p.expression() for n, p in self.space.items()}, "base_argv": self.base_argv}

    def print_space(self):
        self.out(f"space ({len(self.space)} parameter{'s' if len(self.space) != 1 else ''}, in real units):")
        for p in self.space.values():
            self.out("  " + p.describe())

    def check_output(self):
        """Fresh search: the output must hold none. --resume: the same search."""
        path = self.output / "hyper_results.jsonl"
        state_path = self.output / STATE_FILE
        if not self.resume:
            if path.exists() or state_path.exists():
                raise UserError(f"{self.output} already holds a search; continue it with --resume, or choose "
                                f"another --output")
            return []
        saved = read_json(state_path)
        if saved is None:
            self.out(f"--resume: no search in {self.output} yet; starting one")
            return []
        now = self.state()
        diff = [k for k in now if json.loads(json.dumps(now[k])) != saved.get(k)]
        if diff:
            raise UserError(f"--resume: the search in {self.output} was started with another "
                            f"{', '.join(diff)}; use the same arguments or another --output")
        return read_jsonl(path)


# ====================================================================== the local search
class Search:
    def __init__(self, setup: Setup, runner=None):
        self.s = setup
        self.out = setup.out
        self.runner = runner or SubprocessRunner()
        self.records = {}            # trial -> record
        self.queue = []              # trials to continue (resume)
        self.next_k = 1
        self.starts = {}

    # ------------------------------------------------------------ records
    def save(self):
        self.s.output.mkdir(parents=True, exist_ok=True)
        write_jsonl(self.s.output / "hyper_results.jsonl", [self.records[k].as_dict() for k in sorted(self.records)])

    def load(self, previous):
        """Resume: finished trials teach the sampler; unfinished ones are continued."""
        for rec in sorted(map(TrialRecord.from_dict, previous), key=lambda r: r.trial):
            k = rec.trial
            self.records[k] = rec
            if rec.status in DONE:
                self.s.sampler.replay(k, rec.vals or {}, rec.loss)
            else:
                self.s.sampler.replay(k, rec.vals or {}, None, running=True)
                self.queue.append(k)
        self.next_k = max(self.records, default=0) + 1
        done = sum(r.status in DONE for r in self.records.values())
        if self.records:
            self.out(f"--resume: {done} finished trial(s) kept, {len(self.queue)} to continue "
                     f"({', '.join(map(str, self.queue)) or 'none'}), {max(0, self.s.max_evals - len(self.records))} "
                     f"new")

    # ------------------------------------------------------------ pool callbacks
    def next_job(self):
        if self.queue:
            k = self.queue.pop(0)
            rec = self.records[k]
            resume = True
        elif self.next_k <= self.s.max_evals:
            k = self.next_k
            self.next_k += 1
            params, vals = self.s.sampler.ask(k)
            rec = self.records[k] = TrialRecord(k, params, str(self.s.output / f"trial_{k}"), self.s.metric, vals)
            resume = False
        else:
            return None
        rec.status = "running"
        save_dir = Path(rec.save_dir)
        resume = resume and holds_checkpoint(save_dir)
        for stale in ["results.json"] + ([] if resume else ["metrics.jsonl"]):
            if (save_dir / stale).exists():
                (save_dir / stale).unlink()
        self.save()
        return Job(k, self.s.trial_settings(rec.params, save_dir, resume=resume), save_dir)

    def on_start(self, job, handle):
        rec = self.records[job.key]
        rec.attempts += 1
        self.starts[job.key] = time.time()
        self.save()

    def on_done(self, job, outcome):
        rec = self.records[job.key]
        elapsed = time.time() - self.starts.pop(job.key, time.time())
        rec.update(wall_time=round((rec.wall_time or 0.0) + elapsed, 3), returncode=outcome.returncode)
        if outcome.interrupted:
            rec.update(status="interrupted", error="interrupted; continue with --resume")
            self.save()
            self._line(rec)
            return
        results = read_json(Path(job.save_dir) / "results.json") if outcome.returncode == 0 else None
        rec.take_results(results)
        value = objective(results, self.s.metric)
        rec.score(value, self.s.maximize)
        if value is not None:
            rec.update(status="ok", error="")
        else:
            rec.update(status="fail",
                       error=outcome.error or (f"results.json has no finite best[{self.s.metric!r}]"
                                               if results is not None else "the run wrote no results.json"))
        self.s.sampler.tell(job.key, rec.loss)
        self.save()
        self._line(rec)

    def _line(self, rec):
        head = f"trial {rec.trial}/{self.s.max_evals} | {format_params(rec.params)} | "
        if rec.status in ("ok", "stopped"):
            tail = f"{self.s.metric} {rec.value:.4f}" + (" (stopped early)" if rec.status == "stopped" else "")
            self.out(head + f"{tail} | {rec.wall_time:.1f}s")
        elif rec.status == "interrupted":
            self.out(head + "interrupted")
        else:
            self.out(head + f"FAILED (exit {rec.returncode}): {rec.error}")

    # ------------------------------------------------------------ run
    def run(self, slots):
        """Returns True if interrupted."""
        try:
            run_pool(self.s.configs, self.next_job, self.on_start, self.on_done, slots, self.runner)
        except KeyboardInterrupt:
            return True
        return False


# ====================================================================== summary
def best_record(records, maximize):
    ok = [r for r in records if r.get("status") == "ok" and r.get("value") is not None]
    if not ok:
        return None
    return min(ok, key=lambda r: ((-r["value"]) if maximize else r["value"], r["trial"]))


def finish(setup, records, interrupted, backend="local"):
    """Writes hyper_results.jsonl/.csv, hyper_best.json, hyper_report.png; prints the table."""
    out, output = setup.out, setup.output
    records = sorted((r.as_dict() for r in records), key=lambda r: r["trial"])
    best = best_record(records, setup.maximize)
    count = {s: sum(r.get("status") == s for r in records) for s in ("ok", "fail", "stopped", "interrupted")}
    data = {"metric": setup.metric, "maximize": setup.maximize, "algo": setup.algo, "seed": setup.seed,
            "backend": backend, "n_trials": len(records), "n_ok": count["ok"], "n_failed": count["fail"],
            "n_stopped": count["stopped"], "n_interrupted": count["interrupted"], "interrupted": interrupted,
            "value": best["value"] if best else None, "params": best["params"] if best else None,
            "trial": best["trial"] if best else None, "save_dir": best["save_dir"] if best else None,
            "command": None, "best": best.get("best") if best else None,
            "final": best.get("final") if best else None}
    if best:
        try:
            data["command"] = (Path(best["save_dir"]) / "command.txt").read_text().strip()
        except OSError:
            pass
    output.mkdir(parents=True, exist_ok=True)
    names = list(setup.space)
    write_jsonl(output / "hyper_results.jsonl", records)
    write_json(output / "hyper_best.json", data)
    write_search_csv(output / "hyper_results.csv", records, names, setup.metric)
    try:
        search_png(output / "hyper_report.png", records, setup.space, setup.metric, setup.maximize)
        png = ", hyper_report.png"
    except Exception as exc:         # a figure must not cost the results
        out(f"warning: hyper_report.png not written: {type(exc).__name__}: {exc}")
        png = ""
    out("")
    out(search_table(records, names, setup.metric, data["trial"]))
    if interrupted:
        out("interrupted: continue with the same command and --resume")
    if best is None:
        out(f"no trial succeeded ({count['fail']} failed); see {output}/hyper_results.jsonl")
    else:
        out(f"best: trial {best['trial']} | {setup.metric} {best['value']:.4f} | {format_params(best['params'])} "
            f"| {best['save_dir']}")
    out(f"wrote {output}/: hyper_results.jsonl, hyper_results.csv, hyper_best.json{png}")
    code = INTERRUPTED if interrupted else (0 if best is not None else 1)
    return code, data


def run_search(space, algo="random", max_evals=None, seed=1, base_argv=(), output="checkpoints/hyper",
               metric=None, maximize=None, runner=None, out=print, parallel=1, gpus_per_trial=0, resume=False):
    """The search from Python, with run_hyper.py's options as arguments."""
    from textbox_like.config.schema import SearchConfig
    search = SearchConfig.for_command("run_hyper.py", algo=algo, max_evals=max_evals, seed=seed, output=str(output),
                                      metric=metric, maximize=maximize, parallel=parallel,
                                      gpus_per_trial=gpus_per_trial, resume=resume)
    from textbox_like.search.trials import output_locked
    with output_locked(search.output):
        return search_locally(space, search, base_argv, runner, out)


def search_locally(space, search, base_argv=(), runner=None, out=print):
    """Validate, run the search on this machine, write the reports. Returns (exit code, summary)."""
    setup = Setup(space, search, base_argv, out)
    previous = setup.check_output()
    slots = plan_slots(setup.parallel, setup.gpus_per_trial, setup.given, out)
    setup.print_space()
    setup.output.mkdir(parents=True, exist_ok=True)
    write_json(setup.output / STATE_FILE, setup.state())
    run = Search(setup, runner)
    run.load(previous)
    out(f"search: {setup.algo}, {setup.max_evals} trials, {'maximize' if setup.maximize else 'minimize'} "
        f"{setup.metric}, {setup.parallel} at a time, output {setup.output}")
    interrupted = run.run(slots)
    return finish(setup, list(run.records.values()), interrupted)
