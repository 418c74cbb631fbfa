"""One rank of tests/integration/test_sharded_checkpoint_processes.py: builds a tiny model (an MLP,
or the MNIST network), shards it with FSDP2's ``fully_shard`` when there are
several ranks (over gloo), trains it with Adam, saves and loads sharded
checkpoints, and dumps what the test compares (each rank's local shards, the
full state gathered on rank 0).

    python tests/sharded_checkpoint_worker.py SPEC_JSON

with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for several ranks.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from textbox_like.storage.sharded_checkpoint import full_state_dicts, load_full_state, load_sharded, save_sharded

MODELS = ("mlp", "mnist")


def build(kind: str, shard: bool):
    """The model (the same initial weights on every rank) and its Adam."""
    torch.manual_seed(0)
    if kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 3))
    else:
        from textbox_like.models.mnist_cnn import MNISTNet
        # FSDP2 shards contiguous parameters only; MNISTNet keeps its convolutions channels-last
        model = MNISTNet(hidden=32).to(memory_format=torch.contiguous_format)
    if shard:
        from torch.distributed.fsdp import fully_shard
        for layer in model.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)


class WholeModel:
    """The model part as training/state.py's ModelPart gives it (here no wrapper to unwrap)."""

    def __init__(self, model):
        self.model = model

    def module(self):
        return self.model

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


class Counter:
    """A small replicated part (as the train state, the scheduler)."""

    def __init__(self):
        self.updates = 0

    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, state):
        self.updates = int(state["updates"])


class PerRank:
    """A part with one value per rank, gathered on every rank (as RNGPart)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        from textbox_like.core.collectives import one_per_rank
        world = dist.get_world_size() if dist.is_initialized() else 1
        return one_per_rank(self.value, world)

    def load_state_dict(self, states):
        self.value = states


def manager_for(save_dir, model, optimizer, saves_sharded, *flags):
    """The trainer's checkpoint manager of ``save_dir`` (a real --save-dir configuration) over
    ``model``, ``optimizer``, an update counter and a per-rank part; returns (manager, counter)."""
    from textbox_like.resolve.resolution import parse
    from textbox_like.config.files import to_yaml
    from textbox_like.storage.sharded_checkpoint import ShardedCheckpointManager
    from textbox_like.training.state import OptimizerPart
    cfg = parse(["--task", "mnist", "--save-dir", str(save_dir), "--save-interval-updates", "1",
                 "--keep-interval-updates", "2", *flags])
    counter = Counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    parts = {"model": WholeModel(model), "optimizer": OptimizerPart(optimizer, "adam", True), "train": counter,
             "per_rank": PerRank(f"rank {rank}")}
    manager = ShardedCheckpointManager(cfg.checkpoint, parts, {"task": "mnist", "config": to_yaml(cfg)},
                                       is_main=rank == 0, saves_sharded=saves_sharded)
    return manager, counter


def run_metadata(kind) -> dict:
    """What the trainer keeps beside the parts: the MNIST net's run is a real
    mnist run's configuration, which ``python -m textbox_like.tools.export`` rebuilds it from."""
    if kind != "mnist":
        return {"task": "test"}
    from textbox_like.resolve.resolution import parse
    from textbox_like.config.files import to_yaml
    return {"task": "mnist", "config": to_yaml(parse(["--task", "mnist", "--model_conf", "hidden=32"]))}


def train(kind, model, optimizer, first, last, rank):
    """Updates first..last-1 on data fixed by (update, rank)."""
    for update in range(first, last):
        torch.manual_seed(1000 * update + rank)  # the data and the dropout masks of this update
        if kind == "mlp":
            loss = model(torch.randn(5, 6)).square().sum()
        else:
            loss = -model(torch.randn(4, 1, 28, 28))[:, 3].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local(value):
    """A DTensor's own shard; anything else as it is."""
    if hasattr(value, "to_local"):
        return value.to_local().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [local(v) for v in value]
    return value


def dump(out: Path, tag: str, model, optimizer, rank):
    """This rank's local shards, and the full state on rank 0 (every rank takes part in gathering it)."""
    torch.save({"model": local(model.state_dict()),
                "optimizer": local(optimizer.state_dict())}, out / f"{tag}.local{rank}.pt")
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state}, out / f"{tag}.full.pt")


def main():
    spec = json.loads(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(spec["out"])
    for kind in spec["models"]:
        model, optimizer = build(kind, shard=world > 1)
        for step in spec["steps"]:
            what = step["do"]
            if what == "train":
                train(kind, model, optimizer, step["first"], step["last"], rank)
            elif what == "save":
                if step.get("publish_delay"):  # test hook: this save stops before its rename (see the test)
                    os.environ["TEXTBOX_LIKE_TEST_DELAY"] = f"publish={step['publish_delay']}"
                extra = {**run_metadata(kind), "train": {"num_updates": step["update"]}}
                save_dir = Path(step["dir"]) / kind
                save_dir.mkdir(parents=True, exist_ok=True)  # the trainer's, made at start
                save_sharded(save_dir, step["names"], model, optimizer, extra)
            elif what == "load":
                extra = load_sharded(Path(step["path"].replace("{model}", kind)), model, optimizer)
                assert extra["task"] == run_metadata(kind)["task"], extra
            elif what == "build":  # a fresh model and optimizer
                model, optimizer = build(kind, shard=world > 1)
            elif what == "load_full":
                full = torch.load(step["path"].replace("{model}", kind), weights_only=True)
                load_full_state(model, optimizer, full["model"], full["optimizer"])
            elif what == "manager_save":  # train and save through the trainer's manager, every update
                save_dir = Path(step["dir"]) / kind
                save_dir.mkdir(parents=True, exist_ok=True)
                manager, counter = manager_for(save_dir, model, optimizer, True)
                for update in range(step["first"], step["last"]):
                    train(kind, model, optimizer, update, update + 1, rank)
                    counter.updates = update + 1
                    manager.save(manager.names(1, update + 1, end_of_epoch=False, is_best=False))
            elif what == "dump":
                dump(out, f"{kind}.{step['tag']}", model, optimizer, rank)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    (out / f"done{rank}").write_text("ok")
    if world > 1:  # as conftest.RANK_LEAVES: the interpreter's teardown of gloo's threads can abort a rank
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
