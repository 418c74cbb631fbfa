"""The typed configuration of a run: one frozen dataclass per component,
composed into :class:`RunConfig` and resolved once (resolution.py) from the
layers of layers.py.

Each setting is declared once, here, with its command-line flag, type, default
and help; the parser is built from these declarations (options.build_options),
so a new setting is one line in the section of the component that reads it.
Spellings of other tools (HetSeq, kanachan, ESPnet2, TextBox, Accelerate) live
in compat.py. A task, an optimizer and an LR scheduler declare their own
options the same way, as a section of their own (their class's ``options``,
or ``dataclass=`` to their registry's decorator); a run's values of those are
``task_options``, ``optimizer_options`` and ``scheduler_options``.

``group`` is where a setting is printed in ``--print_config`` and
``config.yaml``: files written by earlier versions keep loading and diffing
cleanly, so the printed order is that of the groups below, then of declaration.

This module imports no heavy library: ``--help`` must answer at once.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import types
from dataclasses import dataclass, field
from collections.abc import Mapping as MappingABC
from typing import ClassVar, Mapping

from textbox_like.core.errors import UserError, closest
from textbox_like.config import layers
from textbox_like.config.value_types import (
    BOOL,
    INT_LIST,
    LITERAL_DICT,
    STR_LIST,
    absolute_path,
    device_name,
    dtype_name,
    float_list,
    gpu_ids,
    metric_name,
    metric_names,
    nonneg_int,
    positive_float,
    names_list,
    positive_int,
    probability,
    seed_int,
    seed_list)

#: the printed groups, in order, with their titles in --help; a plugin's
#: options follow them (plugin_group)
GROUPS = {"common": "task and data", "optimization": "optimization", "validation": "validation",
          "checkpoint": "checkpoints and resuming", "logging": "logging", "distributed": "distributed training",
          "sharding": "sharded data parallel (printed and saved where --fsdp is on)",
          "adapters": "parameter-efficient fine-tuning (printed and saved where --peft is on)"}

#: the plugins' own options in a RunConfig: its attribute -> (the setting that
#: chooses the plugin, the plugin's kind in --help's group titles)
PLUGIN_PARTS = {"task_options": ("task", "task"), "optimizer_options": ("optimizer", "optimizer"),
                "scheduler_options": ("lr_scheduler", "lr scheduler")}


def plugin_group(part, name):
    """The group of the own options of the plugin ``name`` (``task:bert``)."""
    return f"{PLUGIN_PARTS[part][0]}:{name}"


_declared = itertools.count()


def setting(default, help, *, group=None, type=None, switch=False, merge=False, optional_value=False,
            choices=None, metavar=None, flag=None):
    """A dataclass field that is also a command-line option (``--name-with-dashes``
    and ``--name_with_underscores``). ``default`` is given as on the command line
    (argparse runs it through ``type``); ``switch``: a bool that takes the bare
    flag or true/false/yes/no/1/0; ``merge``: a dict option, each use adding keys."""
    meta = dict(help=help, group=group, type=type, switch=switch, merge=merge, optional_value=optional_value,
                choices=choices, metavar=metavar, flag=flag, cli_default=default, order=next(_declared))
    value = type(default) if type is not None and isinstance(default, str) else default
    if isinstance(value, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(value), metadata=meta)
    return field(default=value, metadata=meta)


class Section:
    """A component's settings. ``group``: where its settings print by default."""
    group: ClassVar[str]

    @classmethod
    def settings(cls):
        return dataclasses.fields(cls)

    @classmethod
    def group_of(cls, f) -> str:
        return f.metadata["group"] or cls.group


