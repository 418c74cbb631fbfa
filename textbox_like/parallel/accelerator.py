"""Building the Accelerator: device, precision, DDP settings and trackers.

Accelerate owns device placement, DDP and mixed precision. Settings can come
from three places; the first that says something wins, and the log says which:

1. our options (``--fp16``, ``--bf16``, ``--train_dtype``, ``--update-freq``),
   when they differ from their defaults;
2. ``accelerate launch`` flags and the ``accelerate config`` file, which the
   launcher hands to the process as ``ACCELERATE_*`` variables;
3. the defaults (float32, no accumulation).
"""
from __future__ import annotations

import os
import sys

from textbox_like.parallel import sharding
from textbox_like.processes.distributed import (
    bind_device,
    claim_accelerate_state,
    note_group,
    one_rank_group,
    uses_cuda)
from textbox_like.core.errors import UserError

PRECISIONS = {"float32": "no", "float64": "no", "float16": "fp16", "bfloat16": "bf16"}


def warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


def precision(numerics, cuda: bool):
    """(Accelerate's mixed_precision, where the choice came from), from the
    run's numerics section."""
    if numerics.fp16:
        chosen, source = "fp16", "--fp16"
    elif numerics.bf16:
        chosen, source = "bf16", "--bf16"
    elif numerics.train_dtype != "float32":
        chosen, source = PRECISIONS[numerics.train_dtype], f"--train_dtype {numerics.train_dtype}"
    elif os.environ.get("ACCELERATE_MIXED_PRECISION", "no") not in ("", "no"):
        chosen, source = os.environ["ACCELERATE_MIXED_PRECISION"], "accelerate launch / accelerate config"
    else:
        chosen, source = "no", "default"
    if chosen not in ("no", "fp16", "bf16"):
        raise UserError(f"mixed precision {chosen!r} (from {source}) is not supported here; use no, fp16 or bf16")
    if chosen == "fp16" and not cuda:
        warn("float16 mixed precision needs CUDA (Accelerate has none on CPU); running bfloat16 instead")
        chosen = "bf16"
    if chosen == "bf16" and cuda:
        import torch
        major, _ = torch.cuda.get_device_capability()
        if major < 8:
            warn(f"bfloat16 on {torch.cuda.get_device_name()} (compute capability {major}.x < 8.0) is emulated "
                 f"and slower than float32; use --fp16 on this GPU")
    return chosen, source


def mixed_precision(numerics, cuda: bool) -> str:
    return precision(numerics, cuda)[0]


def update_freq_source(cfg):
    """Where --update-freq came from: ours (command line, --config), else
    accelerate launch --gradient_accumulation_steps (compat.environment_settings),
    else the default; resolved once in the configuration, not here."""
    return cfg.source("update_freq")


def compile_plugin(runtime, cuda: bool):
    """(TorchDynamoPlugin or None, source): --compile, else accelerate launch's
    --dynamo_backend; None where this platform cannot compile."""
    import importlib.util
    import shutil

    launched = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() not in ("", "no")
    if not (runtime.compile or launched):
        return None, "default"
    source = "--compile" if runtime.compile else "accelerate launch --dynamo_backend"
    mode = runtime.compile_mode if runtime.compile or runtime.compile_mode != "default" else \
        os.environ.get("ACCELERATE_DYNAMO_MODE") or "default"
    missing = None
    if cuda and importlib.util.find_spec("triton") is None:
        missing = "Triton (pip install triton)"
    elif not cuda and not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        missing = "a C++ compiler (apt-get install g++)"
    if missing:
        warn(f"{source}: compiling here needs {missing}; training eager")
        return None, "default"
    from accelerate.utils import TorchDynamoPlugin
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "inductor") if launched and not runtime.compile \
        else "inductor"
    return TorchDynamoPlugin(backend=backend.lower(), mode=mode), f"{source} (mode {mode})"


def compile_regions(accelerator, model):
    """Compile only the parts a model names for this device, with Accelerate's
    dynamo settings (ours or the launcher's); returns their names, or None when
    Accelerate compiles the whole model in prepare() as usual.

    A model says ``compile_regions(device_type) -> list of names | None``: the
    methods or submodules worth compiling there (torchtitan compiles per block
    in the same spirit). A submodule compiles in place and a method is replaced
    on the instance, so parameter names and checkpoints are the same compiled
    or not. Accelerate is then told to compile nothing more."""
    from accelerate.utils import DynamoBackend
    plugin = accelerator.state.dynamo_plugin
    if plugin.backend == DynamoBackend.NO or not hasattr(model, "compile_regions"):
        return None
    names = model.compile_regions(accelerator.device.type)
    if names is None:
        return None
    import torch
    kwargs = plugin.to_kwargs()
    for name in names:
        part = getattr(model, name)
        if isinstance(part, torch.nn.Module):
            part.compile(**kwargs)
        else:
            setattr(model, name, torch.compile(part, **kwargs))
    # the state is this process's Accelerator's: prepare() reads it to decide
    # whether to wrap the whole model in torch.compile
    plugin.backend = DynamoBackend.NO
    return list(names)


def uncompile(model, regions):
    """The eager model back, after a failed compilation: the module under
    Accelerate's torch.compile wrapper, or ``model`` with its regions restored."""
    import torch

    from textbox_like.core.internals import compiled_original, drop_module_compilation
    if regions is None:
        return compiled_original(model)
    inner = getattr(model, "module", model)  # under DDP
    for name in regions:
        part = getattr(inner, name)
        if isinstance(part, torch.nn.Module):
            drop_module_compilation(part)
        else:
            delattr(inner, name)  # the class's own method again
    return model




