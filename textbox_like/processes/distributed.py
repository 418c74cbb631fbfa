"""Turns every way of starting processes into what Accelerate needs.

Sources of "who am I", first match wins:

1. ``RANK``/``WORLD_SIZE`` in the environment: ``accelerate launch``,
   ``torchrun``, or a child we spawned.
2. Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ...) under ``srun``.
3. HetSeq's flags: ``--distributed-init-method`` with ``--distributed-world-size
   W --distributed-gpus G --distributed-rank R`` starts G local processes with
   global ranks R..R+G-1; ``--distributed-world-size N`` alone starts N local
   processes with a fresh rendezvous.
4. One process.

Each worker then creates the process group itself (gloo without CUDA, NCCL
with it), with our timeout, and sets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE and MASTER_ADDR, which is the combination under which
``Accelerator(cpu=True)`` adopts an existing group instead of silently
running one process.

GPUs: LOCAL_RANK stays the node-local rank (Accelerate's local main process,
data preparation once per node); the GPU of a process is chosen apart from
it (:func:`cuda_device`) and handed to Accelerate as ``ACCELERATE_TORCH_DEVICE``
(:func:`bind_device`), so ``srun --gpus-per-task 1``, ``--device-id`` and
``CUDA_VISIBLE_DEVICES`` all place the model where they say. Before the
group is created, the ranks compare backends and GPUs through the rendezvous
store: two ranks on one GPU are refused with one line instead of NCCL's
"Duplicate GPU detected".
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from textbox_like.core import collectives
from textbox_like.processes import children
from textbox_like.core.errors import UserError, first_line

CHILD_ENV = "TEXTBOX_LIKE_SPAWNED"


@dataclass
class Placement:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    init_method: str = "env://"
    master_addr: str = "127.0.0.1"
    master_port: str | None = None


def _env_int(name, default=None):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _slurm_placement(cfg):
    # only inside an srun step: a batch script's own shell also carries
    # SLURM_PROCID and the job's task count, but it is not a rank
    if "SLURM_STEP_ID" not in os.environ or "SLURM_PROCID" not in os.environ:
        return None
    world = _env_int("SLURM_STEP_NUM_TASKS", None) or _env_int("SLURM_NTASKS", 1)
    if world <= 1:
        return None
    host = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30)
            if out.returncode == 0 and out.stdout.split():
                host = out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    # SLURM_TASKS_PER_NODE reads like "2(x3),1": this node's count is not
    # knowable from it alone, so take the first group's (it only sets threads)
    per_node = re.match(r"\d+", os.environ.get("SLURM_STEP_TASKS_PER_NODE", "") or
                        os.environ.get("SLURM_TASKS_PER_NODE", ""))
    port = cfg.distributed.distributed_port if cfg.distributed.distributed_port > 0 else \
        os.environ.get("MASTER_PORT") or 29500 + _env_int("SLURM_JOB_ID", 0) % 1000
    return Placement(rank=_env_int("SLURM_PROCID"), world_size=world,
                     local_rank=_env_int("SLURM_LOCALID", 0),
                     local_world_size=int(per_node.group()) if per_node else 1,
                     init_method="env://", master_addr=host,
                     master_port=str(port))


def placement_from_env(cfg):
    """The placement of this process when something else started it, or None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init = os.environ.get("TEXTBOX_LIKE_INIT_METHOD", "env://")
        return Placement(rank=_env_int("RANK"), world_size=_env_int("WORLD_SIZE"),
                         local_rank=_env_int("LOCAL_RANK", 0),
                         local_world_size=_env_int("LOCAL_WORLD_SIZE", None) or _env_int("WORLD_SIZE"),
                         init_method=init, master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         master_port=os.environ.get("MASTER_PORT"))
    return _slurm_placement(cfg)


def export(p: Placement):
    """Publish a placement in the environment, where placement_from_env finds it."""
    os.environ.update({"RANK": str(p.rank), "WORLD_SIZE": str(p.world_size), "LOCAL_RANK": str(p.local_rank),
                       "LOCAL_WORLD_SIZE": str(p.local_world_size), "MASTER_ADDR": p.master_addr,
                       "TEXTBOX_LIKE_INIT_METHOD": p.init_method})
    if p.master_port:
        os.environ["MASTER_PORT"] = str(p.master_port)


