"""Running trials: one trainer run per trial in a child process, up to N at
once, each with its own share of the machine (CPU threads, or K GPUs through
``CUDA_VISIBLE_DEVICES``).

A child rather than ``cli.main`` in this process because a trial leaves state
behind that the next must not see (Accelerate's singletons, RANK/WORLD_SIZE in
``os.environ``, torch's thread count and RNGs, signal handlers) and a trial that
segfaults or is OOM-killed must fail alone. Children run in their own session
(Ctrl-C reaches the search, which then asks each running trial to stop with
SIGTERM: the trainer saves ``checkpoint_last.pt`` and exits 75) and receive
SIGTERM if the search process dies (Linux ``PR_SET_PDEATHSIG``), so a killed
search leaves no orphan training on.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from textbox_like.processes.children import can_fork, start_trainer
from textbox_like.processes.distributed import usable_cpus
from textbox_like.core.errors import UserError
from textbox_like.storage.fileio import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent.parent
TRIAL_CONFIG = "trial_config.yaml"
SEARCH_LOCK = "search.lock"
PREEMPTED = 75


@dataclass
class Outcome:
    returncode: int
    error: str = ""
    interrupted: bool = False


# ====================================================================== trial configurations
#: where a trial's own settings (sampled values, save directory, share of the
#: machine) come from, in its config.yaml's provenance and --print_config
SOURCE = "the search"


def given_dests(options, argv):
    """The options a trainer command line names."""
    return {d for d in (options.dest_of(t) for t in argv if str(t).startswith("--")) if d}


class TrialConfigs:
    """Each trial's trainer configuration, resolved once, here, from the base
    command line and the trial's own settings, and checked as the trainer
    checks it; the trial's process runs it as it is (``cli.run_resolved``)."""

    def __init__(self, base_argv):
        from textbox_like.resolve.options import build_options
        from textbox_like.resolve.resolution import import_plugins
        self.base_argv = [str(a) for a in base_argv]
        import_plugins(self.base_argv)      # a --user-dir's components, before the parser
        self.options = build_options()
        self.given = given_dests(self.options, self.base_argv)

    def resolve(self, settings=None):
        """The RunConfig of the base command line with ``settings`` (by name;
        ``OPTION.KEY`` for one key of a dict option) on top; UserError if the
        trainer would refuse it."""
        from textbox_like.resolve.checks import check
        from textbox_like.resolve.resolution import parse
        cfg = parse(self.base_argv, overrides=nested(settings or {}), overrides_name=SOURCE)
        check(cfg)
        return cfg

    def task(self):
        """The task class of the base command line."""
        from textbox_like.resolve.resolution import parse
        from textbox_like.tasks import TASKS
        return TASKS.get(parse(self.base_argv).data.task)

    def command(self, settings):
        """The equivalent trainer command line, for people (command.txt,
        hyper_best.json): the trial itself never re-parses it."""
        return quote_command(self.base_argv + as_flags(nested(settings)))


def nested(settings):
    """{'model_conf.hidden_size': 64} -> {'model_conf': {'hidden_size': 64}}."""
    out = {}
    for name, value in settings.items():
        option, dot, key = name.partition(".")
        if dot:
            out.setdefault(option, {})[key] = value
        else:
            out[name] = value
    return out


def as_flags(settings):
    """Settings -> '--name=value' flags (a switch: true/false)."""
    out = []
    for name, value in settings.items():
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
        out.append(f"--{name}={text}")
    return out


def quote_command(argv):
    return " ".join(shlex.quote(str(a)) for a in ["python", "run_hetseq.py", *argv])


@contextlib.contextmanager
def output_locked(output):
    """This search holds its ``--output`` (``search.lock``, made and kept
    fresh as ``run.lock`` holds a save directory) while it runs: a second
    search on it, a second ``--resume`` too, is refused in one line instead
    of running the same trials and recording the other's running trials as
    failed. A lock whose search died is taken over (savelock's rules)."""
    from textbox_like.storage.savelock import SaveDirLock
    directory = Path(output)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    lock = SaveDirLock(directory, option="--output", kind="search", name=SEARCH_LOCK)
    try:
        lock.take()
        yield
    finally:
        lock.release()
        if made:   # a search refused before it wrote anything leaves no empty --output behind
            with contextlib.suppress(OSError):
                directory.rmdir()


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path):
    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass          # a line cut by a crash
    return out


