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
        except (ValueError, TypeError, SyntaxError):
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


def DEVICE(text):
    """cpu, cuda, cudaN or cuda:N (kanachan's --device)."""
    import re
    text = str(text).strip().lower()
    if not re.fullmatch(r"cpu|cuda(:?\d+)?", text):
        raise argparse.ArgumentTypeError(f"expects cpu, cuda or cudaN (e.g. cuda1), got {text!r}")
    return text


def GPU_IDS(text):
    """TextBox's --gpu_id '0,1': device indices."""
    parts = [p.strip() for p in str(text).strip("[]() ").split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expects device indices like 0 or 0,1, got {text!r}")
    return ",".join(parts)


AMP_LEVELS = {"O0": "float32", "O1": "float16", "O2": "float16", "O3": "float16"}


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
    o.add("--training-data", default=None, metavar="PATH",
          help="kanachan: the training data, a directory or a file in it; sets --data to that directory "
               "(MNIST: the idx or torchvision .pt files; BERT: the HDF5 shards)")
    o.add("--validation-data", default=None, metavar="PATH",
          help="kanachan: the validation data; must be in the --data / --training-data directory, "
               "its split is chosen with --valid-subset")
    o.add("--max-sentences", type=POSITIVE, default=None, help="batch size per process")
    o.add_alias("--batch-size", "max_sentences")
    o.add_alias("--training-batch-size", "max_sentences", help="kanachan: alias of --max-sentences")
    o.add_alias("--train_batch_size", "max_sentences", help="TextBox: alias of --max-sentences")
    o.add("--max-sentences-valid", type=POSITIVE, default=None, help="validation batch size per process")
    o.add_alias("--valid_batch_size", "max_sentences_valid", help="ESPnet2: alias of --max-sentences-valid")
    o.add_alias("--validation-batch-size", "max_sentences_valid", help="kanachan: alias of --max-sentences-valid")
    o.add_alias("--eval_batch_size", "max_sentences_valid", help="TextBox: alias of --max-sentences-valid")
    o.add("--max-tokens", type=POSITIVE, default=None, help="limit of real tokens per batch and process")
    o.add("--required-batch-size-multiple", type=POSITIVE, default=1,
          help="batch sizes are rounded down to a multiple of this (a batch smaller than it is kept)")
    o.add("--num-workers", type=NONNEG, default=0,
          help="batches read ahead in a background thread, for data read from disk or pinned for CUDA (0: inline)")
    o.add("--no-shuffle", action="store_true", help="train in data order")
    o.add("--num_iters_per_epoch", type=NONNEG, default=0, help="cap on updates per epoch (0: whole epoch)")
    o.add("--fast-stat-sync", action="store_true",
          help="HetSeq compatibility, accepted and changes nothing: we always do what it asks for, "
               "summing the statistics over ranks in one all-reduce per log interval")
    o.add("--model_conf", action=C.MergeDict, default={},
          help="model options, key=value or '{key: value}' (repeatable)")
    o.add("--dim-final-feedforward", type=POSITIVE, default=None,
          help="kanachan: size of the feed-forward layer of the final head (no such layer in mnist's CNN "
               "or BertForPreTraining: a note says so)")
    o.add("--checkpointing", action="store_true",
          help="kanachan: activation (gradient) checkpointing: recompute activations in backward, "
               "less memory, the same loss")
    o.add("--initial-encoder", default=None, metavar="PATH",
          help="kanachan: start from these encoder weights (BERT: sets --init-checkpoint)")

    o.group("optimization", "optimization")
    o.add("--optimizer", default="adam",
          help=f"any case; one of: {', '.join(OPTIMIZERS.choices())} (the others of torch.optim by "
               f"their class names; adam is Adam with decoupled weight decay, i.e. torch's AdamW)")
    o.add_alias("--optim", "optimizer", help="ESPnet2: alias of --optimizer")
    o.add("--lr", type=float_list, default="0.001",
          help="learning rate (HetSeq: 'a,b,c' per epoch); when neither the command line nor a --config file "
               "gives one and the optimizer is not the one the properties files chose: 0.1 for sgd, "
               "0.001 for adam/adamw/radam/lamb, torch's default for the others")
    o.add_alias("--learning-rate", "lr", help="kanachan: alias of --lr")
    o.add("--weight-decay", "--wd", type=float, default=0.0, help="weight decay")
    o.add("--epsilon", type=float, default=None,
          help="kanachan: the optimizer's eps (unset: the optimizer's own, e.g. 1e-6 for lamb)")
    o.add("--optim_conf", action=C.MergeDict, default={},
          help="the optimizer's constructor arguments, key=value or '{key: value}' (repeatable); checked "
               "against its signature; --print_config lists them all")
    o.add("--lr-scheduler", default="PolynomialDecayScheduler",
          help=f"any case; one of: {', '.join(SCHEDULERS.choices())}. Ours step per update; torch's "
               f"StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, ConstantLR, PolynomialLR per "
               f"epoch, CyclicLR, OneCycleLR, CosineAnnealingWarmRestarts per update (as ESPnet2; see "
               f"--scheduler-interval), ReduceLROnPlateau after each validation on --best-checkpoint-metric")
    o.add_alias("--scheduler", "lr_scheduler", help="ESPnet2: alias of --lr-scheduler")
    o.add("--warmup-updates", type=NONNEG, default=0, help="linear LR warm-up over this many updates")
    o.add("--total-num-update", type=NONNEG, default=0, help="updates of the LR decay (0: --max-update)")
    o.add("--scheduler_conf", action=C.MergeDict, default={},
          help="LR scheduler overrides, key=value or '{key: value}' (repeatable); a torch scheduler's "
               "constructor arguments (checked; --print_config lists them all)")
    o.add("--max-epoch", type=NONNEG, default=0, help="stop after this many epochs (0: no limit)")
    o.add_alias("--num-epochs", "max_epoch", help="kanachan: alias of --max-epoch")
    o.add_alias("--epochs", "max_epoch", help="TextBox: alias of --max-epoch")
    o.add("--max-update", type=NONNEG, default=0, help="stop after this many updates (0: no limit)")
    o.add("--update-freq", type=INT_LIST, default="1", help="accumulate gradients over N batches "
          "(HetSeq: 'a,b,c' per epoch)")
    o.add_alias("--accum_grad", "update_freq")
    o.add_alias("--gradient-accumulation-steps", "update_freq", help="kanachan: alias of --update-freq")
    o.add_alias("--accumulation_steps", "update_freq", help="TextBox: alias of --update-freq")
    o.add("--clip-norm", type=float, default=0.0, help="clip the gradient norm to this (0: no clipping)")
    o.add_alias("--max-gradient-norm", "clip_norm", help="kanachan: alias of --clip-norm")
    o.add_alias("--grad_clip", "clip_norm", help="TextBox: alias of --clip-norm")
    o.add("--fp16", action="store_true", help="float16 mixed precision (CUDA; bfloat16 on CPU)")
    o.add("--bf16", action="store_true", help="bfloat16 mixed precision")
    o.add("--train_dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32",
          help="training precision (float16/bfloat16: mixed precision; float64: the whole model in float64)")
    o.add("--amp-optimization-level", choices=list(AMP_LEVELS), default=None,
          help="kanachan/Apex: O0 is float32, O1-O3 float16 mixed precision (Accelerate's; bfloat16 on CPU); "
               "sets --train_dtype and says so")
    o.add("--seed", type=SEED, default=1, help="seed of python, numpy, torch and the batch order")
    o.add("--cudnn_deterministic", action="store_true", help="deterministic cuDNN kernels")
    o.add("--cpu", action="store_true", help="train on CPU even when CUDA is present")
    o.add("--device", type=DEVICE, default=None,
          help="kanachan: cpu, cuda or cudaN (cpu: as --cpu; cudaN: GPU N for a single process)")
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
    o.add_alias("--saved_dir", "save_dir", help="TextBox: alias of --save-dir")
    o.add("--output-prefix", default=None, metavar="DIR",
          help="kanachan: with --experiment-name, save into DIR/NAME (unset: --save-dir is the prefix)")
    o.add("--experiment-name", default=None, metavar="NAME",
          help="kanachan: save into PREFIX/NAME; with --output-prefix alone NAME is the start time "
               "(YYYY-MM-DD-HH-MM-SS; give a name to --resume it later or to run on several nodes)")
    o.add("--num-epoch-digits", type=NONNEG, default=0,
          help="kanachan: epoch numbers in checkpoint names padded to this many digits (0: no padding)")
    o.add("--snapshot-interval", type=NONNEG, default=0, metavar="NSAMPLES",
          help="kanachan: save a checkpoint every NSAMPLES training samples (0: off)")
    o.add("--initial-optimizer", default=None, metavar="PATH",
          help="kanachan: start from this optimizer state (a checkpoint of ours or a torch state dict)")
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
    from .faults import add_args as add_fault_args
    add_fault_args(o, POSITIVE)
    from .accelerator import add_args as add_accelerator_args
    add_accelerator_args(o, BOOL)

    o.group("distributed", "distributed training")
    o.add("--distributed-world-size", type=POSITIVE, default=1, help="processes over all nodes")
    o.add("--distributed-init-method", default=None, help="tcp://HOST:PORT or file:///shared/path")
    o.add("--distributed-gpus", type=NONNEG, default=0, help="processes to start on this node")
    o.add("--ngpu", type=NONNEG, default=None,
          help="ESPnet2: processes on this node (0: one process on CPU); alone it sets "
               "--distributed-world-size, with --distributed-init-method --distributed-gpus")
    o.add("--gpu_id", type=GPU_IDS, default=None, metavar="IDS",
          help="TextBox: the GPUs to use, e.g. 0,1")
    o.add("--distributed-rank", type=NONNEG, default=0, help="global rank of this node's first process")
    o.add("--distributed-backend", choices=["gloo", "nccl"], default=None, help="nccl with CUDA, else gloo")
    o.add("--distributed-no-spawn", action="store_true", help="this process is one rank; start no others")
    o.add("--distributed-port", type=int, default=-1, help="HetSeq compatibility: port for tcp rendezvous")
    o.add("--device-id", "--local_rank", type=int, default=None, help="GPU of this process")
    o.add("--ddp-backend", choices=["c10d"], default="c10d", help="DDP implementation (PyTorch's c10d)")
    o.add("--bucket-cap-mb", type=POSITIVE, default=None,
          help="DDP gradient bucket size in MiB (default: 25, DDP's own, on CUDA; 4 on CPU, where gloo sums on a "
               "CPU thread and smaller buckets start summing during the backward pass)")
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
    from .lr_scheduler import check_scheduler
    from .optim import typed_like, optimizer_kwargs
    spec = OPTIMIZERS.get(ns.optimizer)
    if spec.unusable:
        raise UserError(f"--optimizer {ns.optimizer}: {spec.unusable}; choose another optimizer")
    optim_keys = optimizer_kwargs(ns)
    check_scheduler(ns)
    if ns.restore_file and ns.resume:
        raise UserError("--resume and --restore-file exclude each other: --resume reads checkpoint_last.pt "
                        "from --save-dir, --restore-file the file you name")
    if not isinstance(ns.optimizer_overrides, dict):
        raise UserError("--optimizer-overrides expects a dict literal like \"{'lr': 0.5}\"")
    for key, value in ns.optimizer_overrides.items():
        if key not in optim_keys:
            raise UserError(f"unknown key {key!r} in --optimizer-overrides for {ns.optimizer}"
                            f"{closest(key, optim_keys)}; valid keys: {', '.join(sorted(optim_keys))}")
        typed_like(value, optim_keys[key], key, ns.optimizer, "--optimizer-overrides")
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
    finalize(options, ns)
    return options, ns, keys


def note(message):
    """One line on stderr, from the first process only."""
    if os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"note: {message}", file=sys.stderr, flush=True)


