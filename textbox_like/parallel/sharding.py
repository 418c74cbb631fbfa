"""--fsdp: parameters, gradients and optimizer states sharded over the ranks
with FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of DDP's full
copy per rank.

On CUDA Accelerate applies it (its FSDP2 plugin, built here from the run's
settings: :func:`accelerate_plugin`) where parameters are split. Accelerate
activates FSDP only on GPU types, and on CPU it would make the run DDP, so
there :func:`shard_model` applies ``fully_shard`` with the same settings
itself, before the optimizer is built, and the model goes through
``prepare_model`` without DDP; so it does on CUDA where no parameter is split
(a shard degree of one: :func:`applied_by_us`).

The maths stays DDP's: FSDP2 divides the reduce-scattered gradients by the
world size as DDP's all-reduce does, and every rank already scales its
summed loss for that (step.UpdateStep.backward); ranks run the same number
of forward/backward calls per update (feed.py, global_batch.py), which FSDP
needs, since every forward all-gathers.
"""
from __future__ import annotations

import contextlib
import gc
import sys

from textbox_like.parallel import malloc

#: (optimizer name, its constructor arguments) -> state elements per parameter
#: element (optimizer_state_elements): SGD keeps a momentum buffer only with momentum > 0
STATE_PER_PARAMETER = {}


def enabled(cfg) -> bool:
    return bool(cfg.sharding.fsdp)


def check_settings(cfg) -> None:
    """DDP's settings under --fsdp: refused where they cannot be honoured (one
    line, before anything starts), a note where they change nothing."""
    from textbox_like.processes.distributed import uses_cuda
    from textbox_like.core.errors import UserError, note
    if not enabled(cfg):
        return
    dist = cfg.distributed
    if dist.ddp_comm_hook != "none":
        raise UserError(f"--ddp-comm-hook {dist.ddp_comm_hook} compresses DDP's all-reduce; --fsdp reduce-scatters "
                        f"the gradients without communication hooks: drop one of them")
    if dist.bucket_cap_mb is not None:
        raise UserError("--bucket-cap-mb sizes DDP's gradient buckets; --fsdp reduces the gradients one unit at a "
                        "time (the units: --fsdp-wrap, --fsdp-min-params): drop --bucket-cap-mb")
    if cfg.sharding.fsdp_cpu_offload and not uses_cuda(cfg):
        note("--fsdp-cpu-offload changes nothing on CPU: parameters, gradients and optimizer states are in CPU "
             "memory already")


def reduce_unused_parameters(model, cfg) -> None:
    """--find-unused-parameters under --fsdp: a parameter that this rank's
    forward left unused still takes part in the reduce-scatter, with a zero
    gradient (FSDP2's set_reduce_scatter_unused_params), so ranks that use
    different parameters run the same collectives, as DDP's
    find_unused_parameters lets them."""
    if cfg.distributed.find_unused_parameters:
        sharded_root(model).set_reduce_scatter_unused_params(True)


def applied_by_us(cfg, placement, cuda: bool) -> bool:
    """Whether :func:`shard_model` applies the sharding, not Accelerate's FSDP2
    plugin: on CPU, where Accelerate has no FSDP; and on CUDA where each
    parameter is split over one rank (--fsdp-sharding none, hybrid with one
    rank per node), which Accelerate refuses ("no dimension for FSDP to shard
    across"): the (world, 1) mesh it needs is the one the CPU runs use, so
    the code CPU tests run is the code these CUDA runs run. One process on
    CUDA keeps Accelerate's plugin (distributed.one_rank_group)."""
    if not enabled(cfg) or placement.world_size == 1:
        return False
    return not cuda or shard_degree(cfg, placement) == 1


def where(cuda: bool, ours: bool) -> str:
    """Who applies the sharding on this device (``ours``: applied_by_us), for the start line."""
    if not ours:
        return "Accelerate's FSDP2 plugin"
    if cuda:
        return "fully_shard applied by textbox_like (Accelerate's FSDP needs ranks to shard across)"
    return "fully_shard applied by textbox_like (Accelerate has no FSDP on CPU)"