@dataclass(frozen=True)
class DataConfig(Section):
    """What is trained on and how it is batched."""
    group = "common"

    task: str = setting('mnist', 'one of: {choices}')
    user_dir: str | None = setting(None, "your own tasks, optimizers and LR schedulers: a folder that is a Python package (DIR/__init__.py importing your modules, whose @register_task, @register_optimizer, @register_scheduler then count), imported before the command line is read, in every process of the run (fairseq's and HetSeq's --user-dir)", type=absolute_path, metavar='DIR')
    task_class: str | None = setting(None, "the task's class as MODULE:CLASS, imported (and registered, where its module does not register it) in every process of the run before the configuration is read: what textbox_like.train(task=MyTask) records; its module must be importable there (on PYTHONPATH)", metavar='MODULE:CLASS')
    data: str | None = setting(None, 'data directory or file (MNIST: the idx files; fetched when left out)')
    train_subset: str = setting('train', 'split to train on')
    valid_subset: list = setting('valid', 'comma-separated splits to validate on', type=STR_LIST)
    training_data: str | None = setting(None, 'kanachan: the training data: a directory (sets --data), or a file (BERT: that shard only; MNIST: its directory)', metavar='PATH')
    validation_data: str | None = setting(None, 'kanachan: the validation data: a file (BERT: that shard only) or, for MNIST, the --data directory (its split: --valid-subset)', metavar='PATH')
    max_sentences: int | None = setting(None, 'batch size per process (with --global-batch-size: the most samples of one micro-batch on this process, for its memory)', type=positive_int)
    max_sentences_valid: int | None = setting(None, 'validation batch size per process (default: 4x --max-sentences: forward-only work needs far less memory per sample)', type=positive_int)
    max_tokens: int | None = setting(None, 'limit of real tokens per batch and process', type=positive_int)
    global_batch_size: int | None = setting(None, 'samples of one update over all ranks, split over them (evenly; by measured speed with --balance); a share above a rank\'s --max-sentences runs as several micro-batches with one all-reduce (unset: each rank trains --max-sentences per step). With --max-tokens N counts real tokens: each rank\'s --max-tokens caps its micro-batches', type=positive_int, metavar='N')
    required_batch_size_multiple: int = setting(1, 'batch sizes are rounded down to a multiple of this (a batch smaller than it is kept)', type=positive_int)
    num_workers: int = setting(0, 'batches read ahead in a background thread, for data read from disk or pinned for '
                                  'CUDA (0: inline); --streaming: processes tokenising the stream', type=nonneg_int)
    no_shuffle: bool = setting(False, 'train in data order', switch=True)
    num_iters_per_epoch: int = setting(0, 'cap on updates per epoch (0: whole epoch)', type=nonneg_int)
    fast_stat_sync: bool = setting(False, 'HetSeq compatibility, accepted and changes nothing: we always do what it asks for, summing the statistics over ranks in one all-reduce per log interval', switch=True)


@dataclass(frozen=True)
class ModelConfig(Section):
    """The model's options common to every task (a task adds its own: task_options)."""
    group = "common"

    model_conf: dict = setting({}, "model options, key=value or '{key: value}' (repeatable)", merge=True)
    dim_final_feedforward: int | None = setting(None, "kanachan: size of the feed-forward layer of the final head (no such layer in mnist's CNN or BertForPreTraining: a note says so)", type=positive_int)
    checkpointing: bool = setting(False, 'kanachan: activation (gradient) checkpointing: recompute activations in backward, less memory, the same loss', switch=True)
    initial_encoder: str | None = setting(None, 'kanachan: start from these encoder weights (BERT: sets --init-checkpoint)', metavar='PATH')
    initial_decoder: str | None = setting(None, "kanachan: start from these decoder weights (BERT: its heads; our checkpoints and save_pretrained directories hold them with the encoder: give the same file as --initial-encoder)", metavar='PATH')
    model_path: str | None = setting(None, 'TextBox: initial weights, a local save_pretrained directory or a checkpoint of ours (BERT: sets --init-checkpoint; nothing is downloaded)', metavar='PATH')


class OptimizerArguments(MappingABC):
    """The optimizer's constructor arguments (``optim_conf``) as --print_config
    lists them: the stored ones, and ``lr`` read from the section's ``lr``,
    the learning rate's one home, at the place the constructor has it."""

    def __init__(self, stored: Mapping, lr, lr_at):
        self._stored, self._lr, self._lr_at = dict(stored), lr, lr_at

    @classmethod
    def of(cls, conf, lr):
        """From a plain mapping (its ``lr``, if any, marks the place only) or
        another view, with the section's ``lr``."""
        if isinstance(conf, OptimizerArguments):
            return cls(conf._stored, lr, conf._lr_at)
        keys = list(conf or {})
        return cls({k: v for k, v in (conf or {}).items() if k != "lr"}, lr,
                   keys.index("lr") if "lr" in keys else None)

    def _keys(self):
        keys = list(self._stored)
        if self._lr_at is not None and self._lr:
            keys.insert(self._lr_at, "lr")
        return keys

    def __getitem__(self, key):
        if key == "lr" and self._lr_at is not None and self._lr:
            return float(self._lr[0])
        return self._stored[key]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    def __repr__(self):
        return repr(dict(self))


