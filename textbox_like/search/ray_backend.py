"""The same search and seeds on Ray Tune (``--backend ray``): a local Ray
instance or a cluster (``--ray-address``), HyperOptSearch for tpe/random/anneal,
the grid for exhaustive, ASHA early stopping fed by every validation of every
trial, retries that resume from the trial's own ``checkpoint_last.pt``.

Each Tune trial runs the trainer as a child process (as the local backend) in
``OUTPUT/trial_<k>`` (``OUTPUT/seed_<s>`` for seeds), tails its
``metrics.jsonl`` and calls ``tune.report`` on every validation event. Tune's
own files go under ``OUTPUT/ray/``; the search's files and reports are the
local backend's. Trial numbers are claimed on the (shared) file system:
``OUTPUT/ray_trials/<tune trial id>`` holds the number, so a retried trial,
on whatever node, continues in its own directory.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from textbox_like.config.files import write_resolved
from textbox_like.resolve.resolution import read_resolved
from textbox_like.processes.distributed import usable_cpus
from textbox_like.core.errors import UserError, first_line
from textbox_like.storage.fileio import atomic_write_text
from textbox_like.core.internals import ray_init_local
from textbox_like.search.algos import plain_value
from textbox_like.search.hyper import Setup, finish, holds_checkpoint, objective
from textbox_like.search.trials import (
    TRIAL_CONFIG,
    Handle,
    TrialConfigs,
    TrialRecord,
    read_json,
    read_jsonl,
    write_json)

INSTALL = 'pip install -e ".[ray]"  (or: pip install "ray[tune]")'
USER_ERROR = 2


def require_ray():
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError as exc:
        raise UserError(f"--backend ray needs Ray Tune, which is not installed ({exc.name or exc}): "
                        f"{INSTALL}") from None


# ====================================================================== cluster
def _check_address(address):
    if address in (None, "auto") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        port = int(port)
    except ValueError:
        raise UserError(f"--ray-address {address!r}: expected auto or HOST:PORT, like 10.0.0.1:6379") from None
    try:
        with socket.create_connection((host or "127.0.0.1", port), timeout=5):
            pass
    except OSError as exc:
        raise UserError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the head "
                        f"with 'ray start --head --port={port}' or check the address") from None


def start_ray(address, root, out=print):
    """ray.init on a cluster (address) or a local instance; returns the module."""
    require_ray()
    _check_address(address)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")         # no progress tables on stdout (verbose=0)
    if address and "RAY_AUTH_MODE" not in os.environ and Path("~/.ray/auth_token").expanduser().exists():
        os.environ["RAY_AUTH_MODE"] = "token"     # `ray start --head` (Ray >= 2.5x) enables token authentication
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    import ray
    env = {"PYTHONPATH": str(root) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                      else "")}
    kwargs = dict(runtime_env={"env_vars": env}, log_to_driver=False, configure_logging=True,
                  logging_level="ERROR")
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            temp = os.environ.get("TEXTBOX_LIKE_RAY_TMP", f"/tmp/ray_tbl_{os.getuid()}")
            # address="local": a new instance even when `ray start` runs a cluster on this machine
            ray_init_local(ray, temp, num_cpus=usable_cpus(), include_dashboard=False, **kwargs)
    except Exception as exc:                  # ConnectionError, AuthenticationError, RuntimeError ...
        first = first_line(exc, 200)
        if "auth" in first.lower():
            first += " (Ray's token authentication: export RAY_AUTH_MODE=token with the head's ~/.ray/auth_token)"
        raise UserError(f"--ray-address {address or '(local)'}: cannot join Ray: {first}") from None
    resources = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    out(f"ray: {'joined ' + address if address else 'local instance'}, {len(nodes)} node(s), "
        f"{resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU")
    return ray


def trial_resources(ray, parallel, cpus_per_trial, gpus_per_trial):
    total = ray.cluster_resources()
    gpus = total.get("GPU", 0)
    if gpus_per_trial and gpus < gpus_per_trial:
        raise UserError(f"--gpus-per-trial {gpus_per_trial}: the Ray cluster has {gpus:g} GPU(s); "
                        f"leave it out to run on CPU")
    cpus = cpus_per_trial or max(1.0, float(int(total.get("CPU", 1) // parallel)))
    if cpus > total.get("CPU", 0):
        raise UserError(f"--cpus-per-trial {cpus:g}: the Ray cluster has {total.get('CPU', 0):g} CPU(s)")
    return {"cpu": cpus, "gpu": gpus_per_trial}


# ====================================================================== the trial function
def claim_dir(output, trial_id, fixed=None):
    """This Tune trial's directory: fixed (grid, seeds) or the next free trial_<k>, remembered per trial id."""
    ids = Path(output) / "ray_trials"
    ids.mkdir(parents=True, exist_ok=True)
    mine = ids / trial_id
    if mine.exists():
        return Path(output) / mine.read_text().strip()
    name = fixed
    if name is None:
        k = 1
        while True:
            try:
                os.mkdir(Path(output) / f"trial_{k}")
                break
            except FileExistsError:
                k += 1
        name = f"trial_{k}"
    atomic_write_text(mine, name + "\n")
    return Path(output) / name