def mixed_precision_policy(mixed_precision: str):
    """FSDP2's policy for the run's precision: parameters gathered in bf16/fp16
    for compute, gradients reduced in float32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)


def nodes(placement) -> int:
    return max(1, placement.world_size // max(placement.local_world_size, 1))


def check_nodes_alike(cfg, placement) -> None:
    """--fsdp-sharding hybrid lays the ranks out as (nodes, ranks per node),
    each rank from its own LOCAL_WORLD_SIZE: nodes with unlike numbers of
    ranks would build unlike meshes (mismatched collectives, or a hang), so
    every rank's count and local rank are compared first (one all-gather)."""
    from textbox_like.core.collectives import one_per_rank
    from textbox_like.core.errors import UserError
    world = placement.world_size
    if cfg.sharding.fsdp_sharding != "hybrid" or world == 1:
        return
    seen = one_per_rank((placement.local_world_size, placement.local_rank), world)
    sizes, locals_ = [size for size, _ in seen], [local for _, local in seen]
    per_node = sizes[0]
    if any(size != per_node for size in sizes) or world % per_node:
        raise UserError(f"--fsdp-sharding hybrid needs the same number of ranks on every node (here the ranks "
                        f"see {sizes} ranks on their node, rank by rank: LOCAL_WORLD_SIZE); use --fsdp-sharding full")
    if any(local != rank % per_node for rank, local in enumerate(locals_)):
        raise UserError(f"--fsdp-sharding hybrid needs each node's ranks numbered one after another (here the "
                        f"local ranks are {locals_}, rank by rank, with {per_node} per node); use --fsdp-sharding "
                        f"full, or start the ranks node by node")


def shard_degree(cfg, placement) -> int:
    """Over how many ranks each parameter is split."""
    strategy = cfg.sharding.fsdp_sharding
    if strategy == "none":
        return 1
    if strategy == "hybrid":
        return placement.world_size // nodes(placement)
    return placement.world_size


def device_mesh(cfg, placement, device_type):
    """full: one dimension over all ranks; hybrid: (nodes, ranks per node),
    sharded within a node and replicated across nodes; none: replicated
    over all ranks (a shard dimension of 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    world, strategy = placement.world_size, cfg.sharding.fsdp_sharding
    if strategy == "full":  # the default group's ranks: the mesh uses that group, with its timeout
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    replicas = nodes(placement) if strategy == "hybrid" else world
    names = ("replicate", "shard")
    override = {name: gloo_timeout_options(cfg) for name in names} if device_type == "cpu" else None
    return init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=names,
                            backend_override=override)


def gloo_timeout_options(cfg):
    """A gloo group's options with --distributed-timeout, for the mesh's own
    groups: torch gives a new group 30 minutes, so a peer that stopped
    answering (a frozen machine) inside FSDP's collectives would hold the
    survivors that long instead of being declared lost."""
    import datetime

    import torch.distributed as dist
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=cfg.distributed.distributed_timeout)
    return "gloo", options


def block_class_names(model, sharding) -> list:
    """The layer classes wrapped one unit each: --fsdp-block-classes, else the
    model's own ``_no_split_modules`` (Hugging Face models and ours declare it)."""
    if sharding.fsdp_block_classes:
        return list(sharding.fsdp_block_classes)
    for module in model.modules():  # the outermost model that declares them (ours, or the HF model itself)
        if getattr(module, "_no_split_modules", None):
            return list(module._no_split_modules)
    return []


def ties_outside(model, unit, prefix) -> bool:
    """Whether a parameter of ``unit`` is also the model's elsewhere (tied
    embeddings): FSDP needs tied parameters in one unit, so such a unit
    stays in its parent's."""
    own = {id(p) for p in unit.parameters()}
    return any(id(p) in own and not name.startswith(prefix + ".")
               for name, p in model.named_parameters(remove_duplicate=False))


