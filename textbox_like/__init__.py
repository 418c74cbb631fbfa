"""textbox_like: distributed training on heterogeneous infrastructure, on Accelerate.

``textbox_like.train(config)`` and ``textbox_like.evaluate(checkpoint)``: see api.py.
"""
import os as _os

__version__ = "0.1.0"

#: the process that started this one, read as early as anything of ours runs:
#: a worker compares it with getppid() to tell that its launcher (torchrun's
#: agent) died before the worker asked to die with it (cli.elastic_restart)
STARTED_BY = _os.getppid()


def train(config=None, **settings):
    """Train with a configuration (a mapping of --print_config's keys, a YAML
    path, or a RunConfig); returns the results dict. See textbox_like.api."""
    from .api import train as run
    return run(config, **settings)


def evaluate(checkpoint, **kwargs):
    """Loss and metrics of a checkpoint on a split. See textbox_like.api."""
    from .api import evaluate as run
    return run(checkpoint, **kwargs)