def write_json(path, data):
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def write_jsonl(path, records):
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


# ====================================================================== records
#: fields left out of a record's JSON while unset (results not read yet; not Ray)
_OPTIONAL = ("seed", "best", "final", "num_updates", "trial_id", "nodes")


@dataclass
class TrialRecord:
    """One trial of a search, or one seed's run: a line of
    hyper_results.jsonl, the same for the local and the Ray backend."""
    trial: int | None
    params: dict
    save_dir: str
    metric: str | None = None
    vals: dict = field(default_factory=dict)      # hyperopt's raw draw (choice indices), for resuming
    status: str = "running"                       # running | ok | fail | stopped | interrupted
    value: float | None = None
    loss: float | None = None                     # what hyperopt minimises: -value when maximising
    returncode: int | None = None
    error: str = ""
    wall_time: float | None = None
    attempts: int = 0
    seed: int | None = None                       # run_multi_seed's key
    best: dict | None = None
    final: dict | None = None
    num_updates: int | None = None
    trial_id: str | None = None                   # Ray Tune's trial id
    nodes: list | None = None                     # Ray: the node of each attempt

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k not in _OPTIONAL}

    @classmethod
    def from_dict(cls, data) -> "TrialRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def update(self, **changes):
        for key, value in changes.items():
            setattr(self, key, value)

    def take_results(self, results):
        """A run's results.json (or None): its best and final metrics."""
        if results is not None:
            self.update(best=results.get("best") or {}, final=results.get("final") or {},
                        num_updates=results.get("num_updates"))

    def score(self, value, maximize):
        """The objective's value (None: no score)."""
        self.value = None if value is None else float(value)
        self.loss = None if value is None else (-self.value if maximize else self.value)


# ====================================================================== resources
def gpu_ids():
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES honoured)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        count = 0
    if visible is not None and visible.strip() not in ("", "-1"):
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return ids[:count] if count else []
    return [str(i) for i in range(count)]


@dataclass
class Slot:
    index: int
    env: dict
    settings: dict       # the trainer settings this share of the machine implies


