"""Learning-rate schedules by name.

Ours (PolynomialDecayScheduler, constant, inverse_sqrt, cosine) are stepped
once per update and are pure functions of (update, epoch) and the configured
values, so their whole state is the update count they last saw: resuming
restores the LR exactly, and raising --max-update continues from the saved LR.

Every scheduler of torch.optim.lr_scheduler is there too, by its class name in
any case (ESPnet2's spellings: steplr, ReduceLROnPlateau, ...), its
constructor arguments in --scheduler_conf. They step as in ESPnet2: StepLR,
MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, ConstantLR and
PolynomialLR once per epoch; CyclicLR, OneCycleLR and
CosineAnnealingWarmRestarts once per update (--scheduler-interval changes
it); ReduceLROnPlateau once per validation, on the value of
--best-checkpoint-metric.

What the trainer calls, on every scheduler: ``step_epoch(epoch)`` at the
start of each epoch, ``step_update(num_updates) -> lr`` after each update,
``step_valid(value)`` after each validation with the value of the
best-checkpoint metric, ``state_dict()``/``load_state_dict()``;
``planned_updates`` (the updates of --max-epoch epochs) is set by the trainer
before the first step.
"""
import math
from dataclasses import dataclass

from textbox_like.config.schema import NoOptions, Section, setting
from textbox_like.core.errors import UserError, closest, first_line
from textbox_like.config.registry import Registry