class TrialPreparer:
    """In the driver: a Tune trial's directory claimed and its configuration
    resolved once, from the base command line and its parameters, and
    written there (trial_config.yaml, command.txt); the trial runs it as it
    is. ``spec``: plain data (Tune pickles this with the searcher)."""

    def __init__(self, spec):
        self.spec = spec
        self._configs = None

    def __getstate__(self):
        return {"spec": self.spec, "_configs": None}

    def __call__(self, trial_id, config):
        """A suggestion of the searcher: its directory and, if the trainer refuses it, the error."""
        save_dir = claim_dir(self.spec["output"], trial_id, config.get("__dir__"))
        params = {n: plain_value(config[n]) for n in self.spec["names"]}
        return {"__dir__": save_dir.name, "__refused__": self.prepare(save_dir, params)}

    def prepare(self, save_dir, params):
        """Writes the trial's resolved configuration; returns None, or the error line of a refused one."""
        if self._configs is None:
            self._configs = TrialConfigs(self.spec["base_argv"])
        settings = {**params, **self.spec["settings"], "save_dir": str(save_dir)}
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(save_dir) / "command.txt", self._configs.command(settings) + "\n")
        try:
            cfg = self._configs.resolve(settings)
        except UserError as exc:                    # a sampled value the trainer refuses
            atomic_write_text(Path(save_dir) / "stderr.log", f"error: {exc}\n")
            return f"error: {exc}"
        write_resolved(cfg, Path(save_dir) / TRIAL_CONFIG)
        return None


