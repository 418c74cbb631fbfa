"""Name -> class registries for tasks, optimizers and LR schedulers (fairseq's
pattern): a new one is a decorated class in its package, nothing else. Its
own options are a typed section (config/schema.py), given as ``dataclass=``
to the decorator or as the class's ``options``."""
from .errors import UserError, unknown


class Registry:
    """``base``: every registered class must derive from it; ``any_case``:
    names are found in any case (ESPnet2 writes adam and sgd, torch Adam and
    SGD)."""

    def __init__(self, kind, base=None, any_case=False):
        self.kind, self.base, self.any_case = kind, base, any_case
        self._entries = {}
        self._aliases = {}

    def register(self, name, *aliases, dataclass=None):
        """A class decorator. ``dataclass``: the section of the class's own
        options (a frozen dataclass of ``setting`` fields, as fairseq's
        ``@register_optimizer("adam", dataclass=...)``); left out, the
        class's ``options`` (inherited: none of its own)."""
        def deco(cls):
            if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.kind} {name!r}: {cls!r} is not a subclass of {self.base.__name__}")
            for taken in (name, *aliases):
                if self._key(taken) in self._keys():
                    raise ValueError(f"{self.kind} {taken!r} is registered already "
                                     f"({self._entries.get(self.canonical(taken))!r})")
            self._entries[name] = cls
            cls.name = name
            if dataclass is not None:
                cls.options = dataclass
            for alias in aliases:
                self._aliases[alias] = name
            return cls
        return deco

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
