"""Name -> class registries for tasks, optimizers and LR schedulers."""
from .errors import unknown


class Registry:
    def __init__(self, kind):
        self.kind = kind
        self._entries = {}
        self._aliases = {}

    def register(self, name, *aliases):
        def deco(cls):
            self._entries[name] = cls
            cls.name = name
            for alias in aliases:
                self._aliases[alias] = name
            return cls
        return deco

    def canonical(self, name):
        if not isinstance(name, str):
            raise unknown(self.kind, name, list(self._entries) + list(self._aliases))
        name = self._aliases.get(name, name)
        if name not in self._entries:
            raise unknown(self.kind, name, list(self._entries) + list(self._aliases))
        return name

    def get(self, name):
        return self._entries[self.canonical(name)]

    def names(self):
        return list(self._entries)

    def choices(self):
        return list(self._entries) + list(self._aliases)

    def items(self):
        return self._entries.items()
