"""Name -> class registries for tasks, optimizers and LR schedulers (fairseq's
pattern): a new one is a decorated class in its package, nothing else. Its
own options are a typed section (config/schema.py), given as ``dataclass=``
to the decorator or as the class's ``options`` (or, fairseq's and HetSeq's
way, added to an argparse parser by its ``add_args(parser)``).

A registration refused (a taken name, a class of the wrong kind) is a
``RegistrationError``, one line naming the files of the classes: what a
user's component from ``--user-dir`` (plugins.py) gets to read."""
import re

from textbox_like.core.errors import UserError, unknown


class RegistrationError(UserError):
    """A class the registry refuses; a UserError (one line, exit 2) that
    code catching the ValueError or TypeError of a refused registration
    still catches (NameTaken, WrongKind)."""


class NameTaken(RegistrationError, ValueError):
    pass


class WrongKind(RegistrationError, TypeError):
    pass


def defined_at(cls) -> str:
    """Where a class is defined: ``FILE:LINE`` (our own files from the
    package's folder on: ``textbox_like/tasks/mnist.py:11``)."""
    import inspect
    from pathlib import Path
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return getattr(cls, "__module__", None) or repr(cls)
    if path is None:
        return cls.__module__
    ours = Path(__file__).resolve().parents[1]   # the package: registry.py lives in its config/
    try:
        path = str(Path(ours.name) / Path(path).resolve().relative_to(ours))
    except ValueError:
        pass
    return f"{path}:{line}"


def options_from_add_args(kind, name, cls):
    """The typed section of a class that declares its options the fairseq
    and HetSeq way, ``add_args(parser)``: it is handed a real argparse
    parser, and each option it adds (``add_argument`` storing one value of
    a type, with a default and choices, or store_true/store_false) becomes
    a ``setting`` of the section, shown by --help, recorded in config.yaml
    and read as ``cfg.<kind>_options.<dest>``. One that is a setting of the
    run already (fairseq's positional ``data``) is that setting. What a
    setting cannot be (a list, a required option, a custom action) is one
    line naming the fix."""
    import argparse
    import dataclasses

    from textbox_like.config.schema import SECTION_OF, Section, setting
    from textbox_like.core.internals import parser_actions
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    cls.add_args(parser)
    fields = []
    for action in parser_actions(parser):
        if action.dest in SECTION_OF:
            continue
        switch = action.nargs == 0 and isinstance(action.const, bool) and type(action).__name__ in (
            "_StoreTrueAction", "_StoreFalseAction")
        unsupported = (not switch and type(action).__name__ != "_StoreAction" and "a custom action"
                       or not switch and action.nargs is not None and f"nargs={action.nargs!r}"
                       or action.required and "required=True" or not action.option_strings and "no --flag")
        if unsupported:
            raise WrongKind(f"{kind} {name!r} ({defined_at(cls)}): its add_args option "
                            f"{'/'.join(action.option_strings) or action.dest} has {unsupported}, which a setting "
                            f"cannot be; declare its options as a frozen dataclass of textbox_like.setting() "
                            f"fields deriving from textbox_like.Section, set as options = YourOptions on the class")
        # ours says the default itself
        help_text = re.sub(r"\s*\(default:? %\(default\)s\)", "", action.help or action.dest)
        help_text = help_text.replace("%(default)s", str(action.default))
        if switch:
            fields.append((action.dest, bool, setting(bool(action.default), help_text, switch=True)))
        else:
            fields.append((action.dest, object, setting(action.default, help_text, type=action.type,
                                                        choices=action.choices, metavar=action.metavar)))
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields, bases=(Section,), frozen=True,
                                      namespace={"__module__": cls.__module__})


class Registry:
    """``base``: every registered class must derive from it; ``any_case``:
    names are found in any case (ESPnet2 writes adam and sgd, torch Adam and
    SGD)."""

    def __init__(self, kind, base=None, any_case=False, base_name=None):
        """``base_name``: the base's public name, which a refusal tells the
        user to derive from (default: its module's)."""
        self.kind, self.base, self.any_case = kind, base, any_case
        self.base_name = base_name or (base and f"{base.__module__}.{base.__qualname__}")
        self._entries = {}
        self._aliases = {}

    def register(self, name, *aliases, dataclass=None):
        """A class decorator. ``dataclass``: the section of the class's own
        options (a frozen dataclass of ``setting`` fields, as fairseq's
        ``@register_optimizer("adam", dataclass=...)``); left out, the
        class's ``options`` (inherited: none of its own)."""
        def deco(cls):
            if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
                what = cls.__qualname__ if isinstance(cls, type) else repr(cls)
                raise WrongKind(f"{self.kind} {name!r} ({defined_at(cls)}): {what} is not a subclass of "
                                f"{self.base_name}; derive it from {self.base_name}")
            own = dataclass
            if own is None and callable(getattr(cls, "add_args", None)) and \
                    getattr(getattr(cls, "options", None), "__name__", None) in (None, "NoOptions"):
                # fairseq's and HetSeq's way; typed options of its own win
                own = options_from_add_args(self.kind, name, cls)
            for taken in (name, *aliases):
                if self._key(taken) in self._keys():
                    holder = self._entries[self.canonical(taken)]
                    whose = "the built-in" if holder.__module__.split(".")[0] == __name__.split(".")[0] else "the"
                    mine = getattr(cls, "__qualname__", cls)
                    raise NameTaken(f"{self.kind} {taken!r} of {mine} ({defined_at(cls)}) is registered already: "
                                    f"{whose} {self.kind} {holder.__qualname__} ({defined_at(holder)}) has that name; "
                                    f"register yours under another name")
            self._entries[name] = cls
            cls.name = name
            if own is not None:
                cls.options = own
            for alias in aliases:
                self._aliases[alias] = name
            return cls
        return deco

    def unregister(self, name):
        """Forget ``name`` and its aliases (a class defined again takes
        the place of its earlier version)."""
        self._entries.pop(name, None)
        self._aliases = {alias: to for alias, to in self._aliases.items() if to != name}

    def _key(self, name):
        return name.lower() if self.any_case else name

    def _keys(self):
        return {self._key(n) for n in self.choices()}

    def canonical(self, name):
        if isinstance(name, str) and self.any_case:
            name = {n.lower(): n for n in self.choices()}.get(name.lower(), name)
        if not isinstance(name, str):
            raise unknown(self.kind, name, self.choices())
        name = self._aliases.get(name, name)
        if name not in self._entries:
            raise unknown(self.kind, name, self.choices())
        return name

    def get(self, name):
        return self._entries[self.canonical(name)]

    def __contains__(self, name):
        """Whether ``name`` (any of its spellings) is registered."""
        try:
            self.canonical(name)
        except UserError:
            return False
        return True

    def names(self):
        return list(self._entries)

    def choices(self):
        return list(self._entries) + list(self._aliases)

    def items(self):
        return self._entries.items()
