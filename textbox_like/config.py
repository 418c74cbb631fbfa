"""Configuration: defaults < properties/overall.yaml < properties/task/<task>.yaml
< ``--config FILE`` (repeatable) < command line.

Every option has one name in the resolved config (``max_update``) and answers
to both spellings on the command line (``--max-update``, ``--max_update``), as
HetSeq's and ESPnet2's users each expect theirs.

Options are registered on one argparse parser in named groups; the resolved
configuration printed by ``--print_config`` and saved as ``config.yaml`` holds
the groups that apply to this run (common, the task's, the chosen
optimizer's and LR scheduler's), so feeding it back with ``--config``
reproduces it exactly.

This module imports no heavy library: ``--help`` must answer at once.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import yaml

from .errors import UserError, closest
from .internals import appends, parser_actions

# properties/: inside the package when installed from a wheel, else beside it (source tree, pip install -e)
PROPERTIES = next((d for d in (Path(__file__).resolve().parent / "properties",
                               Path(__file__).resolve().parent.parent / "properties") if d.is_dir()),
                  Path(__file__).resolve().parent.parent / "properties")


# ---------------------------------------------------------------- value types
def _int(text, low, what):
    try:
        value = int(text)
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or value < low or isinstance(text, float) and text != value:
        raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}")
    return value


def positive_int(text):
    return _int(text, 1, "a positive integer")


def nonneg_int(text):
    return _int(text, 0, "an integer >= 0")


def int_list(text):
    """'4,2,1' or [4, 2, 1] -> [4, 2, 1] (HetSeq's per-epoch --update-freq)."""
    if isinstance(text, (list, tuple)):
        values = [int(v) for v in text]
    elif isinstance(text, int):
        values = [text]
    else:
        values = [int(v) for v in str(text).strip("[]() ").split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expects positive integers like 4 or 4,2,1, got {text!r}")
    return values


def str_list(text):
    if isinstance(text, (list, tuple)):
        return [str(v) for v in text]
    return [v.strip() for v in str(text).split(",") if v.strip()]


def float_tuple(text):
    """'(0.9, 0.999)' -> [0.9, 0.999], read with ast.literal_eval, never eval."""
    if isinstance(text, (list, tuple)):
        value = text
    else:
        try:
            value = ast.literal_eval(str(text))
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise ValueError(f"expects a tuple of numbers like '(0.9, 0.999)', got {text!r}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"expects a tuple of numbers like '(0.9, 0.999)', got {text!r}")
    return [float(v) for v in value]


def str2bool(text):
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("true", "yes", "1", "on", "y", "t"):
        return True
    if lowered in ("false", "no", "0", "off", "none", "n", "f"):
        return False
    raise ValueError(f"expects true or false, got {text!r}")


def switch(text):
    """The value of a switch: true/false/yes/no/1/0 in any case."""
    try:
        return str2bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"is a switch: give it alone or with true/false/yes/no/1/0, got {text!r}") from None


def with_numbers(value):
    """YAML 1.1 reads '1e-7' as a string; people mean a number."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") or value.lower() in ("inf", "-inf") \
                else int(value)
        except ValueError:
            return value
    if isinstance(value, dict):
        return {k: with_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_numbers(v) for v in value]
    return value


def parse_dict(text):
    """'{lr: 0.1, rho: 0.8}' or 'lr=0.1' -> dict. YAML safe_load for values."""
    if isinstance(text, dict):
        return with_numbers(dict(text))
    text = str(text).strip()
    try:
        if text.startswith("{"):
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise ValueError(f"expects a mapping like '{{lr: 0.1}}', got {text!r}")
            return with_numbers(value)
        out = {}
        for part in text.split(","):
            if "=" not in part:
                raise ValueError(f"expects key=value or '{{key: value}}', got {text!r}")
            key, raw = part.split("=", 1)
            out[key.strip()] = with_numbers(yaml.safe_load(raw))
        return out
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{text!r} is not valid: {problem}") from None


def float_list(text):
    """--lr: one LR, or HetSeq's per-epoch list 'a,b,c'."""
    try:
        if isinstance(text, (int, float)):
            return [float(text)]
        if isinstance(text, (list, tuple)):
            return [float(v) for v in text]
        return [float(v) for v in str(text).strip("[] ").split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number (or numbers 'a,b,c'), got {text!r}") from None


def _described(fn, what):
    """``fn`` raising argparse's error, which names the option, with ``what`` it expects."""
    def convert(text):
        try:
            return fn(text)
        except (ValueError, TypeError, SyntaxError):
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None
    convert.__name__ = fn.__name__
    return convert


def _literal_dict(text):
    return text if isinstance(text, dict) else ast.literal_eval(str(text)) or {}


INT_LIST = _described(int_list, "positive integers like 4 or 4,2,1")
STR_LIST = _described(str_list, "a comma-separated list")
LITERAL_DICT = _described(_literal_dict, "a Python dict literal like \"{'lr': 0.5}\"")
BOOL = _described(str2bool, "true or false")


def seed_int(text):
    value = _int(text, 0, "an integer from 0 to 2**32 - 1")
    if value >= 2 ** 32:
        raise argparse.ArgumentTypeError(f"expects an integer from 0 to 2**32 - 1, got {text!r}")
    return value


class MergeDict(argparse.Action):
    """Repeatable dict option: each occurrence updates the dict."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        current = dict(current) if isinstance(current, dict) else {}
        try:
            current.update(parse_dict(values))
        except (ValueError, yaml.YAMLError) as exc:
            raise UserError(f"{option_string}: {exc}") from None
        setattr(namespace, self.dest, current)


def program_name(script):
    """The name --help shows: ``textbox-like train`` when the console command
    started this tool, else its script (``run_hetseq.py``)."""
    import sys
    started_as = sys.argv[0] if sys.argv else ""
    return started_as if started_as.startswith("textbox-like ") else script


# ---------------------------------------------------------------- registration
class Options:
    """The parser plus the record of which option belongs to which group."""

    def __init__(self, prog, description):
        self.parser = argparse.ArgumentParser(
            prog=prog, description=description, allow_abbrev=False,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        self.groups = {}          # group name -> list of dests
        self.actions = {}         # dest -> argparse action
        self._group = None
        self._argparse_group = self.parser
        self.switches = set()     # dests of boolean options
        self.aliases = {}         # alias name (underscores) -> dest, for config files too
        self.alias_tools = {}     # alias name (underscores) -> the tool whose spelling it is
        self.flags = {}           # every flag ('--max-update', '--batch_size', ...) -> its dest

    def group(self, name, title=None):
        self._group = name
        self.groups.setdefault(name, [])
        self._argparse_group = self.parser.add_argument_group(title or name)
        return self

    def add(self, *flags, **kwargs):
        """Like add_argument; every '--a-b' also answers to '--a_b' and back.

        A switch (``action="store_true"``) takes the bare flag or a value
        true/false/yes/no/1/0 in any case (``--resume true``,
        ``--find_unused_parameters=True``), as ESPnet2's users write them."""
        if kwargs.get("action") == "store_true":
            kwargs.pop("action")
            kwargs.update(type=switch, nargs="?", const=True, metavar="BOOL",
                          default=kwargs.get("default", False))
            self.switches.add(kwargs.get("dest") or flags[0].lstrip("-").replace("-", "_"))
        names = []
        for flag in flags:
            names.append(flag)
            if flag.startswith("--"):
                body = flag[2:]
                for alt in (body.replace("-", "_"), body.replace("_", "-")):
                    if "--" + alt not in names:
                        names.append("--" + alt)
        if "dest" not in kwargs:
            kwargs["dest"] = flags[0].lstrip("-").replace("-", "_")
        if kwargs["dest"] in self.actions:
            # the same option shared by several components (adam, adamw)
            if kwargs["dest"] not in self.groups[self._group]:
                self.groups[self._group].append(kwargs["dest"])
            return self.actions[kwargs["dest"]]
        action = self._argparse_group.add_argument(*names, **kwargs)
        self.flags.update({name: kwargs["dest"] for name in action.option_strings})
        if kwargs["dest"] not in self.actions:
            self.groups[self._group].append(kwargs["dest"])
            self.actions[kwargs["dest"]] = action
        return action

    def add_alias(self, flag, dest, help=None, tool=None):
        """A second flag for an existing option, e.g. --accum_grad for update_freq.
        Config files may use the alias's name as a key too. ``tool``: whose
        spelling it is (the source of a value given by it names it)."""
        action = self.actions[dest]
        kwargs = {"dest": dest, "help": help or f"alias of --{dest.replace('_', '-')}",
                  "default": argparse.SUPPRESS}
        self.aliases[flag.lstrip("-").replace("-", "_")] = dest
        if tool:
            self.alias_tools[flag.lstrip("-").replace("-", "_")] = (tool, flag)
        for key in ("type", "nargs", "const", "choices", "metavar"):
            value = getattr(action, key, None)
            if value is not None:
                kwargs[key] = value
        body = flag[2:]
        names = [flag] + [f"--{b}" for b in sorted({body.replace("-", "_"), body.replace("_", "-")})
                          if f"--{b}" != flag]
        self._argparse_group.add_argument(*names, **kwargs)
        self.flags.update({name: dest for name in names})

    def dest_of(self, flag):
        """The option a flag ('--lr', '--learning-rate=0.1') stands for, or None."""
        return self.flags.get(str(flag).split("=", 1)[0])


# ---------------------------------------------------------------- YAML layers
def read_text_file(path, what, kind) -> str:
    """A text file a user named, as a string; one line naming the file and
    what it is when it is empty, binary (a checkpoint, an archive) or not
    UTF-8, instead of a decoder's traceback."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{what} {str(path)!r} cannot be read ({exc.strerror or exc}); check the path") from None
    if not raw:
        raise UserError(f"{what} {str(path)!r} is empty (0 bytes); expected {kind} text")
    if raw.startswith(b"PK\x03\x04") or raw.startswith(b"\x80") or b"\0" in raw[:8192]:
        kind_of = "a zip archive (a torch checkpoint?)" if raw.startswith(b"PK\x03\x04") else \
            "a pickle (a checkpoint?)" if raw.startswith(b"\x80") else "binary data"
        raise UserError(f"{what} {str(path)!r} is {kind_of}, not {kind} text; pass the {kind} file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"{what} {str(path)!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
                        f"save it as UTF-8") from None


def load_yaml(path, what="config file"):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {str(path)!r} does not exist; check the path")
    try:
        data = yaml.safe_load(read_text_file(path, what, "YAML"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{what} {str(path)!r} is not valid YAML{where}: "
                        f"{getattr(exc, 'problem', None) or exc}; fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {str(path)!r} must hold a mapping of option: value, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _check_keys(layer, options, source):
    """Alias keys (``learning_rate``) become their option's name (``lr``);
    unknown keys are errors."""
    out = {}
    for key, value in layer.items():
        dest = options.aliases.get(key, key)
        if dest not in options.actions:
            from .compat import no_such_part
            if no_such_part(key):
                raise UserError(f"{key!r} in {source}: {no_such_part(key)}")
            raise UserError(f"unknown key {key!r} in {source}"
                            f"{closest(key, list(options.actions) + list(options.aliases))}; "
                            f"run with --help for the valid options")
        out[dest] = value
    return out


#: where a value came from, lowest first: the user gave it when >= CONFIG_FILE
BUILTIN, OVERALL, TASK_FILE, CONFIG_FILE, ENVIRONMENT, COMMAND_LINE = range(6)
LAYER_NAMES = {BUILTIN: "default", OVERALL: "properties/overall.yaml", TASK_FILE: "the task's properties file",
               CONFIG_FILE: "--config", ENVIRONMENT: "accelerate launch / accelerate config",
               COMMAND_LINE: "command line"}


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


def run_tool(parser, argv, work):
    """A small command's main (export, prepare_bert): ``argv`` parsed with
    one-line errors, then ``work(args)``; 0, or 2 after one line
    ``error: ...`` for a mistake the user can fix."""
    import sys
    raise_user_errors(parser)
    try:
        work(parser.parse_args(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def raise_user_errors(parser):
    """argparse prints usage and exits 2 on error; we want one line."""

    def error(message):
        if message.startswith("unrecognized arguments"):
            bad = message.split(":", 1)[1].split()[0]
            flag = bad.split("=")[0]
            from .compat import no_such_part
            if no_such_part(flag):
                raise UserError(no_such_part(flag))
            known = [s for a in parser_actions(parser) for s in a.option_strings]
            raise UserError(f"unknown option {flag}{closest(flag, known)}; run with --help for the valid options")
        raise UserError(message)

    parser.error = error


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
    layers = []
    overall = PROPERTIES / "overall.yaml"
    if overall.is_file():
        layers.append((load_yaml(overall, "properties file"), str(overall), OVERALL))
    config_layers = [(_check_keys(load_yaml(p), options, p), p, CONFIG_FILE) for p in config_files]
    for layer, _, _ in [*reversed(config_layers), *reversed(layers)]:
        if task is None and "task" in layer:
            task = layer["task"]
    if task is not None:
        task = task_registry.canonical(task)
        task_yaml = PROPERTIES / "task" / f"{task}.yaml"
        if task_yaml.is_file():
            layers.append((load_yaml(task_yaml, "properties file"), str(task_yaml), TASK_FILE))
    layers.extend(config_layers)
    if environment:
        layers.append((dict(environment), LAYER_NAMES[ENVIRONMENT], ENVIRONMENT))
    if overrides:
        layers.append((overrides, overrides_name, COMMAND_LINE))
    return layers, task


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


def resolve(options: Options, argv, task_registry, component_groups, overrides=None, environment=None,
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
    layers, task = _layers(options, given, task_registry, overrides, environment, overrides_name)

    merged = {}
    sources = {dest: BUILTIN for dest in options.actions}
    names = {}
    dict_sources = {}
    layer_values = {}
    for layer, source, rank in layers:
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


def to_yaml(cfg) -> str:
    """The resolved configuration as YAML (a settings.RunConfig): what
    --print_config prints and config.yaml holds; --config reads it back."""
    return yaml.safe_dump(_plain(cfg.as_dict()), sort_keys=False, default_flow_style=None)


def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def write_config(cfg, directory):
    from .fileio import atomic_write_text
    return atomic_write_text(Path(directory) / "config.yaml", to_yaml(cfg))


def write_resolved(cfg, path):
    """A resolved configuration for a process that runs it as it is (a spawned
    rank, a search trial): the values, where each came from, and which
    options are the task's, optimizer's and scheduler's own."""
    from .fileio import atomic_write_text
    data = {"config": _plain(cfg.as_dict()), "sources": dict(cfg.sources),
            "plugins": {part: list(vars(getattr(cfg, part)))
                        for part in ("task_options", "optimizer_options", "scheduler_options")}}
    return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def read_resolved(path):
    from .settings import RunConfig
    data = load_yaml(path, "resolved configuration")
    return RunConfig.from_values(data["config"], list(data["config"]), data["plugins"], data["sources"])
