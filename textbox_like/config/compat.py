"""The spellings of other tools, in one place: HetSeq, fairseq, kanachan,
ESPnet2, TextBox, torch.distributed.launch and Accelerate.

- ``ALIASES``: other names of our settings (``--learning-rate`` for ``--lr``);
  a config file may use them as keys too.
- ``environment_settings``: what Accelerate's launcher hands over in the
  environment, as settings (a layer above the files, below the command line).
- ``apply_foreign_settings``: settings of other tools that stand for ours
  (kanachan's ``--training-data``, ESPnet2's ``--ngpu``, Apex levels, ...),
  rewritten onto ours once, while the configuration is resolved; the start
  line and ``--print_config`` still show both, and each rewritten value names
  the option it came from as its source (``cfg.source(key)``). What
  happens when the run starts (TextBox's --gpu_id, HetSeq's every visible
  GPU, the note on Accelerate's one-process launcher) is the launch code's:
  textbox_like/launch.py.
- ``default_notes``: where a user of another tool, by the spellings used,
  would get our default instead of that tool's documented one.
- HetSeq's scheduler named by --optimizer, and TextBox's names for
  search-space labels (``TEXTBOX_ALIASES``). Other tools' value types
  (TextBox's metric lists, kanachan's --device, Apex levels) are in
  value_types.py with ours.

Settings that only another tool has (``--num-epoch-digits``) are declared in
schema.py like any other, their help naming the tool. This module imports
only value_types.py of the configuration (and errors.py): the task a rewrite
needs is handed in.
"""
from __future__ import annotations

import os

from textbox_like.core.errors import UserError, note
from textbox_like.config.value_types import AMP_LEVELS, positive_float, positive_int, probability

#: (flag, our setting, help); the help's "TOOL:" names whose spelling it is
ALIASES = (
    ("--batch-size", "max_sentences", None),
    ("--training-batch-size", "max_sentences", "kanachan: alias of --max-sentences"),
    ("--train_batch_size", "max_sentences", "TextBox: alias of --max-sentences"),
    ("--valid_batch_size", "max_sentences_valid", "ESPnet2: alias of --max-sentences-valid"),
    ("--validation-batch-size", "max_sentences_valid", "kanachan: alias of --max-sentences-valid"),
    ("--eval_batch_size", "max_sentences_valid", "TextBox: alias of --max-sentences-valid"),
    ("--optim", "optimizer", "ESPnet2: alias of --optimizer"),
    ("--learning-rate", "lr", "kanachan: alias of --lr"),
    ("--wd", "weight_decay", "fairseq: alias of --weight-decay"),
    ("--scheduler", "lr_scheduler", "ESPnet2: alias of --lr-scheduler"),
    ("--num-epochs", "max_epoch", "kanachan: alias of --max-epoch"),
    ("--epochs", "max_epoch", "TextBox: alias of --max-epoch"),
    ("--accum_grad", "update_freq", "ESPnet2: alias of --update-freq"),
    ("--gradient-accumulation-steps", "update_freq", "kanachan: alias of --update-freq"),
    ("--accumulation_steps", "update_freq", "TextBox: alias of --update-freq"),
    ("--max-gradient-norm", "clip_norm", "kanachan: alias of --clip-norm"),
    ("--grad_clip", "clip_norm", "TextBox: alias of --clip-norm"),
    ("--saved_dir", "save_dir", "TextBox: alias of --save-dir"),
    ("--local_rank", "device_id", "torch.distributed.launch: alias of --device-id"),
    ("--metrics_for_best_model", "best_checkpoint_metric",
     "TextBox: alias of --best-checkpoint-metric (a one-name list like ['accuracy'] too)"),
)

#: aliases of a plugin's own options, added once the plugins have added theirs
PLUGIN_ALIASES = (
    ("--dadelta_weight_decay", "adadelta_weight_decay", "HetSeq: its spelling of --adadelta_weight_decay"),
)