class Scheduler:
    def __init__(self, cfg, optimizer):
        self.cfg = cfg
        self.optimizer = optimizer
        self.epoch = 1
        self.num_updates = 0
        self.planned_updates = 0  # updates of --max-epoch epochs, set by the trainer from the batch plan

    #: its own options: a section (config/schema.py); values in cfg.scheduler_options
    options = NoOptions

    @property
    def lrs(self):
        """The base LRs (HetSeq: one per epoch), read from the configuration."""
        return self.cfg.optim.lr

    def rebase(self, lr):
        """--optimizer-overrides' lr on a restore: the schedule's base LR
        from now on (the run's configuration, and config.yaml, keep --lr)."""
        self.cfg = self.cfg.replace("--optimizer-overrides", lr=[lr])

    def base_lr(self):
        """HetSeq/fairseq: --lr 'a,b,c' gives a per-epoch base LR; after
        --force-anneal epochs the last one is kept."""
        force = getattr(self.cfg.scheduler_options, "force_anneal", None)  # PolynomialDecayScheduler's
        if force is None or self.epoch < force:
            return self.lrs[min(self.epoch - 1, len(self.lrs) - 1)]
        return self.lrs[-1]

    def lr_at(self, n):
        """The LR at update ``n``: the linear warm-up over --warmup-updates
        (from warmup_start(); None: fairseq's lr/warmup at the first update),
        then the schedule's own curve."""
        lr, warmup, start = self.base_lr(), self.cfg.schedule.warmup_updates, self.warmup_start()
        if warmup > 0 and n < warmup:
            return lr * max(n, 1) / warmup if start is None else start + (lr - start) * n / warmup
        return self.after_warmup(n)

    def warmup_start(self):
        return None

    def after_warmup(self, n):
        raise NotImplementedError

    def step_epoch(self, epoch):
        self.epoch = epoch
        self.step_update(self.num_updates)

    def step_update(self, num_updates):
        self.num_updates = num_updates
        lr = self.lr_at(num_updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step_valid(self, value):
        """After a validation, with the value of the best-checkpoint metric:
        nothing for schedules of updates and epochs."""
        return self.get_lr()

    def get_lr(self):
        return self.optimizer.param_groups[0]["lr"]

    def describe(self) -> str:
        """The schedule in a few words, for the start line: the warm-up, then
        :meth:`curve` (a user reading only --lr would not expect a decay)."""
        warmup = self.cfg.schedule.warmup_updates
        curve = self.curve()
        return (f"warm-up {warmup} updates, then {curve}" if warmup > 0 else curve)

    def curve(self) -> str:
        """What the LR does after the warm-up."""
        return f"the {self.cfg.schedule.lr_scheduler} schedule"

    def state_dict(self):
        return {"num_updates": self.num_updates, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = int(state["epoch"])
        self.step_update(int(state["num_updates"]))


SCHEDULERS = Registry("lr scheduler", base=Scheduler, any_case=True, base_name="textbox_like.Scheduler")
register_scheduler = SCHEDULERS.register

def _total_updates(cfg, planned_updates=0):
    """--total-num-update, else the run's length: --max-update or the updates
    of --max-epoch epochs, whichever ends it first."""
    if cfg.schedule.total_num_update:
        return cfg.schedule.total_num_update
    ends = [n for n in (cfg.schedule.max_update, planned_updates) if n]
    return min(ends) if ends else 0


@dataclass(frozen=True)
class PolynomialDecayOptions(Section):
    end_learning_rate: float = setting(0.0, "LR at the end of the decay", type=float)
    power: float = setting(1.0, "decay exponent", type=float)
    force_anneal: int | None = setting(None, "with a per-epoch --lr list, keep the last LR from this epoch on", type=int)


@register_scheduler("PolynomialDecayScheduler", "polynomial_decay", "polynomial", dataclass=PolynomialDecayOptions)
class PolynomialDecay(Scheduler):
    """Linear warm-up, then (1 - progress)^power decay to --end-learning-rate
    at --total-num-update (fairseq's polynomial_decay, HetSeq's default)."""

    def lr_at(self, n):
        lr, warmup, end = self.base_lr(), self.cfg.schedule.warmup_updates, self.cfg.scheduler_options.end_learning_rate
        total = _total_updates(self.cfg, self.planned_updates)
        if warmup > 0 and n <= warmup:
            return lr * max(n, 1) / warmup  # fairseq: the first update already gets lr/warmup
        if total <= 0 or n >= total:
            return end if total > 0 else lr
        remaining = 1.0 - (n - warmup) / max(total - warmup, 1)
        return (lr - end) * remaining ** self.cfg.scheduler_options.power + end

    def curve(self):
        total = _total_updates(self.cfg, self.planned_updates)
        options = self.cfg.scheduler_options
        shape = "linear" if options.power == 1 else f"power {options.power:g}"
        return (f"{shape} decay to {options.end_learning_rate:g} at update {total:,} (--end-learning-rate)"
                if total > 0 else "constant (no --max-update or --total-num-update to decay over)")


@register_scheduler("constant", "fixed")
class Constant(Scheduler):
    """Linear warm-up over --warmup-updates, then --lr."""

    def after_warmup(self, n):
        return self.base_lr()

    def curve(self):
        return "constant"


@dataclass(frozen=True)
class InverseSqrtOptions(Section):
    warmup_init_lr: float = setting(0.0, "LR at update 0", type=float)


@register_scheduler("inverse_sqrt", dataclass=InverseSqrtOptions)
class InverseSqrt(Scheduler):
    """Linear warm-up from --warmup-init-lr, then lr * sqrt(warmup / update)."""

    def warmup_start(self):
        return self.cfg.scheduler_options.warmup_init_lr

    def after_warmup(self, n):
        return self.base_lr() * math.sqrt(max(self.cfg.schedule.warmup_updates, 1) / max(n, 1))

    def curve(self):
        return "1/sqrt(update) decay"


@dataclass(frozen=True)
class CosineOptions(Section):
    min_lr: float = setting(0.0, "LR at the end of the cosine", type=float)


@register_scheduler("cosine", dataclass=CosineOptions)
class Cosine(Scheduler):
    """Linear warm-up, then half a cosine from --lr to --min-lr at --total-num-update."""

    def after_warmup(self, n):
        lr, warmup, low = self.base_lr(), self.cfg.schedule.warmup_updates, self.cfg.scheduler_options.min_lr
        total = _total_updates(self.cfg, self.planned_updates)
        if total <= warmup:
            return lr
        progress = min(1.0, (n - warmup) / (total - warmup))
        return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress))

    def curve(self):
        total = _total_updates(self.cfg, self.planned_updates)
        return (f"cosine decay to {self.cfg.scheduler_options.min_lr:g} at update {total:,} (--min-lr)" if total > 0
                else "constant (no --max-update or --total-num-update to decay over)")


# ------------------------------------------------------------ torch.optim.lr_scheduler
#: every scheduler class of torch.optim.lr_scheduler and when it steps
#: (a test checks this list against torch); None: needs Python objects
#: (functions, other schedulers) a configuration cannot hold
TORCH_SCHEDULERS = {
    "StepLR": "epoch", "MultiStepLR": "epoch", "ExponentialLR": "epoch", "CosineAnnealingLR": "epoch",
    "LinearLR": "epoch", "ConstantLR": "epoch", "PolynomialLR": "epoch",
    "CyclicLR": "update", "OneCycleLR": "update", "CosineAnnealingWarmRestarts": "update",
    "ReduceLROnPlateau": "valid",
    "LambdaLR": None, "MultiplicativeLR": None, "SequentialLR": None, "ChainedScheduler": None,
}
#: arguments that default to the run's length in the scheduler's steps when null
RUN_LENGTH_ARGS = {"CosineAnnealingLR": "T_max", "OneCycleLR": "total_steps"}


