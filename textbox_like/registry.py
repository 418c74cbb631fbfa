"""Name -> class registries for tasks, optimizers and LR schedulers (fairseq's
pattern): a new one is a decorated class in its package, nothing else. Its
own options are a typed section (config/schema.py), given as ``dataclass=``
to the decorator or as the class's ``options``.

A registration refused (a taken name, a class of the wrong kind) is a
``RegistrationError``, one line naming the files of the classes: what a
user's component from ``--user-dir`` (plugins.py) gets to read."""
from .errors import UserError, unknown


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
    ours = Path(__file__).resolve().parent
    try:
        path = str(Path(ours.name) / Path(path).resolve().relative_to(ours))
    except ValueError:
        pass
    return f"{path}:{line}"


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
            if callable(getattr(cls, "add_args", None)):
                raise WrongKind(f"{self.kind} {name!r} ({defined_at(cls)}) defines add_args(parser), the "
                                f"fairseq/HetSeq way, which is not called here: declare its options as a frozen "
                                f"dataclass of textbox_like.setting() fields deriving from textbox_like.Section, "
                                f"and set options = YourOptions on the class (or pass dataclass=YourOptions to "
                                f"the decorator); they arrive as cfg.{self.kind.split()[-1]}_options."
                                f"<name>")
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
            if dataclass is not None:
                cls.options = dataclass
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