#: TextBox's option names with a counterpart here, for search-space labels (used only
#: where the trainer's own parser does not know the name)
TEXTBOX_ALIASES = {
    "learning_rate": "lr",
    "train_batch_size": "max_sentences",
    "eval_batch_size": "max_sentences_valid",
    "epochs": "max_epoch",
    "max_steps": "max_update",
    "seed": "seed",
    "grad_clip": "clip_norm",
    "accumulation_steps": "update_freq",
    "warmup_steps": "warmup_updates",
    "scheduler": "lr_scheduler",
    "valid_steps": "validate_interval_updates",
    "valid_intervals": "validate_interval",
    "weight_decay": "weight_decay",
    "embedding_size": "model_conf.hidden_size",     # the model width (tasks with a width_key: BERT)
}


#: other tools' options for parts our models do not have: ESPnet2's --encoder_conf and --decoder_conf
NO_SUCH_PART = {"encoder_conf": "encoder", "decoder_conf": "decoder"}


def no_such_part(name):
    """The line for another tool's option (``--encoder_conf`` or the config
    key ``encoder_conf``) that names a model part we do not have, or None."""
    key = str(name).split("=", 1)[0].lstrip("-").replace("-", "_")
    if key not in NO_SUCH_PART:
        return None
    return (f"ESPnet2's --{key} configures a model's {NO_SUCH_PART[key]}, and this toolkit's models (mnist's "
            f"network, BERT) have no separate encoder/decoder parts: give their options with --model_conf "
            f"key=value (BERT's sizes: --model-preset, or --model_conf hidden_size=...)")


def check_optimizer_name(name, optimizers, schedulers):
    """HetSeq's docs list PolynomialDecayScheduler under --optimizer: a
    scheduler's name there says which option it belongs to."""
    if name not in optimizers and name in schedulers:
        raise UserError(f"--optimizer {name} is a learning-rate scheduler: pass --lr-scheduler "
                        f"{name} (and an optimizer, e.g. --optimizer adam)")


def environment_settings(environ=None) -> dict:
    """Settings that ``accelerate launch`` and ``accelerate config`` pass on:
    Accelerate's gradient accumulation exists only in its DeepSpeed section,
    and where the launcher exports it, it sets --update-freq (unless the
    command line or a config file of ours says otherwise: they rank above)."""
    environ = os.environ if environ is None else environ
    out = {}
    steps = environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "").strip()
    if steps.isdigit() and int(steps) > 0:
        out["update_freq"] = [int(steps)]
    out.update(fsdp_environment_settings(environ))
    return out


#: accelerate launch --fsdp_auto_wrap_policy -> --fsdp-wrap
FSDP_WRAPS = {"TRANSFORMER_BASED_WRAP": "block", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}

#: FSDP1's sharding strategies, which accelerate launch --fsdp_reshard_after_forward
#: also takes (FSDP1 only: Accelerate refuses them for FSDP2), as our
#: (--fsdp-sharding, --fsdp-reshard-after-forward): ZeRO-3 reshards the
#: parameters after forward, ZeRO-2 (SHARD_GRAD_OP) keeps them gathered
FSDP1_STRATEGIES = {"FULL_SHARD": ("full", True), "SHARD_GRAD_OP": ("full", False), "NO_SHARD": ("none", True),
                    "HYBRID_SHARD": ("hybrid", True), "HYBRID_SHARD_ZERO2": ("hybrid", False)}