def plan_slots(parallel, gpus_per_trial, given, out=print):
    """One Slot per concurrent trial: its environment and extra trainer flags."""
    slots = []
    if gpus_per_trial:
        ids = gpu_ids()
        need = parallel * gpus_per_trial
        if not ids:
            raise UserError(f"--gpus-per-trial {gpus_per_trial}: this machine has no CUDA GPU; "
                            f"leave it out to run the trials on CPU")
        if need > len(ids):
            raise UserError(f"--parallel {parallel} x --gpus-per-trial {gpus_per_trial} needs {need} GPUs, "
                            f"this machine has {len(ids)} ({','.join(ids)}); lower one of them")
        for i in range(parallel):
            mine = ids[i * gpus_per_trial:(i + 1) * gpus_per_trial]
            settings = {} if gpus_per_trial == 1 or "distributed_world_size" in given else \
                {"distributed_world_size": gpus_per_trial}
            slots.append(Slot(i, {"CUDA_VISIBLE_DEVICES": ",".join(mine)}, settings))
        out(f"resources: {parallel} trial(s) at once, GPUs " +
            "; ".join(s.env["CUDA_VISIBLE_DEVICES"] for s in slots))
        return slots
    cores = usable_cpus()
    threads = max(1, cores // parallel)
    for i in range(parallel):
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        slots.append(Slot(i, env, {} if "threads" in given else {"threads": threads}))
    out(f"resources: {parallel} trial(s) at once on {cores} CPU core(s), {threads} thread(s) each"
        + (" (--threads given: kept)" if "threads" in given else ""))
    return slots


# ====================================================================== the child
def trainer_env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def last_error(save_dir):
    try:
        lines = [line for line in (Path(save_dir) / "stderr.log").read_text(errors="replace").splitlines()
                 if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1][:300]


class Handle:
    """One trial's trainer process, running the configuration resolved for
    it (written to the trial's directory as trial_config.yaml)."""

    def __init__(self, cfg, save_dir, env=None):
        from textbox_like.config.files import write_resolved
        self.save_dir = Path(save_dir)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.stopping = False
        resolved = write_resolved(cfg, self.save_dir / TRIAL_CONFIG)
        self._out = open(self.save_dir / "stdout.log", "a")
        self._err = open(self.save_dir / "stderr.log", "a")
        self.child = start_trainer(resolved, trainer_env(env), can_fork(), stdout=self._out, stderr=self._err,
                                   new_session=True)

    @property
    def pid(self):
        return self.child.pid

    def poll(self):
        rc = self.child.poll()
        return None if rc is None else self._finish(rc)

    def wait(self, timeout=None):
        return self._finish(self.child.wait(timeout))

    def _finish(self, rc):
        self._out.close()
        self._err.close()
        return Outcome(rc, last_error(self.save_dir) if rc else "", interrupted=self.stopping)

    def stop(self):
        """Ask the trainer to save checkpoint_last.pt and exit (SIGTERM)."""
        self.stopping = True
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def kill(self):
        if self.child.poll() is None:
            self.child.kill()


class SubprocessRunner:
    def start(self, cfg, save_dir, env=None):
        return Handle(cfg, save_dir, env)


# ====================================================================== the pool
@dataclass
class Job:
    """A trial to start: its own trainer settings (on top of the base
    command line); the pool adds its slot's and resolves them."""
    key: object           # trial number or seed
    settings: dict
    save_dir: Path


def run_pool(configs, next_job, on_start, on_done, slots, runner, poll_interval=0.2, stop_timeout=120):
    """Keep len(slots) jobs running, each with its configuration resolved by
    ``configs`` (TrialConfigs). next_job() -> Job or None (nothing more);
    on_start(job, handle); on_done(job, outcome). Ctrl-C: every running job is
    asked to stop (it saves checkpoint_last.pt), waited for, reported through
    on_done with outcome.interrupted, then KeyboardInterrupt is raised again."""
    free = list(slots)
    running = {}          # slot index -> (job, handle, slot)
    exhausted = False
    try:
        while True:
            while free and not exhausted:
                job = next_job()
                if job is None:
                    exhausted = True
                    break
                slot = free.pop(0)
                Path(job.save_dir).mkdir(parents=True, exist_ok=True)
                settings = {**job.settings, **slot.settings}
                try:
                    cfg = configs.resolve(settings)
                except UserError as exc:            # a sampled value the trainer refuses
                    free.insert(0, slot)
                    on_done(job, Outcome(2, f"error: {exc}"))
                    continue
                devices = slot.env.get("CUDA_VISIBLE_DEVICES")
                atomic_write_text(Path(job.save_dir) / "command.txt",
                                  (f"CUDA_VISIBLE_DEVICES={devices} " if devices else "")
                                  + configs.command(settings) + "\n")
                handle = runner.start(cfg, job.save_dir, slot.env)
                running[slot.index] = (job, handle, slot)
                on_start(job, handle)
            if not running:
                return
            finished = False
            for index in list(running):
                job, handle, slot = running[index]
                outcome = handle.poll()
                if outcome is not None:
                    del running[index]
                    free.append(slot)
                    free.sort(key=lambda s: s.index)
                    on_done(job, outcome)
                    finished = True
            if not finished:
                time.sleep(poll_interval)
    except KeyboardInterrupt:
        for job, handle, slot in running.values():
            handle.stop()
        deadline = time.time() + stop_timeout
        for job, handle, slot in running.values():
            try:
                outcome = handle.wait(timeout=max(1.0, deadline - time.time()))
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                handle.kill()
                outcome = handle.wait()
            outcome.interrupted = True
            on_done(job, outcome)
        raise
