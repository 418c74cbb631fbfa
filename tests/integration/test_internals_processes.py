"""The tests of test_internals.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import pytest

from textbox_like.core import internals


@pytest.mark.slow
def test_ray_init_local_puts_the_instance_under_the_given_directory():
    ray = pytest.importorskip("ray")
    import shutil
    import tempfile
    from pathlib import Path
    temp = Path(tempfile.mkdtemp(prefix="ray_i_", dir="/tmp"))     # short: Ray's socket paths have a limit
    try:
        internals.ray_init_local(ray, temp, num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 1
            assert (temp / "session_latest").exists()               # its files are there, not in /tmp/ray
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_the_checks_build_optimizers_without_importing_dynamo_and_training_still_does():
    """A fresh interpreter (torch._dynamo is long imported in this one): the launcher's checks build their dummy
    optimizer and scheduler without importing torch._dynamo (~1 s a multi-rank launch no longer pays); the
    cache they filled is emptied, so a real optimizer afterwards is wrapped as torch does and steps."""
    import subprocess
    import sys
    code = """
import sys
from textbox_like.resolve.resolution import resolve
from textbox_like.resolve.checks import check
cfg, _ = resolve(["--task", "mnist", "--max-sentences", "8", "--max-update", "1", "--optimizer", "adam",
                  "--lr-scheduler", "StepLR", "--scheduler_conf", "step_size=1"])
check(cfg)
print("after checks", "torch._dynamo" in sys.modules)
import torch
plain = torch.optim.Optimizer.add_param_group.__wrapped__
print("cache left", hasattr(plain, "__dynamo_disable"))
p = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.Adam([p], lr=0.1)
p.sum().backward()
opt.step()
print("after a real step", "torch._dynamo" in sys.modules, float(p[0]) < 1.0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["after checks False", "cache left False", "after a real step True True"], \
        out.stdout
