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


#: an Adam step on fixed values, its result printed exactly: the same here (torch's step) and in a process
#: whose optimizers step without torch._dynamo
ADAM_STEPS = """
import torch
p = torch.nn.Parameter(torch.arange(4.0))
opt = torch.optim.Adam([p], lr=0.1)
for _ in range(3):
    (p * p).sum().backward()
    opt.step()
    opt.zero_grad()
print("adam", p.detach().tolist())
"""


@pytest.mark.slow
@pytest.mark.fresh_interpreter   # the suite's zygote imported torch._dynamo
def test_a_one_process_run_loads_no_compiler_or_sharding_and_steps_as_torch_does(small_mnist_dir, tmp_path):
    """A fresh interpreter (torch._dynamo is long imported in this one): the
    launcher's checks, then a one-process run that trains and saves, import
    neither torch._dynamo nor torch.distributed.tensor / .fsdp (2.4 s of CPU
    a run no longer pays: internals.import_dynamo_only_when_compiling,
    accelerator.device_placement, sharding.sharded_root); an Adam step there
    is bitwise torch's own; once torch._dynamo is imported, torch.compile
    compiles a model, and the optimizers still step."""
    import subprocess
    import sys

    from conftest import clean_env
    code = f"""
import sys
from textbox_like.resolve.resolution import resolve
from textbox_like.resolve.checks import check
cfg, _ = resolve(["--task", "mnist", "--max-sentences", "8", "--max-update", "1", "--optimizer", "adam",
                  "--lr-scheduler", "StepLR", "--scheduler_conf", "step_size=1"])
check(cfg)
print("after checks", "torch._dynamo" in sys.modules)
from textbox_like.cli import main
code = main(["--task", "mnist", "--data", {str(small_mnist_dir)!r}, "--max-update", "3", "--max-sentences", "8",
             "--log-format", "none", "--save-dir", {str(tmp_path / "run")!r}])
print("trained", code, [m for m in ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp")
                        if m in sys.modules])
{ADAM_STEPS}
import torch, torch._dynamo
model = torch.compile(torch.nn.Linear(2, 2), backend="eager")
model(torch.ones(1, 2)).sum().backward()
print("compiled", type(model).__name__)
{ADAM_STEPS}
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=clean_env(),
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    here = subprocess.run([sys.executable, "-c", "import torch._dynamo\n" + ADAM_STEPS], capture_output=True,
                          text=True, timeout=120).stdout.strip()
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "after checks False" and lines[1] == "trained 0 []", out.stdout
    assert lines[2] == here and lines[4] == here and here.startswith("adam ["), (out.stdout, here)
    assert lines[3] == "compiled OptimizedModule", out.stdout
    assert (tmp_path / "run" / "checkpoint_last.pt").exists()