#: --ddp-comm-hook -> Accelerate's DDPCommunicationHookType member
COMM_HOOKS = {"fp16": "FP16", "bf16": "BF16", "powersgd": "POWER_SGD"}


def comm_hook(distributed) -> dict:
    """Accelerate's DDP arguments for --ddp-comm-hook: gradients all-reduced
    in float16 or bfloat16 (half the bytes), or PowerSGD's rank-1
    approximation with error feedback, from the first update."""
    if distributed.ddp_comm_hook == "none":
        return {}
    from accelerate.utils import DDPCommunicationHookType
    kwargs = {"comm_hook": getattr(DDPCommunicationHookType, COMM_HOOKS[distributed.ddp_comm_hook])}
    if distributed.ddp_comm_hook == "powersgd":
        kwargs["comm_state_option"] = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    return kwargs


def build_accelerator(cfg, placement, log_with=None):
    """The Accelerator for this process; (accelerator, {setting: source})."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    cuda = uses_cuda(cfg)
    if cuda:
        # this process's GPU for torch and for Accelerate (ACCELERATE_TORCH_DEVICE):
        # --device-id modulo the visible devices for a node's only process (also
        # under torchrun --nproc_per_node 1, where Accelerate would take
        # cuda:LOCAL_RANK), else the node-local rank modulo them
        device = bind_device(placement, cfg)
    chosen, precision_source = precision(cfg.numerics, cuda)
    plugin, compile_source = compile_plugin(cfg.runtime, cuda)
    sources = {"precision": precision_source, "update-freq": update_freq_source(cfg), "compile": compile_source}
    bucket_cap_mb = cfg.distributed.bucket_cap_mb or (25 if cuda else 4)
    if cfg.distributed.ddp_comm_hook == "powersgd" and not cuda:
        # PowerSGD all-reduces twice per bucket, the second from a callback of
        # the first; gloo runs callbacks in the order its transfers finish,
        # which differs between ranks, so several buckets mismatch their
        # collectives ("Received data size doesn't match"): one bucket on gloo
        bucket_cap_mb = 1 << 20
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.distributed.find_unused_parameters,
                                        bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
                                        **comm_hook(cfg.distributed))
    if cfg.distributed.ddp_comm_hook != "none":
        sources["ddp-comm-hook"] = f"--ddp-comm-hook {cfg.distributed.ddp_comm_hook}"
    if plugin is None:  # not compiling, whatever ACCELERATE_DYNAMO_* say
        from accelerate.utils import TorchDynamoPlugin
        plugin = TorchDynamoPlugin(backend="no")
    fsdp = {}
    if sharding.enabled(cfg):
        launched = cfg.source("fsdp") == "accelerate launch / accelerate config"
        sources["sharding"] = cfg.source("fsdp") if launched else "--fsdp"
        sharding.check_nodes_alike(cfg, placement)  # before any mesh is built
        if cuda and not sharding.applied_by_us(cfg, placement, cuda):  # else the trainer's shard_model
            if placement.world_size == 1:
                one_rank_group(cfg, device)
            fsdp["fsdp_plugin"], parallelism = sharding.accelerate_plugin(cfg, placement, chosen)
            if parallelism is not None:
                fsdp["parallelism_config"] = parallelism
    if not fsdp:
        # the run's settings decide: without --fsdp (or where the trainer
        # shards itself: sharding.applied_by_us) Accelerate builds no plugin of its own from
        # what accelerate launch exported
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    if "parallelism_config" not in fsdp:
        # Accelerate 1.15 builds a ParallelismConfig from what accelerate launch
        # --parallelism_config_* exported and applies it to every model, also one
        # the trainer's shard_model already sharded: the run's mesh decides
        for name in [n for n in os.environ if n == "ACCELERATE_USE_PARALLELISM_CONFIG"
                     or n.startswith("PARALLELISM_CONFIG_")]:
            os.environ.pop(name)
    claim_accelerate_state()  # reset by distributed.cleanup() where this run sets it up
    accelerator = Accelerator(cpu=not cuda, mixed_precision=chosen, kwargs_handlers=[ddp], dynamo_plugin=plugin,
                              step_scheduler_with_optimizer=False, log_with=log_with or None,
                              project_dir=cfg.checkpoint.save_dir if log_with else None, **fsdp)
    if accelerator.num_processes != placement.world_size:
        raise UserError(f"Accelerate sees {accelerator.num_processes} process(es) but this run has "
                        f"{placement.world_size}; on a machine without CUDA start with "
                        f"'accelerate launch --multi_gpu --num_processes N' or '--distributed-world-size N'")
    import torch.distributed as dist
    if dist.is_initialized():
        note_group()
    return accelerator, sources


def device_placement(accelerator, *objects) -> list | None:
    """``prepare()``'s ``device_placement`` for ``objects``, as Accelerate
    would decide it, where no DTensor exists yet: Accelerate asks whether the
    model holds DTensors by importing torch.distributed.tensor (0.8 s of CPU in
    a one-process run that has none). Without that module loaded no tensor
    can be one; with it (a model we sharded) Accelerate decides (None)."""
    from accelerate.utils import DistributedType
    if "torch.distributed.tensor" in sys.modules:
        return None
    place = accelerator.device_placement and accelerator.distributed_type != DistributedType.FSDP
    return [place] * len(objects)