def wrapped_units(model, sharding) -> list:
    """The submodules sharded as units of their own (before the model itself,
    the root unit): by block class, or by size (a submodule holding at least
    --fsdp-min-params parameters not already in a smaller unit), or none."""
    from textbox_like.core.errors import UserError
    if sharding.fsdp_wrap == "none":
        return []
    if sharding.fsdp_wrap == "block":
        names = set(block_class_names(model, sharding))
        units = [m for prefix, m in model.named_modules() if m is not model and type(m).__name__ in names
                 and not ties_outside(model, m, prefix)]
        present = {type(m).__name__ for m in units}
        if sharding.fsdp_block_classes and not present:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(f"--fsdp-block-classes {','.join(sharding.fsdp_block_classes)}: no such layer in "
                            f"{type(model).__name__} (its classes: {', '.join(found)})")
        return units
    units = []

    def visit(module, prefix):  # post-order: the smallest submodule that reaches the size is a unit
        inside = sum(visit(child, f"{prefix}.{name}" if prefix else name) for name, child in module.named_children())
        own = sum(p.numel() for p in module.parameters(recurse=False))
        total = inside + own
        if module is not model and total >= sharding.fsdp_min_params and not ties_outside(model, module, prefix):
            units.append(module)
            return 0
        return total
    visit(model, "")
    return units