def _default_local_processes(at_most):
    try:
        import torch
        count = torch.cuda.device_count()
    except Exception:
        count = 0
    return max(1, min(count, at_most))


def local_plan(cfg):
    """For plain ``python run_hetseq.py``: the processes to start on this node
    as a list of Placements, or None for one process with no group."""
    world = cfg.distributed.distributed_world_size or 1
    init = cfg.distributed.distributed_init_method
    if init is None:
        if world <= 1:
            return None
        if cfg.distributed.distributed_port > 0:
            init = f"tcp://127.0.0.1:{cfg.distributed.distributed_port}"
        else:
            fd, path = tempfile.mkstemp(prefix="textbox_like_rdzv_")
            os.close(fd)
            os.unlink(path)  # a fresh name that does not exist yet
            init = "file://" + path
        gpus, first = world, 0
    else:
        parsed = urlparse(init)
        try:
            parsed.port
        except ValueError:
            raise UserError(f"--distributed-init-method {init}: the port must be a number from 1 to 65535") \
                from None
        if parsed.scheme not in ("tcp", "file", "env"):
            raise UserError(f"--distributed-init-method {init}: use tcp://HOST:PORT or file:///shared/path")
        if parsed.scheme == "tcp" and (not parsed.hostname or not parsed.port):
            raise UserError(f"--distributed-init-method {init}: a tcp address needs a host and a port")
        if world <= 1:
            raise UserError("--distributed-init-method needs --distributed-world-size > 1")
        gpus = cfg.distributed.distributed_gpus or _default_local_processes(world - (cfg.distributed.distributed_rank or 0))
        first = cfg.distributed.distributed_rank or 0
    if first < 0 or first + gpus > world:
        raise UserError(f"--distributed-rank {first} with --distributed-gpus {gpus} needs ranks up to "
                        f"{first + gpus - 1}, but --distributed-world-size is {world}")
    if init.startswith("file://"):
        directory = os.path.dirname(urlparse(init).path) or "/"
        if not os.path.isdir(directory):
            raise UserError(f"--distributed-init-method {init}: the directory {directory} does not exist; "
                            f"create it on the shared file system (every node must see the same path)")
    _check_gpus_for(gpus, cfg)
    host = urlparse(init).hostname if init.startswith("tcp://") else "127.0.0.1"
    port = str(urlparse(init).port) if init.startswith("tcp://") else None
    return [Placement(rank=first + i, world_size=world, local_rank=i, local_world_size=gpus,
                      init_method=init, master_addr=host, master_port=port) for i in range(gpus)]


def uses_cuda(cfg) -> bool:
    """Whether this process trains on CUDA (``--device cpu`` sets --cpu)."""
    try:
        import torch
        available = torch.cuda.is_available()
    except Exception:
        return False
    return available and not cfg.runtime.cpu


def _check_gpus_for(processes, cfg):
    """Refuse to start more processes on this node than it has GPUs: two
    ranks on one GPU make NCCL fail with "Duplicate GPU detected"."""
    if not uses_cuda(cfg):
        return
    import torch
    count = torch.cuda.device_count()
    if processes > count:
        raise UserError(
            f"{processes} processes on this node, but it has {count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); pass "
            f"--distributed-gpus {count} on this node (with --distributed-world-size the sum over nodes), "
            f"or --cpu to train on CPU")


def cuda_device(p: Placement, cfg) -> int:
    """The index (among the visible devices) of this process's GPU: --device-id
    modulo the visible devices for a node's only process, else the node-local
    rank modulo them (under ``srun --gpus-per-task 1`` each task sees one GPU,
    whatever its local rank)."""
    import torch
    count = max(torch.cuda.device_count(), 1)
    if cfg.distributed.device_id is not None and p.local_world_size == 1:
        if cfg.distributed.device_id < 0:
            raise UserError(f"--device-id {cfg.distributed.device_id}: a GPU index is 0 or more")
        return cfg.distributed.device_id % count
    return p.local_rank % count


