"""The Python API and the typed configuration (issue 20): textbox_like.train
and textbox_like.evaluate from a Python process, errors as one line, each
component handed its own frozen section, provenance of every value."""
from __future__ import annotations

import dataclasses

import pytest

from textbox_like.resolve.resolution import parse
from textbox_like.core.errors import UserError
from textbox_like.config.schema import SECTION_OF, SECTIONS, RunConfig


def test_a_bad_key_raises_the_command_lines_one_line_error():
    import textbox_like
    with pytest.raises(UserError) as err:
        textbox_like.train({"task": "mnist", "max_updat": 5})
    message = str(err.value)
    assert "\n" not in message and "'max_updat'" in message and "'max_update'" in message
    with pytest.raises(UserError, match="expects a positive integer"):
        textbox_like.train({"task": "mnist", "max_sentences": 0, "max_update": 1})
    with pytest.raises(UserError, match="does not exist"):
        textbox_like.train("/nonexistent/config.yaml")


def test_a_yaml_path_and_a_resolved_config_are_configurations_too(tmp_path):
    from textbox_like.api import resolve_config
    path = tmp_path / "c.yaml"
    path.write_text("task: mnist\nmax_update: 9\nlr: 0.01\n")
    cfg = resolve_config(str(path), max_sentences=12)
    assert (cfg.schedule.max_update, cfg.optim.lr, cfg.data.max_sentences) == (9, [0.01], 12)
    assert cfg.source("max_update") == f"--config {path}" and cfg.source("max_sentences") == "textbox_like.train()"
    assert resolve_config(cfg, max_update=3).schedule.max_update == 3


def test_the_configuration_is_resolved_once_and_frozen():
    cfg = parse(["--task", "mnist", "--lr", "0.5"])
    assert isinstance(cfg, RunConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = [1.0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduler_options.power = 2.0
    # each setting has exactly one section, and each section's fields are its settings
    assert sum(len(dataclasses.fields(s)) for s in SECTIONS.values()) == len(SECTION_OF)
    assert all(getattr(getattr(cfg, SECTION_OF[k]), k) == cfg.get(k) for k in SECTION_OF)
    # where each value came from
    assert cfg.source("lr") == "command line"
    assert cfg.source("max_sentences").endswith("properties/task/mnist.yaml")
    assert cfg.source("clip_norm") == "default"
    # a derived copy leaves the original as it was
    assert cfg.replace(max_update=3).schedule.max_update == 3 and cfg.schedule.max_update == 0
    with pytest.raises(UserError, match="max_update"):
        cfg.replace(max_updat=3)


def test_the_learning_rate_has_one_home_the_optimizer_section():
    cfg = parse(["--task", "mnist", "--optimizer", "sgd", "--optim_conf", "lr=0.2"])
    assert cfg.optim.lr == [0.2] and cfg.optim.optim_conf["lr"] == 0.2
    from textbox_like.optim.lr_scheduler import build_scheduler
    from textbox_like.optim import build_optimizer
    import torch
    optimizer = build_optimizer(cfg.optim, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    scheduler = build_scheduler(cfg, optimizer)
    assert scheduler.lrs == [0.2] and optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    # optim_conf's lr is read from optim.lr: a derived configuration cannot disagree with itself
    changed = cfg.replace(lr=[0.5])
    assert changed.optim.optim_conf["lr"] == 0.5 and list(changed.optim.optim_conf) == list(cfg.optim.optim_conf)
    assert "lr" not in vars(changed.optim.optim_conf)["_stored"]
    # a restore's --optimizer-overrides lr moves the schedule's base, not the run's configuration
    before = scheduler.step_update(3)
    scheduler.rebase(0.05)
    assert scheduler.lrs == [0.05] and scheduler.step_update(3) == pytest.approx(before / 4) and cfg.optim.lr == [0.2]


def test_spawned_ranks_get_the_resolved_configuration(tmp_path):
    """A child reads the file its launcher wrote: the same configuration and
    provenance, with no command line to parse again."""
    from textbox_like.resolve.resolution import read_resolved
    from textbox_like.config.files import write_resolved
    cfg = parse(["--task", "bert", "--model-preset", "tiny", "--optim", "lamb", "--lr", "0.002",
                 "--scheduler", "StepLR", "--scheduler_conf", "step_size=3", "--max-update", "5"])
    write_resolved(cfg, tmp_path / "resolved.yaml")
    again = read_resolved(tmp_path / "resolved.yaml")
    assert again.as_dict() == cfg.as_dict() and dict(again.sources) == dict(cfg.sources)
    assert again.task_options == cfg.task_options and again.optimizer_options == cfg.optimizer_options


def test_registries_refuse_a_duplicate_name_and_a_foreign_class():
    from textbox_like.optim.lr_scheduler import SCHEDULERS
    from textbox_like.optim import OPTIMIZERS, OptimizerSpec
    from textbox_like.config.registry import Registry
    from textbox_like.tasks import TASKS
    with pytest.raises(ValueError, match="registered already"):
        OPTIMIZERS.register("ADAM")(type("Other", (OptimizerSpec,), {}))  # any case: the same name
    with pytest.raises(TypeError, match="not a subclass"):
        TASKS.register("not_a_task")(object)
    assert "not_a_task" not in TASKS.names() and OPTIMIZERS.canonical("RMSprop") == "rmsprop"
    assert SCHEDULERS.canonical("steplr") == "StepLR"
    exact = Registry("thing")
    exact.register("Name")(type("Thing", (), {}))
    with pytest.raises(UserError, match="unknown thing 'name'"):
        exact.canonical("name")  # case matters unless any_case


def test_no_module_of_the_package_hides_its_api_functions():
    """Importing a submodule binds it as an attribute of the package: a module
    named train or evaluate would replace textbox_like.train() for every later
    call in the process (the trainer package is textbox_like.training)."""
    import importlib
    import pkgutil

    import textbox_like
    api = {name: getattr(textbox_like, name) for name in ("train", "evaluate")}
    for module in pkgutil.walk_packages(textbox_like.__path__, "textbox_like."):
        if module.name.split(".")[1] in ("train", "evaluate"):
            pytest.fail(f"{module.name} would replace textbox_like.{module.name.split('.')[1]}()")
        if "ray" not in module.name:  # ray is an extra
            importlib.import_module(module.name)
    for name, function in api.items():
        assert getattr(textbox_like, name) is function and callable(function), name


def test_a_run_from_python_leaves_the_callers_thread_variables_as_they_were(small_mnist_dir, monkeypatch):
    """The run publishes OMP_NUM_THREADS/MKL_NUM_THREADS for what it loads (Accelerate would set its own count);
    a notebook's environment after the run is its own again: a later process it starts is not held to the
    run's count, and a value it had set stays."""
    import os

    import textbox_like
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "5")
    seen = {}

    class Watch(textbox_like.Callback):
        def on_train_start(self, run):
            seen.update({key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})

    textbox_like.train({"task": "mnist", "data": str(small_mnist_dir), "max_sentences": 32, "max_update": 1,
                        "threads": 1, "log_format": "none", "no_save": True}, callbacks=[Watch()])
    assert seen == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "5"}, seen
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["MKL_NUM_THREADS"] == "5"