#: the truth values Accelerate's str_to_bool reads
TRUE_WORDS, FALSE_WORDS = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def fsdp_environment_settings(environ) -> dict:
    """``accelerate launch --use_fsdp --fsdp_version 2`` (or ``accelerate
    config``'s FSDP section) as our --fsdp settings: the launcher exports
    ACCELERATE_USE_FSDP and FSDP_* variables. Only FSDP2 is built here."""
    if environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() not in ("true", "1", "yes"):
        return {}
    version = environ.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise UserError(f"accelerate launch --use_fsdp asks for FSDP version {version}; this trainer shards with "
                        f"FSDP2 only: add --fsdp_version 2 (or set fsdp_version: 2 in accelerate config)")
    truthy = ("true", "1", "yes")
    out = {"fsdp": True}
    reshard = environ.get("FSDP_RESHARD_AFTER_FORWARD", "").strip()
    if reshard.lower() in TRUE_WORDS + FALSE_WORDS:  # FSDP2's bool
        out["fsdp_reshard_after_forward"] = reshard.lower() in TRUE_WORDS
    elif reshard.upper() in FSDP1_STRATEGIES:  # an FSDP1 strategy: what it means under FSDP2
        out["fsdp_sharding"], out["fsdp_reshard_after_forward"] = FSDP1_STRATEGIES[reshard.upper()]
        note(f"accelerate launch --fsdp_reshard_after_forward {reshard.upper()} is FSDP1's sharding strategy; "
             f"under FSDP2 it is --fsdp-sharding {out['fsdp_sharding']} --fsdp-reshard-after-forward "
             f"{str(out['fsdp_reshard_after_forward']).lower()}")
    elif reshard:
        raise UserError(f"accelerate launch --fsdp_reshard_after_forward {reshard} (FSDP_RESHARD_AFTER_FORWARD): "
                        f"FSDP2 takes true or false there (or one of FSDP1's {', '.join(FSDP1_STRATEGIES)})")
    wrap = environ.get("FSDP_AUTO_WRAP_POLICY", "").strip().upper()
    if wrap in FSDP_WRAPS:
        out["fsdp_wrap"] = FSDP_WRAPS[wrap]
    if environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").strip():
        out["fsdp_block_classes"] = [name.strip() for name in environ["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
                                     if name.strip()]
    if environ.get("FSDP_MIN_NUM_PARAMS", "").strip().isdigit() and int(environ["FSDP_MIN_NUM_PARAMS"]) > 0:
        out["fsdp_min_params"] = int(environ["FSDP_MIN_NUM_PARAMS"])
    if environ.get("FSDP_OFFLOAD_PARAMS", "").strip().lower() in truthy:
        out["fsdp_cpu_offload"] = True
    if environ.get("FSDP_ACTIVATION_CHECKPOINTING", "").strip().lower() in truthy:
        out["checkpointing"] = True
    return out


#: settings of ours that only one other tool spells so: the tool a rewritten
#: value comes from, and a sign that the run is that tool's user's
FOREIGN_OPTIONS = {
    **dict.fromkeys(("amp_optimization_level", "device", "training_data", "validation_data", "output_prefix",
                     "experiment_name", "initial_encoder", "initial_decoder", "initial_optimizer", "epsilon",
                     "num_epoch_digits", "snapshot_interval", "dim_final_feedforward", "checkpointing"), "kanachan"),
    **dict.fromkeys(("ngpu", "use_tensorboard", "use_wandb"), "ESPnet2"),
    **dict.fromkeys(("gpu_id", "model_path", "metrics", "efficient_methods", "efficient_kwargs"), "TextBox"),
    **dict.fromkeys(("fast_stat_sync", "distributed_port", "adadelta_weight_decay"), "HetSeq"),
}

#: each tool's documented default where ours differs (hetseq/options.py;
#: kanachan/training/bert/phase1/README.md; espnet2/tasks/abs_task.py;
#: TextBox's textbox/properties/overall.yaml). TextBox's adamw is our adam
#: (decoupled weight decay), so the optimizer is not listed for it. A value
#: that depends on the optimizer is a dict by optimizer name (kanachan's lr:
#: 0.1 for sgd, 0.001 for the others; its sgd momentum 0.9).
THEIR_DEFAULTS = {
    "HetSeq": {"lr": [0.25], "clip_norm": 25.0, "seed": 19940802, "log_interval": 1},
    "kanachan": {"optimizer": "lamb", "clip_norm": 1.0, "num_workers": 2, "momentum": {"sgd": 0.9},
                 "lr": {"sgd": [0.1], "adam": [0.001], "radam": [0.001], "lamb": [0.001]}},
    "ESPnet2": {"max_epoch": 40, "clip_norm": 5.0, "cudnn_deterministic": True},
    "TextBox": {"max_epoch": 50, "max_sentences": 16, "lr": [3e-5], "clip_norm": 0.1, "seed": 2020},
}


def tools_used(cfg):
    """The other tools whose spellings this configuration uses: one of
    their own settings given, or a value set by one of their options or
    aliases (its source says "(TOOL --flag)")."""
    used = {tool for key, tool in FOREIGN_OPTIONS.items() if key in cfg.keys and cfg.given(key)}
    for source in cfg.sources.values():
        used.update(tool for tool in THEIR_DEFAULTS if f"({tool} --" in source)
    return sorted(used)


def default_notes(cfg):
    """One line per other tool whose spellings are used, naming the settings
    left at our default where that tool's documented default differs: its
    users would otherwise expect theirs."""
    lines = []
    for tool in tools_used(cfg):
        defaults = {key: theirs.get(cfg.optim.optimizer) if isinstance(theirs, dict) else theirs
                    for key, theirs in THEIR_DEFAULTS[tool].items()}
        differing = [(key, cfg.get(key), theirs) for key, theirs in defaults.items()
                     if theirs is not None and key in cfg.keys and not cfg.given(key) and cfg.get(key) != theirs]
        if differing:
            lines.append(f"{tool}'s defaults differ from ours here: "
                         + ", ".join(f"--{key.replace('_', '-')} {_shown(ours)} ({tool}: {_shown(theirs)})"
                                     for key, ours, theirs in differing)
                         + f"; give them to train with {tool}'s")
    return lines


def _shown(value):
    return ",".join(f"{v:g}" for v in value) if isinstance(value, (list, tuple)) else \
        str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def foreign_source(sources, foreign):
    """Where a value rewritten from another tool's option came from: that
    option's own source and its name, e.g. "command line (kanachan --training-data)"."""
    flag = "--gpu_id" if foreign == "gpu_id" else "--model_path" if foreign == "model_path" else \
        "--" + foreign.replace("_", "-")
    return f"{sources.get(foreign, 'default')} ({FOREIGN_OPTIONS[foreign]} {flag})"


def _rewrite(ns, sources, dest, value, foreign):
    """``dest`` takes ``value``, set by the other tool's option ``foreign``
    (a value the user gave already, unchanged, keeps its source)."""
    if not (dest in sources and getattr(ns, dest) == value):
        sources[dest] = foreign_source(sources, foreign)
    setattr(ns, dest, value)


def apply_foreign_settings(ns, task, user_gave, rank_of, sources=None, espnet2_batch=False):
    """Rewrite other tools' settings onto ours, on the namespace being
    resolved. ``task``: the chosen task's class (what it reads its data from,
    its initial-weights setting, its metrics); ``user_gave(dest)``: the user
    set it (file or command line);
    ``rank_of(dest)``: the layer it came from; ``sources``: {dest: where its
    value came from, in words}, updated for every value rewritten;
    ``espnet2_batch``: the batch size was given as ESPnet2's --batch_size."""
    sources = {} if sources is None else sources
    _precision(ns, user_gave, sources)
    _devices(ns, user_gave, sources, espnet2_batch)
    _data_paths(ns, task, user_gave, rank_of, sources)
    _save_dir(ns, user_gave, rank_of, sources)
    _model(ns, task, sources)
    _metrics(ns, task)
    _efficient_methods(ns, user_gave, sources)
    if ns.fast_stat_sync:
        note("--fast-stat-sync changes nothing here: the statistics of all ranks are always summed in one "
             "all-reduce per log interval, which is what it asks for")


def _precision(ns, user_gave, sources):
    if ns.amp_optimization_level is not None:
        dtype = AMP_LEVELS[ns.amp_optimization_level]
        if user_gave("train_dtype") and ns.train_dtype != dtype:
            raise UserError(f"--amp-optimization-level {ns.amp_optimization_level} means --train_dtype {dtype}, "
                            f"but --train_dtype {ns.train_dtype} is given too; keep one")
        if ns.train_dtype != dtype:
            _rewrite(ns, sources, "train_dtype", dtype, "amp_optimization_level")
            note(f"--amp-optimization-level {ns.amp_optimization_level}: training with --train_dtype {dtype}"
                 + (" (float16 mixed precision; O1, O2 and O3 are all Accelerate's autocast)"
                    if dtype == "float16" else ""))
    if ns.train_dtype == "float64" and (ns.fp16 or ns.bf16):
        raise UserError("--train_dtype float64 excludes --fp16 and --bf16; choose one")


def cuda_devices():
    """The CUDA GPUs this process sees (0 without CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _devices(ns, user_gave, sources, espnet2_batch=False):
    if ns.device is not None:
        if ns.device == "cpu":
            _rewrite(ns, sources, "cpu", True, "device")
        else:
            index = None if ns.device == "cuda" else int(ns.device[4:].lstrip(":"))
            count = cuda_devices()
            if count == 0:
                raise UserError(f"--device {ns.device}: this machine has no CUDA GPU; pass --device cpu "
                                f"(or leave --device out)")
            if index is not None and index >= count:
                raise UserError(f"--device {ns.device}: this machine has {count} CUDA GPU(s), numbered from 0")
            if index is not None:
                if ns.device_id is not None and ns.device_id != index:
                    raise UserError(f"--device {ns.device} and --device-id {ns.device_id} name different GPUs; "
                                    f"keep one")
                _rewrite(ns, sources, "device_id", index, "device")
    if ns.device_id is not None and user_gave("device_id") and not ns.cpu and "LOCAL_RANK" not in os.environ \
            and cuda_devices() == 0:
        note(f"--device-id {ns.device_id}: this machine has no CUDA GPU; training on CPU")
    if ns.ngpu is not None:
        if ns.ngpu > 0 and not ns.cpu and cuda_devices() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            note(f"--ngpu {ns.ngpu}: this machine has no CUDA GPU"
                 + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
                 + f"; running {ns.ngpu} process(es) on CPU")
        if ns.ngpu == 0:
            _rewrite(ns, sources, "cpu", True, "ngpu")
        elif ns.distributed_init_method:
            if user_gave("distributed_gpus") and ns.distributed_gpus != ns.ngpu:
                raise UserError(f"--ngpu {ns.ngpu} and --distributed-gpus {ns.distributed_gpus} differ; keep one")
            _rewrite(ns, sources, "distributed_gpus", ns.ngpu, "ngpu")
        elif not user_gave("distributed_world_size"):
            _rewrite(ns, sources, "distributed_world_size", ns.ngpu, "ngpu")
        elif ns.distributed_world_size != ns.ngpu:
            raise UserError(f"--ngpu {ns.ngpu} (processes on this node) and --distributed-world-size "
                            f"{ns.distributed_world_size} differ on a single node; give "
                            f"--distributed-init-method for several nodes, or keep one")
        if ns.ngpu > 1 and espnet2_batch:
            _espnet2_batch(ns, user_gave, sources)


def _espnet2_batch(ns, user_gave, sources):
    """ESPnet2's --batch_size N with --ngpu K is the batch of one step over
    all processes, ours (--max-sentences, --batch-size) is per process: N is
    split over the world (N/K each where K divides N, else as
    --global-batch-size N)."""
    if not user_gave("max_sentences") or user_gave("global_batch_size") or ns.max_sentences is None:
        return
    total, world = ns.max_sentences, ns.distributed_world_size
    if world <= 1:
        return
    if total % world == 0:
        _rewrite(ns, sources, "max_sentences", total // world, "ngpu")
        note(f"--ngpu {ns.ngpu}: --batch_size {total} is ESPnet2's batch over all {world} processes, so "
             f"--max-sentences {total // world} per process (ours is per process)")
    elif list(ns.update_freq) == [1]:
        _rewrite(ns, sources, "global_batch_size", total, "ngpu")
        note(f"--ngpu {ns.ngpu}: --batch_size {total} is ESPnet2's batch over all {world} processes: "
             f"--global-batch-size {total}, split over them")
    else:
        raise UserError(f"--ngpu {ns.ngpu}: --batch_size {total} is ESPnet2's batch over all {world} processes, "
                        f"which cannot split evenly with --accum_grad; give a multiple of {world}")


def _data_paths(ns, task, user_gave, rank_of, sources):
    """kanachan's --training-data/--validation-data: a directory is --data;
    a file is that split's data where the task reads a split from one file
    (BERT's shards), else its directory (MNIST's splits are fixed names)."""
    split_files = task.split_files
    for flag, dest in (("--training-data", "training_data"), ("--validation-data", "validation_data")):
        value = getattr(ns, dest)
        if value is not None and not os.path.exists(value):
            raise UserError(f"{flag} {value}: no such file or directory")
    if ns.training_data is not None:
        path = os.path.abspath(ns.training_data)
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        if os.path.isfile(path) and split_files:
            ns.training_data = path                     # the task trains on this file only
            directory = ns.data or directory            # the other splits: --data, else beside it
        elif os.path.isfile(path):
            note(f"--training-data {ns.training_data}: the {ns.task} task reads its splits from a directory; "
                 f"training on its {ns.train_subset!r} split in {directory}")
        if user_gave("data") and ns.data and os.path.abspath(ns.data) != directory \
                and rank_of("data") >= rank_of("training_data"):
            raise UserError(f"--data {ns.data} and --training-data {ns.training_data} name different "
                            f"directories; keep one")
        _rewrite(ns, sources, "data", directory, "training_data")
    if ns.validation_data is not None:
        path = os.path.abspath(ns.validation_data)
        if os.path.isfile(path) and split_files:
            ns.validation_data = path                   # the task validates on this file only
            if ns.data is None:
                raise UserError("--validation-data FILE needs the training data too: --training-data or --data")
            return
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        if ns.data is None:
            _rewrite(ns, sources, "data", directory, "validation_data")
        elif os.path.abspath(ns.data) != directory:
            raise UserError(f"--validation-data {ns.validation_data} is not in the data directory {ns.data}: "
                            f"the {ns.task} task reads every split from one directory (choose the split "
                            f"with --valid-subset)")


def _save_dir(ns, user_gave, rank_of, sources):
    """kanachan's PREFIX/NAME save directory."""
    named = [d for d in ("output_prefix", "experiment_name") if getattr(ns, d) is not None]
    if not named:
        return
    rank = max(rank_of(d) for d in named)
    if rank_of("save_dir") > rank and user_gave("save_dir"):
        ns.output_prefix = ns.experiment_name = None  # a later --save-dir wins
        return
    prefix = ns.output_prefix if ns.output_prefix is not None else ns.save_dir
    name = ns.experiment_name or os.environ.get("TEXTBOX_LIKE_EXPERIMENT_NAME")
    if not name:
        import time
        name = time.strftime("%Y-%m-%d-%H-%M-%S")
        os.environ["TEXTBOX_LIKE_EXPERIMENT_NAME"] = name  # the same for spawned ranks
    given = "output_prefix" if ns.output_prefix is not None else "experiment_name"
    _rewrite(ns, sources, "output_prefix", prefix, given)
    _rewrite(ns, sources, "experiment_name", name, given)
    _rewrite(ns, sources, "save_dir", os.path.join(prefix, name), given)


def _model(ns, task, sources):
    """kanachan's model options that mean nothing for the chosen task, or
    stand for ours."""
    if ns.dim_final_feedforward is not None:
        what = "BertForPreTraining (its heads have no feed-forward layer)" if ns.task == "bert" else \
            f"the {ns.task} model"
        note(f"--dim-final-feedforward {ns.dim_final_feedforward} has no meaning for {what}; ignored")
    for dest in ("initial_encoder", "model_path"):
        if getattr(ns, dest) is not None:
            _initial_weights(ns, task, dest, sources)
    if ns.initial_decoder is not None:
        encoder = ns.initial_encoder or ns.model_path or getattr(ns, "init_checkpoint", None)
        if encoder is None or os.path.abspath(encoder) != os.path.abspath(ns.initial_decoder):
            raise UserError(f"--initial-decoder {ns.initial_decoder}: our checkpoints and save_pretrained "
                            f"directories hold the heads with the encoder; pass that file as --initial-encoder "
                            f"(alone, or with the same --initial-decoder)")
    if ns.initial_optimizer is not None and not os.path.isfile(ns.initial_optimizer):
        raise UserError(f"--initial-optimizer {ns.initial_optimizer}: no such file")
    given = [f for f, v in (("--initial-encoder", ns.initial_encoder), ("--initial-decoder", ns.initial_decoder),
                            ("--initial-optimizer", ns.initial_optimizer)) if v is not None]
    if given and ns.resume:
        raise UserError(f"{' and '.join(given)} and --resume exclude each other (kanachan: mutually exclusive): "
                        f"--resume continues checkpoint_last.pt with its own weights and optimizer; leave one out")


def _initial_weights(ns, task, dest, sources):
    """kanachan's --initial-encoder, TextBox's --model_path: the task's
    initial weights (BERT: --init-checkpoint)."""
    flag, path = ("--model_path" if dest == "model_path" else "--initial-encoder"), getattr(ns, dest)
    setting = task.initial_weights_setting
    if setting is None:
        raise UserError(f"{flag}: the {ns.task} model starts from random weights only (initial weights are for "
                        f"--task bert and --task hf); leave {flag} out")
    if not os.path.exists(path) and not getattr(task, "accepts_cached_names", False):  # hf: its resolve_config looks in the local cache
        raise UserError(f"{flag} {path}: no such file or directory; nothing can be downloaded here: pass a local "
                        f"save_pretrained directory (python -m textbox_like.tools.export makes one) or a checkpoint of "
                        f"ours")
    current = getattr(ns, setting)
    if current and os.path.abspath(current) != os.path.abspath(path):
        raise UserError(f"{flag} and --{setting.replace('_', '-')} name different files; keep one")
    _rewrite(ns, sources, setting, path, dest)


def _metrics(ns, task):
    """TextBox's --metrics: we report every metric of the task; a name it
    does not report is a mistake worth one line."""
    if not ns.metrics:
        return
    ours = task.metric_names
    # TextBox's names of metric families (rouge, bleu) stand for the metrics they report (ROUGE-1, ...)
    families = task.metric_families
    unknown = [m for m in ns.metrics if ours and m not in ours and m.lower() not in families]
    if unknown:
        raise UserError(f"--metrics {', '.join(unknown)}: not reported by task {ns.task}; it reports "
                        f"{', '.join(ours)} (all of them, always)")


#: TextBox's efficient methods and their defaults (textbox/utils/argument_list.py),
#: each --efficient_kwargs key as our option with its value type; TextBox's
#: ``adapter`` has no counterpart in peft
TEXTBOX_EFFICIENT_DEFAULTS = {
    "lora": {"lora_r": 4, "lora_dropout": 0.1, "lora_alpha": 32},
    "prefix-tuning": {"prefix_length": 100, "prefix_dropout": 0.1, "prefix_mid_dim": 512},
    "p-tuning-v2": {"prefix_length": 100, "prefix_dropout": 0.1, "prefix_mid_dim": 512},
    "prompt-tuning": {"prompt_length": 100},
    "bitfit": {},
}
EFFICIENT_KWARG_TYPES = {"lora_r": positive_int, "lora_alpha": positive_float, "lora_dropout": probability,
                         "prefix_length": positive_int, "prefix_mid_dim": positive_int, "prefix_dropout": probability,
                         "prompt_length": positive_int}


def _efficient_methods(ns, user_gave, sources):
    """TextBox's --efficient_methods ['lora'] --efficient_kwargs {...} as
    --peft lora --lora-r ...: TextBox's defaults for the options left out; a
    value also given in our spelling must agree."""
    methods, kwargs = ns.efficient_methods, ns.efficient_kwargs or {}
    if not methods:
        if kwargs:
            raise UserError("--efficient_kwargs needs --efficient_methods (TextBox), e.g. \"['lora']\"; or use "
                            "--peft lora and its options (--lora-r, ...)")
        return
    supported = ", ".join(TEXTBOX_EFFICIENT_DEFAULTS)
    if len(methods) != 1:
        raise UserError(f"--efficient_methods {methods}: one method at a time here; choose one of {supported}")
    method = methods[0]
    if method not in TEXTBOX_EFFICIENT_DEFAULTS:
        why = " (TextBox's adapter layers have no counterpart in peft)" if method == "adapter" else ""
        raise UserError(f"--efficient_methods ['{method}'] is not supported{why}; choose one of {supported}")
    if user_gave("peft") and ns.peft != method:
        raise UserError(f"--efficient_methods ['{method}'] and --peft {ns.peft} name different methods; keep one")
    _rewrite(ns, sources, "peft", method, "efficient_methods")
    unknown = sorted(set(kwargs) - set(TEXTBOX_EFFICIENT_DEFAULTS[method]))
    if unknown:
        known = ", ".join(TEXTBOX_EFFICIENT_DEFAULTS[method]) or "none"
        raise UserError(f"--efficient_kwargs: {', '.join(unknown)} is no option of {method} (its options: {known})")
    for key, value in {**TEXTBOX_EFFICIENT_DEFAULTS[method], **kwargs}.items():
        try:
            value = EFFICIENT_KWARG_TYPES[key](value)
        except Exception as exc:  # argparse's error, which names no option here
            raise UserError(f"--efficient_kwargs {key}: {exc}") from None
        if user_gave(key) and getattr(ns, key) != value:
            raise UserError(f"--efficient_kwargs {key} {value} and --{key.replace('_', '-')} {getattr(ns, key)} "
                            f"disagree; keep one")
        _rewrite(ns, sources, key, value, "efficient_kwargs")
