"""The tests of test_cuda_paths.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_TORCH_DEVICE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "CUBLAS_WORKSPACE_CONFIG", "MASTER_ADDR", "MASTER_PORT", "TEXTBOX_LIKE_INIT_METHOD"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)


# ----------------------------------------------------------- item 8
@pytest.mark.slow
def test_long_barrier_outlasts_the_training_timeout(tmp_path):
    """Rank 0 is slow (a large checkpoint) for longer than --distributed-timeout:
    the others wait in long_barrier() instead of failing."""
    script = textwrap.dedent(f"""
        import os, sys, time
        import torch, torch.distributed as dist
        from textbox_like.processes import distributed
        from textbox_like.resolve.resolution import parse
        rank = int(sys.argv[1])
        cfg = parse(["--task", "mnist", "--cpu", "--distributed-timeout", "1"])
        # the 1 s timeout also bounds the rendezvous: start it together (two cold
        # imports of torch on a GPU machine differed by more than a second)
        open("{tmp_path}/ready%d" % rank, "w").close()
        while not all(os.path.exists("{tmp_path}/ready%d" % r) for r in (0, 1)):
            time.sleep(0.01)
        p = distributed.Placement(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                                  init_method="file://{tmp_path}/rdzv")
        distributed.init_process_group(p, cfg)
        assert distributed.long_group() is not None
        if rank == 0:
            time.sleep(3)  # three times the training timeout
        distributed.long_barrier()
        t = torch.ones(1)
        dist.all_reduce(t)
        print("ok", t.item())
        distributed.cleanup()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("ok 2.0" in o for o, _ in outs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cudnn_deterministic_trains_on_cpu(tmp_path):
    from conftest import write_mnist
    write_mnist(tmp_path / "data", n_train=128, n_test=32)
    out = subprocess.run([sys.executable, "run_hetseq.py", "--task", "mnist", "--data", str(tmp_path / "data"),
                          "--save-dir", str(tmp_path / "out"), "--max-sentences", "32", "--max-update", "3",
                          "--max-epoch", "0", "--threads", "1", "--log-format", "simple", "--cudnn_deterministic"],
                         capture_output=True, text=True, cwd=REPO, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
