"""textbox_like: distributed training on heterogeneous infrastructure, on Accelerate.

``textbox_like.train(config)`` and ``textbox_like.evaluate(checkpoint)``: see api.py.
"""
from .parent_process import STARTED_BY  # noqa: F401  first: read as early as anything of ours runs

__version__ = "0.1.0"


def train(config=None, **settings):
    """Train with a configuration (a mapping of --print_config's keys, a YAML
    path, or a RunConfig); returns the results dict. See textbox_like.api."""
    from .api import train as run
    return run(config, **settings)


def evaluate(checkpoint, **kwargs):
    """Loss and metrics of a checkpoint on a split. See textbox_like.api."""
    from .api import evaluate as run
    return run(checkpoint, **kwargs)