def bind_device(p: Placement, cfg):
    """Put this process on its GPU, for torch and for Accelerate (which would
    otherwise take cuda:LOCAL_RANK); LOCAL_RANK itself stays the node-local
    rank. Returns the torch.device, or None without CUDA."""
    if not uses_cuda(cfg):
        return None
    import torch
    index = cuda_device(p, cfg)
    torch.cuda.set_device(index)
    global _OWN_TORCH_DEVICE
    if "ACCELERATE_TORCH_DEVICE" not in os.environ:
        _OWN_TORCH_DEVICE = True
    os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{index}"
    return torch.device("cuda", index)


def nccl_environment():
    """NCCL errors as Python exceptions, not a watchdog's C++ abort: with
    CleanUpOnly (2) the watchdog aborts the communicators on a timeout or a
    dead peer and the next wait raises in the training thread, where the one
    line of cli.run reports it (lost_peer). TORCH_NCCL_BLOCKING_WAIT stays off (it
    would make the host wait for every collective, a sync per update); the
    timeout is the group's (--distributed-timeout). A user's own setting,
    under the current or the older name, wins."""
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "NCCL_ASYNC_ERROR_HANDLING" not in os.environ:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    # no flight-recorder dump and no extra wait before raising on a timeout
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def apply_determinism(cfg):
    """--cudnn_deterministic: deterministic cuDNN and torch kernels, and the
    cuBLAS workspace setting they need. Called first thing in every worker,
    before CUDA (and cuBLAS) initialise."""
    if not cfg.numerics.cudnn_deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    remember_torch_settings()
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


_TORCH_SETTINGS_BEFORE = None  # torch's process-wide settings before this run changed them


def remember_torch_settings():
    """Before this run changes torch's process-wide settings (the default
    dtype of --train_dtype float64, --cudnn_deterministic's flags): what they
    were, so cleanup() puts them back and a later run in this process builds
    its model as its own settings say."""
    global _TORCH_SETTINGS_BEFORE
    if _TORCH_SETTINGS_BEFORE is not None:
        return
    import torch
    _TORCH_SETTINGS_BEFORE = {
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def restore_torch_settings():
    global _TORCH_SETTINGS_BEFORE
    before, _TORCH_SETTINGS_BEFORE = _TORCH_SETTINGS_BEFORE, None
    if before is None:
        return
    import torch
    torch.set_default_dtype(before["dtype"])
    torch.use_deterministic_algorithms(before["deterministic"], warn_only=before["warn_only"])
    torch.backends.cudnn.deterministic = before["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = before["cudnn_benchmark"]


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, Slurm's
    --cpus-per-task, a container's cpuset) and its cgroup's CPU quota, not
    the whole machine that os.cpu_count() counts."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(count, quota) if quota else count)


def ranks_on_this_machine(group=None) -> int:
    """How many ranks of the run share this machine's cores: what torchrun's
    LOCAL_WORLD_SIZE says, also where each process was started alone (by
    hand, by HetSeq's flags with --distributed-gpus 1, two agents on one
    machine), which each see a local world of one. A machine is known by its
    boot id (containers on one machine share its cores and its boot id),
    else its host name. 1 without a process group."""
    import socket

    import torch.distributed as dist
    if not dist.is_initialized():
        return 1
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            machine = handle.read().strip()
    except OSError:
        machine = socket.gethostname()
    machines = [None] * dist.get_world_size(group)
    dist.all_gather_object(machines, machine, group=group)
    return max(1, machines.count(machine))


def _cgroup_cpu_quota():
    """CPUs the cgroup's quota allows (rounded up), or None where unlimited."""
    import math
    try:                            # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:                            # cgroup v1
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else math.ceil(quota / period)
    except (OSError, ValueError):
        return None


def run_local_ranks(placements, resolved, timeout, environment=None):
    """Start one child per placement, each handed ``resolved``, the path of
    this run's resolved configuration, already written (launch.spawn), and
    its rank variables; forward signals, and fail fast: when one child fails,
    the others are stopped after at most ``timeout`` seconds (30 at most).
    ``environment``: variables the children get on top of this process's.
    Returns the exit code for this node."""
    fork = children.can_fork(environment)
    if fork:
        children.prepare_forks()
    environ = {**os.environ, **(environment or {})}
    return _supervise(placements, lambda env: children.start_trainer(resolved, {**environ, **env}, fork), timeout)


def _supervise(placements, start, timeout):
    """Start a child per placement (``start(its rank variables)``), forward
    signals to them, and fail fast; the node's exit code."""
    ranks = []
    for p in placements:
        env = {CHILD_ENV: "1", "RANK": str(p.rank), "WORLD_SIZE": str(p.world_size),
               "LOCAL_RANK": str(p.local_rank), "LOCAL_WORLD_SIZE": str(p.local_world_size),
               "MASTER_ADDR": p.master_addr, "TEXTBOX_LIKE_INIT_METHOD": p.init_method}
        if p.master_port:
            env["MASTER_PORT"] = p.master_port
        ranks.append(start(env))

    def forward(signum, _frame):
        for child in ranks:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)

    code = 0
    failed_at = None
    while True:
        alive = [c for c in ranks if c.poll() is None]
        for child in ranks:
            rc = child.returncode
            if rc not in (None, 0) and (code == 0 or code > 128 and 0 < rc < 128):
                # the node's code is the first a child chose (an error, 75 from a survivor of a lost peer)
                # rather than a signal's (128 + N): a rank killed as a node dies leaves its survivors to say
                # what the run can do (a requeue script retries 75)
                code = rc if rc > 0 else 128 - rc
                failed_at = failed_at or time.monotonic()
        if not alive:
            # the children are gone: nothing to forward, and a late signal must
            # not kill this process by the signal while it exits with theirs
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_IGN)
            break
        if failed_at is not None and time.monotonic() - failed_at > min(timeout, 30):
            for child in alive:
                child.kill()
        time.sleep(0.1)
    from textbox_like.core.faults import Superseded
    for p, child in zip(placements, ranks):
        # a rank 0 that found its run taken over: the file may be the newer run's
        if p.init_method.startswith("file://") and p.rank == 0 and child.returncode != Superseded.exit_code:
            try:
                os.unlink(urlparse(p.init_method).path)
            except OSError:
                pass
    return code


