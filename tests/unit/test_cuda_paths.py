"""CUDA paths checked on a CPU-only machine (issue 14): torch.cuda is mocked
where a GPU would be; two ranks over gloo where a group is needed."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from textbox_like.processes import distributed
from textbox_like.core.errors import UserError


def cfg(**kw):
    """A resolved configuration with these settings (distributed_timeout 60 unless given)."""
    from textbox_like.resolve.resolution import parse
    return parse(["--task", "mnist"]).replace(**{"distributed_timeout": 60, **kw})


@pytest.fixture
def gpus(monkeypatch):
    """A machine with N visible GPUs; records torch.cuda.set_device calls."""
    calls = []

    def install(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(int(getattr(d, "index", d))))
        return calls
    return install


# ----------------------------------------------------------- item 4
def test_more_processes_than_gpus_is_refused_before_starting(gpus):
    gpus(2)
    with pytest.raises(UserError) as err:
        distributed.local_plan(cfg(distributed_world_size=4))
    message = str(err.value)
    assert "4 processes on this node" in message and "2 GPU(s)" in message and "--distributed-gpus 2" in message
    # two nodes of 2 GPUs each: fine
    plan = distributed.local_plan(cfg(distributed_world_size=4, distributed_init_method="tcp://h:1234",
                                      distributed_gpus=2, distributed_rank=2))
    assert [p.rank for p in plan] == [2, 3]
    with pytest.raises(UserError, match="2 GPU"):
        distributed.local_plan(cfg(distributed_world_size=4, distributed_init_method="tcp://h:1234",
                                   distributed_gpus=3))
    # on CPU (--cpu) any number of processes is fine
    assert len(distributed.local_plan(cfg(distributed_world_size=4, cpu=True))) == 4


def test_more_processes_than_gpus_one_line_from_the_command_line(gpus, capsys, tmp_path):
    gpus(2)
    from textbox_like import cli
    code = cli.main(["--task", "mnist", "--data", str(tmp_path), "--max-sentences", "8", "--max-update", "1",
                     "--save-dir", str(tmp_path / "out"), "--distributed-world-size", "4"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "2 GPU(s)" in lines[0], err


def test_ranks_sharing_a_gpu_are_refused():
    """torchrun/Slurm placements are checked through the rendezvous store:
    two ranks on one host with the same GPU."""
    peers = [{"host": "n1", "backend": "nccl", "gpu": "GPU-a", "gpus": 1, "index": 0},
             {"host": "n1", "backend": "nccl", "gpu": "GPU-b", "gpus": 1, "index": 0},
             {"host": "n2", "backend": "nccl", "gpu": "GPU-a", "gpus": 1, "index": 0},  # another node
             {"host": "n1", "backend": "nccl", "gpu": "GPU-a", "gpus": 1, "index": 0}]
    with pytest.raises(UserError) as err:
        distributed._check_peers(peers)
    assert "ranks 0 and 3" in str(err.value) and "1 GPU(s)" in str(err.value) and "--distributed-gpus 1" in \
        str(err.value)
    distributed._check_peers(peers[:3])  # one GPU per task under srun --gpus-per-task 1: fine
    with pytest.raises(UserError, match="disagree on the backend"):
        distributed._check_peers([{"host": "a", "backend": "nccl"}, {"host": "b", "backend": "gloo"}])


def test_exchange_through_a_store():
    store = torch.distributed.HashStore()
    store.set("textbox_like/peer/0/1", '{"host": "b"}')
    assert distributed._exchange(store, 0, 2, {"host": "a"}) == [{"host": "a"}, {"host": "b"}]


def test_nccl_gets_device_id(gpus, monkeypatch):
    """With NCCL the group is bound to this process's GPU (device_id), so
    NCCL errors surface at once, where the one-line handling sees them."""
    calls = gpus(2)
    import torch.distributed as dist
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(distributed, "_describe", lambda backend, device: {"host": "h", "backend": backend,
                                                                           "gpu": f"g{device.index}", "gpus": 2})
    monkeypatch.setattr(distributed, "_exchange", lambda store, rank, world, me: [me | {"gpu": "other"}, me])
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist, "new_group", lambda **kw: seen.setdefault("long", kw))
    p = distributed.Placement(rank=1, world_size=2, local_rank=1, local_world_size=2, init_method="tcp://h:1",
                              master_port="1")
    distributed.init_process_group(p, cfg())
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert calls == [1]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert seen["long"]["backend"] == "gloo" and seen["long"]["timeout"].total_seconds() >= 1800
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["ACCELERATE_TORCH_DEVICE"] == "cuda:1"
    distributed._LONG_GROUP = None


def test_nccl_environment_respects_the_user(monkeypatch):
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")  # the older name
    distributed.nccl_environment()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING")
    distributed.nccl_environment()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


# ----------------------------------------------------------- item 5
def test_slurm_one_gpu_per_task_keeps_the_node_local_rank(gpus, monkeypatch):
    """srun --ntasks-per-node 4 --gpus-per-task 1: each task sees one GPU.
    LOCAL_RANK stays SLURM_LOCALID (one local main per node), the device is cuda:0."""
    calls = gpus(1)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "6")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    p = distributed.placement_from_env(cfg())
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size) == (6, 8, 2, 4)
    distributed.export(p)
    device = distributed.bind_device(p, cfg())
    assert device == torch.device("cuda", 0) and calls == [0]
    assert os.environ["LOCAL_RANK"] == "2"  # ordering: not a local main process
    assert os.environ["ACCELERATE_TORCH_DEVICE"] == "cuda:0"  # placement: Accelerate takes this device


def test_slurm_tasks_sharing_a_node_of_gpus(gpus):
    """srun --ntasks-per-node 4 --gres gpu:4: each task sees 4 GPUs, takes its local rank's."""
    calls = gpus(4)
    p = distributed.Placement(rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert distributed.bind_device(p, cfg()) == torch.device("cuda", 1) and calls == [1]


def test_accelerate_honours_the_bound_device(monkeypatch):
    """Accelerate's PartialState keeps a device given in ACCELERATE_TORCH_DEVICE
    instead of taking cuda:LOCAL_RANK: what bind_device relies on."""
    import inspect

    from accelerate.state import PartialState
    source = inspect.getsource(PartialState.__init__) + inspect.getsource(PartialState.set_device)
    assert "ACCELERATE_TORCH_DEVICE" in source and "if self.device is not None" in source


# ----------------------------------------------------------- item 6
@pytest.mark.parametrize("device_id,visible,expected", [(0, 2, 0), (1, 2, 1), (3, 2, 1), (5, 1, 0), (None, 2, 0)])
def test_device_id_modulo_visible_devices(gpus, device_id, visible, expected):
    calls = gpus(visible)
    p = distributed.Placement()  # one process (also torchrun --nproc_per_node 1: world 1, LOCAL_RANK 0)
    assert distributed.bind_device(p, cfg(device_id=device_id)) == torch.device("cuda", expected)
    assert calls == [expected] and os.environ["ACCELERATE_TORCH_DEVICE"] == f"cuda:{expected}"


def test_device_id_ignored_with_several_local_processes(gpus):
    gpus(4)
    p = distributed.Placement(rank=2, world_size=4, local_rank=2, local_world_size=4)
    assert distributed.cuda_device(p, cfg(device_id=0)) == 2


def test_build_accelerator_binds_device_id_under_torchrun_one_process(gpus, monkeypatch):
    """torchrun --nproc_per_node 1 sets LOCAL_RANK=0; --device-id 3 on 2 visible GPUs is cuda:1."""
    calls = gpus(2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    import accelerate

    made = {}

    class FakeAccelerator:
        num_processes = 1

        def __init__(self, **kw):
            made.update(kw, device=os.environ.get("ACCELERATE_TORCH_DEVICE"))
    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    from textbox_like.parallel.accelerator import build_accelerator
    config = cfg(device_id=3, fp16=False, bf16=False, train_dtype="float32", update_freq=[1], compile=False,
                 compile_mode="default", find_unused_parameters=False, bucket_cap_mb=25, save_dir="x")
    placement = distributed.placement_from_env(config)
    assert placement.world_size == 1
    build_accelerator(config, placement)
    assert calls[-1] == 1 and made["device"] == "cuda:1" and made["cpu"] is False


def test_cpu_binds_no_device(gpus):
    calls = gpus(2)
    assert distributed.bind_device(distributed.Placement(), cfg(cpu=True, device_id=1)) is None
    assert calls == [] and "ACCELERATE_TORCH_DEVICE" not in os.environ


def test_negative_device_id_is_refused(gpus):
    gpus(2)
    with pytest.raises(UserError, match="--device-id -1"):
        distributed.cuda_device(distributed.Placement(), cfg(device_id=-1))


def test_long_barrier_is_a_no_op_alone():
    distributed.long_barrier()
    acc = SimpleNamespace(num_processes=1, is_main_process=True, is_local_main_process=True)
    with distributed.main_then_local_main_first(acc):
        pass


def test_main_then_local_main_first_barrier_counts(monkeypatch):
    """Every process passes two barriers; the main first, the local mains next, the rest last."""
    order = []
    monkeypatch.setattr(distributed, "_LONG_GROUP", object())
    monkeypatch.setattr(distributed, "long_barrier", lambda: order.append("B"))
    for main, local in ((True, True), (False, True), (False, False)):
        order.clear()
        acc = SimpleNamespace(num_processes=4, is_main_process=main, is_local_main_process=local)
        with distributed.main_then_local_main_first(acc):
            order.append("work")
        assert order.count("B") == 2
        assert order.index("work") == {(True, True): 0, (False, True): 1, (False, False): 2}[(main, local)]


def test_lost_peer_recognises_nccl_aborts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.lost_peer(RuntimeError("NCCL communicator was aborted on rank 1."))
    # gloo, in DDP's backward, when a peer stopped answering (a SIGSTOPped rank, seen by the late-survivor test)
    assert distributed.lost_peer(RuntimeError("Application timeout caused pair closure"))
    assert not distributed.lost_peer(RuntimeError("shape mismatch"))


# ----------------------------------------------------------- item 9
def test_cudnn_deterministic_turns_on_deterministic_algorithms(monkeypatch):
    was = torch.are_deterministic_algorithms_enabled()
    try:
        distributed.apply_determinism(cfg(cudnn_deterministic=False))
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        distributed.apply_determinism(cfg(cudnn_deterministic=True))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(was)
        torch.backends.cudnn.deterministic = False


def test_cudnn_deterministic_is_applied_before_the_trainer(monkeypatch):
    """cli.run applies it before the trainer (and CUDA) start, in the worker."""
    from textbox_like import cli
    from textbox_like.training import outcome as trainer
    seen = []
    monkeypatch.setattr(distributed, "apply_determinism", lambda ns: seen.append("determinism"))
    monkeypatch.setattr(trainer, "train", lambda ns, callbacks=(): seen.append("train") or 0)
    ns = cfg(cudnn_deterministic=True)
    assert cli.run(ns) == 0 and seen == ["determinism", "train"]


# ----------------------------------------------------------- item 10
class _Data:
    def __len__(self):
        return 40

    def epoch_order(self, seed, epoch, shuffle):
        return np.arange(40)

    def get_batch(self, indices):
        return {"x": torch.as_tensor(indices, dtype=torch.float32), "y": torch.as_tensor(indices)}


@pytest.mark.parametrize("pin", [False, True])
def test_read_ahead_pins_only_when_asked(monkeypatch, pin):
    from textbox_like.data.iterators import EpochBatchIterator
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pinned.append(self) or self)
    it = EpochBatchIterator(_Data(), 1, 0, 1, [8], num_workers=1, pin_memory=pin)
    it.set_epoch(1)
    batches = [b for b, _ in it]
    assert len(batches) == 5
    assert len(pinned) == (10 if pin else 0)  # two tensors per batch
    assert it.offset == 40


def test_pinning_is_requested_only_with_cuda(gpus):
    """What the trainer passes: pin with a CUDA device, never on CPU-only torch."""
    from textbox_like.data.iterators import pin_for
    assert not pin_for(torch.device("cpu"))
    gpus(1)
    assert pin_for(torch.device("cuda", 0))


def test_no_deterministic_kernel_is_one_line(monkeypatch, capsys):
    from textbox_like import cli
    from textbox_like.training import outcome as trainer
    monkeypatch.setattr(distributed, "apply_determinism", lambda ns: None)

    def fail(ns, callbacks=()):
        raise RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set "
                           "'torch.use_deterministic_algorithms(True)'.\nmore")
    monkeypatch.setattr(trainer, "train", fail)
    ns = cfg(cudnn_deterministic=True)
    assert cli.run(ns) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --cudnn_deterministic: index_add_cuda_")