def _quiet():
    import warnings
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
    warnings.filterwarnings("ignore", message=".*epoch parameter.*")
    return context


@dataclass(frozen=True)
class TorchSchedulerOptions(Section):
    scheduler_interval: str = setting("auto", "torch schedulers: step once per epoch or per update (auto: ESPnet2's "
                                              "choice for the class; ReduceLROnPlateau always steps per validation)",
                                      choices=["auto", "epoch", "update"])


class TorchScheduler(Scheduler):
    """A torch.optim.lr_scheduler class behind our interface. Built at the
    first step (the run's length is known then); its state is torch's plus the
    number of steps taken, which follows the update or epoch count, so a
    resumed run (or one restarted with --reset-lr-scheduler) reaches the same
    LR."""
    torch_name = None
    interval = "epoch"
    options = TorchSchedulerOptions

    @classmethod
    def scheduler_class(cls):
        import torch.optim.lr_scheduler as module
        found = getattr(module, cls.torch_name, None)
        if found is None:
            import torch
            raise UserError(f"lr scheduler {cls.name}: this torch ({torch.__version__}) has no "
                            f"torch.optim.lr_scheduler.{cls.torch_name}; choose another --scheduler")
        return found

    @classmethod
    def signature(cls):
        """{argument: default or REQUIRED}"""
        import inspect
        out = {}
        for name, param in inspect.signature(cls.scheduler_class()).parameters.items():
            if name in ("self", "optimizer", "last_epoch", "verbose") or \
                    param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            default = REQUIRED if param.default is param.empty else param.default
            out[name] = list(default) if isinstance(default, tuple) else default
        if cls.torch_name in RUN_LENGTH_ARGS:
            out[RUN_LENGTH_ARGS[cls.torch_name]] = None
        return out

    def __init__(self, cfg, optimizer):
        super().__init__(cfg, optimizer)
        self.conf = dict(cfg.schedule.scheduler_conf or {})
        chosen = cfg.scheduler_options.scheduler_interval or "auto"
        if self.interval != "valid" and chosen != "auto":
            self.interval = chosen
        self.steps = 0
        self.torch = None

    def _run_length(self):
        total = self.cfg.schedule.max_epoch if self.interval == "epoch" else \
            _total_updates(self.cfg, self.planned_updates)
        if not total:
            raise UserError(f"--scheduler {self.name}: give {RUN_LENGTH_ARGS[self.torch_name]} in "
                            f"--scheduler_conf, or --max-update / --max-epoch")
        return total

    def _build(self):
        if self.torch is not None:
            return
        conf = dict(self.conf)
        length_arg = RUN_LENGTH_ARGS.get(self.torch_name)
        if length_arg and conf.get(length_arg) is None and not (
                self.torch_name == "OneCycleLR" and conf.get("epochs") and conf.get("steps_per_epoch")):
            conf[length_arg] = self._run_length()
        conf = {k: tuple(v) if isinstance(v, list) and k != "milestones" else v for k, v in conf.items()}
        quiet = _quiet()
        try:
            self.torch = self.scheduler_class()(self.optimizer, **conf)
        finally:
            quiet.__exit__(None, None, None)

    def _target(self):
        if self.interval == "update":
            return self.num_updates
        if self.interval == "epoch":
            return self.epoch - 1
        return self.steps  # per validation: only step_valid steps

    def _advance(self):
        self._build()
        quiet = _quiet()
        try:
            while self.steps < self._target():
                self.torch.step()
                self.steps += 1
        finally:
            quiet.__exit__(None, None, None)
        return self.get_lr()

    def step_epoch(self, epoch):
        self.epoch = epoch
        return self._advance()

    def step_update(self, num_updates):
        self.num_updates = num_updates
        return self._advance()

    def state_dict(self):
        self._build()
        return {"num_updates": self.num_updates, "epoch": self.epoch, "steps": self.steps,
                "torch": self.torch.state_dict()}

    def load_state_dict(self, state):
        self._build()
        self.epoch, self.num_updates = int(state["epoch"]), int(state["num_updates"])
        if "torch" in state:
            self.torch.load_state_dict(state["torch"])
            self.steps = int(state.get("steps", 0))
            last = getattr(self.torch, "_last_lr", None)
            if last:
                for group, lr in zip(self.optimizer.param_groups, last):
                    group["lr"] = lr
        self._advance()