def remove_rendezvous_file(cfg) -> None:
    """This run's file:// rendezvous file gone, once no rank needs it (the
    run ended, or its one survivor hands over): a rerun of the same command
    within --distributed-timeout would otherwise find it fresh and hang in
    its rendezvous. Only while the run is this process's (fileio.remove)."""
    from textbox_like.storage.fileio import remove
    init = os.environ.get("TEXTBOX_LIKE_INIT_METHOD") or cfg.distributed.distributed_init_method or ""
    if not init.startswith("file://"):
        return
    path = urlparse(init).path
    try:
        remove(path)
    except OSError as exc:  # a shared file system's refusal ends nothing: the run is done or saved
        print(f"warning: could not remove the rendezvous file {path} ({exc.strerror or exc}); remove it before "
              f"running the same command again", file=sys.stderr)


def _handle_stale_file(path, rank, timeout):
    """A FileStore file left by a crashed run makes the next rendezvous hang.
    A file older than the timeout cannot belong to a run still gathering (that
    run would have timed out): rank 0 removes it, the others wait for it to go."""
    if not os.path.exists(path):
        return
    age = time.time() - os.path.getmtime(path)
    if age <= timeout:
        return
    if rank == 0:
        print(f"warning: removing stale rendezvous file {path} (left by an earlier run {age:.0f}s ago)",
              file=sys.stderr)
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.time() - os.path.getmtime(path) > timeout:
        if time.monotonic() > deadline:
            raise UserError(f"stale rendezvous file {path} is still there after {timeout}s and rank 0 has not "
                            f"replaced it; delete it, or start rank 0")
        time.sleep(0.2)


def one_rank_group(cfg, device):
    """--fsdp on the GPU of a run of one process that no launcher started: a
    process group of this process alone, and LOCAL_RANK, without which
    Accelerate treats the run as not distributed and leaves its FSDP2 plugin
    unused (no mixed-precision policy, no --fsdp-cpu-offload); the same state
    as under ``torchrun --nproc_per_node 1``. cleanup() destroys it (and
    drops the LOCAL_RANK set here: a later run in this process may be DDP)."""
    import torch.distributed as dist
    global _OWN_LOCAL_RANK
    if dist.is_initialized():
        return
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"], _OWN_LOCAL_RANK = "0", True
    nccl_environment()
    dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device,
                            timeout=datetime.timedelta(seconds=cfg.distributed.distributed_timeout))


