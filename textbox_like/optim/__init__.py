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


class BetasEpsSpec(OptimizerSpec):
    """The Adam family: betas and epsilon under the optimizer's own prefix
    (``--adam-betas``, ``--lamb-eps``, ...)."""
    prefix = "adam"
    eps = 1e-8

    @classmethod
    def add_args(cls, options):
        from ..config import float_tuple
        options.add(f"--{cls.prefix}-betas", type=float_tuple, default="(0.9, 0.999)",
                    help=f"{cls.prefix} betas, as a Python tuple literal")
        options.add(f"--{cls.prefix}-eps", type=float, default=cls.eps, help=f"{cls.prefix} epsilon")

    @classmethod
    def kwargs(cls, cfg):
        return {"lr": cfg.lr[0], "betas": list(getattr(cfg, f"{cls.prefix}_betas")),
                "eps": getattr(cfg, f"{cls.prefix}_eps"), "weight_decay": cfg.weight_decay}


def _like(value, default, key, optimizer, flag="--optim_conf"):
    """``value`` in the type of ``default`` (float for numbers, list for tuples)."""
    try:
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError
            return value
        if isinstance(default, (int, float)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError
            return float(value) if isinstance(default, float) else value
        if isinstance(default, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(default):
                raise ValueError
            return [float(v) for v in value]
    except (TypeError, ValueError):
        raise UserError(f"{flag} {key}={value!r} for {optimizer}: expects a value like {default!r}") from None
    return value


def optimizer_kwargs(cfg) -> dict:
    """Constructor arguments of the chosen optimizer: its options, then
    --optim_conf, each key checked and each value typed like the default."""
    spec = OPTIMIZERS.get(cfg.optimizer)
    kwargs = spec.kwargs(cfg)
    for key, value in (cfg.optim_conf or {}).items():
        if key not in kwargs:
            raise UserError(f"unknown key {key!r} in --optim_conf for optimizer {cfg.optimizer}"
                            f"{closest(key, kwargs)}; valid keys: {', '.join(sorted(kwargs))}")
        kwargs[key] = _like(value, kwargs[key], key, cfg.optimizer)
    return kwargs


def build_optimizer(cfg, param_groups):
    kwargs = optimizer_kwargs(cfg)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    # weight decay per group: groups the task marks no_decay (biases, norms) keep 0
    wd = kwargs.pop("weight_decay", None)
    groups = [dict(g) for g in param_groups]
    for g in groups:
        exempt = g.pop("no_decay", False)
        if wd is None:
            g.pop("weight_decay", None)
        else:
            g["weight_decay"] = 0.0 if exempt else wd
    optimizer = OPTIMIZERS.get(cfg.optimizer).build(groups, **kwargs)
    for group, source in zip(optimizer.param_groups, param_groups):
        group["no_decay"] = bool(source.get("no_decay", False))  # kept for --optimizer-overrides
    return optimizer


def add_args(options):
    for name, spec in OPTIMIZERS.items():
        options.group(f"optimizer:{name}", f"optimizer {name}")
        spec.add_args(options)


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
