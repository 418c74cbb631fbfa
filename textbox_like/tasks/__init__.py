"""Task registry. Every module in this package registers its tasks on import."""
import importlib
import pkgutil

from textbox_like.config.registry import Registry
from textbox_like.tasks.base import Task

TASKS = Registry("task", base=Task, base_name="textbox_like.Task")
register_task = TASKS.register


def _import_all():
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


_import_all()