@pytest.mark.parametrize("n_gpus,given,expected", [(0, None, 4), (2, None, 25), (0, 8, 8), (2, 8, 8)])
def test_ddp_bucket_size_defaults_by_device(gpus, monkeypatch, n_gpus, given, expected):
    """gloo on CPU sums on a CPU thread: 4 MiB buckets let the large fc1
    gradient start summing during the backward pass; CUDA keeps DDP's 25."""
    gpus(n_gpus)
    import accelerate

    made = {}

    class FakeAccelerator:
        num_processes = 1

        def __init__(self, **kw):
            made.update(kw)
    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    from textbox_like.parallel.accelerator import build_accelerator
    config = cfg(cpu=n_gpus == 0, fp16=False, bf16=False, train_dtype="float32", update_freq=[1], compile=False,
                 compile_mode="default", find_unused_parameters=False, bucket_cap_mb=given, save_dir="x",
                 device_id=0)
    build_accelerator(config, distributed.placement_from_env(config) or distributed.Placement())
    (ddp,) = made["kwargs_handlers"]
    assert ddp.bucket_cap_mb == expected and ddp.gradient_as_bucket_view


def test_fsdp_one_gpu_without_a_launcher_gets_a_group_of_one_and_accelerates_fsdp2_plugin(gpus, monkeypatch):
    """--fsdp in one process on a GPU, started without torchrun: Accelerate
    applies its FSDP plugin only in a distributed run (LOCAL_RANK set, a
    process group), so the process makes a group of itself (NCCL, bound to
    its GPU) before the Accelerator, which gets the FSDP2 plugin with the
    run's settings: bf16 parameters for compute, float32 gradient reduction."""
    calls = gpus(1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # bf16 in hardware
    # restored to absent at teardown: the code under test sets it with os.environ
    monkeypatch.setenv("LOCAL_RANK", "unset")
    monkeypatch.delenv("LOCAL_RANK")
    import accelerate
    import torch.distributed as dist
    group = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(group))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: group.update(kw))
    made = {}

    class FakeAccelerator:
        num_processes = 1

        def __init__(self, **kw):
            made.update(kw, local_rank=os.environ.get("LOCAL_RANK"), group=dict(group))
    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    from textbox_like.parallel.accelerator import build_accelerator
    config = cfg(fsdp=True, bf16=True, fp16=False, train_dtype="float32", update_freq=[1], compile=False,
                 compile_mode="default", find_unused_parameters=False, bucket_cap_mb=None, save_dir="x",
                 device_id=0)
    build_accelerator(config, distributed.Placement())
    assert calls == [0] and made["cpu"] is False and made["local_rank"] == "0"
    assert made["group"]["backend"] == "nccl" and made["group"]["world_size"] == 1
    assert made["group"]["device_id"] == torch.device("cuda", 0)
    plugin = made["fsdp_plugin"]
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == \
        (torch.bfloat16, torch.float32)
    assert "parallelism_config" not in made and made["mixed_precision"] == "bf16"
    monkeypatch.setattr(dist, "destroy_process_group", group.clear)
    distributed.cleanup()  # the end of the run: the group and the LOCAL_RANK it needed are gone
    assert group == {} and "LOCAL_RANK" not in os.environ

    # a launcher's group (two ranks) is left alone: no second group is made
    made.clear()
    FakeAccelerator.num_processes = 2
    build_accelerator(config.replace(distributed_world_size=2),
                      distributed.Placement(world_size=2, local_world_size=2))
    assert made["group"] == {} and made["fsdp_plugin"].fsdp_version == 2


