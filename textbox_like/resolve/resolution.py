"""Resolution: a run's settings from their layers (layers.py), parsed once,
with where each value came from (its provenance), then the values that
follow from others (other tools' spellings, a preset's sizes, the
optimizer's and scheduler's full arguments), into one RunConfig.

Every option has one name in the resolved config (``max_update``); the
resolved configuration printed by ``--print_config`` and saved as
``config.yaml`` holds the groups that apply to this run (common, the
task's, the chosen optimizer's and LR scheduler's), so feeding it back with
``--config`` reproduces it exactly.

This module imports no heavy library: ``--help`` must answer at once.
"""
from __future__ import annotations

import argparse
import dataclasses

from textbox_like.core.errors import UserError, closest, note
from textbox_like.core.internals import appends, parser_actions
from textbox_like.config import compat, layers
from textbox_like.config.files import load_yaml
from textbox_like.config.layers import (
    BUILTIN,
    COMMAND_LINE,
    CONFIG_FILE,
    ENVIRONMENT,
    LAYER_NAMES,
    OVERALL,
    TASK_FILE)
from textbox_like.resolve.options import Options, build_options, plugin_registries, raise_user_errors
from textbox_like.config.schema import GROUPS, PLUGIN_PARTS, RunConfig, plugin_group


def _check_keys(layer, options, source):
    """Alias keys (``learning_rate``) become their option's name (``lr``);
    unknown keys are errors."""
    out = {}
    for key, value in layer.items():
        dest = options.aliases.get(key, key)
        if dest not in options.actions:
            if compat.no_such_part(key):
                raise UserError(f"{key!r} in {source}: {compat.no_such_part(key)}")
            raise UserError(f"unknown key {key!r} in {source}"
                            f"{closest(key, list(options.actions) + list(options.aliases))}; "
                            f"run with --help for the valid options")
        out[dest] = value
    return out



class _Unset:
    def __repr__(self):
        return "<unset>"


_UNSET = _Unset()


def _spellings(options, argv):
    """{dest: " (TOOL --flag)"} for the options whose last use in ``argv`` is
    another tool's alias (kanachan's --learning-rate for --lr)."""
    out = {}
    for arg in argv:
        if not str(arg).startswith("--"):
            continue
        dest = options.dest_of(arg)
        if dest is None:
            continue
        name = str(arg).split("=", 1)[0][2:].replace("-", "_")
        tool = options.alias_tools.get(name)
        out[dest] = f" ({tool[0]} {tool[1]})" if tool else ""
    return out



@dataclasses.dataclass
class Provenance:
    """Where a resolve found each value: ``sources``: dest -> layer (BUILTIN ...
    COMMAND_LINE); ``names``: dest -> the source in words; ``dict_sources``:
    dict dest -> {key: layer}; ``layer_values``: layer -> {dest: value} of the
    files and Python layers."""
    sources: dict
    names: dict
    dict_sources: dict
    layer_values: dict


def _parse_command_line(parser, argv):
    """{dest: value} of the options named in ``argv``, parsed once (dict
    options: only the keys given there; lists: only the items)."""
    lists = {a.dest for a in parser_actions(parser) if appends(a)}
    probe = argparse.Namespace(**{a.dest: None if a.dest in lists else _UNSET for a in parser_actions(parser)
                                  if a.dest not in (None, argparse.SUPPRESS, "help")})
    parser.parse_args(argv, namespace=probe)
    return {dest: value for dest, value in vars(probe).items()
            if value is not _UNSET and not (dest in lists and value is None)}


def _typed_default(action, value):
    """A layer's string value through the option's type, as argparse runs a
    string default (so a YAML 'lr: abc' fails exactly like '--lr abc')."""
    if not isinstance(value, str) or action.type is None or not callable(action.type):
        return value
    try:
        return action.type(value)
    except argparse.ArgumentTypeError as exc:
        message = str(exc)
    except (TypeError, ValueError):
        message = f"invalid {getattr(action.type, '__name__', repr(action.type))} value: {value!r}"
    raise UserError(str(argparse.ArgumentError(action, message))) from None