def shard_model(model, cfg, placement, device_type, mixed_precision) -> list:
    """fully_shard the units, then the whole model; the units' names."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    sharding = cfg.sharding
    kwargs = {"mesh": device_mesh(cfg, placement, device_type),
              "reshard_after_forward": sharding.fsdp_reshard_after_forward,
              "mp_policy": mixed_precision_policy(mixed_precision)}
    if sharding.fsdp_cpu_offload and device_type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for p in model.parameters():
        if not p.is_contiguous():  # FSDP2 shards contiguous tensors only (mnist's CNN is channels_last)
            p.data = p.data.contiguous()
    units = wrapped_units(model, sharding)
    names = {id(m): n for n, m in model.named_modules()}
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    gc.collect()  # the whole weights are garbage now: only this rank's shard is kept
    malloc.give_back_freed_heap()
    return [names[id(u)] for u in units]


def accelerate_plugin(cfg, placement, mixed_precision):
    """(Accelerate's FSDP2 plugin, its ParallelismConfig or None) for CUDA,
    with the settings shard_model applies on CPU."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    sharding = cfg.sharding
    wrap = {"block": "transformer_based_wrap", "size": "size_based_wrap", "none": "no_wrap"}[sharding.fsdp_wrap]
    kwargs = {}
    if sharding.fsdp_wrap == "block" and sharding.fsdp_block_classes:
        kwargs["transformer_cls_names_to_wrap"] = list(sharding.fsdp_block_classes)
    if sharding.fsdp_wrap == "size":
        kwargs["min_num_params"] = sharding.fsdp_min_params
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=sharding.fsdp_reshard_after_forward, auto_wrap_policy=wrap,
        cpu_offload=sharding.fsdp_cpu_offload, mixed_precision_policy=mixed_precision_policy(mixed_precision),
        activation_checkpointing=False,  # --checkpointing: the task enables it on the model (tasks/*.py)
        state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False, **kwargs)
    parallelism = None
    degree = shard_degree(cfg, placement)
    if degree == 1 and placement.world_size > 1:  # Accelerate cannot; applied_by_us routes these to shard_model
        raise ValueError("accelerate_plugin: a shard degree of 1 over several ranks is shard_model's")
    if degree != placement.world_size:  # hybrid over several nodes of several ranks
        from accelerate.parallelism_config import ParallelismConfig
        parallelism = ParallelismConfig(dp_replicate_size=placement.world_size // degree, dp_shard_size=degree)
    return plugin, parallelism


def fit_accelerate_plugin(plugin, model, cfg) -> None:
    """Accelerate's FSDP2 plugin, before prepare(), told to wrap the units
    shard_model wraps (wrapped_units). Left to itself it wraps the classes
    of the model's ``_no_split_modules``, which transformers 5 gathers from
    the submodules too (BERT's: BertEmbeddings beside BertLayer): a unit
    holding a tied word embedding apart from its decoder, where fully_shard
    fails ("Invariant encountered: value was None"). Where those units are
    exactly all the instances of their classes, the plugin wraps those
    classes, so both paths shard the same units; else (--fsdp-wrap size
    picking some instances of a class) its own policy stays, and a unit it
    would make that shares a parameter outside itself is refused in one line."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from textbox_like.core.errors import UserError
    sharding = cfg.sharding
    units = wrapped_units(model, sharding)
    names = {type(u).__name__ for u in units}
    chosen = {id(u) for u in units}
    if all(id(m) in chosen for m in model.modules() if m is not model and type(m).__name__ in names):
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
        plugin.transformer_cls_names_to_wrap = sorted(names)
        return
    if sharding.fsdp_wrap == "block":
        classes = set(block_class_names(model, sharding))
        targets = [(prefix, m) for prefix, m in model.named_modules() if m is not model and type(m).__name__ in classes]
    else:  # Accelerate's size policy: every submodule of more than min_num_params parameters
        targets = [(prefix, m) for prefix, m in model.named_modules()
                   if m is not model and sum(p.numel() for p in m.parameters()) > plugin.min_num_params]
    # the fix the line names is one the user has not tried yet
    fixes = ("name layer classes without tied weights with --fsdp-block-classes, or use --fsdp-wrap none"
             if sharding.fsdp_wrap == "block" else
             "use --fsdp-wrap block (or name the layers with --fsdp-block-classes), or --fsdp-wrap none")
    for prefix, m in targets:
        if ties_outside(model, m, prefix):
            raise UserError(f"--fsdp-wrap {sharding.fsdp_wrap}: Accelerate's FSDP2 plugin would shard {prefix} "
                            f"({type(m).__name__}) as a unit apart from a parameter it shares with the rest of the "
                            f"model (tied weights); {fixes}")


@contextlib.contextmanager
def units_for_accelerate(accelerator, model, cfg):
    """Around ``accelerator.prepare`` where Accelerate's FSDP2 plugin shards
    (CUDA): the plugin fitted to shard_model's units (fit_accelerate_plugin),
    and the model's embeddings hidden from it. Accelerate carves the input and
    output embeddings into units of their own (tied: one unit of both), and a
    parameter tied beyond those two (BERT's decoder bias is its prediction
    head's own ``bias``) then sits in two units, which torch 2.13 and later
    refuses ("shared with a parameter already managed by another FSDP
    group"). Hidden, they stay in the root unit, where shard_model keeps
    them; Accelerate may still make the final norm a unit of its own."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        yield
        return
    fit_accelerate_plugin(plugin, model, cfg)
    # instance attributes shadow the model's methods for the one prepare() call
    model.get_input_embeddings = model.get_output_embeddings = lambda: None
    try:
        yield
    finally:
        del model.get_input_embeddings, model.get_output_embeddings


def sharded_root(model):
    """The FSDP2 module that ``model`` is, or that it wraps: --compile puts a
    model that is not compiled by regions under torch.compile's
    OptimizedModule (``_orig_mod``), DDP under ``module``; None where the
    model is not sharded."""
    if "torch.distributed.fsdp" not in sys.modules:  # no module is one before FSDP is loaded (0.8 s to load)
        return None
    from torch.distributed.fsdp import FSDPModule
    while not isinstance(model, FSDPModule):
        model = model._modules.get("_orig_mod") or model._modules.get("module")
        if model is None:
            return None
    return model


def is_sharded(model) -> bool:
    return sharded_root(model) is not None


@contextlib.contextmanager
def no_sync(accelerator, model):
    """A micro-batch that is not the update's last: no gradient reduction
    (FSDP2: accumulate the unsharded gradients; DDP: Accelerate's no_sync)."""
    root = sharded_root(model)
    if root is None:
        with accelerator.no_sync(model):
            yield
        return
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def full_value(tensor):
    """A DTensor (a norm over sharded gradients) as the plain tensor every rank agrees on."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def optimizer_state_elements(optim_cfg) -> float:
    """State elements the optimizer keeps per parameter element (Adam 2,
    SGD with momentum 1): measured on one small tensor with the run's
    optimizer class and arguments."""
    import torch

    from textbox_like.optim import build_optimizer, optimizer_kwargs
    key = (optim_cfg.optimizer, repr(sorted(optimizer_kwargs(optim_cfg).items())))
    if key not in STATE_PER_PARAMETER:
        p = torch.nn.Parameter(torch.zeros(64))
        p.grad = torch.ones(64)
        opt = build_optimizer(optim_cfg, [{"params": [p]}], fused_default=False)
        opt.step()
        STATE_PER_PARAMETER[key] = sum(v.numel() for s in opt.state.values() for v in s.values()
                                       if torch.is_tensor(v) and v.numel() == p.numel()) / p.numel()
    return STATE_PER_PARAMETER[key]


def describe(model, cfg, placement, cuda: bool, elements: int, trained: int | None = None) -> str:
    """The start line's sharding: strategy, who applied it, the units, and
    the expected memory per rank (``trained``: the elements that train,
    where some are frozen, e.g. under --peft)."""
    from collections import Counter

    from torch.distributed.fsdp import FSDPModule
    sharding = cfg.sharding
    root = sharded_root(model)
    units = Counter(type(m).__name__.removeprefix("FSDP") for m in root.modules()
                    if isinstance(m, FSDPModule) and m is not root)
    unit_text = ", ".join(f"{n} {name}" for name, n in units.items()) + " + the root" if units else "the root only"
    degree = shard_degree(cfg, placement)
    how = {"full": f"full over {degree} rank{'s' if degree != 1 else ''}",
           "none": f"none (replicated over {placement.world_size} ranks)",
           "hybrid": f"hybrid: over {degree} ranks per node, replicated over {nodes(placement)} node(s)"}
    ours = applied_by_us(cfg, placement, cuda)
    return (f"sharding {how[sharding.fsdp_sharding]} ({where(cuda, ours)}; units: {unit_text}; "
            f"reshard after forward {'on' if sharding.fsdp_reshard_after_forward else 'off'}"
            + ("; parameters offloaded to CPU" if sharding.fsdp_cpu_offload and cuda else "")
            + ("; activation checkpointing" if cfg.model.checkpointing else "")
            + f") | {memory_line(elements, cfg, placement, offloaded=sharding.fsdp_cpu_offload and cuda, trained=trained)}")


def memory_line(elements: int, cfg, placement, offloaded=False, trained: int | None = None) -> str:
    """Expected memory per rank of parameters, gradients and optimizer states
    (float32 masters, split over the shard degree), beside DDP's; ``offloaded``
    (--fsdp-cpu-offload on CUDA): they are in CPU memory, not the GPU's.
    ``trained``: the elements that take gradients and optimizer states
    (all by default; the adapters under --peft)."""
    state = optimizer_state_elements(cfg.optim)
    degree = shard_degree(cfg, placement)
    trained = elements if trained is None else trained

    def mib(n):
        return f"{n * 4 / degree / 2 ** 20:,.2f}"
    figures = (f"parameters {mib(elements)} MiB, gradients {mib(trained)} MiB, "
               f"optimizer states {mib(trained * state)} MiB")
    full = f"{(elements + trained * (1 + state)) * 4 / 2 ** 20:,.2f}"
    held = " in CPU memory" if offloaded else ""
    return f"expected per rank{held}: {figures} (DDP: {full} MiB in all)"