@dataclass(frozen=True)
class OptimConfig(Section):
    """The optimizer: the one home of the learning rate (``optim_conf``'s lr
    is read from it)."""
    group = "optimization"

    optimizer: str = setting('adam', "any case; {choices} (the others of torch.optim by their class names; adam is Adam with decoupled weight decay, i.e. torch's AdamW)")
    lr: list = setting('0.001', "learning rate (HetSeq: 'a,b,c' per epoch); when neither the command line nor a --config file gives one and the optimizer is not the one the properties files chose: 0.1 for sgd, 0.001 for adam/adamw/radam/lamb, torch's default for the others", type=float_list)
    weight_decay: float = setting(0.0, 'weight decay', type=float)
    epsilon: float | None = setting(None, "kanachan: the optimizer's eps (unset: the optimizer's own, e.g. 1e-6 for lamb)", type=float)
    optim_conf: dict = setting({}, "the optimizer's constructor arguments, key=value or '{key: value}' (repeatable); checked against its signature; --print_config lists them all", merge=True)

    def __post_init__(self):
        object.__setattr__(self, "optim_conf", OptimizerArguments.of(self.optim_conf, self.lr))


@dataclass(frozen=True)
class ScheduleConfig(Section):
    """The LR schedule, the run's length and the shape of an update."""
    group = "optimization"

    lr_scheduler: str = setting('PolynomialDecayScheduler', "any case; {choices}. Ours step per update; torch's StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, ConstantLR, PolynomialLR per epoch, CyclicLR, OneCycleLR, CosineAnnealingWarmRestarts per update (as ESPnet2; see --scheduler-interval), ReduceLROnPlateau after each validation on --best-checkpoint-metric")
    warmup_updates: int = setting(0, 'linear LR warm-up over this many updates', type=nonneg_int)
    total_num_update: int = setting(0, 'updates of the LR decay (0: --max-update)', type=nonneg_int)
    scheduler_conf: dict = setting({}, "LR scheduler overrides, key=value or '{key: value}' (repeatable); a torch scheduler's constructor arguments (checked; --print_config lists them all)", merge=True)
    max_epoch: int = setting(0, 'stop after this many epochs (0: no limit)', type=nonneg_int)
    max_update: int = setting(0, 'stop after this many updates (0: no limit)', type=nonneg_int)
    update_freq: list = setting('1', "accumulate gradients over N batches (HetSeq: 'a,b,c' per epoch)", type=INT_LIST)
    clip_norm: float = setting(0.0, 'clip the gradient norm to this (0: no clipping)', type=float)


@dataclass(frozen=True)
class NumericsConfig(Section):
    """What makes the numbers: precision, seed, determinism."""
    group = "optimization"

    fp16: bool = setting(False, 'float16 mixed precision (CUDA; bfloat16 on CPU)', switch=True)
    bf16: bool = setting(False, 'bfloat16 mixed precision', switch=True)
    train_dtype: str = setting('float32', 'training precision (float16/bfloat16: mixed precision; float64: the whole model in float64)', type=dtype_name, choices=['float32', 'float16', 'bfloat16', 'float64'])
    amp_optimization_level: str | None = setting(None, "kanachan/Apex: O0 is float32, O1-O3 float16 mixed precision (Accelerate's; bfloat16 on CPU); sets --train_dtype and says so", choices=['O0', 'O1', 'O2', 'O3'])
    seed: int = setting(1, 'seed of python, numpy, torch and the batch order', type=seed_int)
    cudnn_deterministic: bool = setting(False, 'deterministic cuDNN kernels', switch=True)


