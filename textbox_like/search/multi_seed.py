"""One configuration over several seeds: the runs (in parallel if asked), the
statistics (scipy.stats) and the reports."""
from __future__ import annotations

import random
import time
from pathlib import Path

from textbox_like.core.errors import UserError
from textbox_like.search.hyper import INTERRUPTED, resolve_metric
from textbox_like.search.report import describe, fmt, seed_png, seed_table, summarize_runs, write_seed_csv
from textbox_like.search.trials import (
    Job,
    SubprocessRunner,
    TrialConfigs,
    TrialRecord,
    plan_slots,
    read_json,
    run_pool,
    write_json)

#: TextBox's draw, random.randint(0, 2**32 - 1): every drawn seed is one the trainer's --seed takes
#: (config.seed_int, the one check of a seed, also of --seeds and --seed here)
TEXTBOX_DRAW_MAX = 2 ** 32 - 1

#: trainer options a seed run sets itself
NOT_HERE = (("seed", "use --seed S with --multi_seed N (seeds drawn from S), or --seeds 3,7,11"),
            ("save_dir", "use --output DIR"), ("no_save", "each run's results.json is needed"),
            ("print_config", "run run_hetseq.py --print_config instead"))


def draw_seeds(n, seed):
    """N distinct seeds from a generator seeded with ``seed`` (TextBox: random.seed(seed), then randint)."""
    rng = random.Random(seed)
    seeds = []
    while len(seeds) < n:
        s = rng.randint(0, TEXTBOX_DRAW_MAX)
        if s not in seeds:
            seeds.append(s)
    return seeds


def plan_seeds(search, base_argv, out=print):
    """The base command line checked and resolved once, and the seeds:
    (TrialConfigs, the resolved RunConfig, seeds). ``search``: the typed
    config.schema.SearchConfig of run_multi_seed.py."""
    configs = TrialConfigs(list(base_argv))
    for name, hint in NOT_HERE:
        if name in configs.given:
            raise UserError(f"--{name.replace('_', '-')} cannot be used here: {hint}")
    ns = configs.resolve()
    if ns.checkpoint.no_save:
        raise UserError("each run's results.json is needed: remove no_save from the configuration")
    if search.seeds is not None:
        seeds = list(search.seeds)
    else:
        base = search.seed if search.seed is not None else ns.numerics.seed
        seeds = draw_seeds(search.multi_seed, base)
        out(f"seeds: {', '.join(map(str, seeds))} ({search.multi_seed} drawn from seed {base})")
    refuse_earlier_runs(search.output, seeds)
    return configs, ns, seeds


def refuse_earlier_runs(output, seeds):
    """Every seed starts afresh in ``output/seed_<seed>``: a directory that
    holds an earlier run of that seed is refused before any seed starts (the
    trainer would refuse it alone, after the others had run)."""
    from textbox_like.storage.sharded_checkpoint import run_held_in
    for seed in seeds:
        held = run_held_in(Path(output) / f"seed_{seed}")
        if held:
            raise UserError(f"--output {output} already holds a run of seed {seed} in seed_{seed} ({held}); "
                            f"choose another --output, or remove the earlier runs")


def run_multi_seed(seeds, base_argv=(), output="checkpoints/multi_seed", metric=None, maximize=None,
                   runner=None, out=print, parallel=1, gpus_per_trial=0):
    """These seeds from Python, with run_multi_seed.py's options as arguments; returns (exit code, summary)."""
    from textbox_like.config.schema import SearchConfig
    search = SearchConfig.for_command("run_multi_seed.py", seeds=list(seeds), output=str(output), metric=metric,
                                      maximize=maximize, parallel=parallel, gpus_per_trial=gpus_per_trial)
    from textbox_like.search.trials import output_locked
    with output_locked(search.output):
        return seeds_locally(search, base_argv, runner, out)


