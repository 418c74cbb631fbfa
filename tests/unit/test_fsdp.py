"""--fsdp (issue 32): FSDP2 sharding on CPU over gloo, two real processes.

An update under --fsdp equals the single-process update over the union of
its samples (and DDP's), with unlike per-rank batches, --balance,
accumulation and clipping; its checkpoints are sharded (.dcp): a run killed
with SIGKILL resumes from its last one bitwise, a run resumes on another
number of ranks and between DDP and --fsdp with each sample once, and the
survivor of a lost peer names the checkpoint to resume from."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from textbox_like.storage.sharded_checkpoint import read_extra_state

from conftest import clean_env, read_jsonl, run_main


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable


def run(cmd, env=None, timeout=400):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env=env or clean_env())
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def in_process(cmd):
    """A one-process run of ``cmd`` ([PY, run_hetseq.py, *args]) in this process: the same run without a
    process's ~3 s of imports; torch's thread count (--threads) restored after it. Returns what it wrote
    to sys.stderr (its log), as run's .stderr."""
    import contextlib
    import io
    assert [str(c) for c in cmd[:2]] == [PY, "run_hetseq.py"], cmd[:2]
    threads, err = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = run_main([str(c) for c in cmd[2:]])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err.getvalue()[-4000:]
    return err.getvalue()


def checkpoint(save_dir, name="checkpoint_last"):
    """The run's newest checkpoint ``name``, whole: a DDP run's file, or a
    --fsdp run's sharded directory read in one process (model and optimizer
    by parameter name, with its extra state)."""
    found = [p for p in (Path(save_dir) / f"{name}.pt", Path(save_dir) / f"{name}.dcp") if p.exists()]
    newest = max(found, key=lambda p: os.lstat(p).st_mtime_ns)
    if newest.suffix == ".pt":
        return torch.load(newest, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(newest), f"{scratch}/whole.pt")
        return {**read_extra_state(newest), **torch.load(f"{scratch}/whole.pt", weights_only=True)}


def assert_close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), atol=atol, rtol=0), \
            (key, (a[key].double() - b[key].double()).abs().max().item())


def train_records(save_dir):
    return [r for r in read_jsonl(Path(save_dir) / "metrics.jsonl") if r["kind"] == "train"]

# ------------------------------------------------------------------ settings
STRATEGIES_SCRIPT = '''
import torch, torch.distributed as dist
from textbox_like.parallel import sharding
from textbox_like.resolve.resolution import resolve
from textbox_like.processes.distributed import Placement
dist.init_process_group("gloo")
for strategy, nodes in (("none", 1), ("hybrid", 1), ("hybrid", 2), ("full", 1)):
    cfg, _ = resolve(["--fsdp", "--fsdp-sharding", strategy])
    placement = Placement(world_size=2, local_world_size=2 // nodes)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Linear(13, 10))
    ref = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Linear(13, 10))
    ref.load_state_dict(m.state_dict())
    x = torch.randn(8, 9)
    ref(x).square().sum().backward()
    sharding.shard_model(m, cfg, placement, "cpu", "no")
    m(x).square().sum().backward()  # the same batch on both ranks: their mean is the one-process gradient
    error = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
    if dist.get_rank() == 0:
        print(strategy, nodes, [p.to_local().shape[0] for p in m.parameters()], error,
              sharding.describe(m, cfg, placement, False, 270).split(" (fully_shard")[0], flush=True)
'''


def test_accelerate_launch_fsdp_flags_are_the_runs_settings():
    from textbox_like.resolve.resolution import resolve
    from textbox_like.core.errors import UserError
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
               "FSDP_MIN_NUM_PARAMS": "5000", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true",
               "FSDP_ACTIVATION_CHECKPOINTING": "true"}
    cfg, _ = resolve([], environ=environ)
    s = cfg.sharding
    assert (s.fsdp, s.fsdp_wrap, s.fsdp_min_params, s.fsdp_reshard_after_forward, s.fsdp_cpu_offload) == \
        (True, "size", 5000, False, True)
    assert cfg.model.checkpointing and cfg.source("fsdp") == "accelerate launch / accelerate config"
    # the command line ranks above the launcher
    assert resolve(["--fsdp-wrap", "block"], environ=environ)[0].sharding.fsdp_wrap == "block"
    with pytest.raises(UserError, match="add --fsdp_version 2"):
        resolve([], environ={"ACCELERATE_USE_FSDP": "true"})
    assert not resolve([], environ={})[0].sharding.fsdp
