"""A rank lost under --fsdp (issue 32, review item 5), with real torchrun
agents on this machine as two "nodes", a node dying as a machine does (its
agent's process group killed with SIGKILL; the worker ends by its
parent-death signal).

Where every rank holds whole tensors (--fsdp-sharding none, hybrid with one
rank per node) the survivor saves the update in flight as DDP does and the
restarted workers go on from it; under full sharding the lost rank's shards
exist nowhere else, and the restarted workers go on from the last
checkpoint by themselves. Either way the run ends equal to one process,
each sample trained once."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import free_port
from test_elastic import GLOBAL, UPDATES, Node, args, children, data, one_process, resumed_updates, running  # noqa: F401
from test_fsdp import assert_close, checkpoint


def lose_node_b(tmp_path, train, after_update):
    """Nodes A and B train; once A logged ``after_update``, B's agent and its
    process group are killed; A's torchrun restarts its worker alone, which
    runs to the end. (A's log, the last update A logged before the kill)."""
    port = free_port()
    a = Node(port, tmp_path / "a.log", train, hosts_rendezvous=True)
    b = Node(port, tmp_path / "b.log", train)
    try:
        a.wait_for_update(after_update)
        (worker,) = children(b.proc.pid)
        k = a.last_update()
        os.killpg(b.proc.pid, signal.SIGKILL)  # the agent's group: its worker is not in it
        b.proc.wait()
        deadline = time.monotonic() + 60
        while running(worker):
            assert time.monotonic() < deadline, f"the worker {worker} of the killed agent trains on"
            time.sleep(0.05)
        assert a.finish(500) == 0, a.text()[-3000:]
    finally:
        for node in (a, b):
            if node.proc.poll() is None:
                node.die()
    return a.text(), k


def error_line(text):
    (line,) = [line for line in text.splitlines() if line.startswith("error:")]
    assert "Traceback" not in text, text[-3000:]
    return line


def assert_equals_one_process(save, one_process):  # noqa: F811
    results = json.loads((save / "results.json").read_text())
    assert results["num_updates"] == UPDATES and results["samples_trained"] == UPDATES * GLOBAL  # each sample once
    assert results["world_size"] == 1
    assert_close(checkpoint(save)["model"], one_process)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["none", "hybrid"])
def test_fsdp_with_whole_tensors_the_survivor_saves_the_update_in_flight_and_the_restart_goes_on(
        data, tmp_path, one_process, strategy):  # noqa: F811
    """none, and hybrid over two nodes of one rank each: every rank's
    DTensors are whole, so the survivor writes the last completed update as a
    DDP file checkpoint, with no collective; torchrun restarts the worker,
    which resumes from it (at most the update in flight is redone)."""
    save = tmp_path / "save"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30,
                 "--fsdp", "--fsdp-sharding", strategy, "--save-interval-updates", 1000)
    text, k = lose_node_b(tmp_path, train, 15)
    how = {"none": "sharding none (replicated over 2 ranks)",
           "hybrid": "sharding hybrid: over 1 ranks per node, replicated over 2 node(s)"}[strategy]
    assert how in text, text[-3000:]
    line = error_line(text)
    assert "lost a peer of this run" in line and "torchrun restarts the workers and they resume from it" in line
    saved = int(re.search(r"saved update (\d+) to ", line).group(1))
    assert saved >= k - 1, (k, line)  # at most the update in flight is redone
    (emergency,) = save.glob(f"checkpoint_*_{saved}.pt")  # checkpoint_EPOCH_UPDATE.pt
    (left_at,) = resumed_updates(text)
    assert re.search(rf"resumed from {re.escape(str(emergency))}: epoch \d+, update {saved}\n", text), text[-3000:]
    assert left_at == saved
    # saved whole, with the model's own names, from this rank alone (no gather over the lost peer)
    whole = checkpoint(save, emergency.stem)
    assert whole["train"]["num_updates"] == saved and whole["train"]["samples_trained"] == saved * GLOBAL
    assert {n: v.shape for n, v in whole["model"].items()} == {n: v.shape for n, v in one_process.items()}
    assert_equals_one_process(save, one_process)


