"""What happens on this node when a resolved run starts, before any process
trains: the settings that act on the environment (TextBox's --gpu_id sets
CUDA_VISIBLE_DEVICES; HetSeq's runs take every visible GPU), the note on
Accelerate's one-process launcher, and the hand-off of the resolved
configuration to the processes started here (distributed.run_local_ranks).

The configuration (textbox_like/config/) resolves and checks; the one
variable it sets is TextBox's run name (see its package docstring).
"""
from __future__ import annotations

import os
import tempfile

from textbox_like.config.compat import cuda_devices, foreign_source, tools_used
from textbox_like.core.errors import note


def launcher_note(environ=None):
    """One line where ``accelerate launch --num_processes N`` started one
    process: its simple launcher (no --multi_gpu) exports MASTER_ADDR/PORT
    for N > 1 but starts a single process without RANK or WORLD_SIZE."""
    environ = os.environ if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" in environ and "MASTER_PORT" in environ \
            and "WORLD_SIZE" not in environ and "RANK" not in environ:
        note("accelerate launch started one process: several local processes need --multi_gpu, on CPU too "
             "(accelerate launch --multi_gpu --num_processes N run_hetseq.py ...)")
        return True
    return False


def apply_gpu_id(cfg):
    """TextBox's --gpu_id: the GPUs this run may use (set before CUDA
    initialises); several of them mean one process each on this node. The
    configuration to run."""
    dist = cfg.distributed
    if dist.gpu_id is None:
        return cfg
    os.environ["CUDA_VISIBLE_DEVICES"] = dist.gpu_id
    import torch

    from textbox_like.processes.distributed import placement_from_env
    count = len(dist.gpu_id.split(","))
    if count > 1 and dist.distributed_world_size == 1 and not cfg.runtime.cpu and torch.cuda.is_available() \
            and placement_from_env(cfg) is None:
        return cfg.replace(foreign_source(cfg.sources, "gpu_id"), distributed_world_size=count)
    return cfg


def apply_hetseq_gpus(cfg, device_count=None):
    """HetSeq's commands for several GPUs on one node give no world size:
    HetSeq (fairseq's default) then uses every visible GPU. A run with
    HetSeq's spellings and no world size, placement or device choice of its
    own does the same, and says so. ``device_count``: the visible CUDA GPUs
    (None: ask torch). The configuration to run."""
    from textbox_like.processes.distributed import placement_from_env
    dist = cfg.distributed
    if "HetSeq" not in tools_used(cfg) or cfg.runtime.cpu or dist.distributed_init_method \
            or any(cfg.given(key) for key in ("distributed_world_size", "ngpu", "gpu_id", "device", "device_id")) \
            or placement_from_env(cfg) is not None:
        return cfg
    count = cuda_devices() if device_count is None else device_count
    if count <= 1:
        return cfg
    note(f"no --distributed-world-size: training on all {count} visible GPUs, one process each, as HetSeq does "
         f"(--distributed-world-size 1 for one)")
    return cfg.replace("HetSeq's default (every visible GPU)", distributed_world_size=count)


def spawn(placements, cfg):
    """Start this node's processes (distributed.run_local_ranks), each handed this
    run's resolved configuration as a file (nothing is parsed again),
    removed when they are done. Returns the exit code for this node."""
    from textbox_like.processes import distributed
    from textbox_like.config.files import write_resolved
    environment = task_class_environment(cfg, len(placements))
    fd, resolved = tempfile.mkstemp(prefix="textbox_like_config_", suffix=".yaml")
    os.close(fd)
    try:
        write_resolved(cfg, resolved)
        return distributed.run_local_ranks(placements, resolved, cfg.distributed.distributed_timeout, environment)
    finally:
        os.unlink(resolved)


def task_class_environment(cfg, processes):
    """What the processes started here need to import the run's task class
    (``task_class``, from ``textbox_like.train(task=MyTask)``) by its module
    path: {} or PYTHONPATH with the folder its module came from added, as
    multiprocessing's spawn hands its children the parent's sys.path. A
    class no fresh interpreter can import (one defined in ``__main__`` or in
    a function) is one line, before any process starts."""
    path = cfg.data.task_class
    if not path:
        return {}
    from textbox_like.resolve.plugins import class_path, module_root, why_not_importable
    from textbox_like.tasks import TASKS
    cls = TASKS.get(cfg.data.task)
    if class_path(cls) != path:
        return {}
    why = why_not_importable(cls)
    if why:
        from textbox_like.core.errors import UserError
        raise UserError(f"task {cfg.data.task} ({path}) cannot train in {processes} processes: {why}, and each "
                        f"process, a fresh interpreter, imports it by its module path; put the class in a module "
                        f"of its own (a .py file on sys.path, or in a --user-dir package) and pass it from there, "
                        f"or train in one process")
    root = module_root(cls)
    if root is None:
        return {}
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {} if root in kept else {"PYTHONPATH": os.pathsep.join([*kept, root])}