def make_trainable(spec):
    """spec: plain data (output, cwd, metric, maximize, names, threads). Each
    trial runs the configuration the driver resolved for it (TrialPreparer)."""

    def trainable(config):
        import ray
        from ray import tune
        ctx = tune.get_context()
        trial_id = ctx.get_trial_id()
        save_dir = claim_dir(spec["output"], trial_id, config.get("__dir__"))
        save_dir.mkdir(parents=True, exist_ok=True)
        params = {n: plain_value(config[n]) for n in spec["names"]}
        resume = holds_checkpoint(save_dir)
        (save_dir / "ray_stopped").unlink(missing_ok=True)  # an earlier attempt's, stopped with its search
        if not resume:
            for stale in ("results.json", "metrics.jsonl"):
                if (save_dir / stale).exists():
                    (save_dir / stale).unlink()
        info = read_json(save_dir / "ray_trial.json") or {"trial_id": trial_id, "params": params,
                                                          "key": config.get("__key__"), "attempts": []}
        info["attempts"].append({"node_id": ray.get_runtime_context().get_node_id(),
                                 "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                                 "start": time.time(), "resume": resume})
        write_json(save_dir / "ray_trial.json", info)
        env = {"OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}
        os.chdir(spec["cwd"])                       # relative --data etc. mean what they meant to the user
        if config.get("__refused__"):
            info["attempts"][-1].update(end=time.time(), returncode=2)
            write_json(save_dir / "ray_trial.json", info)
            raise RuntimeError(f"trainer refused its configuration (exit 2): {config['__refused__']}")
        cfg = read_resolved(save_dir / TRIAL_CONFIG)
        if resume:
            cfg = cfg.replace(resume=True)
        handle = Handle(cfg, save_dir, env)
        metric, seen, best = spec["metric"], 0, None
        stopped = True
        try:
            while True:
                outcome = handle.poll()
                records = read_jsonl(save_dir / "metrics.jsonl")
                for rec in records[seen:]:
                    if str(rec.get("kind", "")).startswith("valid") and isinstance(rec.get(metric), (int, float)):
                        v = float(rec[metric])
                        best = v if best is None or (v > best if spec["maximize"] else v < best) else best
                        tune.report({metric: v, "update": int(rec.get("update", 0)), "best_so_far": best})
                seen = len(records)
                if outcome is not None:
                    break
                time.sleep(0.3)
            stopped = False
        finally:
            if stopped:                              # Tune stopped us (ASHA) or the actor is going down
                handle.stop()
                try:
                    handle.wait(timeout=60)
                except Exception:
                    handle.kill()
                atomic_write_text(save_dir / "ray_stopped", "stopped by Ray Tune\n")
        info["attempts"][-1].update(end=time.time(), returncode=outcome.returncode)
        write_json(save_dir / "ray_trial.json", info)
        if outcome.returncode != 0:                  # crashed or killed: Tune retries (--max-failures)
            raise RuntimeError(f"trainer exited with code {outcome.returncode}: {outcome.error}")
        results = read_json(save_dir / "results.json") or {}
        value = objective(results, metric)
        if value is None:
            raise RuntimeError(f"results.json has no finite best[{metric!r}]")
        tune.report({metric: value, "update": int(results.get("num_updates") or 0), "done_training": 1})

    return trainable


# ====================================================================== records from the trial directories
def tune_outcomes(grid):
    """Tune trial id -> ('error', message) | ('stopped', None) | ('done', None), from Ray's records."""
    hints = {}
    if grid is None:
        return hints
    for result in grid:
        metrics = result.metrics or {}
        tid = metrics.get("trial_id") or Path(result.path).name.split("_")[-1]
        if result.error is not None:
            lines = str(result.error).strip().splitlines() or ["error"]
            hints[tid] = ("error", next((line.strip() for line in lines if "exited with code" in line
                                         or "refused its configuration" in line or "no finite best" in line),
                                        lines[-1])[:300])
        elif metrics.get("done_training"):
            hints[tid] = ("done", None)
        else:
            hints[tid] = ("stopped", None)
    return hints


def record_of(save_dir, k, metric, maximize, hint=None):
    """The TrialRecord of a Tune trial, from its directory and Tune's outcome."""
    info = read_json(save_dir / "ray_trial.json") or {}
    results = read_json(save_dir / "results.json")
    attempts = info.get("attempts", [])
    rec = TrialRecord(k, info.get("params") or {}, str(save_dir), metric, status="fail", attempts=len(attempts),
                      trial_id=info.get("trial_id"), nodes=[a.get("node_id") for a in attempts])
    if attempts:
        rec.returncode = attempts[-1].get("returncode")
        last_write = max((f.stat().st_mtime for f in (save_dir / "metrics.jsonl", save_dir / "stderr.log")
                          if f.exists()), default=time.time())   # a stopped trial's process has no "end"
        rec.wall_time = round(sum((a.get("end") or max(last_write, a["start"])) - a["start"]
                                  for a in attempts), 3)
    value = objective(results, metric)
    completed = results is not None and results.get("stopped") == "completed"
    rec.take_results(results)
    # Tune records a trial stopped by ASHA and one stopped with its search
    # (Ctrl+C) alike; ASHA marks its own (see ray_asha)
    by_asha = bool(rec.trial_id) and (save_dir.parent / "ray_trials" / f"{rec.trial_id}.asha_stopped").exists()
    stopped = (hint or ("",))[0] == "stopped" or (hint is None and ((save_dir / "ray_stopped").exists() or
                                                                    (results is not None and not completed)))
    if completed and value is not None:
        rec.status = "ok"
    elif stopped and not by_asha:
        rec.update(status="interrupted", error="interrupted: continue with --resume")
        value = None
    elif stopped:
        valids = [r for r in read_jsonl(save_dir / "metrics.jsonl")
                  if str(r.get("kind", "")).startswith("valid") and isinstance(r.get(metric), (int, float))]
        if valids:
            value = max(r[metric] for r in valids) if maximize else min(r[metric] for r in valids)
            rec.update(status="stopped", num_updates=valids[-1].get("update"), final=valids[-1],
                       error="stopped early by ASHA")
        else:
            rec.update(status="fail", error="stopped before its first validation")
            value = None
    else:
        err = (save_dir / "stderr.log")
        lines = [line for line in err.read_text(errors="replace").splitlines() if line.strip()] \
            if err.exists() else []
        rec.error = (hint[1] if hint and hint[1] else None) or next(
            (line for line in reversed(lines) if line.startswith("error:")), lines[-1][:300] if lines else "no result")
        value = None
    rec.score(value, maximize)
    return rec


# ====================================================================== search
def _searcher(setup, hspace, prepare):
    from functools import partial

    from hyperopt import anneal, rand, tpe

    from textbox_like.search.ray_searcher import ResolvingHyperOptSearch
    searcher = ResolvingHyperOptSearch(prepare, space=hspace, metric=setup.metric,
                                       mode="max" if setup.maximize else "min", random_state_seed=setup.seed)
    searcher.algo = {"random": rand.suggest, "anneal": anneal.suggest,
                     "tpe": partial(tpe.suggest, n_startup_jobs=20)}[setup.algo]
    return searcher


def ray_search(space, search, rest, out=print):
    """run_hyper.py --backend ray; ``search``: its typed config.schema.SearchConfig."""
    from textbox_like.search.trials import ROOT
    if search.algo and search.algo.strip().lower() in ("atpe", "atpe.suggest", "hyperopt.atpe.suggest"):
        raise UserError("--backend ray runs exhaustive, random, tpe and anneal (HyperOptSearch); "
                        "use --backend local for atpe")
    require_ray()
    setup = Setup(space, search, rest, out)
    previous = setup.check_output()
    if previous and not (setup.output / "ray").exists():
        raise UserError(f"--resume: the search in {setup.output} ran on another backend; resume it with that one")
    ray = start_ray(search.ray_address, ROOT, out)
    try:
        return _ray_search(ray, setup, out)
    finally:
        ray.shutdown()


def _common_spec(setup_output, base_argv, metric, maximize, names, resources):
    """What every trial function needs, as plain data (Ray pickles it to its workers)."""
    threads = max(1, int(resources["cpu"]))
    settings = {"best_checkpoint_metric": metric, "maximize_best_checkpoint_metric": maximize}
    if resources["gpu"] and resources["gpu"] > 1:
        settings["distributed_world_size"] = int(resources["gpu"])
    return {"output": str(Path(setup_output).resolve()), "cwd": os.getcwd(), "base_argv": list(base_argv),
            "metric": metric, "maximize": maximize, "names": list(names), "threads": threads, "settings": settings}


def _tune_run(ray, trainable, resources, param_space, tune_config, output, max_failures, resume, out):
    from ray import tune
    storage = str(Path(output).resolve())
    path = Path(storage) / "ray"
    trainable = tune.with_resources(trainable, resources)
    if resume and tune.Tuner.can_restore(str(path)):
        out(f"--resume: continuing the Ray search in {path}")
        tuner = tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        run_config = tune.RunConfig(name="ray", storage_path=storage, verbose=0,
                                    failure_config=tune.FailureConfig(max_failures=max_failures))
        tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)
    try:
        return tuner.fit(), False
    except KeyboardInterrupt:
        return None, True


def _ray_search(ray, setup, out):
    from ray import tune
    from textbox_like.search.ray_asha import MarkingASHA
    search = setup.search
    resources = trial_resources(ray, setup.parallel, search.cpus_per_trial, search.gpus_per_trial)
    setup.print_space()
    setup.output.mkdir(parents=True, exist_ok=True)
    write_json(setup.output / "hyper_search.json", setup.state())
    spec = _common_spec(setup.output, setup.base_argv, setup.metric, setup.maximize, setup.space, resources)
    prepare = TrialPreparer(spec)
    mode = "max" if setup.maximize else "min"
    scheduler, grace = None, None
    if search.scheduler == "asha":
        grace = search.grace_updates or setup.ns.validation.validate_interval_updates or 1
        # max_t beyond the last update: a trial that trains to the end is never stopped at its last validation
        max_t = (setup.ns.schedule.max_update or 10 ** 9) + 1
        scheduler = MarkingASHA(setup.output.resolve(), time_attr="update", grace_period=grace,
                                max_t=max(max_t, grace + 1), reduction_factor=2)
    if setup.algo == "exhaustive":
        points = []
        for k in range(1, setup.max_evals + 1):
            params, _ = setup.sampler.ask(k)
            refused = prepare.prepare(setup.output.resolve() / f"trial_{k}", params)
            points.append({**params, "__dir__": f"trial_{k}", "__key__": k, "__refused__": refused})
        param_space = {"__point__": tune.grid_search(points)}
        trainable = _unpack_point(make_trainable(spec), list(setup.space))
        tune_config = tune.TuneConfig(metric=setup.metric, mode=mode, num_samples=1, scheduler=scheduler,
                                      max_concurrent_trials=setup.parallel)
    else:
        hspace = {n: p.hyperopt() for n, p in setup.space.items()}
        trainable = make_trainable(spec)
        param_space = None
        tune_config = tune.TuneConfig(search_alg=_searcher(setup, hspace, prepare), scheduler=scheduler,
                                      metric=setup.metric, mode=mode, num_samples=setup.max_evals,
                                      max_concurrent_trials=setup.parallel)
    out(f"search: {setup.algo} on Ray Tune, {setup.max_evals} trials, {mode}imize {setup.metric}, "
        f"{setup.parallel} at a time, {resources['cpu']:g} CPU + {resources['gpu']:g} GPU each"
        + (f", ASHA (grace {grace} updates)" if scheduler else "") + f", output {setup.output}")
    grid, interrupted = _tune_run(ray, trainable, resources, param_space or {}, tune_config, setup.output,
                                  search.max_failures, search.resume, out)
    hints = tune_outcomes(grid)
    # Tune returns from fit() normally after Ctrl+C (it catches SIGINT and
    # saves its state): fewer trials than asked for, or one stopped with it
    interrupted = interrupted or grid is None or len(grid) < setup.max_evals
    records = []
    for d in sorted(setup.output.glob("trial_*"), key=lambda p: int(p.name.split("_")[1])):
        if not (d / "ray_trial.json").exists():
            continue
        info = read_json(d / "ray_trial.json") or {}
        rec = record_of(d, int(d.name.split("_")[1]), setup.metric, setup.maximize,
                        hints.get(info.get("trial_id")))
        records.append(rec)
    interrupted = interrupted or any(rec.status == "interrupted" for rec in records)
    for rec in records:
        if interrupted and rec.status == "fail" and not (Path(rec.save_dir) / "results.json").exists():
            rec.status = "interrupted"
        line = f"trial {rec.trial} | {' '.join(f'{k}={v}' for k, v in rec.params.items())} | {rec.status}"
        out(line + (f" | {setup.metric} {rec.value:.4f}" if rec.value is not None else f" | {rec.error}")
            + (f" | attempts {rec.attempts}" if rec.attempts > 1 else ""))
    code, data = finish(setup, records, interrupted, backend="ray")
    return code, data


def _unpack_point(trainable, names):
    def unpacked(config):
        point = dict(config["__point__"])
        return trainable({**{n: point[n] for n in names}, "__dir__": point["__dir__"], "__key__": point["__key__"],
                          "__refused__": point["__refused__"]})
    unpacked.__name__ = "trainer"
    return unpacked


# ====================================================================== seeds
def ray_multi_seed(search, rest, out=print):
    """run_multi_seed.py --backend ray; ``search``: its typed config.schema.SearchConfig."""
    from ray import tune

    from textbox_like.search.hyper import resolve_metric
    from textbox_like.search.multi_seed import plan_seeds, summarize_and_report
    from textbox_like.search.trials import ROOT
    require_ray()
    _, ns, seeds = plan_seeds(search, rest, out)
    metric, maximize = resolve_metric(ns, search.metric, search.maximize)
    output = Path(search.output)
    ray = start_ray(search.ray_address, ROOT, out)
    try:
        resources = trial_resources(ray, search.parallel, search.cpus_per_trial, search.gpus_per_trial)
        output.mkdir(parents=True, exist_ok=True)
        spec = _common_spec(output, rest, metric, maximize, ["seed"], resources)
        prepare = TrialPreparer(spec)
        points = [{"seed": s, "__dir__": f"seed_{s}", "__key__": s,
                   "__refused__": prepare.prepare(output.resolve() / f"seed_{s}", {"seed": s})} for s in seeds]
        trainable = _unpack_point(make_trainable(spec), ["seed"])
        mode = "max" if maximize else "min"
        out(f"multi-seed on Ray Tune: {len(seeds)} seeds | {metric} ({mode}) | {search.parallel} at a time | "
            f"output {output}")
        tune_config = tune.TuneConfig(metric=metric, mode=mode, num_samples=1,
                                      max_concurrent_trials=search.parallel)
        grid, interrupted = _tune_run(ray, trainable, resources, {"__point__": tune.grid_search(points)},
                                      tune_config, output, search.max_failures, False, out)
        # no ASHA here: a trial Tune stopped was stopped with the search (Ctrl+C)
        interrupted = interrupted or grid is None or len(grid) < len(seeds) or any(
            h[0] == "stopped" for h in tune_outcomes(grid).values())
    finally:
        ray.shutdown()
    runs = []
    for s in seeds:
        d = output / f"seed_{s}"
        results = read_json(d / "results.json")
        info = read_json(d / "ray_trial.json") or {}
        attempts = info.get("attempts", [])
        wall = round(sum((a.get("end") or time.time()) - a["start"] for a in attempts), 3) if attempts else None
        run = TrialRecord(None, {}, str(d), metric, seed=s, wall_time=wall, attempts=len(attempts))
        if results is not None and results.get("stopped") == "completed":
            run.update(status="ok", returncode=0)
            run.take_results(results)
            out(f"seed {s} | final {metric} {run.final.get(metric)} | {wall}s")
        elif attempts:
            run.update(status="interrupted" if interrupted else "fail", returncode=attempts[-1].get("returncode"),
                       error="interrupted" if interrupted else "the run did not complete")
            out(f"seed {s} | FAILED: {run.error}")
        else:
            continue
        runs.append(run.as_dict())
    code, summary = summarize_and_report(seeds, runs, output, metric, maximize, interrupted, out)
    return code, summary


__all__ = ["ray_multi_seed", "ray_search", "require_ray", "start_ray"]