@pytest.mark.timeout(900)
def test_fsdp_full_sharding_the_restarted_workers_resume_from_the_last_checkpoint(data, tmp_path,
                                                                                   one_process):  # noqa: F811
    """Full sharding: the survivor saves nothing, says the updates since the
    last checkpoint are lost and that torchrun's restarted workers resume
    from it by themselves; they do, on one rank, and the run ends equal to
    one process."""
    save = tmp_path / "save"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30,
                 "--fsdp", "--save-interval-updates", 10)
    text, k = lose_node_b(tmp_path, train, 15)
    line = error_line(text)
    assert "lost a peer of this run" in line and "the lost rank's shards exist nowhere else" in line, line
    assert "the updates since the last checkpoint are lost" in line and "--resume" not in line, line
    found = re.search(r"torchrun restarts the workers and they resume by themselves from the last checkpoint "
                      r"\((\S+)\) at update (\d+)$", line)
    assert found, line
    named, update = found.group(1), int(found.group(2))
    assert update % 10 == 0 and 10 <= update <= k, (k, line)
    assert not list(save.glob("*.pt"))  # no emergency save
    (left_at,) = resumed_updates(text)
    assert left_at == update and Path(named).is_dir() and Path(named).suffix == ".dcp"
    assert_equals_one_process(save, one_process)


MID_FORWARD_SCRIPT = '''
import datetime
from types import SimpleNamespace
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from textbox_like import sharding
from textbox_like.config.resolution import resolve
from textbox_like.distributed import Placement
from textbox_like.training import elastic
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
chosen = []
elastic.shards_lost = lambda trainer, where: chosen.append("nothing saved") or 75
elastic.emergency_save = lambda trainer: chosen.append("emergency save") or (None, "3")
for strategy in ("full", "none"):
    cfg, _ = resolve(["--fsdp", "--fsdp-sharding", strategy, "--fsdp-wrap", "none",
                      "--fsdp-reshard-after-forward", "false"])
    placement = Placement(world_size=2, local_world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Linear(13, 10))
    shapes = {name: tuple(v.shape) for name, v in model.state_dict().items()}
    sharding.shard_model(model, cfg, placement, "cpu", "no")
    model(torch.randn(4, 9))  # forward done, backward not begun: the root holds the gathered Parameters
    visible = sum(isinstance(p, DTensor) for p in model.parameters())
    trainer = SimpleNamespace(model=model, cfg=cfg, placement=placement, rank=dist.get_rank(), agent=None,
                              state=SimpleNamespace(num_updates=3), in_flight=SimpleNamespace(offset=0),
                              checkpointer=SimpleNamespace(checkpoints=SimpleNamespace(enabled=True)),
                              lifecycle=SimpleNamespace(release_save_dir=lambda: None))
    chosen.clear()
    elastic.peer_lost(trainer, RuntimeError("Connection closed by peer"))
    saved = {name: tuple(v.shape) for name, v in elastic.local_whole(model.state_dict()).items()}
    mine = f"rank {dist.get_rank()} {strategy} dtensors visible {visible} {chosen} whole {saved == shapes}"
    lines = [None, None]
    dist.all_gather_object(lines, mine)
    if dist.get_rank() == 0:  # one writer: two ranks printing to one pipe can interleave their lines
        print("\\n".join(lines), flush=True)
'''


@pytest.mark.timeout(300)
def test_a_peer_lost_mid_forward_is_judged_by_the_mesh_not_by_the_gathered_parameters(tmp_path):
    """Two real ranks, the failure met between forward and backward under
    --fsdp-reshard-after-forward false, where FSDP2 has put plain gathered
    Parameters in the modules (no DTensor visible): under full sharding the
    survivor still saves nothing (its shards are not the whole tensors);
    under none it saves, and what it would save is whole."""
    from test_fsdp_options import torchrun
    out = torchrun(MID_FORWARD_SCRIPT, tmp_path)
    lines = sorted(line for line in out.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} {s} dtensors visible 0 ['{what}'] whole {whole}"
                     for r in (0, 1) for s, what, whole in (("full", "nothing saved", False),
                                                            ("none", "emergency save", True))], out
