"""The command line of run_hetseq.py: options, checks, and the hand-off to the
launcher (distributed.py) or the trainer (trainer.py).

Heavy libraries are imported only after the arguments are known to be good,
so ``--help`` and every bad-input error answer at once.
"""
from __future__ import annotations

import argparse
import os
import sys

from . import config as C
from .errors import UserError, closest


def float_list(text):
    """--lr: one LR, or HetSeq's per-epoch list 'a,b,c'."""
    try:
        if isinstance(text, (int, float)):
            return [float(text)]
        if isinstance(text, (list, tuple)):
            return [float(v) for v in text]
        return [float(v) for v in str(text).strip("[] ").split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number (or numbers 'a,b,c'), got {text!r}") from None


def _typed(fn, what):
    def convert(text):
        try:
            return fn(text)
        except (ValueError, TypeError, SyntaxError) as exc:
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None
    convert.__name__ = fn.__name__
    return convert


POSITIVE = C.positive_int
NONNEG = C.nonneg_int
INT_LIST = _typed(C.int_list, "positive integers like 4 or 4,2,1")
STR_LIST = _typed(C.str_list, "a comma-separated list")
def _literal_dict(text):
    import ast
    return text if isinstance(text, dict) else ast.literal_eval(str(text)) or {}


LITERAL_DICT = _typed(_literal_dict, "a Python dict literal like \"{'lr': 0.5}\"")
BOOL = _typed(C.str2bool, "true or false")


def SEED(text):
    value = C.nonneg_int(text)
    if value >= 2 ** 32:
        raise argparse.ArgumentTypeError(f"expects an integer from 0 to 2**32 - 1, got {text!r}")
    return value


def build_options():
    from .lr_scheduler import SCHEDULERS
    from .lr_scheduler import add_args as add_scheduler_args
    from .optim import OPTIMIZERS
    from .optim import add_args as add_optimizer_args
    from .tasks import TASKS

    o = C.Options("run_hetseq.py", "Train a task on one process, one node or several unlike nodes.")
    o.group("meta", "configuration files")
    o.add("--config", action="append", default=[], metavar="FILE",
          help="YAML file of option: value (repeatable; later files win; the command line wins over all)")
    o.add("--print_config", action="store_true", help="print the resolved configuration as YAML and exit")

    o.group("common", "task and data")
    o.add("--task", default="mnist", help=f"one of: {', '.join(TASKS.names())}")
    o.add("--data", default=None, help="data directory or file (MNIST: the idx files; fetched when left out)")
    o.add("--train-subset", default="train", help="split to train on")
    o.add("--valid-subset", type=STR_LIST, default="valid", help="comma-separated splits to validate on")
    o.add("--max-sentences", type=POSITIVE, default=None, help="batch size per process")
    o.add_alias("--batch-size", "max_sentences")
    o.add("--max-sentences-valid", type=POSITIVE, default=None, help="validation batch size per process")
    o.add("--max-tokens", type=POSITIVE, default=None, help="limit of real tokens per batch and process")
    o.add("--required-batch-size-multiple", type=POSITIVE, default=1, help="batch sizes are rounded to this")
    o.add("--num-workers", type=NONNEG, default=0, help="batches read ahead in the background (0: inline)")
    o.add("--no-shuffle", action="store_true", help="train in data order")
    o.add("--num_iters_per_epoch", type=NONNEG, default=0, help="cap on updates per epoch (0: whole epoch)")
    o.add("--fast-stat-sync", action="store_true",
          help="HetSeq compatibility: statistics are always summed over ranks once per log interval")
    o.add("--model_conf", action=C.MergeDict, default={},
          help="model options, key=value or '{key: value}' (repeatable)")

    o.group("optimization", "optimization")
    o.add("--optimizer", default="adam", help=f"one of: {', '.join(OPTIMIZERS.choices())}")
    o.add("--lr", type=float_list, default="0.001", help="learning rate (HetSeq: 'a,b,c' per epoch)")
    o.add("--weight-decay", "--wd", type=float, default=0.0, help="weight decay")
    o.add("--optim_conf", action=C.MergeDict, default={},
          help="optimizer constructor overrides, key=value or '{key: value}' (repeatable)")
    o.add("--lr-scheduler", default="PolynomialDecayScheduler", help=f"one of: {', '.join(SCHEDULERS.choices())}")
    o.add("--warmup-updates", type=NONNEG, default=0, help="linear LR warm-up over this many updates")
    o.add("--total-num-update", type=NONNEG, default=0, help="updates of the LR decay (0: --max-update)")
    o.add("--scheduler_conf", action=C.MergeDict, default={},
          help="LR scheduler overrides, key=value or '{key: value}' (repeatable)")
    o.add("--max-epoch", type=NONNEG, default=0, help="stop after this many epochs (0: no limit)")
    o.add("--max-update", type=NONNEG, default=0, help="stop after this many updates (0: no limit)")
    o.add("--update-freq", type=INT_LIST, default="1", help="accumulate gradients over N batches "
          "(HetSeq: 'a,b,c' per epoch)")
    o.add_alias("--accum_grad", "update_freq")
    o.add("--clip-norm", type=float, default=0.0, help="clip the gradient norm to this (0: no clipping)")
    o.add("--fp16", action="store_true", help="float16 mixed precision (CUDA; bfloat16 on CPU)")
    o.add("--bf16", action="store_true", help="bfloat16 mixed precision")
    o.add("--train_dtype", choices=["float32", "float16", "bfloat16"], default="float32",
          help="training precision")
    o.add("--seed", type=SEED, default=1, help="seed of python, numpy, torch and the batch order")
    o.add("--cudnn_deterministic", action="store_true", help="deterministic cuDNN kernels")
    o.add("--cpu", action="store_true", help="train on CPU even when CUDA is present")
    o.add("--threads", type=NONNEG, default=0,
          help="torch intra-op threads per process (0: the cores divided among this node's processes)")

    o.group("validation", "validation")
    o.add("--validate-interval", type=POSITIVE, default=1, help="validate every N epochs")
    o.add("--validate-interval-updates", type=NONNEG, default=0, help="validate every N updates (0: off)")
    o.add("--disable-validation", action="store_true", help="never validate")
    o.add("--best-checkpoint-metric", default=None, help="metric for checkpoint_best.pt (task default if unset)")
    o.add("--maximize-best-checkpoint-metric", type=BOOL, nargs="?", const=True, default=None,
          help="higher is better for --best-checkpoint-metric (task default if unset)")

    o.group("checkpoint", "checkpoints and resuming")
    o.add("--save-dir", default="checkpoints", help="where checkpoints, config.yaml and metrics go")
    o.add("--save-interval", type=POSITIVE, default=1, help="save every N epochs")
    o.add("--save-interval-updates", type=NONNEG, default=0, help="save every N updates (0: off)")
    o.add("--keep-interval-updates", type=NONNEG, default=0, help="keep the newest N update checkpoints (0: all)")
    o.add("--keep-last-epochs", type=NONNEG, default=0, help="keep the newest N epoch checkpoints (0: all)")
    o.add("--no-epoch-checkpoints", action="store_true", help="no checkpoint{epoch}.pt")
    o.add("--no-last-checkpoints", action="store_true", help="no checkpoint_last.pt")
    o.add("--no-save-optimizer-state", action="store_true", help="leave the optimizer state out")
    o.add("--no-save", action="store_true", help="write no checkpoints and no files")
    o.add("--resume", action="store_true", help="continue from checkpoint_last.pt in --save-dir, if any")
    o.add("--restore-file", default=None, help="start from this checkpoint")
    o.add("--reset-optimizer", action="store_true", help="do not restore the optimizer state")
    o.add("--reset-lr-scheduler", action="store_true", help="do not restore the LR schedule")
    o.add("--reset-meters", action="store_true", help="do not restore meters and the best metric")
    o.add("--reset-dataloader", action="store_true", help="do not restore the position in the data")
    o.add("--optimizer-overrides", type=LITERAL_DICT, default="{}",
          help="dict literal of optimizer values to override on restore, e.g. \"{'lr': 0.5}\"")

    o.group("logging", "logging")
    o.add("--log-format", choices=["none", "simple", "json", "tqdm"], default=None,
          help="tqdm on a terminal, simple otherwise")
    o.add("--log-interval", type=NONNEG, default=100, help="log every N updates")
    from .trackers import add_args as add_tracker_args
    add_tracker_args(o, BOOL)

    o.group("distributed", "distributed training")
    o.add("--distributed-world-size", type=POSITIVE, default=1, help="processes over all nodes")
    o.add("--distributed-init-method", default=None, help="tcp://HOST:PORT or file:///shared/path")
    o.add("--distributed-gpus", type=NONNEG, default=0, help="processes to start on this node")
    o.add("--distributed-rank", type=NONNEG, default=0, help="global rank of this node's first process")
    o.add("--distributed-backend", choices=["gloo", "nccl"], default=None, help="nccl with CUDA, else gloo")
    o.add("--distributed-no-spawn", action="store_true", help="this process is one rank; start no others")
    o.add("--distributed-port", type=int, default=-1, help="HetSeq compatibility: port for tcp rendezvous")
    o.add("--device-id", "--local_rank", type=int, default=None, help="GPU of this process")
    o.add("--ddp-backend", choices=["c10d"], default="c10d", help="DDP implementation (PyTorch's c10d)")
    o.add("--bucket-cap-mb", type=POSITIVE, default=25, help="DDP gradient bucket size")
    o.add("--find-unused-parameters", action="store_true", help="DDP: allow parameters without gradient")
    o.add("--distributed-timeout", type=POSITIVE, default=300,
          help="seconds to wait for a missing rank before failing")

    for name, cls in TASKS.items():
        o.group(f"task:{name}", f"task {name}")
        cls.add_args(o)
    add_optimizer_args(o)
    add_scheduler_args(o)
    return o


def groups_for(ns):
    from .lr_scheduler import SCHEDULERS
    from .optim import OPTIMIZERS
    from .tasks import TASKS
    ns.task = TASKS.canonical(ns.task)
    ns.optimizer = OPTIMIZERS.canonical(ns.optimizer)
    ns.lr_scheduler = SCHEDULERS.canonical(ns.lr_scheduler)
    return ["common", "optimization", "validation", "checkpoint", "logging", "distributed",
            f"task:{ns.task}", f"optimizer:{ns.optimizer}", f"lr_scheduler:{ns.lr_scheduler}"]


def check(options, ns):
    """Combinations argparse cannot see, checked before anything heavy starts."""
    from .optim import OPTIMIZERS
    from .tasks import TASKS

    if ns.max_sentences is None and ns.max_tokens is None:
        raise UserError("give a batch size: --max-sentences N (or --max-tokens N)")
    if not ns.max_epoch and not ns.max_update:
        raise UserError("training would never stop: set --max-epoch or --max-update")
    if ns.fp16 and ns.bf16:
        raise UserError("--fp16 and --bf16 exclude each other; choose one")
    from .optim import _like, optimizer_kwargs
    optim_keys = optimizer_kwargs(ns)
    scheduler_keys = set(options.groups.get(f"lr_scheduler:{ns.lr_scheduler}", [])) | \
        {"lr", "warmup_updates", "total_num_update"}
    for key in ns.scheduler_conf:
        if key not in scheduler_keys:
            raise UserError(f"unknown key {key!r} in --scheduler_conf for {ns.lr_scheduler}"
                            f"{closest(key, scheduler_keys)}; valid keys: {', '.join(sorted(scheduler_keys))}")
    if ns.restore_file and ns.resume:
        raise UserError("--resume and --restore-file exclude each other: --resume reads checkpoint_last.pt "
                        "from --save-dir, --restore-file the file you name")
    if not isinstance(ns.optimizer_overrides, dict):
        raise UserError("--optimizer-overrides expects a dict literal like \"{'lr': 0.5}\"")
    for key, value in ns.optimizer_overrides.items():
        if key not in optim_keys:
            raise UserError(f"unknown key {key!r} in --optimizer-overrides for {ns.optimizer}"
                            f"{closest(key, optim_keys)}; valid keys: {', '.join(sorted(optim_keys))}")
        _like(value, optim_keys[key], key, ns.optimizer, "--optimizer-overrides")
    if ns.distributed_no_spawn and not ns.distributed_init_method and "RANK" not in os.environ:
        raise UserError("--distributed-no-spawn needs --distributed-init-method (or a launcher that sets RANK)")
    if os.path.exists(ns.save_dir) and not os.path.isdir(ns.save_dir):
        raise UserError(f"--save-dir {ns.save_dir} is a file, not a directory; choose another path")
    _check_optimizer_values(ns)
    task = TASKS.get(ns.task)
    task.check_config(ns)
    if ns.best_checkpoint_metric and task.metric_names and ns.best_checkpoint_metric not in task.metric_names:
        raise UserError(f"--best-checkpoint-metric {ns.best_checkpoint_metric!r} is not a metric of task "
                        f"{ns.task}{closest(ns.best_checkpoint_metric, task.metric_names)}; "
                        f"choose from: {', '.join(task.metric_names)}")


def _check_optimizer_values(ns):
    """Let torch judge the values (lr < 0, rho > 1, betas of the wrong length)
    on one dummy parameter, before any data is read."""
    import torch
    from .optim import build_optimizer
    try:
        build_optimizer(ns, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    except IndexError:
        raise UserError(f"optimizer {ns.optimizer}: betas must be two numbers, like '(0.9, 0.999)'") from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"optimizer {ns.optimizer}: {exc}; check --lr, --weight-decay and its own options") \
            from None


def parse(argv):
    from .tasks import TASKS
    options = build_options()
    ns, keys = C.resolve(options, argv, TASKS, groups_for)
    return options, ns, keys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        options, ns, keys = parse(argv)
        if ns.print_config:
            sys.stdout.write(C.to_yaml(ns, keys))
            return 0
        check(options, ns)
        return run(ns, keys)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run(ns, keys):
    from . import distributed
    if distributed.placement_from_env(ns) is None:
        if ns.distributed_no_spawn and ns.distributed_init_method:
            placement = distributed.Placement(
                rank=ns.distributed_rank, world_size=ns.distributed_world_size,
                local_rank=ns.device_id or 0, local_world_size=1, init_method=ns.distributed_init_method)
            distributed.export(placement)
        else:
            placements = distributed.local_plan(ns)
            if placements is not None:
                return distributed.spawn(placements, ns.distributed_timeout)
    from .trainer import train
    try:
        return train(ns, keys)
    except UserError:
        raise
    except Exception as exc:
        if not _lost_peer(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        print(f"error: rank {os.environ.get('RANK', '?')}: another process of this run died or is "
              f"unreachable ({first}); stopping", file=sys.stderr)
        return 1


def _lost_peer(exc):
    """A collective failed because a peer is gone: one line, not a traceback."""
    if "WORLD_SIZE" not in os.environ or os.environ["WORLD_SIZE"] == "1":
        return False
    try:
        from torch.distributed import DistError
        if isinstance(exc, DistError):
            return True
    except ImportError:
        pass
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out",
                            "Gloo", "gloo", "NCCL", "connectFullMesh"))