@dataclass(frozen=True)
class ValidationConfig(Section):
    """When to validate and which metric is best."""
    group = "validation"

    validate_interval: int = setting(1, 'validate every N epochs (not where --validate-interval-updates is given alone)', type=positive_int)
    validate_interval_updates: int = setting(0, 'validate every N updates (0: off)', type=nonneg_int)
    disable_validation: bool = setting(False, 'never validate', switch=True)
    best_checkpoint_metric: str | None = setting(None, 'metric for checkpoint_best.pt (task default if unset)', type=metric_name)
    patience: int = setting(-1, 'fairseq: stop after this many validations in a row without improvement of --best-checkpoint-metric (-1: never)', type=int)
    metrics: list | None = setting(None, "TextBox: the metrics to report, like ['accuracy']: every metric of the task is reported; a name it does not report is refused", type=metric_names)
    maximize_best_checkpoint_metric: bool | None = setting(None, 'higher is better for --best-checkpoint-metric (default: by the metric: lower for loss, *_loss, ppl; higher for accuracy, F1, ROUGE, BLEU)', type=BOOL, optional_value=True)


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Where and when to save, and what a restore restores."""
    group = "checkpoint"

    save_dir: str = setting('checkpoints', 'where checkpoints, config.yaml and metrics go')
    output_prefix: str | None = setting(None, 'kanachan: with --experiment-name, save into DIR/NAME (unset: --save-dir is the prefix)', metavar='DIR')
    experiment_name: str | None = setting(None, 'kanachan: save into PREFIX/NAME; with --output-prefix alone NAME is the start time (YYYY-MM-DD-HH-MM-SS; give a name to --resume it later or to run on several nodes)', metavar='NAME')
    num_epoch_digits: int = setting(0, 'kanachan: epoch numbers in checkpoint names padded to this many digits (0: no padding)', type=nonneg_int)
    snapshot_interval: int = setting(0, 'kanachan: save a checkpoint every NSAMPLES training samples (0: off)', type=nonneg_int, metavar='NSAMPLES')
    initial_optimizer: str | None = setting(None, 'kanachan: start from this optimizer state (a checkpoint of ours or a torch state dict)', metavar='PATH')
    save_interval: int = setting(1, 'save every N epochs', type=positive_int)
    save_interval_updates: int = setting(0, 'save every N updates (0: off)', type=nonneg_int)
    keep_interval_updates: int = setting(0, 'keep the newest N update checkpoints (0: all)', type=nonneg_int)
    keep_last_epochs: int = setting(0, 'keep the newest N epoch checkpoints (0: all)', type=nonneg_int)
    no_epoch_checkpoints: bool = setting(False, 'no checkpoint{epoch}.pt', switch=True)
    no_last_checkpoints: bool = setting(False, 'no checkpoint_last.pt', switch=True)
    no_save_optimizer_state: bool = setting(False, 'leave the optimizer state out', switch=True)
    no_save: bool = setting(False, 'write no checkpoints and no files', switch=True)
    resume: bool = setting(False, 'continue from checkpoint_last.pt in --save-dir, if any', switch=True)
    restore_file: str | None = setting(None, 'start from this checkpoint')
    reset_optimizer: bool = setting(False, 'do not restore the optimizer state', switch=True)
    reset_lr_scheduler: bool = setting(False, 'do not restore the LR schedule', switch=True)
    reset_meters: bool = setting(False, 'do not restore meters and the best metric', switch=True)
    reset_dataloader: bool = setting(False, 'do not restore the position in the data', switch=True)
    optimizer_overrides: dict = setting('{}', 'dict literal of optimizer values to override on restore, e.g. "{\'lr\': 0.5}"', type=LITERAL_DICT)


@dataclass(frozen=True)
class LoggingConfig(Section):
    """Log lines and experiment trackers."""
    group = "logging"

    log_format: str | None = setting(None, 'tqdm on a terminal, simple otherwise', choices=['none', 'simple', 'json', 'tqdm'])
    log_interval: int = setting(100, 'log every N updates', type=nonneg_int)
    report_to: str = setting('tensorboard', 'experiment trackers, comma-separated: {choices}, all or none (TensorBoard writes to SAVE_DIR/tensorboard)')
    use_tensorboard: bool | None = setting(None, 'ESPnet2: add (true) or remove (false) the TensorBoard tracker', type=BOOL, optional_value=True)
    use_wandb: bool | None = setting(None, 'ESPnet2: add (true) or remove (false) the W&B tracker', type=BOOL, optional_value=True)


@dataclass(frozen=True)
class CallbacksConfig(Section):
    """Callbacks that hook into the run (training/callbacks.py)."""
    group = "logging"

    callbacks: list = setting([], 'comma-separated callbacks to call at the start, after each update, validation and '
                                  'checkpoint, and at the end: classes registered with @register_callback("name") in '
                                  'a --user-dir package or an entry point', type=STR_LIST)


@dataclass(frozen=True)
class RuntimeConfig(Section):
    """How this process runs the work: device, threads, compilation, the non-finite guard."""
    group = "optimization"

    cpu: bool = setting(False, 'train on CPU even when CUDA is present', switch=True)
    device: str | None = setting(None, 'kanachan: cpu, cuda or cudaN (cpu: as --cpu; cudaN: GPU N for a single process)', type=device_name)
    threads: int = setting(0, "torch intra-op threads per process (0: the cores divided among this node's processes)", type=nonneg_int)
    max_nonfinite_updates: int = setting(10, 'stop (exit 65) after this many consecutive updates whose gradient norm is not finite; each such update is skipped (no optimizer or LR step)', group='logging', type=positive_int)
    compile: bool = setting(False, 'compile the model with torch.compile through Accelerate (inductor: C++ on CPU, Triton on CUDA); falls back to eager with one line where it cannot', group='logging', type=BOOL, optional_value=True)
    compile_mode: str = setting('default', 'torch.compile mode with --compile', group='logging', choices=['default', 'reduce-overhead', 'max-autotune'])


@dataclass(frozen=True)
class DistributedConfig(Section):
    """Processes, nodes and DDP."""
    group = "distributed"

    distributed_world_size: int = setting(1, 'processes over all nodes', type=positive_int)
    distributed_init_method: str | None = setting(None, 'tcp://HOST:PORT or file:///shared/path')
    distributed_gpus: int = setting(0, 'processes to start on this node', type=nonneg_int)
    ngpu: int | None = setting(None, 'ESPnet2: processes on this node (0: one process on CPU); alone it sets --distributed-world-size, with --distributed-init-method --distributed-gpus', type=nonneg_int)
    gpu_id: str | None = setting(None, 'TextBox: the GPUs to use, e.g. 0,1', type=gpu_ids, metavar='IDS')
    distributed_rank: int = setting(0, "global rank of this node's first process", type=nonneg_int)
    distributed_backend: str | None = setting(None, 'nccl with CUDA, else gloo', choices=['gloo', 'nccl'])
    distributed_no_spawn: bool = setting(False, 'this process is one rank; start no others', switch=True)
    distributed_port: int = setting(-1, 'HetSeq compatibility: port for tcp rendezvous', type=int)
    device_id: int | None = setting(None, 'GPU of this process', type=int)
    ddp_backend: str = setting('c10d', "DDP implementation (PyTorch's c10d)", choices=['c10d'])
    bucket_cap_mb: int | None = setting(None, "DDP gradient bucket size in MiB (default: 25, DDP's own, on CUDA; 4 on CPU, where gloo sums on a CPU thread and smaller buckets start summing during the backward pass)", type=positive_int)
    find_unused_parameters: bool = setting(False, 'DDP: allow parameters without gradient', switch=True)
    distributed_timeout: int = setting(300, 'seconds to wait for a missing rank before failing', type=positive_int)
    balance: bool = setting(False, 'with --global-batch-size: re-split it over the ranks to the split with the shortest measured update time, searched from the one proportional to their compute speed', switch=True)
    balance_interval: int = setting(50, 'updates between re-checks of the split under --balance (the first exchange after at most 10; each split tried runs min(10, this) updates)', type=positive_int, metavar='UPDATES')
    ddp_comm_hook: str = setting('none', "compress DDP's gradient all-reduce for slow links (Accelerate's comm_hook; lossy, so opt-in): fp16, bf16 or powersgd (rank-1 PowerSGD)", choices=['none', 'fp16', 'bf16', 'powersgd'])



@dataclass(frozen=True)
class ShardingConfig(Section):
    """--fsdp: parameters, gradients and optimizer states sharded over the
    ranks (FSDP2's fully_shard; Accelerate's FSDP2 plugin on CUDA where parameters
    are split, ours on CPU and where nothing is split: sharding.applied_by_us).
    Its group is printed only where --fsdp is on (resolution.groups_for):
    the configuration of a run without it reads as before."""
    group = "sharding"

    fsdp: bool = setting(False, "shard parameters, gradients and optimizer states over the ranks instead of DDP's full copy per rank (FSDP2; accelerate launch --use_fsdp --fsdp_version 2 sets it); the same update as DDP, mixed precision follows the run's (bf16/fp16 parameters, float32 gradient reduction); activation checkpointing is --checkpointing", switch=True)
    fsdp_sharding: str = setting('full', 'with --fsdp: full (over all ranks), hybrid (within each node, replicated across nodes) or none (every rank a full copy, as DDP)', choices=['full', 'hybrid', 'none'])
    fsdp_wrap: str = setting('block', "with --fsdp: the units gathered one at a time: block (the model's own layer class: its _no_split_modules, or --fsdp-block-classes), size (submodules of at least --fsdp-min-params parameters) or none (the whole model as one unit)", choices=['block', 'size', 'none'])
    fsdp_block_classes: list = setting('', 'with --fsdp --fsdp-wrap block: the layer classes to wrap, by class name, comma-separated (default: the model\'s _no_split_modules)', type=STR_LIST, metavar='NAMES')
    fsdp_min_params: int = setting(100000000, 'with --fsdp --fsdp-wrap size: the fewest parameters of a unit', type=positive_int, metavar='N')
    fsdp_reshard_after_forward: bool = setting(True, 'with --fsdp: free the gathered parameters after forward and gather them again in backward (less memory, one more all-gather per unit)', type=BOOL)
    fsdp_cpu_offload: bool = setting(False, "with --fsdp on CUDA: keep parameters, gradients and optimizer states in CPU memory, copied to the GPU per unit (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU)", switch=True)


#: --peft's methods: peft's (prefix-tuning reparameterises its prefix by an MLP,
#: p-tuning-v2 trains it directly, as in TextBox), and bitfit (biases only: no peft)
PEFT_METHODS = ("none", "lora", "prefix-tuning", "p-tuning-v2", "prompt-tuning", "bitfit")


@dataclass(frozen=True)
class AdaptersConfig(Section):
    """--peft: train a few weights of a frozen model (adapters through peft,
    or its biases) instead of every weight; the update is still that of one
    device over the global batch. Printed only where --peft is on."""
    group = "adapters"

    peft: str = setting('none', "parameter-efficient fine-tuning: {choices} (the base model's weights stay frozen; checkpoints hold only what is trained)", choices=list(PEFT_METHODS))
    lora_r: int = setting(8, 'lora: the rank of each adapter', type=positive_int)
    lora_alpha: float = setting(16.0, 'lora: the adapters are scaled by lora_alpha / lora_r', type=positive_float)
    lora_dropout: float = setting(0.0, "lora: dropout on the adapters' input", type=probability)
    lora_target_modules: list = setting('', "lora: the modules adapted, by the end of their names (e.g. q_proj,v_proj; default: peft's table for the model type, or a task's own lora_target_modules)", type=STR_LIST, metavar='NAMES')
    prefix_length: int = setting(20, 'prefix-tuning, p-tuning-v2: virtual tokens of the prefix of every layer', type=positive_int)
    prefix_mid_dim: int = setting(512, 'prefix-tuning: the hidden size of the MLP that makes the prefix (p-tuning-v2 trains the prefix itself)', type=positive_int)
    prefix_dropout: float = setting(0.0, "prefix-tuning, p-tuning-v2: dropout on the prefix's keys and values", type=probability)
    prompt_length: int = setting(20, 'prompt-tuning: virtual tokens prepended to the input', type=positive_int)
    merge_on_export: bool = setting(False, "lora: the end-of-run hf_model/ is the model with the adapters folded in (default: the adapter alone, as PeftModel.save_pretrained writes it)", switch=True)
    efficient_methods: list | None = setting(None, "TextBox: one method in a list like ['lora'] (sets --peft; TextBox's defaults for the options --efficient_kwargs leaves out)", type=names_list)
    efficient_kwargs: dict = setting('{}', "TextBox: the method's options, e.g. \"{'lora_r': 4, 'lora_alpha': 32, 'lora_dropout': 0.1}\" (prefix_length, prefix_mid_dim, prefix_dropout, prompt_length)", type=LITERAL_DICT)


@dataclass(frozen=True)
class SearchConfig(Section):
    """The options of run_hyper.py and run_multi_seed.py themselves (not a
    trainer section: not in SECTIONS; every other option of those command
    lines goes to each trial's trainer). ``COMMANDS`` says which options each
    command line has, and the defaults and help that differ between them;
    ``choices`` are checked after parsing, with the closest name."""
    group = "search"

    space: str | None = setting(None, "space file: TextBox lines ('learning_rate loguniform (-8, 0)') or YAML", metavar='FILE')
    algo: str = setting('random', 'exhaustive, random (rand), bayes (tpe), anneal, atpe, or tpe.suggest etc. (default random)', metavar='ALGO')
    max_evals: int | None = setting(None, 'number of trials (default 10; exhaustive: the whole grid)', type=positive_int, metavar='N', flag='--max_evals')
    multi_seed: int | None = setting(None, 'run N seeds drawn from a generator seeded with --seed (as TextBox)', type=positive_int, metavar='N', flag='--multi_seed')
    seeds: list | None = setting(None, 'run these seeds, e.g. 3,7,11', type=seed_list, metavar='LIST')
    seed: int | None = setting(None, 'seed of the sampler', type=seed_int)
    train_seed: int | None = setting(None, "--seed of every trial's training run (default: the configured one)", type=seed_int, flag='--train_seed')
    output: str | None = setting(None, 'where the trials and the reports go', metavar='DIR')
    resume: bool = setting(False, 'continue the search in --output: finished trials are kept, a running one continues', switch=True)
    scheduler: str = setting('none', 'ray: asha stops hopeless trials early (default none)', choices=['none', 'asha'], metavar='NAME')
    grace_updates: int | None = setting(None, "ray/asha: updates every trial runs before it may be stopped (default: the first validation's)", type=positive_int, metavar='N')
    metric: str | None = setting(None, "validation metric (default: --best-checkpoint-metric or the task's)")
    maximize: bool | None = setting(None, "higher METRIC is better (--minimize: lower; default: the configured or the task's direction)")
    parallel: int = setting(1, 'trials at once (default 1); on CPU the cores are split between them', type=positive_int, metavar='N')
    gpus_per_trial: int = setting(0, "GPUs of each trial (K > 1: K processes of the trainer's multi-process mode)", type=nonneg_int, metavar='K')
    cpus_per_trial: float | None = setting(None, 'CPUs of each trial (ray; default: the cores divided by --parallel)', type=positive_float, metavar='C')
    backend: str = setting('local', 'local (default): this machine; ray: Ray Tune, this machine or a cluster', choices=['local', 'ray'], metavar='NAME')
    ray_address: str | None = setting(None, 'ray: join a running cluster (auto or HOST:PORT); default a local Ray instance', metavar='ADDR')
    max_failures: int = setting(2, "ray: retries of a trial whose process or node dies (default 2); it resumes from its checkpoint_last.pt", type=nonneg_int, metavar='N')

    _SHARED: ClassVar[tuple] = ("metric", "maximize", "parallel", "gpus_per_trial", "cpus_per_trial", "backend",
                                "ray_address", "max_failures")
    #: command line -> (its options, {option: (default, help)} where it differs from the declaration)
    COMMANDS: ClassVar[dict] = {
        "run_hyper.py": (("space", "algo", "max_evals", "seed", "train_seed", "output", "resume", "scheduler",
                          "grace_updates") + _SHARED,
                         {"seed": (1, "seed of the sampler (default 1)"),
                          "output": ("checkpoints/hyper", "where trial_<k>/ and the reports go (default "
                                                          "checkpoints/hyper)")}),
        "run_multi_seed.py": (("multi_seed", "seeds", "seed", "output") + _SHARED,
                              {"seed": (None, "with --multi_seed: seeds the generator of the N seeds (default: the "
                                              "configured --seed)"),
                               "output": ("checkpoints/multi_seed", "where seed_<s>/ and the summaries go (default "
                                                                    "checkpoints/multi_seed)"),
                               "parallel": (1, "seeds at once (default 1); on CPU the cores are split between "
                                               "them")}),
    }

    @classmethod
    def for_command(cls, command, **values):
        """The settings of ``command`` with its own defaults where ``values`` gives none."""
        own, differs = cls.COMMANDS[command]
        unknown = sorted(set(values) - set(own))
        if unknown:
            raise UserError(f"{command} has no option {', '.join(unknown)}")
        return cls(**{**{name: default for name, (default, _) in differs.items()}, **values})

SECTIONS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "schedule": ScheduleConfig,
            "numerics": NumericsConfig, "validation": ValidationConfig, "checkpoint": CheckpointConfig,
            "logging": LoggingConfig, "callbacks": CallbacksConfig, "runtime": RuntimeConfig,
            "distributed": DistributedConfig, "sharding": ShardingConfig, "adapters": AdaptersConfig}

#: sections printed (and saved) only where the run uses them: a configuration
#: written without one means its defaults
OPTIONAL_SECTIONS = ("sharding", "adapters")


def declared_settings():
    """(section name, section class, field) of every declared setting, in printed order."""
    found = [(name, cls, f) for name, cls in SECTIONS.items() for f in cls.settings()]
    return sorted(found, key=lambda item: (list(GROUPS).index(item[1].group_of(item[2])), item[2].metadata["order"]))


#: setting name -> the section that holds it
SECTION_OF = {f.name: name for name, _, f in declared_settings()}


@dataclass(frozen=True)
class NoOptions(Section):
    """The section of a task, optimizer or LR scheduler without options of its own."""


@dataclass(frozen=True)
class RunConfig:
    """A run's whole configuration, resolved once; each component is handed
    its own section. ``keys``: the settings that apply to this run, in printed
    order; ``sources``: where each value came from (see layers.LAYER_NAMES)."""
    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    numerics: NumericsConfig
    validation: ValidationConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    callbacks: CallbacksConfig
    runtime: RuntimeConfig
    distributed: DistributedConfig
    sharding: ShardingConfig
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    task_options: Section = field(default_factory=NoOptions)
    optimizer_options: Section = field(default_factory=NoOptions)
    scheduler_options: Section = field(default_factory=NoOptions)
    keys: tuple = ()
    sources: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_values(cls, values: Mapping, keys, plugin_sections: Mapping[str, type], sources: Mapping[str, str]):
        """From resolved values by setting name; ``plugin_sections``: the
        sections of the chosen task's, optimizer's and scheduler's own options
        (by PLUGIN_PARTS' names)."""
        # the sharding and adapters groups are printed only where used (resolution.groups_for):
        # a configuration written from a run's keys may lack them, and means their defaults
        sections = {name: section(**{f.name: values[f.name] for f in section.settings()
                                     if f.name in values or name not in OPTIONAL_SECTIONS})
                    for name, section in SECTIONS.items()}
        plugins = {part: section(**{f.name: values[f.name] for f in section.settings()})
                   for part, section in plugin_sections.items()}
        return cls(**sections, **plugins, keys=tuple(keys), sources=types.MappingProxyType(dict(sources)))

    def get(self, key):
        """The value of a setting by its printed name (``max_update``, ``adam_betas``)."""
        section = SECTION_OF.get(key)
        if section is not None:
            return getattr(getattr(self, section), key)
        for part in (self.task_options, self.optimizer_options, self.scheduler_options):
            if key in vars(part):
                return getattr(part, key)
        raise UserError(f"unknown setting {key!r}{closest(key, list(self.keys))}")

    def source(self, key) -> str:
        return self.sources.get(key, "default")

    def given(self, key) -> bool:
        """Whether the user set it (command line, --config, Python, the
        environment), not a built-in default or one of our properties files."""
        return layers.set_by_user(self.source(key))

    def as_dict(self) -> dict:
        """{setting: value} in printed order: what --print_config prints."""
        return {key: self.get(key) for key in self.keys}

    def replace(self, source="RunConfig.replace()", **changes):
        """A copy with settings changed by name (``cfg.replace(max_update=5)``),
        for code that derives one configuration from another (evaluation,
        tests); values are taken as typed; ``source`` says where the new
        values came from (``cfg.source(key)``)."""
        sections, plugins = {}, {}
        for key, value in changes.items():
            section = SECTION_OF.get(key)
            if section is not None:
                sections.setdefault(section, {})[key] = value
                continue
            for part in ("task_options", "optimizer_options", "scheduler_options"):
                if key in vars(getattr(self, part)):
                    plugins.setdefault(part, {})[key] = value
                    break
            else:
                raise UserError(f"unknown setting {key!r}{closest(key, list(SECTION_OF))}")
        return dataclasses.replace(
            self, **{name: dataclasses.replace(getattr(self, name), **values) for name, values in sections.items()},
            **{part: dataclasses.replace(getattr(self, part), **values) for part, values in plugins.items()},
            sources=types.MappingProxyType({**self.sources, **{key: source for key in changes}}))