@pytest.mark.parametrize("strategy, per_node", [("none", 2), ("hybrid", 1), ("full", 2), ("hybrid", 2)])
def test_fsdp_on_two_gpus_splitting_nothing_is_sharded_by_shard_model_not_accelerate(gpus, monkeypatch,
                                                                                       strategy, per_node):
    """Two ranks on CUDA where each parameter is split over one rank (none;
    hybrid over two nodes of one GPU): Accelerate 1.15 refuses its FSDP2
    plugin there ("no dimension for FSDP to shard across"), so the
    Accelerator gets no plugin and no parallelism config (nor the
    launcher's ACCELERATE_USE_FSDP, nor its
    ACCELERATE_USE_PARALLELISM_CONFIG / PARALLELISM_CONFIG_*), and the trainer's shard_model applies
    the (world, 1) mesh, the code the CPU runs test; full and hybrid on one
    node of two GPUs keep Accelerate's plugin."""
    from textbox_like.parallel import sharding
    gpus(2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    import accelerate
    made = {}

    class FakeAccelerator:
        num_processes = 2

        def __init__(self, **kw):
            made.update(kw, use_fsdp=os.environ.get("ACCELERATE_USE_FSDP"),
                        parallelism_env=sorted(n for n in os.environ if "PARALLELISM_CONFIG" in n))
    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setattr(sharding, "check_nodes_alike", lambda cfg, placement: None)  # a collective: no group here
    from textbox_like.parallel.accelerator import build_accelerator
    config = cfg(fsdp=True, fsdp_sharding=strategy, bf16=True, fp16=False, train_dtype="float32", update_freq=[1],
                 compile=False, compile_mode="default", find_unused_parameters=False, bucket_cap_mb=None,
                 save_dir="x", distributed_world_size=2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as accelerate launch --use_fsdp exports it
    # as accelerate launch --parallelism_config_dp_shard_size 2 exports it: Accelerate
    # would build a ParallelismConfig from these and apply it on top of ours
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    placement = distributed.Placement(world_size=2, local_world_size=per_node)
    build_accelerator(config, placement)
    ours = sharding.shard_degree(config, placement) == 1
    assert sharding.applied_by_us(config, placement, cuda=True) is ours
    if ours:
        assert "fsdp_plugin" not in made and "parallelism_config" not in made and made["use_fsdp"] is None
        assert made["parallelism_env"] == []
        assert sharding.where(True, ours).startswith("fully_shard applied by textbox_like")
    else:
        assert made["fsdp_plugin"].fsdp_version == 2 and "parallelism_config" not in made
        assert made["parallelism_env"] == []


def test_hybrid_over_two_nodes_of_two_gpus_gives_a_parallelism_config_accelerate_accepts(gpus, monkeypatch):
    """The one place the run builds a ParallelismConfig for Accelerate:
    --fsdp-sharding hybrid over 2 nodes x 2 GPUs, replicated over the nodes
    and sharded within each. Accelerate 1.15 validates it against its
    Accelerator (the check Accelerator.__init__ runs) without complaint."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from textbox_like.parallel import sharding
    gpus(2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    config = cfg(fsdp=True, fsdp_sharding="hybrid", distributed_world_size=4)
    placement = distributed.Placement(world_size=4, local_world_size=2)
    assert not sharding.applied_by_us(config, placement, cuda=True)
    plugin, parallelism = sharding.accelerate_plugin(config, placement, "bf16")
    assert plugin.fsdp_version == 2
    assert (parallelism.dp_replicate_size, parallelism.dp_shard_size, parallelism.total_size) == (2, 2, 4)
    accelerator = SimpleNamespace(num_processes=4, is_fsdp2=True, multi_device=True, is_main_process=True,
                                  distributed_type=DistributedType.FSDP)
    parallelism._validate_accelerator(accelerator)  # raises where Accelerate would refuse it
    assert parallelism.dp_shard_enabled and parallelism.dp_replicate_enabled