def init_process_group(p: Placement, cfg):
    """Create the process group for this worker (when world size > 1) and set
    the environment Accelerate reads."""
    import torch.distributed as dist

    if p.world_size <= 1 or dist.is_initialized():
        return  # one process: no group, and no rank variables that would make Accelerate open one
    export(p)
    cuda = uses_cuda(cfg)
    backend = cfg.distributed.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise UserError("--distributed-backend nccl needs CUDA; leave it out to use gloo on CPU")
    device = bind_device(p, cfg) if cuda else None
    if backend == "nccl":
        nccl_environment()
    if p.init_method.startswith("env://") and "MASTER_PORT" not in os.environ:
        raise UserError("WORLD_SIZE is set but MASTER_PORT is not; start with torchrun/accelerate launch, "
                        "or pass --distributed-init-method tcp://HOST:PORT")
    if p.init_method.startswith("file://"):
        _handle_stale_file(urlparse(p.init_method).path, p.rank, cfg.distributed.distributed_timeout)
    timeout = datetime.timedelta(seconds=cfg.distributed.distributed_timeout)
    try:
        store, rank, world = next(dist.rendezvous(p.init_method, p.rank, p.world_size, timeout=timeout))
        store.set_timeout(timeout)
        peers = _exchange(store, rank, world, _describe(backend, device))
    except UserError:
        raise
    except Exception as exc:  # timeout or refused connection
        first = first_line(exc, 200)
        raise UserError(f"rank {p.rank}: could not gather {p.world_size} processes at {p.init_method} within "
                        f"{cfg.distributed.distributed_timeout}s ({first}); start every node with the same "
                        f"--distributed-world-size and init method") from None
    _check_peers(peers)
    kwargs = {"device_id": device} if backend == "nccl" and device is not None else {}
    # the same PrefixStore init_process_group puts around a store it makes itself
    dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=timeout, **kwargs)
    global _LONG_GROUP
    # saving a large checkpoint or preparing data may take longer than the
    # timeout of training's collectives: a host group of their own
    _LONG_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=long_timeout(cfg)))


def _describe(backend, device) -> dict:
    me = {"host": socket.gethostname(), "backend": backend, "gpu": None, "gpus": 0}
    if device is not None:
        import torch
        props = torch.cuda.get_device_properties(device)
        me["gpu"] = str(getattr(props, "uuid", "") or f"{getattr(props, 'pci_domain_id', 0)}:"
                        f"{getattr(props, 'pci_bus_id', 0)}:{getattr(props, 'pci_device_id', 0)}:{device.index}")
        me["gpus"] = torch.cuda.device_count()
        me["index"] = device.index
    return me


def _exchange(store, rank, world, mine: dict) -> list:
    """Every rank's ``mine``, in rank order, through the rendezvous store
    (before any process group exists)."""
    import json
    # torchrun's shared agent store outlives a restart of the workers: one key set
    # per attempt. Without it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which lets
    # nodes join) each worker group has a fresh store, and a node that joined
    # later has another restart count than the others: no attempt in the keys
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") \
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "0"
    prefix = f"textbox_like/peer/{attempt}"
    store.set(f"{prefix}/{rank}", json.dumps(mine))
    return [json.loads(store.get(f"{prefix}/{r}")) for r in range(world)]


def _check_peers(peers):
    """What must hold before the group is created; every rank raises alike."""
    backends = [p["backend"] for p in peers]
    if len(set(backends)) > 1:
        shown = ", ".join(f"rank {r}: {b}" for r, b in enumerate(backends))
        raise UserError(f"the ranks disagree on the backend ({shown}); a node without CUDA (or with --cpu) "
                        f"needs --distributed-backend gloo on every node")
    seen = {}
    for r, peer in enumerate(peers):
        if peer.get("gpu") is None:
            continue
        key = (peer["host"], peer["gpu"])
        if key in seen:
            first = seen[key]
            count = peer["gpus"]
            raise UserError(
                f"ranks {first} and {r} would share one GPU (cuda:{peer.get('index')}) on {peer['host']}, "
                f"where each process sees {count} GPU(s); start at most one process per GPU: "
                f"--distributed-gpus {count} (torchrun --nproc_per_node {count}, srun --gpus-per-task 1)")
        seen[key] = r


