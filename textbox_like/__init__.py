"""textbox_like: distributed training on heterogeneous infrastructure, on Accelerate.

``textbox_like.train(config)`` and ``textbox_like.evaluate(checkpoint)``: see api.py.
A user's own components (``--user-dir DIR``, plugins.py) derive from and
register with the names of ``PUBLIC``.
"""
from textbox_like.core.parent_process import STARTED_BY  # noqa: F401  first: read as early as anything of ours runs

__version__ = "0.1.0"


def train(config=None, **settings):
    """Train with a configuration (a mapping of --print_config's keys, a YAML
    path, or a RunConfig); returns the results dict. ``callbacks=[...]``:
    textbox_like.Callback instances (or registered names). See textbox_like.api."""
    from textbox_like.api import train as run
    return run(config, **settings)


def evaluate(checkpoint, **kwargs):
    """Loss and metrics of a checkpoint on a split. See textbox_like.api."""
    from textbox_like.api import evaluate as run
    return run(checkpoint, **kwargs)


#: the public surface for a user's own components (docs/your-own-model.md, "Your own
#: components"), imported on first use: ``import textbox_like`` and --help
#: stay light (no torch)
PUBLIC = ("Task", "register_task", "OptimizerSpec", "register_optimizer", "Scheduler", "register_scheduler",
          "Section", "setting", "BatchDataset", "Callback", "register_callback")


def __getattr__(name):
    if name == "Task":
        from textbox_like.tasks.base import Task as found
    elif name == "register_task":
        from textbox_like.tasks import register_task as found
    elif name == "OptimizerSpec":
        from textbox_like.optim import OptimizerSpec as found
    elif name == "register_optimizer":
        from textbox_like.optim import register_optimizer as found
    elif name == "Scheduler":
        from textbox_like.optim.lr_scheduler import Scheduler as found
    elif name == "register_scheduler":
        from textbox_like.optim.lr_scheduler import register_scheduler as found
    elif name == "Section":
        from textbox_like.config.schema import Section as found
    elif name == "setting":
        from textbox_like.config.schema import setting as found
    elif name == "BatchDataset":
        from textbox_like.data.base import BatchDataset as found
    elif name == "Callback":
        from textbox_like.callbacks import Callback as found
    elif name == "register_callback":
        from textbox_like.callbacks import register_callback as found
    else:
        raise AttributeError(f"module 'textbox_like' has no attribute {name!r}")
    globals()[name] = found
    return found


def __dir__():
    return sorted({*globals(), *PUBLIC})
