"""Learning-rate schedules by name, stepped once per update.

A schedule is a pure function of (update, epoch) and the configured values, so
its whole state is the update count it last saw: resuming restores the LR
exactly, and raising --max-update continues from the saved LR.
"""
import math

from .registry import Registry

SCHEDULERS = Registry("lr scheduler")
register_scheduler = SCHEDULERS.register


class Scheduler:
    def __init__(self, cfg, optimizer):
        self.cfg = cfg
        self.optimizer = optimizer
        self.lrs = list(cfg.lr)
        self.epoch = 1
        self.num_updates = 0
        self.planned_updates = 0  # updates of --max-epoch epochs, set by the trainer from the batch plan

    @staticmethod
    def add_args(options):
        pass

    def base_lr(self):
        """HetSeq/fairseq: --lr 'a,b,c' gives a per-epoch base LR; after
        --force-anneal epochs the last one is kept."""
        force = getattr(self.cfg, "force_anneal", None)
        if force is None or self.epoch < force:
            return self.lrs[min(self.epoch - 1, len(self.lrs) - 1)]
        return self.lrs[-1]

    def lr_at(self, num_updates):
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

    def get_lr(self):
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self):
        return {"num_updates": self.num_updates, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = int(state["epoch"])
        self.step_update(int(state["num_updates"]))


def _total_updates(cfg, planned_updates=0):
    """--total-num-update, else the run's length: --max-update or the updates
    of --max-epoch epochs, whichever ends it first."""
    if cfg.total_num_update:
        return cfg.total_num_update
    ends = [n for n in (cfg.max_update, planned_updates) if n]
    return min(ends) if ends else 0


@register_scheduler("PolynomialDecayScheduler", "polynomial_decay", "polynomial")
class PolynomialDecay(Scheduler):
    """Linear warm-up, then (1 - progress)^power decay to --end-learning-rate
    at --total-num-update (fairseq's polynomial_decay, HetSeq's default)."""

    @staticmethod
    def add_args(options):
        options.add("--end-learning-rate", type=float, default=0.0, help="LR at the end of the decay")
        options.add("--power", type=float, default=1.0, help="decay exponent")
        options.add("--force-anneal", type=int, default=None,
                    help="with a per-epoch --lr list, keep the last LR from this epoch on")

    def lr_at(self, n):
        lr, warmup, end = self.base_lr(), self.cfg.warmup_updates, self.cfg.end_learning_rate
        total = _total_updates(self.cfg, self.planned_updates)
        if warmup > 0 and n <= warmup:
            return lr * max(n, 1) / warmup  # fairseq: the first update already gets lr/warmup
        if total <= 0 or n >= total:
            return end if total > 0 else lr
        remaining = 1.0 - (n - warmup) / max(total - warmup, 1)
        return (lr - end) * remaining ** self.cfg.power + end


@register_scheduler("constant", "fixed")
class Constant(Scheduler):
    """Linear warm-up over --warmup-updates, then --lr."""

    def lr_at(self, n):
        lr, warmup = self.base_lr(), self.cfg.warmup_updates
        return lr * max(n, 1) / warmup if warmup > 0 and n < warmup else lr


@register_scheduler("inverse_sqrt")
class InverseSqrt(Scheduler):
    """Linear warm-up from --warmup-init-lr, then lr * sqrt(warmup / update)."""

    @staticmethod
    def add_args(options):
        options.add("--warmup-init-lr", type=float, default=0.0, help="LR at update 0")

    def lr_at(self, n):
        lr, warmup, init = self.base_lr(), self.cfg.warmup_updates, self.cfg.warmup_init_lr
        if warmup > 0 and n < warmup:
            return init + (lr - init) * n / warmup
        return lr * math.sqrt(max(warmup, 1) / max(n, 1))


@register_scheduler("cosine")
class Cosine(Scheduler):
    """Linear warm-up, then half a cosine from --lr to --min-lr at --total-num-update."""

    @staticmethod
    def add_args(options):
        options.add("--min-lr", type=float, default=0.0, help="LR at the end of the cosine")

    def lr_at(self, n):
        lr, warmup, low = self.base_lr(), self.cfg.warmup_updates, self.cfg.min_lr
        total = _total_updates(self.cfg, self.planned_updates)
        if warmup > 0 and n < warmup:
            return lr * max(n, 1) / warmup
        if total <= warmup:
            return lr
        progress = min(1.0, (n - warmup) / (total - warmup))
        return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress))


def add_args(options):
    for name, cls in SCHEDULERS.items():
        options.group(f"lr_scheduler:{name}", f"lr scheduler {name}")
        cls.add_args(options)


def build_scheduler(cfg, optimizer):
    """The scheduler of --lr-scheduler. --scheduler_conf values (already
    checked by the CLI) override the config for the schedule only; an lr in
    --optim_conf is the schedule's base LR, as the user meant."""
    import argparse
    values = dict(vars(cfg))
    if "lr" in (cfg.optim_conf or {}):
        values["lr"] = cfg.optim_conf["lr"]
    values.update(cfg.scheduler_conf or {})
    if not isinstance(values["lr"], (list, tuple)):
        values["lr"] = [float(values["lr"])]
    return SCHEDULERS.get(cfg.lr_scheduler)(argparse.Namespace(**values), optimizer)
