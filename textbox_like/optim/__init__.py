"""Optimizers by name.

Each entry registers its own command-line options (group ``optimizer:<name>``)
and turns the resolved config into constructor keyword arguments;
``--optim_conf key=value`` overrides those arguments and is checked against
them. Every module of this package is imported, so a new optimizer is one new
module. Heavy imports stay inside ``build``.
"""
import importlib
import pkgutil

from ..errors import UserError, closest
from ..registry import Registry

OPTIMIZERS = Registry("optimizer")
register_optimizer = OPTIMIZERS.register


class OptimizerSpec:
    @staticmethod
    def add_args(options):
        pass

    @staticmethod
    def kwargs(cfg) -> dict:
        """Constructor keyword arguments from the resolved config."""
        return {"lr": cfg.lr[0], "weight_decay": cfg.weight_decay}

    @staticmethod
    def build(param_groups, **kwargs):
        raise NotImplementedError


def build_optimizer(cfg, param_groups):
    spec = OPTIMIZERS.get(cfg.optimizer)
    kwargs = spec.kwargs(cfg)
    for key, value in (cfg.optim_conf or {}).items():
        if key not in kwargs:
            raise UserError(f"unknown key {key!r} in --optim_conf for optimizer {cfg.optimizer}"
                            f"{closest(key, kwargs)}; valid keys: {', '.join(sorted(kwargs))}")
        kwargs[key] = value
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    # weight decay is set per group by the task (biases and norms exempt)
    wd = kwargs.pop("weight_decay", None)
    groups = [dict(g) for g in param_groups]
    for g in groups:
        if wd is not None and g.get("weight_decay", None) != 0.0:
            g["weight_decay"] = wd
        elif wd is None:
            g.pop("weight_decay", None)
    return spec.build(groups, **kwargs)


def add_args(options):
    for name, spec in OPTIMIZERS.items():
        options.group(f"optimizer:{name}", f"optimizer {name}")
        spec.add_args(options)


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