def _textbox_model_task(given, overrides, config_layers):
    """TextBox's commands name a Hugging Face model (``--model_path=facebook/bart-base``)
    and no task: with no task given anywhere, that model is trained by the hf
    task (None: no such --model_path; a checkpoint file of ours is left to
    the task the user names)."""
    for values in (given, overrides, *(layer for layer, _, _ in config_layers)):
        model_path = values.get("model_path")
        if model_path and not str(model_path).endswith((".pt", ".pth", ".bin", ".safetensors")):
            note(f"--model_path {model_path} and no --task: trained by --task hf (any Hugging Face model); "
                 f"give --task to choose another")
            return "hf"
    return None


def _layers(options, given, task_registry, overrides, environment, overrides_name):
    """[(values, source, rank)] lowest first, and the task whose properties
    file is one of them (Python's ``task`` first, then the command line's,
    then the files')."""
    found = {"config": list(given.get("config") or []), "task": [given["task"]] if "task" in given else []}
    for key in ("config", "task"):
        if key in overrides:
            value = overrides[key]
            found[key].extend(value if isinstance(value, (list, tuple)) else [value])
    config_files, task = found["config"], (found["task"][-1] if found["task"] else None)
    stack = []
    overall = layers.PROPERTIES / "overall.yaml"
    if overall.is_file():
        stack.append((load_yaml(overall, "properties file"), str(overall), OVERALL))
    config_layers = [(_check_keys(load_yaml(p), options, p), p, CONFIG_FILE) for p in config_files]
    if task is None and not any("task" in layer for layer, _, _ in config_layers):
        task = _textbox_model_task(given, overrides, config_layers)
    for layer, _, _ in [*reversed(config_layers), *reversed(stack)]:
        if task is None and "task" in layer:
            task = layer["task"]
    if task is not None:
        task = task_registry.canonical(task)
        task_yaml = layers.PROPERTIES / "task" / f"{task}.yaml"
        if task_yaml.is_file():
            stack.append((load_yaml(task_yaml, "properties file"), str(task_yaml), TASK_FILE))
    stack.extend(config_layers)
    if environment:
        stack.append((dict(environment), LAYER_NAMES[ENVIRONMENT], ENVIRONMENT))
    if overrides:
        stack.append((overrides, overrides_name, COMMAND_LINE))
    return stack, task


def _print_help(parser, options, merged):
    """--help, showing the defaults of this command line's layers (the task's
    file, --config files); exits."""
    saved = {action: action.default for action in parser_actions(parser)}
    try:
        parser.set_defaults(**merged)
        parser.parse_args(["--help"])
    finally:
        for action, default in saved.items():
            action.default = default