_LONG_GROUP = None
_RANK_OF_A_GROUP = False  # see note_group
_OWN_LOCAL_RANK = False  # LOCAL_RANK set by one_rank_group, not by a launcher
_OWN_TORCH_DEVICE = False  # ACCELERATE_TORCH_DEVICE set by bind_device, not by a launcher
# Accelerate's process-wide states made by this run's Accelerator (each apart:
# a caller may have made only a PartialState, and this run the AcceleratorState)
_OWN_ACCELERATOR_STATE = False
_OWN_PARTIAL_STATE = False


def claim_accelerate_state():
    """Before this run's Accelerator (a training run's, or evaluate()'s):
    which of Accelerate's process-wide states (PartialState: the distributed
    type, backend, device; AcceleratorState: precision, FSDP plugin) are not
    set up yet; this run sets those up, and release_accelerate_state() resets
    them; a state the caller made is left alone."""
    from accelerate.state import AcceleratorState, PartialState
    global _OWN_ACCELERATOR_STATE, _OWN_PARTIAL_STATE
    if not AcceleratorState._shared_state:
        _OWN_ACCELERATOR_STATE = True
    if not PartialState._shared_state:
        _OWN_PARTIAL_STATE = True


def release_accelerate_state():
    """Resets the states claim_accelerate_state() found not set up, so a
    later run in this process sets up its own (another precision) instead of
    "AcceleratorState has already been initialized"."""
    global _OWN_ACCELERATOR_STATE, _OWN_PARTIAL_STATE
    from accelerate.state import AcceleratorState, GradientState, PartialState
    if _OWN_ACCELERATOR_STATE:
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    if _OWN_PARTIAL_STATE:
        PartialState._reset_state()
    _OWN_ACCELERATOR_STATE = _OWN_PARTIAL_STATE = False


def long_timeout(cfg) -> int:
    """Seconds the long barrier waits: 6 x --distributed-timeout, at least 30 min."""
    return max(1800, 6 * int(cfg.distributed.distributed_timeout))


def long_group():
    """The host (gloo) group with the long timeout, or None with one process."""
    return _LONG_GROUP


def long_barrier():
    """A barrier for slow work on some ranks (rank 0 writing a checkpoint,
    one process per node preparing data): host side, with the long timeout,
    so the others wait there instead of timing out in a training collective.
    No-op with one process."""
    import torch.distributed as dist
    if _LONG_GROUP is None or not dist.is_initialized():
        return
    dist.barrier(group=_LONG_GROUP)


class _FirstThenOthers:
    """``with main_then_local_main_first(accelerator):`` runs the body on the
    main process first, then on every node's local main process, then on all
    the others (two long barriers each), as Accelerate's main_process_first()
    inside local_main_process_first() but with the long timeout."""

    def __init__(self, accelerator):
        self.acc = accelerator
        self.active = _LONG_GROUP is not None and accelerator.num_processes > 1

    def __enter__(self):
        if self.active:
            if not self.acc.is_main_process:
                long_barrier()
            if not self.acc.is_local_main_process:
                long_barrier()
        return self

    def __exit__(self, *exc):
        if self.active:
            if self.acc.is_local_main_process:
                long_barrier()
            if self.acc.is_main_process:
                long_barrier()
        return False


def main_then_local_main_first(accelerator):
    return _FirstThenOthers(accelerator)


def note_group():
    """This process is a rank of a process group (also after the group is
    destroyed: Accelerate's end_training destroys one): it leaves without
    the interpreter's teardown (cli.leave)."""
    global _RANK_OF_A_GROUP
    _RANK_OF_A_GROUP = True


def was_rank_of_a_group() -> bool:
    return _RANK_OF_A_GROUP


