"""Checks: the combinations argparse cannot see, on the resolved
configuration, before anything heavy starts."""
from __future__ import annotations

import os

from textbox_like.parallel import sharding
from textbox_like.models import adapters
from textbox_like.core.errors import UserError, closest


def check(cfg):
    """Combinations argparse cannot see, checked on the resolved configuration
    before anything heavy starts."""
    from textbox_like.optim.lr_scheduler import check_scheduler
    from textbox_like.optim import OPTIMIZERS, optimizer_kwargs, typed_like
    from textbox_like.tasks import TASKS

    data, optim, ckpt = cfg.data, cfg.optim, cfg.checkpoint
    if data.max_sentences is None and data.max_tokens is None and data.global_batch_size is None:
        raise UserError("give a batch size: --max-sentences N (or --max-tokens N, or --global-batch-size N)")
    _check_global_batch(cfg)
    if not cfg.schedule.max_epoch and not cfg.schedule.max_update:
        raise UserError("training would never stop: set --max-epoch or --max-update")
    if cfg.numerics.fp16 and cfg.numerics.bf16:
        raise UserError("--fp16 and --bf16 exclude each other; choose one")
    _check_callbacks(cfg.callbacks.callbacks)
    spec = OPTIMIZERS.get(optim.optimizer)
    if spec.unusable:
        raise UserError(f"--optimizer {optim.optimizer}: {spec.unusable}; choose another optimizer")
    optim_keys = optimizer_kwargs(optim)
    check_scheduler(cfg)
    if ckpt.restore_file and ckpt.resume:
        raise UserError("--resume and --restore-file exclude each other: --resume reads checkpoint_last.pt "
                        "from --save-dir, --restore-file the file you name")
    if not isinstance(ckpt.optimizer_overrides, dict):
        raise UserError("--optimizer-overrides expects a dict literal like \"{'lr': 0.5}\"")
    for key, value in ckpt.optimizer_overrides.items():
        if key not in optim_keys:
            raise UserError(f"unknown key {key!r} in --optimizer-overrides for {optim.optimizer}"
                            f"{closest(key, optim_keys)}; valid keys: {', '.join(sorted(optim_keys))}")
        typed_like(value, optim_keys[key], key, optim.optimizer, "--optimizer-overrides")
    dist = cfg.distributed
    if dist.distributed_no_spawn and not dist.distributed_init_method and "RANK" not in os.environ:
        raise UserError("--distributed-no-spawn needs --distributed-init-method (or a launcher that sets RANK)")
    if os.path.exists(ckpt.save_dir) and not os.path.isdir(ckpt.save_dir):
        raise UserError(f"--save-dir {ckpt.save_dir} is a file, not a directory; choose another path")
    sharding.check_settings(cfg)
    adapters.check_options(cfg)
    task = TASKS.get(data.task)
    task.check_config(cfg)
    metric = cfg.validation.best_checkpoint_metric
    if metric and task.metric_names and metric not in task.metric_names:
        raise UserError(f"--best-checkpoint-metric {metric!r} is not a metric of task "
                        f"{data.task}{closest(metric, task.metric_names)}; "
                        f"choose from: {', '.join(task.metric_names)}")
    _check_optimizer_values(optim)  # last: the one check that imports torch (a refusal above needs none)


def _check_global_batch(cfg):
    """--global-batch-size and what goes with it (with --max-tokens it counts tokens: see balance.py)."""
    data, dist = cfg.data, cfg.distributed
    if dist.balance and not data.global_batch_size:
        raise UserError("--balance re-splits a fixed global batch by the ranks' speed: give --global-batch-size N")
    if not data.global_batch_size:
        return
    if any(k != 1 for k in cfg.schedule.update_freq):
        raise UserError("--global-batch-size sets the samples of an update; leave --update-freq out (a rank runs "
                        "as many micro-batches of --max-sentences as its share needs)")


def _check_optimizer_values(optim):
    """Let torch judge the values (lr < 0, rho > 1, betas of the wrong length)
    on one dummy parameter, before any data is read."""
    import torch

    from textbox_like.optim import build_optimizer
    try:
        build_optimizer(optim, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    except IndexError:
        raise UserError(f"optimizer {optim.optimizer}: betas must be two numbers, like '(0.9, 0.999)'") from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"optimizer {optim.optimizer}: {exc}; check --lr, --weight-decay and its own options") \
            from None


def _check_callbacks(names):
    """Every --callbacks name is a registered class (a --user-dir package's are registered by now)."""
    from textbox_like.callbacks import CALLBACKS
    for name in names:
        if name not in CALLBACKS:
            known = ", ".join(CALLBACKS.names()) or "none is registered"
            raise UserError(f"--callbacks {name}: no callback of that name{closest(name, CALLBACKS.choices())} "
                            f"(registered: {known}); register a textbox_like.Callback subclass with "
                            f"@register_callback({name!r}) in your --user-dir package")