def resolve_namespace(options: Options, argv, task_registry, component_groups, overrides=None, environment=None,
                      overrides_name="textbox_like.train()"):
    """Parse ``argv`` (once) with the layered defaults. Returns (namespace,
    keys, provenance) where ``keys`` lists the options that apply to this
    run, in group order, and ``provenance`` says where each value came from.

    ``component_groups(ns)`` names the groups that apply given the chosen task,
    optimizer and scheduler. ``environment``: {option: value} set by the
    environment (Accelerate's launcher), above the files and below the command
    line; ``overrides``: {option: value} from Python, at the command line's rank.
    ``options`` is not changed: one parser serves every resolve.
    """
    parser = options.parser
    raise_user_errors(parser)
    asks_for_help = any(arg in ("-h", "--help") for arg in argv)
    given = _parse_command_line(parser, [arg for arg in argv if arg not in ("-h", "--help")])
    overrides = _check_keys({str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}, options,
                            overrides_name)
    # a task on the command line wins over one from Python, as its layer would
    stack, task = _layers(options, given, task_registry, overrides, environment, overrides_name)

    merged = {}
    sources = {dest: BUILTIN for dest in options.actions}
    names = {}
    dict_sources = {}
    layer_values = {}
    for layer, source, rank in stack:
        layer = _check_keys(layer, options, source)
        layer_values.setdefault(rank, {}).update(layer)
        for key, value in layer.items():
            sources[key] = rank
            names[key] = f"--config {source}" if rank == CONFIG_FILE else \
                LAYER_NAMES[rank] if rank in (OVERALL, ENVIRONMENT) else source
            if isinstance(value, dict):
                dict_sources.setdefault(key, {}).update({k: rank for k in value})
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    if task is not None:
        merged["task"] = task
    builtin = {dest: action.default for dest, action in options.actions.items()}
    if asks_for_help:
        _print_help(parser, options, merged)
    values = {}
    for dest, action in options.actions.items():
        default = merged[dest] if dest in merged else builtin[dest]
        if dest not in given:
            values[dest] = _typed_default(action, default)
        elif appends(action):  # --config: the layers' files, then the command line's
            values[dest] = list(_typed_default(action, default) or []) + list(given[dest])
        elif isinstance(given[dest], dict):  # a dict option: the command line's keys on the layers'
            values[dest] = {**(default if isinstance(default, dict) else {}), **given[dest]}
        else:
            values[dest] = given[dest]
    ns = argparse.Namespace(**values)
    spelled = _spellings(options, argv)
    for dest, value in given.items():
        sources[dest] = COMMAND_LINE
        names[dest] = LAYER_NAMES[COMMAND_LINE] + spelled.get(dest, "")
        if isinstance(value, dict):
            dict_sources.setdefault(dest, {}).update({k: COMMAND_LINE for k in value})
    for dest, action in options.actions.items():
        value = getattr(ns, dest, None)
        if value is not None and action.type is not None and not isinstance(value, str) \
                and action.type not in (str,):
            try:
                setattr(ns, dest, action.type(value))
            except (TypeError, ValueError, OverflowError, argparse.ArgumentTypeError) as exc:
                raise UserError(f"option {dest}: {exc}") from None
    for dest, action in options.actions.items():
        value = getattr(ns, dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            raise UserError(f"option {dest}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        if value is None and builtin[dest] is not None:
            raise UserError(f"option {dest} needs a value (got null); its default is {builtin[dest]!r}")
    keys = []
    for group in component_groups(ns):
        keys.extend(options.groups.get(group, []))
    return ns, keys, Provenance(sources, names, dict_sources, layer_values)


def groups_for(ns):
    """The groups of options that apply to this run: the printed groups,
    then the chosen task's, optimizer's and LR scheduler's (each name made
    canonical on ``ns``)."""
    from textbox_like.optim.lr_scheduler import SCHEDULERS
    from textbox_like.optim import OPTIMIZERS
    from textbox_like.tasks import TASKS
    ns.task = TASKS.canonical(ns.task)
    compat.check_optimizer_name(ns.optimizer, OPTIMIZERS, SCHEDULERS)
    ns.optimizer = OPTIMIZERS.canonical(ns.optimizer)
    ns.lr_scheduler = SCHEDULERS.canonical(ns.lr_scheduler)
    used = {"sharding": ns.fsdp, "adapters": ns.peft != "none" or bool(ns.efficient_methods)}
    shown = [group for group in GROUPS if used.get(group, True)]
    return [*shown, *(plugin_group(part, getattr(ns, chooser)) for part, (chooser, _) in PLUGIN_PARTS.items())]


def user_dir_given(argv=(), overrides=None):
    """The user dir (--user-dir) a command line and its Python settings
    ask for, found as the resolution will find it, before the parser that
    depends on it is built: the command line's, else Python's, else the
    last --config file's that names one; None where none does."""
    return given_early("user_dir", argv, overrides)


def given_early(dest, argv=(), overrides=None):
    """The value of the setting ``dest`` (user_dir, task_class: those that
    import code) a command line and its Python settings give, found as the
    resolution will find it, before the parser that depends on it is built:
    the command line's, else Python's, else the last --config file's that
    names one; None where none does."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scan.add_argument(f"--{dest.replace('_', '-')}", f"--{dest}", dest=dest)
    scan.add_argument("--config", action="append", default=[])
    raise_user_errors(scan)
    given, _ = scan.parse_known_args([str(arg) for arg in argv])
    if getattr(given, dest) is not None:
        return getattr(given, dest)
    overrides = {str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}
    if overrides.get(dest) is not None:
        return overrides[dest]
    files = overrides.get("config")
    files = [] if files is None else list(files) if isinstance(files, (list, tuple)) else [files]
    found = None
    for path in [*given.config, *files]:
        found = load_yaml(path).get(dest, found)
    return found


def import_plugins(argv=(), overrides=None):
    """Import the installed plugins, the user dir and the task class a
    command line asks for (plugins.py): their components then take part in
    the parser."""
    from textbox_like.resolve.plugins import load_plugins
    load_plugins(user_dir_given(argv, overrides), given_early("task_class", argv, overrides))


def resolve(argv=(), overrides=None, environ=None, overrides_name="textbox_like.train()"):
    """(the resolved RunConfig, whether --print_config was asked for).
    ``overrides``: settings by name, from Python (textbox_like.train, a
    search's trial), at the command line's rank; ``overrides_name`` says
    where they came from."""
    from textbox_like.tasks import TASKS
    import_plugins(argv, overrides)
    options = build_options()
    ns, keys, found = resolve_namespace(options, list(argv), TASKS, groups_for, overrides=overrides,
                                        environment=compat.environment_settings(environ),
                                        overrides_name=overrides_name)
    # ESPnet2's spelling of the batch size means the batch over all --ngpu processes (compat.py)
    finalize(options, ns, found, espnet2_batch="--batch_size" in {str(a).split("=", 1)[0] for a in argv})
    cfg = RunConfig.from_values(vars(ns), keys, plugin_sections(vars(ns)), found.names)
    return cfg, bool(ns.print_config)


def plugin_sections(values) -> dict:
    """The sections of the own options of the task, optimizer and LR
    scheduler that ``values`` (by setting name) choose."""
    registries = plugin_registries()
    return {part: registries[part].get(values[chooser]).options for part, (chooser, _) in PLUGIN_PARTS.items()}


def read_resolved(path):
    """A configuration written by files.write_resolved, as it was resolved."""
    from textbox_like.resolve.plugins import load_plugins
    data = load_yaml(path, "resolved configuration")
    values = data["config"]
    load_plugins(values.get("user_dir"), values.get("task_class"))   # before their sections are read
    return RunConfig.from_values(values, list(values), plugin_sections(values), data["sources"])


def parse(argv=(), overrides=None, overrides_name="textbox_like.train()"):
    """The resolved configuration of a command line (and Python overrides)."""
    return resolve(argv, overrides, overrides_name=overrides_name)[0]


def _credit_optim_conf_lr(found):
    """An lr given as --optim_conf lr=X is the run's lr (resolve_optim_conf:
    at the same layer --optim_conf wins): its source is where that
    --optim_conf came from, not the layer of the --lr it replaced."""
    rank = found.dict_sources.get("optim_conf", {}).get("lr")
    if rank is None or rank < found.sources.get("lr", BUILTIN):
        return
    layer = found.names.get("optim_conf") if found.sources.get("optim_conf") == rank else None
    found.sources["lr"] = rank
    found.names["lr"] = f"{layer or LAYER_NAMES.get(rank, 'default')} (--optim_conf lr)"


def finalize(options, ns, found, espnet2_batch=False):
    """Options of other tools that stand for ours, and the values that
    depend on several options, resolved once, so that --print_config and
    config.yaml show what the run uses."""
    from textbox_like.optim.lr_scheduler import resolve_scheduler_conf
    from textbox_like.optim import resolve_optim_conf
    from textbox_like.tasks import TASKS
    from textbox_like.tasks.base import best_metric_direction

    def user_gave(dest):
        return found.sources.get(dest, BUILTIN) >= CONFIG_FILE

    task = TASKS.get(ns.task)
    compat.apply_foreign_settings(ns, task, user_gave, lambda dest: found.sources.get(dest, BUILTIN), found.names,
                                  espnet2_batch=espnet2_batch)
    # the model's sizes, after the rewrites (--model_path and --initial-encoder
    # name the weights whose config.json gives them) and before anything reads them
    task.resolve_config(ns)
    if ns.required_batch_size_multiple > 1 and ns.max_sentences and not ns.max_tokens:
        from textbox_like.data.iterators import round_batch_size
        rounded = round_batch_size(ns.max_sentences, ns.required_batch_size_multiple)
        if rounded != ns.max_sentences:
            note(f"--max-sentences {ns.max_sentences} rounded down to {rounded}, a multiple of "
                 f"--required-batch-size-multiple {ns.required_batch_size_multiple}")
            ns.max_sentences = rounded

    # the optimizer's and the scheduler's own arguments, in full
    builtin_optimizer = options.actions["optimizer"].default
    resolve_optim_conf(ns, found.sources, found.dict_sources.get("optim_conf", {}), found.layer_values,
                       builtin_optimizer)
    _credit_optim_conf_lr(found)
    _, maximize = best_metric_direction(ns, task)  # ReduceLROnPlateau's mode follows it
    resolve_scheduler_conf(ns, options.groups.get(plugin_group("scheduler_options", ns.lr_scheduler), []), maximize)
