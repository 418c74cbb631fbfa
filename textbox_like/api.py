"""The Python API: what the command line does, from a notebook or a script.

    import textbox_like
    results = textbox_like.train({"task": "mnist", "max_update": 100, "save_dir": "runs/a"})
    metrics = textbox_like.evaluate("runs/a/checkpoint_best.pt", subset="test")
    results = textbox_like.train({"max_update": 100}, task=MyTask)   # a Task class of your own

A configuration is a mapping with the keys ``--print_config`` prints (other
tools' spellings too), a YAML file's path, or a resolved
:class:`~textbox_like.config.schema.RunConfig`. A mapping is one layer above the
properties files, as the command line is; its ``config`` key may name YAML
files to read first, like ``--config``. ``task`` may be a
:class:`~textbox_like.Task` subclass, registered or not (plugins.py:
register_task_class); the run records its ``MODULE:CLASS`` as
``task_class``, which every process it starts, its config.yaml and
:func:`evaluate` import again. Bad values raise
:class:`~textbox_like.core.errors.UserError` with the line the command line prints.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from textbox_like.core.errors import UserError


def resolve_config(config=None, **settings):
    """A RunConfig from a mapping, a YAML path or a RunConfig, with
    ``settings`` (by name) on top; checked as the command line checks it."""
    from textbox_like.resolve.checks import check
    from textbox_like.resolve.resolution import parse
    from textbox_like.config.schema import RunConfig
    if isinstance(config, Mapping) and isinstance(config.get("task"), type):
        config = {**config, **task_settings(config["task"])}
    if isinstance(settings.get("task"), type):
        settings = {**settings, **task_settings(settings["task"])}
    if isinstance(config, RunConfig):
        cfg = config.replace("textbox_like.train()", **settings) if settings else config
    elif config is None or isinstance(config, Mapping):
        cfg = parse(overrides={**(config or {}), **settings})
    elif isinstance(config, (str, os.PathLike)):
        cfg = parse(["--config", str(config)], overrides=settings)
    else:
        raise UserError(f"a configuration is a mapping, a YAML file's path or a RunConfig, not "
                        f"{type(config).__name__}")
    check(cfg)
    return cfg


def task_settings(cls) -> dict:
    """The settings naming the Task class ``cls``: its task name (it is
    registered under one now, where it is not yet) and its ``task_class``."""
    from textbox_like.resolve.plugins import class_path, register_task_class
    return {"task": register_task_class(cls), "task_class": class_path(cls)}


def train(config=None, **settings) -> dict:
    """Train as ``run_hetseq.py`` would with this configuration; returns the
    results (those of results.json: final and best validation metrics,
    updates, samples, wall time, exit code). A run that asks for several
    processes on this node starts them as the command line does; its
    ``task`` may be a Task class (module docstring)."""
    from textbox_like.cli import run
    given = settings.pop("callbacks", None)
    names = [c for c in (given or []) if isinstance(c, str)]
    if names:   # registered names, as --callbacks: recorded in config.yaml and passed to every rank
        settings["callbacks"] = names
    cfg = resolve_config(config, **settings)
    earlier = _results_file(cfg)
    code = run(cfg, [c for c in (given or []) if not isinstance(c, str)])
    results = _read_results(cfg, earlier) or {}
    if code not in (0, None):
        results.setdefault("exit_code", code)
    else:
        results.setdefault("exit_code", 0)
    return results


def _results_file(cfg):
    """results.json's identity (inode, modification time, size), or None:
    written atomically, a new one is a new file."""
    try:
        found = (Path(cfg.checkpoint.save_dir) / "results.json").stat()
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns, found.st_size


def _read_results(cfg, earlier):
    """This run's results.json; not an earlier run's (``earlier``: the file
    as it was before the run; a run refused, or stopped before it wrote one,
    leaves it as it was)."""
    path = Path(cfg.checkpoint.save_dir) / "results.json"
    if cfg.checkpoint.no_save or not path.is_file() or _results_file(cfg) == earlier:
        return None
    return json.loads(path.read_text())


def evaluate(checkpoint, subset=None, data=None, batch_size=None, cpu=False, user_dir=None, task=None) -> dict:
    """Loss and metrics of a checkpoint on a split (the run's first valid
    subset by default), averaged over all samples; ``data``: another data
    directory than the one the run trained on; ``user_dir``: the folder of
    the run's own components, where it is not the one the run recorded;
    ``task``: the run's Task class, where the one it recorded (its
    ``task_class``) is not importable here or has moved."""
    import yaml

    from textbox_like.storage.checkpoint import load_checkpoint
    from textbox_like.resolve.resolution import parse
    from textbox_like.core.errors import notes_muted
    from textbox_like.storage.sharded_checkpoint import claims_to_be_sharded, consolidated_state
    # a sharded (FSDP) run's checkpoint: its full weights gathered from the shards
    state = consolidated_state(checkpoint) if claims_to_be_sharded(checkpoint) else load_checkpoint(checkpoint)
    saved = yaml.safe_load(state["config"])
    with notes_muted():  # the training run's notes, said to it already
        cfg = parse(overrides={**saved, **({"data": data} if data else {}),
                               **({"user_dir": user_dir} if user_dir else {}),
                               **(task_settings(task) if task is not None else {})})
    init = vars(cfg.task_options).get("init_checkpoint")
    if init and not (Path(init) / "config.json").is_file():
        # the checkpoint's own weights replace it anyway; a save_pretrained
        # directory stays: its config.json gives the model's sizes
        cfg = cfg.replace("textbox_like.evaluate()", init_checkpoint=None)
    subset = subset or cfg.data.valid_subset[0]

    import torch
    from accelerate import Accelerator

    from textbox_like.tasks import TASKS
    from textbox_like.training.validate import evaluate as evaluate_split
    task = TASKS.get(cfg.data.task)(cfg)
    task.check_config(cfg)
    task.prepare_data()
    split = task.batch_dataset(subset)
    from textbox_like.models import adapters
    model = adapters.build_model(task, cfg.adapters)
    if adapters.enabled(cfg.adapters):  # the checkpoint holds the weights that were trained
        adapters.load_trained_state(model, state["model"], "the checkpoint")
    else:
        model.load_state_dict(state["model"])
    from textbox_like.processes.distributed import claim_accelerate_state, release_accelerate_state
    from textbox_like.training.validation import valid_batch_size
    claim_accelerate_state()  # else a later train() in this process would inherit this precision
    try:
        accelerator = Accelerator(cpu=cpu or not torch.cuda.is_available())
        model = accelerator.prepare(model)
        size = batch_size or valid_batch_size(cfg.data)
        metrics = evaluate_split(task, model, split, size, accelerator)
    finally:
        release_accelerate_state()
    return {"checkpoint": str(checkpoint), "subset": subset, "samples": len(split),
            "num_updates": state["train"]["num_updates"], **metrics}