def _user_gave(options, dest):
    return options.sources.get(dest, C.BUILTIN) >= C.CONFIG_FILE


def finalize(options, ns):
    """Options of other tools that stand for ours, and the values that
    depend on several options, resolved once, so that --print_config and
    config.yaml show what the run uses."""
    from .lr_scheduler import resolve_scheduler_conf
    from .optim import resolve_optim_conf
    from .tasks import TASKS
    TASKS.get(ns.task).resolve_config(ns)  # a preset's sizes, before anything reads them

    # precision: Apex/kanachan levels onto ours
    if ns.amp_optimization_level is not None:
        dtype = AMP_LEVELS[ns.amp_optimization_level]
        if _user_gave(options, "train_dtype") and ns.train_dtype != dtype:
            raise UserError(f"--amp-optimization-level {ns.amp_optimization_level} means --train_dtype {dtype}, "
                            f"but --train_dtype {ns.train_dtype} is given too; keep one")
        if ns.train_dtype != dtype:
            ns.train_dtype = dtype
            note(f"--amp-optimization-level {ns.amp_optimization_level}: training with --train_dtype {dtype}"
                 + (" (float16 mixed precision; O1, O2 and O3 are all Accelerate's autocast)"
                    if dtype == "float16" else ""))
    if ns.train_dtype == "float64" and (ns.fp16 or ns.bf16):
        raise UserError("--train_dtype float64 excludes --fp16 and --bf16; choose one")

    # devices and processes
    if ns.device is not None:
        if ns.device == "cpu":
            ns.cpu = True
        elif ns.device not in ("cuda",):
            index = int(ns.device[4:].lstrip(":"))
            if ns.device_id is not None and ns.device_id != index:
                raise UserError(f"--device {ns.device} and --device-id {ns.device_id} name different GPUs; keep one")
            ns.device_id = index
    if ns.ngpu is not None:
        if ns.ngpu == 0:
            ns.cpu = True
        elif ns.distributed_init_method:
            if _user_gave(options, "distributed_gpus") and ns.distributed_gpus != ns.ngpu:
                raise UserError(f"--ngpu {ns.ngpu} and --distributed-gpus {ns.distributed_gpus} differ; keep one")
            ns.distributed_gpus = ns.ngpu
        elif not _user_gave(options, "distributed_world_size"):
            ns.distributed_world_size = ns.ngpu
        elif ns.distributed_world_size != ns.ngpu:
            raise UserError(f"--ngpu {ns.ngpu} (processes on this node) and --distributed-world-size "
                            f"{ns.distributed_world_size} differ on a single node; give "
                            f"--distributed-init-method for several nodes, or keep one")

    # data paths (kanachan)
    if ns.training_data is not None:
        path = os.path.abspath(ns.training_data)
        if not os.path.exists(path):
            raise UserError(f"--training-data {ns.training_data}: no such file or directory")
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        if _user_gave(options, "data") and ns.data and os.path.abspath(ns.data) != directory \
                and options.sources.get("data") >= options.sources.get("training_data"):
            raise UserError(f"--data {ns.data} and --training-data {ns.training_data} name different "
                            f"directories; keep one")
        ns.data = directory
    if ns.validation_data is not None:
        path = os.path.abspath(ns.validation_data)
        if not os.path.exists(path):
            raise UserError(f"--validation-data {ns.validation_data}: no such file or directory")
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        if ns.data is None:
            ns.data = directory
        elif os.path.abspath(ns.data) != directory:
            raise UserError(f"--validation-data {ns.validation_data} is not in the data directory {ns.data}: "
                            f"the {ns.task} task reads every split from one directory (choose the split "
                            f"with --valid-subset)")

    if ns.required_batch_size_multiple > 1 and ns.max_sentences and not ns.max_tokens:
        from .data.iterators import round_batch_size
        rounded = round_batch_size(ns.max_sentences, ns.required_batch_size_multiple)
        if rounded != ns.max_sentences:
            note(f"--max-sentences {ns.max_sentences} rounded down to {rounded}, a multiple of "
                 f"--required-batch-size-multiple {ns.required_batch_size_multiple}")
            ns.max_sentences = rounded

    # save directory: PREFIX/NAME (kanachan)
    named = [d for d in ("output_prefix", "experiment_name") if getattr(ns, d) is not None]
    if named:
        rank = max(options.sources.get(d, 0) for d in named)
        if options.sources.get("save_dir", 0) > rank and _user_gave(options, "save_dir"):
            ns.output_prefix = ns.experiment_name = None  # a later --save-dir wins
        else:
            prefix = ns.output_prefix if ns.output_prefix is not None else ns.save_dir
            name = ns.experiment_name or os.environ.get("TEXTBOX_LIKE_EXPERIMENT_NAME")
            if not name:
                import time
                name = time.strftime("%Y-%m-%d-%H-%M-%S")
                os.environ["TEXTBOX_LIKE_EXPERIMENT_NAME"] = name  # the same for spawned ranks
            ns.output_prefix, ns.experiment_name = prefix, name
            ns.save_dir = os.path.join(prefix, name)

    # model options that mean nothing for the chosen task
    task = TASKS.get(ns.task)
    if ns.dim_final_feedforward is not None:
        what = "BertForPreTraining (its heads have no feed-forward layer)" if ns.task == "bert" else \
            f"the {ns.task} model"
        note(f"--dim-final-feedforward {ns.dim_final_feedforward} has no meaning for {what}; ignored")
    if ns.initial_encoder is not None:
        if not os.path.exists(ns.initial_encoder):
            raise UserError(f"--initial-encoder {ns.initial_encoder}: no such file or directory")
        if hasattr(ns, "init_checkpoint"):
            if ns.init_checkpoint and ns.init_checkpoint != ns.initial_encoder:
                raise UserError("--initial-encoder and --init-checkpoint name different files; keep one")
            ns.init_checkpoint = ns.initial_encoder
    if ns.initial_optimizer is not None and not os.path.isfile(ns.initial_optimizer):
        raise UserError(f"--initial-optimizer {ns.initial_optimizer}: no such file")

    # the optimizer's and the scheduler's own arguments, in full
    builtin_optimizer = options.actions["optimizer"].default
    resolve_optim_conf(ns, options.sources, options.dict_sources.get("optim_conf", {}),
                       options.layer_values, builtin_optimizer)
    maximize = ns.maximize_best_checkpoint_metric
    if maximize is None:
        maximize = task.default_maximize_best_metric if not ns.best_checkpoint_metric or \
            ns.best_checkpoint_metric == task.default_best_metric else None
    resolve_scheduler_conf(ns, options.groups.get(f"lr_scheduler:{ns.lr_scheduler}", []), maximize)


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
    if getattr(ns, "gpu_id", None) is not None:
        # TextBox's --gpu_id: the GPUs this run may use (set before CUDA
        # initialises); several of them mean one process each on this node
        os.environ["CUDA_VISIBLE_DEVICES"] = ns.gpu_id
        import torch
        count = len(ns.gpu_id.split(","))
        if count > 1 and ns.distributed_world_size == 1 and not ns.cpu and torch.cuda.is_available() \
                and distributed.placement_from_env(ns) is None:
            ns.distributed_world_size = count
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
    # before CUDA and cuBLAS initialise, in every worker
    distributed.apply_determinism(ns)
    from .trainer import train
    try:
        return train(ns, keys)
    except UserError:
        # leave the process group before exiting: a group torn down by the
        # interpreter at exit, with its peer already gone, can abort the
        # process ("terminate called without an active exception") and turn
        # a clean refusal (exit 2) into SIGABRT
        distributed.cleanup()
        raise
    except Exception as exc:
        if ns.cudnn_deterministic and isinstance(exc, RuntimeError) and "deterministic" in str(exc):
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            print(f"error: --cudnn_deterministic: {first}; leave it out to train with this operation",
                  file=sys.stderr)
            return 2
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
                            "Gloo", "gloo", "NCCL", "connectFullMesh", "communicator was aborted",
                            "Watchdog caught collective"))
