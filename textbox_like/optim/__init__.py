"""Optimizers by name.

Each entry declares its own options as a typed section (its ``options``:
group ``optimizer:<name>``, values in ``cfg.optimizer_options``) and turns
the resolved config into constructor keyword arguments;
``--optim_conf key=value`` overrides those arguments and is checked against
them. Every module of this package is imported, so a new optimizer is one new
module. Heavy imports stay inside ``build``.
"""
import dataclasses
import importlib
import pkgutil
from pathlib import Path

from textbox_like.config.schema import NoOptions, Section, setting
from textbox_like.config.value_types import float_tuple
from textbox_like.core.errors import UserError, closest
from textbox_like.config.registry import Registry
from textbox_like.optim import signatures
from textbox_like.optim.signatures import TORCH_OPTIMIZERS




class OptimizerSpec:
    """An optimizer: its class, its command-line options, and how they map
    onto the constructor's keyword arguments (``links``: key -> option dests,
    lowest priority first)."""
    torch_name = None    # class of torch.optim
    default_lr = None    # lr when the user gives none (None: the class's own default)
    overrides = {}       # our constructor defaults where they differ from the class's
    unusable = None      # why this trainer cannot run it (a reason), or None
    links = {"lr": ["lr"], "weight_decay": ["weight_decay"]}
    options = NoOptions  # its own options: a section (config/schema.py)

    @classmethod
    def optimizer_class(cls):
        import torch
        found = getattr(torch.optim, cls.torch_name, None)
        if found is None:
            raise UserError(f"optimizer {cls.name}: this torch ({torch.__version__}) has no "
                            f"torch.optim.{cls.torch_name}; choose another --optimizer")
        return found

    @classmethod
    def defaults(cls) -> dict:
        """Every constructor argument with its default (ours where we differ)."""
        own_class = cls.optimizer_class.__func__ is not OptimizerSpec.optimizer_class.__func__
        found = None if own_class else signatures.known_defaults(cls.torch_name)  # without importing torch
        if found is None:
            found = signatures.signature_defaults(cls.optimizer_class())
        out = {}
        for name, default in found.items():
            if hasattr(default, "item") and getattr(default, "numel", lambda: 2)() == 1:
                default = default.item()  # lr given as a tensor
            out[name] = list(default) if isinstance(default, tuple) else default
        for key in ("lr", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value"):
            if type(out.get(key)) is int:
                out[key] = float(out[key])
        out.update(cls.overrides)
        return out

    @classmethod
    def option_links(cls, defaults):
        links = {k: list(v) for k, v in cls.links.items() if k in defaults}
        if isinstance(defaults.get("eps"), float):
            links.setdefault("eps", []).append("epsilon")
        return links

    @classmethod
    def build(cls, param_groups, **kwargs):
        return cls.optimizer_class()(param_groups, **kwargs)


OPTIMIZERS = Registry("optimizer", base=OptimizerSpec, any_case=True, base_name="textbox_like.OptimizerSpec")
register_optimizer = OPTIMIZERS.register


def _option_value(dest, value):
    if dest == "lr":
        return float(value[0]) if isinstance(value, (list, tuple)) else float(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def betas_eps_options(prefix, eps):
    """The section of an optimizer of the Adam family: betas and epsilon
    under its own prefix (``--adam-betas``, ``--lamb-eps``, ...)."""
    return dataclasses.make_dataclass(
        f"{prefix.capitalize()}Options",
        [(f"{prefix}_betas", list, setting("(0.9, 0.999)", f"{prefix} betas, as a Python tuple literal",
                                          type=float_tuple)),
         (f"{prefix}_eps", float, setting(eps, f"{prefix} epsilon", type=float))],
        bases=(Section,), frozen=True)


class BetasEpsSpec(OptimizerSpec):
    """The Adam family: betas and epsilon under the optimizer's own prefix
    (its options: ``betas_eps_options(prefix, eps)``), which feed the
    constructor's betas and eps."""
    default_lr = 0.001

    @classmethod
    def option_links(cls, defaults):
        links = super().option_links(defaults)
        betas, eps = (f.name for f in cls.options.settings())
        links["betas"] = [betas]
        links["eps"] = [eps, "epsilon"]
        return links


def typed_like(value, default, key, optimizer, flag="--optim_conf"):
    """``value`` in the type of ``default`` (float for numbers, list for tuples)."""
    try:
        if default is None:
            return value
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
            return [v if d is None else float(v) for v, d in zip(value, default)]
        if isinstance(default, str) and not isinstance(value, str):
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{flag} {key}={value!r} for {optimizer}: expects a value like {default!r}") from None
    return value


def optimizers_with_key(key) -> list:
    """The optimizers whose constructor takes ``key`` (ESPnet2's documented
    rho=0.8 is adadelta's)."""
    found = []
    for name, spec in OPTIMIZERS.items():
        try:
            keys = spec.defaults()
        except UserError:  # an optimizer this torch lacks
            continue
        if key in keys:
            found.append(name)
    return found


def _check_conf_keys(conf, valid, optimizer, flag="--optim_conf"):
    for key in conf:
        if key not in valid:
            owners = optimizers_with_key(key)
            hint = f"; {key!r} is an option of {', '.join(owners)}: add --optim {owners[0]}" if owners else ""
            raise UserError(f"unknown key {key!r} in {flag} for optimizer {optimizer}"
                            f"{closest(key, valid)}{hint}; valid keys: {', '.join(valid)}")


def optimizer_kwargs(optim) -> dict:
    """Constructor arguments of the chosen optimizer (``optim``: the run's
    optimizer section): every argument, from --optim_conf as resolve_optim_conf
    completed it, each key checked and each value typed like the default."""
    spec = OPTIMIZERS.get(optim.optimizer)
    defaults = spec.defaults()
    _check_conf_keys(optim.optim_conf, list(defaults), optim.optimizer)
    kwargs = dict(defaults)
    for key, value in optim.optim_conf.items():
        kwargs[key] = typed_like(value, defaults[key], key, optim.optimizer)
    return kwargs


def resolve_optim_conf(ns, sources, conf_sources, layer_values, builtin_optimizer="adam"):
    """Fill ``ns.optim_conf`` with every constructor argument of the chosen
    optimizer and make the options that feed it (--lr, --weight-decay,
    --adam-eps, --epsilon, ...) agree with it.

    For each argument the value from the highest layer wins (defaults <
    properties files < --config files < command line), whether it came as an
    option or as an --optim_conf key; two different values from the same
    layer of the user's are an error. Where the user gave no learning rate
    (neither on the command line nor in a --config file) and chose another
    optimizer than the one the properties files' lr was meant for, the
    optimizer's own default applies: 0.1 for sgd, 0.001 for the Adam family
    (adam, adamw, radam, lamb), the class's default for the others."""
    from textbox_like.config.layers import CONFIG_FILE
    spec = OPTIMIZERS.get(ns.optimizer)
    defaults = spec.defaults()
    user_conf = dict(ns.optim_conf or {})
    _check_conf_keys(user_conf, list(defaults), ns.optimizer)
    links = spec.option_links(defaults)
    if getattr(ns, "epsilon", None) is not None and "eps" not in links:
        raise UserError(f"--epsilon: optimizer {ns.optimizer} has no single epsilon; "
                        f"leave --epsilon out (its arguments: {', '.join(defaults)})")
    conf = dict(defaults)
    for key, dests in links.items():
        candidates = []
        for order, dest in enumerate(dests):
            value = getattr(ns, dest, None)
            if value is not None:
                candidates.append((sources.get(dest, 0), order, _option_value(dest, value),
                                   "--" + dest.replace("_", "-")))
        if key in user_conf:
            candidates.append((conf_sources.get(key, 0), len(dests), user_conf[key], f"--optim_conf {key}"))
        if not candidates:
            continue
        top = max(c[0] for c in candidates)
        at_top = sorted(c for c in candidates if c[0] == top)
        if top == CONFIG_FILE:
            # a config file (e.g. an edited config.yaml) saying two things: refuse
            typed = [(typed_like(c[2], defaults[key], key, ns.optimizer, c[3]), c[3]) for c in at_top]
            if any(t[0] != typed[0][0] for t in typed):
                raise UserError(f"the --config files set the {ns.optimizer} argument {key!r} twice, "
                                f"{typed[0][1].lstrip('-')}: {typed[0][0]!r} and {typed[-1][1].lstrip('-')}: "
                                f"{typed[-1][0]!r}; make them agree or delete one")
        conf[key] = at_top[-1][2]  # same layer: --optim_conf, then --epsilon, beat the older options
    for key, value in user_conf.items():
        if key not in links:
            conf[key] = value
    for key in set(user_conf) | set(links):
        if key in conf and defaults.get(key) is not None:
            conf[key] = typed_like(conf[key], defaults[key], key, ns.optimizer)
    if "lr" in conf and sources.get("lr", 0) < CONFIG_FILE and conf_sources.get("lr", 0) < CONFIG_FILE:
        lr_layer = sources.get("lr", 0)
        meant_for = builtin_optimizer
        for layer in sorted(layer_values):
            if layer <= lr_layer and "optimizer" in layer_values[layer]:
                meant_for = layer_values[layer]["optimizer"]
        try:
            meant_for = OPTIMIZERS.canonical(meant_for)
        except UserError:
            pass
        if meant_for != ns.optimizer:
            conf["lr"] = float(spec.default_lr if spec.default_lr is not None else defaults["lr"])
    ns.optim_conf = conf
    for key, dests in links.items():
        for dest in dests:
            if dest == "lr":
                if not ns.lr or float(ns.lr[0]) != conf["lr"]:
                    ns.lr = [conf["lr"]]
            elif hasattr(ns, dest):
                setattr(ns, dest, list(conf[key]) if isinstance(conf[key], tuple) else conf[key])
    return conf


def lr_explained(cfg) -> str:
    """The learning rate a run uses and why, for its start line: a properties
    file's lr is meant for the optimizer that file names, so another
    optimizer (when the user gave no --lr) starts from its own default
    (resolve_optim_conf), which a user reading only the task's file would
    not expect."""
    lr = cfg.optim.optim_conf.get("lr", cfg.optim.lr[0] if cfg.optim.lr else None)
    if lr is None:
        return "lr: none (this optimizer takes none)"
    if cfg.given("lr"):
        return f"lr {float(lr)} ({cfg.source('lr')})"
    source = cfg.source("lr")
    spec = OPTIMIZERS.get(cfg.optim.optimizer)
    own = spec.default_lr if spec.default_lr is not None else spec.defaults().get("lr")
    meant_lr, meant_for = None, None
    name = "default"
    if source != "default" and Path(source).is_file():
        from textbox_like.config.layers import PROPERTIES
        path = Path(source)
        name = str(path.relative_to(PROPERTIES.parent)) if path.is_relative_to(PROPERTIES.parent) else path.name
        import yaml
        layer = yaml.safe_load(Path(source).read_text()) or {}
        meant_lr, meant_for = layer.get("lr"), layer.get("optimizer")
        meant_lr = meant_lr[0] if isinstance(meant_lr, list) else meant_lr
    if meant_lr is not None and own is not None and float(meant_lr) != float(lr) and float(lr) == float(own):
        return (f"lr {float(lr)} ({cfg.optim.optimizer}'s default; the {float(meant_lr)} of {name} "
                f"is for {meant_for or 'another optimizer'}; pass --lr to choose)")
    return f"lr {float(lr)} ({name})"


def build_optimizer(optim, param_groups, fused_default=False):
    """The optimizer of ``optim`` (the run's optimizer section).
    ``fused_default``: fuse where torch can and the user did not choose
    (the trainer asks for it on CUDA without a loss scaler)."""
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in optimizer_kwargs(optim).items()}
    if fused_default and kwargs.get("fused", False) is None and not kwargs.get("foreach") \
            and not kwargs.get("capturable") and not kwargs.get("differentiable"):
        # one kernel per step on CUDA, which also skips a non-finite update
        # by itself (found_inf), so the trainer's guard needs no host sync.
        # Not under float16's loss scaler: with a fused optimizer the scaler
        # skips inside the kernel and Accelerate no longer sees its skips
        kwargs["fused"] = True
    if kwargs.get("fused"):
        kwargs["foreach"] = False  # torch refuses both
    if "foreach" in kwargs and kwargs["foreach"] is None:
        # torch picks the one-tensor-at-a-time loop on CPU; the multi-tensor
        # kernels run on CPU and CUDA alike and are several times faster there
        kwargs["foreach"] = True
    # weight decay per group: groups the task marks no_decay (biases, norms) keep 0
    wd = kwargs.pop("weight_decay", None)
    groups = [dict(g) for g in param_groups]
    for g in groups:
        exempt = g.pop("no_decay", False)
        if wd is None:
            g.pop("weight_decay", None)
        else:
            g["weight_decay"] = 0.0 if exempt else wd
    from textbox_like.core.internals import import_dynamo_only_when_compiling
    import_dynamo_only_when_compiling()   # not 1 s of CPU in every process that steps an optimizer
    optimizer = OPTIMIZERS.get(optim.optimizer).build(groups, **kwargs)
    for group, source in zip(optimizer.param_groups, param_groups):
        group["no_decay"] = bool(source.get("no_decay", False))  # kept for --optimizer-overrides
    return optimizer


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