def cleanup():
    """The end of a run in this process: its process group gone, and what
    it set up for Accelerate (LOCAL_RANK, ACCELERATE_TORCH_DEVICE, the
    process-wide state) and torch's default dtype and determinism flags as
    they were before it: a later run in this process (api.train) would
    otherwise reuse a distributed type, backend and plugin whose group no
    longer exists, or be refused another precision ("AcceleratorState has
    already been initialized")."""
    global _LONG_GROUP, _OWN_LOCAL_RANK, _OWN_TORCH_DEVICE
    _LONG_GROUP = None
    restore_torch_settings()
    if _OWN_LOCAL_RANK:
        os.environ.pop("LOCAL_RANK", None)
        _OWN_LOCAL_RANK = False
    if _OWN_TORCH_DEVICE:
        os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
        _OWN_TORCH_DEVICE = False
    release_accelerate_state()
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            note_group()
            dist.destroy_process_group()
    except Exception:
        pass


# ------------------------------------------------------------ across ranks
# Settings each node may set for itself: they change neither the numbers of
# an update nor the order of collectives (batch sizes are per rank by design;
# the trainer weights every update by the global sample count). Everything
# else the trainer compares, with the precision actually chosen.
PER_NODE_SETTINGS = frozenset({
    # where this node finds its data (the trainer compares the sample count)
    "data", "dict", "config_file", "training_data", "validation_data",
    # per-rank batching and host resources
    "max_sentences", "max_tokens", "max_sentences_valid", "num_workers", "threads",
    # how this node starts and which devices it uses (the backend and the
    # precision actually chosen are compared apart)
    "distributed_gpus", "distributed_rank", "distributed_no_spawn", "distributed_port", "distributed_timeout",
    "distributed_init_method", "device_id", "device", "gpu_id", "ngpu", "cpu",
    # carried by --train_dtype, which is compared
    "amp_optimization_level",
    # where this node writes and what it prints (only rank 0 writes; --no-save
    # and the checkpoint switches are compared: they decide the collectives of saving)
    "save_dir", "output_prefix", "experiment_name", "resume", "config", "print_config",
    "log_format", "report_to", "use_tensorboard", "use_wandb",
})

# Paths that may differ from node to node, but that every node must give or
# none: a node without --init-checkpoint would start from other weights, a
# node without --initial-optimizer with another optimizer state.
PRESENCE_SETTINGS = frozenset({"init_checkpoint", "initial_encoder", "initial_optimizer", "restore_file"})


def _comparable(name, value):
    key = name.lstrip("-").replace("-", "_")
    if key in PRESENCE_SETTINGS:
        return "given" if value not in (None, "", False) else "not given"
    return repr(value)


def check_ranks_agree(settings: dict, world: int, group=None) -> None:
    """Refuse to train when the ranks were started with different values of
    settings that must agree: one line naming the settings and each rank's
    value. Every rank raises, so every rank exits."""
    if world == 1:
        return
    names = list(settings)
    per_rank = collectives.one_per_rank([_comparable(n, settings[n]) for n in names], world, group)
    differing = []
    for i, name in enumerate(names):
        values = [row[i] for row in per_rank]
        if len(set(values)) > 1:
            differing.append((name, values))
    if not differing:
        return
    parts = []
    for name, values in differing[:3]:
        shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values[:8])) + (", ..." if len(values) > 8 else "")
        parts.append(f"{name} ({shown})")
    more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
    hint = " and a --save-dir all nodes share" if any(n.startswith("position") for n, _ in differing) else ""
    raise UserError(f"the ranks disagree on {'; '.join(parts)}{more}; start every node with the same "
                    f"value{hint}")


def lost_peer(exc) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone (died,
    killed, unreachable): gloo's closed connections, NCCL's aborted
    communicators, a timeout."""
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
                            # gloo's own words when a pair's wait ran out inside DDP's backward
                            "Application timeout caused pair closure",
                            "Gloo", "gloo", "NCCL", "connectFullMesh", "communicator was aborted",
                            "Watchdog caught collective"))


def host_group():
    """A process group for small host-side values (flags, counts): the default
    group when it is gloo, else a gloo group of its own, so reading them never
    waits on CUDA work."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