def seeds_locally(search, base_argv=(), runner=None, out=print):
    """Runs every seed on this machine; returns (exit code, summary dict)."""
    configs, ns, seeds = plan_seeds(search, base_argv, out)
    given, parallel = configs.given, search.parallel
    metric, maximize = resolve_metric(ns, search.metric, search.maximize)
    output = Path(search.output)
    output.mkdir(parents=True, exist_ok=True)
    slots = plan_slots(parallel, search.gpus_per_trial, given, out)
    chosen = {"best_checkpoint_metric": metric, "maximize_best_checkpoint_metric": maximize}
    out(f"multi-seed: {len(seeds)} seeds {', '.join(map(str, seeds))} | {metric} "
        f"({'max' if maximize else 'min'}) | {parallel} at a time | output {output}")
    todo = list(seeds)
    runs, starts = {}, {}

    def next_job():
        if not todo:
            return None
        seed = todo.pop(0)
        save_dir = output / f"seed_{seed}"
        for stale in ("results.json", "metrics.jsonl"):
            if (save_dir / stale).exists():
                (save_dir / stale).unlink()
        return Job(seed, {"save_dir": str(save_dir), "seed": seed, **chosen}, save_dir)

    def on_start(job, handle):
        starts[job.key] = time.time()

    def on_done(job, outcome):
        seed = job.key
        run = TrialRecord(None, {}, str(job.save_dir), metric, seed=seed, returncode=outcome.returncode,
                          error=outcome.error, wall_time=round(time.time() - starts.pop(seed, time.time()), 3))
        results = read_json(Path(job.save_dir) / "results.json") if outcome.returncode == 0 else None
        i = len(runs) + 1
        if outcome.interrupted:
            run.update(status="interrupted", error="interrupted")
            out(f"seed {seed} | interrupted")
        elif results is not None:
            run.update(status="ok")
            run.take_results(results)
            out(f"seed {seed} ({i}/{len(seeds)}) | final {metric} {fmt(run.final.get(metric))} | best {metric} "
                f"{fmt(run.best.get(metric))} | {run.wall_time:.1f}s")
        else:
            run.update(status="fail", error=outcome.error or "the run wrote no results.json")
            out(f"seed {seed} ({i}/{len(seeds)}) | FAILED (exit {outcome.returncode}): {run.error}")
        runs[seed] = run.as_dict()

    interrupted = False
    try:
        run_pool(configs, next_job, on_start, on_done, slots, runner or SubprocessRunner())
    except KeyboardInterrupt:
        interrupted = True
    ordered = [runs[s] for s in seeds if s in runs]
    return summarize_and_report(seeds, ordered, output, metric, maximize, interrupted, out)


def summarize_and_report(seeds, ordered, output, metric, maximize, interrupted, out=print):
    """Statistics over the runs that succeeded; summary JSON, CSV, PNG, table. Returns (code, summary)."""
    output = Path(output)
    done = {r["seed"] for r in ordered}
    ok = [r for r in ordered if r["status"] == "ok"]
    failed = [{"seed": r["seed"], "returncode": r.get("returncode"), "error": r.get("error")}
              for r in ordered if r["status"] != "ok"]
    stats = summarize_runs(ok)
    summary = {"metric": metric, "maximize": maximize, "seeds": list(seeds), "ok_seeds": [r["seed"] for r in ok],
               "failed": failed, "not_run": [s for s in seeds if s not in done], "interrupted": interrupted,
               "final": stats["final"], "best": stats["best"], "runs": ordered}
    write_json(output / "multi_seed_summary.json", summary)
    write_seed_csv(output / "multi_seed_summary.csv", stats)
    png = ""
    if ok:
        try:
            seed_png(output / "multi_seed_curves.png", [r["save_dir"] for r in ok], metric, [r["seed"] for r in ok])
            png = ", multi_seed_curves.png"
        except Exception as exc:
            out(f"warning: multi_seed_curves.png not written: {type(exc).__name__}: {exc}")
    out("")
    out(f"{len(ok)} of {len(seeds)} runs succeeded" +
        (f"; failed seeds: {', '.join(str(f['seed']) for f in failed)}" if failed else ""))
    if ok:
        out(seed_table(stats))
    out(f"wrote {output}/: multi_seed_summary.json, multi_seed_summary.csv{png}")
    if interrupted:
        return INTERRUPTED, summary
    return (1 if failed or not ok else 0), summary


__all__ = ["describe", "draw_seeds", "run_multi_seed", "summarize_runs"]
