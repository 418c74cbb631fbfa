"""--fsdp with the run's other options (review of issue 32): --compile on a
model compiled whole, hybrid sharding on unlike nodes, DDP's settings under
--fsdp and Accelerate's FSDP1 spellings, evaluating a sharded model before it
trains, --find-unused-parameters, and the optimizer-state figure of the start
line. Real processes over gloo where the behaviour is multi-rank."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RANK_LEAVES, clean_env, write_mnist


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable


def torchrun(script, tmp_path, timeout=300):
    path = tmp_path / "script.py"
    path.write_text(script + RANK_LEAVES)
    out = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(path)], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # what rank 0 printed, then each rank's verdict from a file of its own (where each rank has one to
    # give: two ranks printing to one pipe interleave their lines)
    return out.stdout + "".join(p.read_text() for p in sorted(tmp_path.glob("script.py.rank*")))


# ------------------------------------------------------------------ DDP's settings and Accelerate's spellings
@pytest.mark.parametrize("flags,message", [
    (["--ddp-comm-hook", "bf16"], "error: --ddp-comm-hook bf16 compresses DDP's all-reduce; --fsdp reduce-scatters "
                                  "the gradients without communication hooks: drop one of them"),
    (["--bucket-cap-mb", "8"], "error: --bucket-cap-mb sizes DDP's gradient buckets; --fsdp reduces the gradients "
                               "one unit at a time (the units: --fsdp-wrap, --fsdp-min-params): drop --bucket-cap-mb"),
])
def test_ddp_settings_that_fsdp_cannot_honour_are_refused(tmp_path, flags, message, capfd):
    from conftest import refusal_in_process   # refused before any process group: in this process
    data = tmp_path / "mnist"
    write_mnist(data, n_train=64, n_test=16)
    out = refusal_in_process(["--task", "mnist", "--data", str(data), "--save-dir", str(tmp_path / "save"),
                              "--max-sentences", "16", "--max-update", "1", "--fsdp", *flags], capfd)
    assert out.returncode == 2, out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("error:")] == [message]
    assert "Traceback" not in out.stderr and not (tmp_path / "save").exists()


def test_cpu_offload_on_cpu_says_it_changes_nothing(capsys):
    from textbox_like.parallel import sharding
    from textbox_like.resolve.resolution import resolve
    cfg, _ = resolve(["--fsdp", "--fsdp-cpu-offload", "--cpu"])
    sharding.check_settings(cfg)
    assert capsys.readouterr().err == ("note: --fsdp-cpu-offload changes nothing on CPU: parameters, gradients and "
                                       "optimizer states are in CPU memory already\n")


@pytest.mark.parametrize("value,sharding_strategy,reshard", [
    ("no_shard", "none", True), ("shard_grad_op", "full", False), ("hybrid_shard", "hybrid", True),
    ("hybrid_shard_zero2", "hybrid", False), ("full_shard", "full", True), ("false", "full", False),
    ("off", "full", False), ("TRUE", "full", True)])
def test_accelerate_reshard_values_read_as_fsdp2_settings(value, sharding_strategy, reshard):
    """accelerate launch lowercases --fsdp_reshard_after_forward; FSDP1's
    strategy names mean a sharding and a resharding under FSDP2."""
    from textbox_like.resolve.resolution import resolve
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": value}
    s = resolve([], environ=environ)[0].sharding
    assert (s.fsdp_sharding, s.fsdp_reshard_after_forward) == (sharding_strategy, reshard)


def test_an_unknown_reshard_value_is_refused():
    from textbox_like.resolve.resolution import resolve
    from textbox_like.core.errors import UserError
    with pytest.raises(UserError, match="FSDP2 takes true or false there"):
        resolve([], environ={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "2"})


# ------------------------------------------------------------------ the start line's optimizer-state figure
def test_optimizer_state_figure_follows_the_optimizers_arguments():
    """SGD keeps a momentum buffer only with momentum > 0: in one process
    (run_hyper's trials), each configuration gets its own figure."""
    from textbox_like.parallel import sharding
    from textbox_like.resolve.resolution import resolve
    plain = resolve(["--optimizer", "sgd", "--momentum", "0"])[0].optim
    heavy = resolve(["--optimizer", "sgd", "--momentum", "0.9"])[0].optim
    assert (sharding.optimizer_state_elements(plain), sharding.optimizer_state_elements(heavy)) == (0, 1)


def test_a_tied_layer_that_accelerates_plugin_would_shard_alone_is_refused_in_one_line():
    import torch

    from textbox_like.parallel import sharding
    from textbox_like.resolve.resolution import resolve
    from textbox_like.processes.distributed import Placement
    from textbox_like.core.errors import UserError

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(4, 4)
            self.head.weight = self.blocks[0].linear.weight

    cfg, _ = resolve(["--fsdp", "--fsdp-block-classes", "Block"])
    plugin = sharding.accelerate_plugin(cfg, Placement(world_size=1, local_world_size=1), "no")[0]
    with pytest.raises(UserError) as err:
        sharding.fit_accelerate_plugin(plugin, Tied(), cfg)
    assert str(err.value) == ("--fsdp-wrap block: Accelerate's FSDP2 plugin would shard blocks.0 (Block) as a unit "
                              "apart from a parameter it shares with the rest of the model (tied weights); name layer "
                              "classes without tied weights with --fsdp-block-classes, or use --fsdp-wrap none")

    # by size, Accelerate's policy takes the ModuleList that holds the tied block: the line names --fsdp-wrap block
    class TiedBySize(Tied):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Linear(8, 8)  # a unit of its own, untied: not what the refusal is about

    cfg, _ = resolve(["--fsdp", "--fsdp-wrap", "size", "--fsdp-min-params", "10"])
    plugin = sharding.accelerate_plugin(cfg, Placement(world_size=1, local_world_size=1), "no")[0]
    with pytest.raises(UserError) as err:
        sharding.fit_accelerate_plugin(plugin, TiedBySize(), cfg)
    assert str(err.value) == ("--fsdp-wrap size: Accelerate's FSDP2 plugin would shard blocks (ModuleList) as a unit "
                              "apart from a parameter it shares with the rest of the model (tied weights); use "
                              "--fsdp-wrap block (or name the layers with --fsdp-block-classes), or --fsdp-wrap none")