class ReduceLROnPlateauScheduler(TorchScheduler):
    """torch's ReduceLROnPlateau, stepped by step_valid on the best-checkpoint
    metric after each validation (mode follows that metric unless given)."""
    interval = "valid"

    def step_valid(self, value):
        self._build()
        self.torch.step(float(value))
        self.steps += 1
        return self.get_lr()


REQUIRED = "<required>"


def _register_torch_schedulers():
    for class_name, interval in TORCH_SCHEDULERS.items():
        base = ReduceLROnPlateauScheduler if interval == "valid" else TorchScheduler
        cls = type(class_name, (base,), {"torch_name": class_name, "interval": interval or "epoch",
                                         "unusable": None if interval else
                                         f"{class_name} takes Python functions or other schedulers, "
                                         f"which a configuration cannot hold",
                                         "__doc__": f"torch.optim.lr_scheduler.{class_name}"})
        SCHEDULERS.register(class_name)(cls)


_register_torch_schedulers()


def resolve_scheduler_conf(ns, scheduler_options, maximize=None):
    """Check --scheduler_conf against the chosen scheduler; for a torch
    scheduler fill it with every constructor argument (nulls where the run's
    length is used), so --print_config shows them all."""
    cls = SCHEDULERS.get(ns.lr_scheduler)
    conf = dict(ns.scheduler_conf or {})
    if not issubclass(cls, TorchScheduler):
        valid = set(scheduler_options) | {"lr", "warmup_updates", "total_num_update"}
        for key in conf:
            if key not in valid:
                raise UserError(f"unknown key {key!r} in --scheduler_conf for {ns.lr_scheduler}"
                                f"{closest(key, valid)}; valid keys: {', '.join(sorted(valid))}")
        return conf
    signature = cls.signature()
    for key in conf:
        if key not in signature:
            raise UserError(f"unknown key {key!r} in --scheduler_conf for {ns.lr_scheduler}"
                            f"{closest(key, signature)}; valid keys: {', '.join(signature)}")
    full = {**signature, **conf}
    if cls.torch_name == "ReduceLROnPlateau" and "mode" not in conf and maximize is not None:
        full["mode"] = "max" if maximize else "min"
    missing = [k for k, v in full.items() if v is REQUIRED or v == REQUIRED]
    if getattr(cls, "unusable", None):
        full = {k: None if k in missing else v for k, v in full.items()}  # refused by check_scheduler
    elif missing:
        raise UserError(f"--scheduler {ns.lr_scheduler} needs {', '.join(missing)} in --scheduler_conf, "
                        f"e.g. --scheduler_conf {missing[0]}=...; its arguments: {', '.join(signature)}")
    ns.scheduler_conf = full
    return full


def check_scheduler(cfg):
    """Let torch judge the --scheduler_conf values on a dummy optimizer."""
    cls = SCHEDULERS.get(cfg.schedule.lr_scheduler)
    if getattr(cls, "unusable", None):
        raise UserError(f"--scheduler {cfg.schedule.lr_scheduler}: {cls.unusable}; choose another scheduler")
    if not issubclass(cls, TorchScheduler):
        return
    import torch

    from textbox_like.core.internals import import_dynamo_only_when_compiling
    import_dynamo_only_when_compiling()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=max(float(cfg.optim.lr[0]), 1e-12),
                                momentum=0.9)
    scheduler = build_scheduler(cfg, optimizer)
    scheduler.planned_updates = max(cfg.schedule.max_update or 0, 1)
    try:
        scheduler.step_epoch(1)
    except (ValueError, TypeError, ZeroDivisionError, KeyError) as exc:
        first = first_line(exc)
        raise UserError(f"--scheduler {cfg.schedule.lr_scheduler}: {first}; check --scheduler_conf") from None


def build_scheduler(cfg, optimizer):
    """The scheduler of --lr-scheduler. For ours, --scheduler_conf keys
    (checked by resolve_scheduler_conf) stand for the schedule's own settings
    (--lr, --warmup-updates, --end-learning-rate, ...), for the schedule only.
    A torch scheduler gets --scheduler_conf as its constructor arguments."""
    from textbox_like.config.value_types import float_list
    cls = SCHEDULERS.get(cfg.schedule.lr_scheduler)
    if issubclass(cls, TorchScheduler):
        return cls(cfg, optimizer)
    conf = dict(cfg.schedule.scheduler_conf or {})
    if "lr" in conf:
        conf["lr"] = float_list(conf["lr"])
    return cls(cfg.replace("--scheduler_conf", **conf) if conf else cfg, optimizer)
