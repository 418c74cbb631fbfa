"""Option building: the command-line parser, from the settings' declarations
(schema.py), the other tools' spellings (compat.py) and each task's,
optimizer's and LR scheduler's own section, declared the same way; and the
one-line errors of every parser of ours.

Every option has one name in the resolved config (``max_update``) and answers
to both spellings on the command line (``--max-update``, ``--max_update``), as
HetSeq's and ESPnet2's users each expect theirs. Options are registered in
named groups (schema.GROUPS, then one group per plugin), which say what
``--print_config`` and ``config.yaml`` hold for a run.

This module imports no heavy library: ``--help`` must answer at once.
"""
from __future__ import annotations

import argparse

import yaml

from textbox_like.core.errors import UserError, closest
from textbox_like.core.internals import parser_actions
from textbox_like.config import compat
from textbox_like.config.schema import GROUPS, PLUGIN_PARTS, declared_settings, plugin_group
from textbox_like.config.value_types import parse_dict, switch


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
            if compat.no_such_part(flag):
                raise UserError(compat.no_such_part(flag))
            known = [s for a in parser_actions(parser) for s in a.option_strings]
            raise UserError(f"unknown option {flag}{closest(flag, known)}; run with --help for the valid options")
        raise UserError(message)

    parser.error = error



def add_aliases(options, aliases=compat.ALIASES, title="other tools' spellings"):
    options.group("compatibility", title)
    for flag, dest, help in aliases:
        options.add_alias(flag, dest, help=help, tool=help.split(":", 1)[0] if help else None)


def plugin_registries() -> dict:
    """The registries of the plugins, by PLUGIN_PARTS' names: tasks,
    optimizers, LR schedulers."""
    from textbox_like.optim.lr_scheduler import SCHEDULERS
    from textbox_like.optim import OPTIMIZERS
    from textbox_like.tasks import TASKS
    return {"task_options": TASKS, "optimizer_options": OPTIMIZERS, "scheduler_options": SCHEDULERS}


_built = {}


def build_options():
    """The parser of run_hetseq.py. Built once per set of registered
    components: resolving never changes it."""
    registries = plugin_registries()
    key = (program_name("run_hetseq.py"), *(tuple(registry.choices()) for registry in registries.values()))
    if key not in _built:
        _built.clear()
        _built[key] = _build_options(registries)
    return _built[key]


def add_setting(o, f, help_text):
    """The option of one declared setting (a field of a section: schema.setting)."""
    meta = f.metadata
    kwargs = {"default": meta["cli_default"], "help": help_text}
    if meta["switch"]:
        kwargs["action"] = "store_true"
    elif meta["merge"]:
        kwargs["action"] = MergeDict
    for key in ("type", "choices", "metavar"):
        if meta[key] is not None:
            kwargs[key] = meta[key]
    if meta["optional_value"]:
        kwargs.update(nargs="?", const=True)
    o.add(meta["flag"] or "--" + f.name.replace("_", "-"), **kwargs)


def _build_options(registries):
    from textbox_like.metrics.trackers import TRACKERS
    tasks, optimizers, schedulers = (registries[part] for part in PLUGIN_PARTS)

    o = Options(program_name("run_hetseq.py"), "Train a task on one process, one node or several unlike nodes.")
    o.group("meta", "configuration files")
    o.add("--config", action="append", default=[], metavar="FILE",
          help="YAML file of option: value (repeatable; later files win; the command line wins over all)")
    o.add("--print_config", action="store_true", help="print the resolved configuration as YAML and exit")
    choices = {"task": f"{', '.join(tasks.names())}", "optimizer": f"one of: {', '.join(optimizers.choices())}",
               "lr_scheduler": f"one of: {', '.join(schedulers.choices())}", "report_to": ", ".join(TRACKERS)}
    group = None
    for _, section, f in declared_settings():
        if group != section.group_of(f):
            group = section.group_of(f)
            o.group(group, GROUPS[group])
        add_setting(o, f, f.metadata["help"].replace("{choices}", choices.get(f.name, "")))
    add_aliases(o)
    # each plugin's own section, in a group of its own
    for part, (_, kind) in PLUGIN_PARTS.items():
        for name, cls in registries[part].items():
            o.group(plugin_group(part, name), f"{kind} {name}")
            for f in cls.options.settings():
                add_setting(o, f, f.metadata["help"])
    add_aliases(o, compat.PLUGIN_ALIASES, "other tools' spellings of the optimizers' options")
    return o
