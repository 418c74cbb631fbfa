"""The tests of test_sharded_checkpoint.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from textbox_like.core.errors import UserError
from textbox_like.storage.sharded_checkpoint import (
    consolidated_state,
    is_sharded_checkpoint,
    load_sharded,
    read_full_model_state,
    read_manifest,
    remove_leftovers,
    save_sharded,
    sharded_checkpoints_newest_first)

from test_sharded_checkpoint import WORKER, assert_same, export_in_process, full_state, worker
from _fsdp_runs import Plan, script, spawned


MODELS = ["mlp", "mnist"]


# ---------------------------------------------------------------- helpers
def dumped(out: Path, name: str):
    return torch.load(out / f"{name}.pt", weights_only=True)


# ---------------------------------------------------------------- runs
def worker_step(spec: dict, world: int):
    """The worker on ``world`` ranks (the first of a plan's processes) for ``spec``, each rank with RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT: a step of a plan (_fsdp_runs.script)."""
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    return script(WORKER, world, [json.dumps(spec)])


@pytest.fixture(scope="module")
def worker_runs(one_process_save, small_mnist_dir, tmp_path_factory):
    """The workers of two_rank_save, two_rank_loads and the three-rank load, the two-rank --fsdp run of
    test_a_ddp_run_prunes_the_interval_checkpoints_an_fsdp_run_left, then the worker of
    test_save_killed_midway_leaves_the_previous_checkpoint_newest, killed, one after the other in three rank
    processes (_fsdp_runs.Plan: each step with the variables, and a process group, of its own; the third
    process takes part in the three-rank step only), instead of 2 + 2 + 3 + 2 + 2 processes. The roots of
    the three workers' steps, in order, the --fsdp run's save directory, and the killed step's root, the
    partial directories it left ("written") and its Run."""
    root = tmp_path_factory.mktemp("sharded_workers")
    saved, loads, three = root / "sharded2", root / "sharded2load", root / "sharded3load"
    one_root, _ = one_process_save
    # two ranks train 3 updates, save (checkpoint_1_3 and checkpoint_last), then go on for 2 more: each
    # rank's shards and the full state dumped at both points
    save = {"out": str(saved / "out"), "models": MODELS, "steps": [
        {"do": "train", "first": 0, "last": 3},
        {"do": "save", "dir": str(saved / "save"), "names": ["checkpoint_1_3.pt", "checkpoint_last.pt"], "update": 3},
        {"do": "dump", "tag": "saved"},
        {"do": "train", "first": 3, "last": 5},
        {"do": "dump", "tag": "continued"}]}
    # two ranks, with fresh models, load the two-rank save and train 2 more updates; then, into fresh
    # models, the one-process save and the DDP file state
    load = {"out": str(loads / "out"), "models": MODELS, "steps": [
        {"do": "load", "path": str(saved / "save" / "{model}" / "checkpoint_last.dcp")},
        {"do": "dump", "tag": "loaded"},
        {"do": "train", "first": 3, "last": 5},
        {"do": "dump", "tag": "resumed"},
        {"do": "build"},
        {"do": "load", "path": str(one_root / "save" / "{model}" / "checkpoint_last.dcp")},
        {"do": "dump", "tag": "from_one"},
        {"do": "build"},
        {"do": "load_full", "path": str(one_root / "ddp" / "{model}.pt")},
        {"do": "dump", "tag": "from_ddp"},
        {"do": "manager_save", "dir": str(loads / "managed"), "first": 3, "last": 6},
        {"do": "dump", "tag": "managed"}]}
    # three ranks, with fresh models, load the two-rank save
    load3 = {"out": str(three / "out"), "models": MODELS, "steps": [
        {"do": "load", "path": str(saved / "save" / "{model}" / "checkpoint_last.dcp")},
        {"do": "dump", "tag": "loaded"}]}
    # the --fsdp run that leaves interval checkpoints (two ranks as run_hetseq.py spawns them)
    pruned = root / "pruned"
    fsdp = spawned(["--task", "mnist", "--data", small_mnist_dir, "--max-sentences", 16, "--threads", 1, "--cpu",
                    "--report-to", "none", "--disable-validation", "--save-dir", pruned, "--save-interval-updates", 1,
                    "--fsdp", "--max-update", 2, "--distributed-world-size", 2], 2, root / "rdzv_pruned")
    # test_save_killed_midway_leaves_the_previous_checkpoint_newest's two ranks, last: they save at update 2,
    # then at update 4 rank 0 stops (test hook) after every file is written and before the rename
    killed = root / "killed"
    kill = {"out": str(killed / "out"), "models": ["mlp"], "steps": [
        {"do": "train", "first": 0, "last": 2},
        {"do": "save", "dir": str(killed / "save"), "names": ["checkpoint_1_2.pt", "checkpoint_last.pt"], "update": 2},
        {"do": "dump", "tag": "first"},
        {"do": "train", "first": 2, "last": 4},
        {"do": "save", "dir": str(killed / "save"), "names": ["checkpoint_1_4.pt", "checkpoint_last.pt"], "update": 4,
         "publish_delay": 3600}]}
    steps = [worker_step(save, 2), worker_step(load, 2), worker_step(load3, 3), fsdp, worker_step(kill, 2)]
    with Plan(steps, root / "plan", ranks=3) as plan:
        written = []

        def both_written():  # both names' directories hold every file: the save sleeps before its rename
            written[:] = list((killed / "save" / "mlp").glob(".checkpoint_*.partial/manifest.json"))
            if not any(path.parent.name.startswith(".checkpoint_1_4.dcp.") for path in written):
                written.clear()  # the update-2 save's own directories, seen in the moment before their rename
            return len(written) >= 2
        plan.wait_for(both_written, timeout=1500, poll=0.2, ranks=(0, 1))
        for rank in (0, 1):   # both killed with SIGKILL there
            plan.kill(rank)
        plan.finish()
    for step in steps[:-1]:
        step.check()
    return saved, loads, three, pruned, {"root": killed, "written": written, "run": steps[-1]}


@pytest.fixture(scope="module")
def two_rank_save(worker_runs):
    """Two ranks trained 3 updates, saved (checkpoint_1_3 and checkpoint_last),
    then went on for 2 more: each rank's shards and the full state dumped at both points."""
    return worker_runs[0]


@pytest.fixture(scope="module")
def one_process_save(tmp_path_factory):
    """This process (no process group, no sharding) trains 3 updates and saves
    sharded and as a DDP run's file state."""
    root = tmp_path_factory.mktemp("sharded1")
    states = {}
    for kind in MODELS:
        model, optimizer = worker.build(kind, shard=False)
        worker.train(kind, model, optimizer, 0, 3, rank=0)
        (root / "save" / kind).mkdir(parents=True)
        save_sharded(root / "save" / kind, ["checkpoint_last.pt"], model, optimizer,
                     {**worker.run_metadata(kind), "train": {"num_updates": 3}})
        states[kind] = full_state(model, optimizer)
        (root / "ddp").mkdir(exist_ok=True)
        torch.save(states[kind], root / "ddp" / f"{kind}.pt")
    return root, states


@pytest.fixture(scope="module")
def two_rank_loads(worker_runs):
    """Two ranks (fresh models) loaded the two-rank save and trained 2 more updates; then, into fresh
    models, the one-process save and the DDP file state."""
    return worker_runs[1]


# ---------------------------------------------------------------- (a) same world size
@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_two_ranks_resume_bitwise(two_rank_save, two_rank_loads, kind):
    """Each rank's shards of the parameters and of Adam's state after the load
    are the saved ones bit for bit, and 2 more updates give the same bits as the run that went on."""
    saved_out, loaded_out = two_rank_save / "out", two_rank_loads / "out"
    for rank in (0, 1):
        assert_same(dumped(loaded_out, f"{kind}.loaded.local{rank}"), dumped(saved_out, f"{kind}.saved.local{rank}"))
        assert_same(dumped(loaded_out, f"{kind}.resumed.local{rank}"),
                    dumped(saved_out, f"{kind}.continued.local{rank}"))
    # the shards are halves: the two ranks' pieces differ (not one replicated copy)
    a, b = (dumped(saved_out, f"{kind}.saved.local{r}")["model"] for r in (0, 1))
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_save_is_published_whole_under_each_name(two_rank_save):
    """Every name is a published checkpoint of its own data (copies, not one
    directory), both verify, and nothing half-written is left."""
    save = two_rank_save / "save" / "mlp"
    newest = sharded_checkpoints_newest_first(save)
    assert [p.name for p in newest] == ["checkpoint_last.dcp", "checkpoint_1_3.dcp"]
    assert all(is_sharded_checkpoint(p) for p in newest)
    assert newest[0].resolve() != newest[1].resolve()
    manifests = [read_manifest(p) for p in newest]
    assert manifests[0]["files"] == manifests[1]["files"] and manifests[0]["world_size"] == 2
    assert not [p for p in save.iterdir() if p.name.endswith(".partial")]
    assert sorted(manifests[0]["files"]) == sorted(p.name for p in newest[0].iterdir() if p.name != "manifest.json")


# ---------------------------------------------------------------- (b) other world sizes, DDP <-> FSDP
@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_one_process_loads_a_two_rank_save(two_rank_save, kind):
    model, optimizer = worker.build(kind, shard=False)
    extra = load_sharded(two_rank_save / "save" / kind / "checkpoint_last.dcp", model, optimizer)
    assert extra["train"] == {"num_updates": 3} and extra["task"] == worker.run_metadata(kind)["task"]
    assert_same(full_state(model, optimizer), dumped(two_rank_save / "out", f"{kind}.saved.full"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_two_ranks_load_a_one_process_save_and_a_ddp_state(one_process_save, two_rank_loads, kind):
    """Two sharded ranks load what one process saved (DCP reshards), and a DDP
    run's full state (load_full_state): the full state gathered back is the one saved."""
    _, states = one_process_save
    assert_same(dumped(two_rank_loads / "out", f"{kind}.from_one.full"), states[kind])
    assert_same(dumped(two_rank_loads / "out", f"{kind}.from_ddp.full"), states[kind])


@pytest.mark.slow
def test_three_sharded_ranks_load_a_two_rank_save(two_rank_save, worker_runs):
    """From two shards per tensor to three, uneven (16 rows over 3 ranks): the full state gathered back is
    the one saved (worker_runs' third step)."""
    out = worker_runs[2] / "out"
    for kind in MODELS:
        assert_same(dumped(out, f"{kind}.loaded.full"), dumped(two_rank_save / "out", f"{kind}.saved.full"))
    # the MLP's middle layer (16 x 16): each of the three ranks holds its own, uneven, piece
    rows = [dumped(out, f"mlp.loaded.local{r}")["model"]["2.weight"].shape[0] for r in range(3)]
    assert sum(rows) == 16 and min(rows) > 0 and len(set(rows)) > 1, rows


# ---------------------------------------------------------------- (c) kill -9 mid-save
@pytest.mark.slow
def test_save_killed_midway_leaves_the_previous_checkpoint_newest(worker_runs):
    """Two ranks save at update 2, then at update 4 rank 0 stops (test hook)
    after every file is written and before the rename: both are killed with
    SIGKILL there (worker_runs' last step). The update-2 save is still the
    newest and loads bit for bit; the leftovers go at the next start; the
    next save replaces it."""
    killed = worker_runs[4]
    save, written, run = killed["root"] / "save", killed["written"], killed["run"]
    assert run.codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}, run.stderr[-3000:]  # killed in the save
    spec = {"out": str(killed["root"] / "out")}
    directory = save / "mlp"
    newest = sharded_checkpoints_newest_first(directory)
    assert [p.name for p in newest] == ["checkpoint_last.dcp", "checkpoint_1_2.dcp"]
    model, optimizer = worker.build("mlp", shard=False)
    assert load_sharded(newest[0], model, optimizer)["train"] == {"num_updates": 2}
    assert_same(full_state(model, optimizer), dumped(Path(spec["out"]), "mlp.first.full"))

    partials = sorted(p.parent for p in written)
    assert sorted(remove_leftovers(directory)) == partials
    assert not any(p.exists() for p in partials)
    assert [p.name for p in sharded_checkpoints_newest_first(directory)] == ["checkpoint_last.dcp", "checkpoint_1_2.dcp"]

    # the next save (one process) replaces checkpoint_last.dcp; its old data goes at the save after
    old_data = (directory / "checkpoint_last.dcp").resolve()
    worker.train("mlp", model, optimizer, 2, 4, rank=0)
    save_sharded(directory, ["checkpoint_1_4.pt", "checkpoint_last.pt"], model, optimizer,
                 {"task": "test", "train": {"num_updates": 4}})
    assert old_data.is_dir()
    save_sharded(directory, ["checkpoint_last.pt"], model, optimizer, {"task": "test", "train": {"num_updates": 4}})
    assert not old_data.exists()
    newest = sharded_checkpoints_newest_first(directory)
    assert [p.name for p in newest][:2] == ["checkpoint_last.dcp", "checkpoint_1_4.dcp"]
    assert consolidated_state(newest[0])["train"] == {"num_updates": 4}
    assert remove_leftovers(directory) == []


# ---------------------------------------------------------------- (d) damage
@pytest.mark.slow
def test_damaged_shard_is_one_line_and_changes_nothing(two_rank_save, tmp_path, capfd):
    """A byte flipped in one rank's shard: the load refuses it naming the file
    and the fix, before touching the model; the other name's copy still loads.
    A truncated or missing file likewise; the export command says it in one line, exit 2."""
    directory = tmp_path / "save"
    shutil.copytree(two_rank_save / "save" / "mlp", directory, symlinks=True)
    damaged = directory / "checkpoint_last.dcp"
    shard = damaged / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    model, optimizer = worker.build("mlp", shard=False)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError) as refused:
        load_sharded(damaged, model, optimizer)
    assert str(refused.value) == (
        f"checkpoint {damaged}: its file __1_0.distcp fails its digest check (its contents were changed or "
        f"corrupted after it was written); restore another checkpoint of that directory with --restore-file, "
        f"or start without --resume")
    assert_same(model.state_dict(), fresh)
    assert not optimizer.state

    # the copy under the other name is its own: it loads
    load_sharded(directory / "checkpoint_1_3.dcp", model, optimizer)
    assert_same(full_state(model, optimizer), dumped(two_rank_save / "out", "mlp.saved.full"))

    out = export_in_process([damaged, "--to", tmp_path / "x"], capfd)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {refused.value}"], out.stderr[-3000:]
    assert not (tmp_path / "x").exists()

    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(UserError, match=r"its file __1_0\.distcp is truncated or changed \(100 bytes, \d+ written\)"):
        load_sharded(damaged, model, optimizer)
    shard.unlink()
    with pytest.raises(UserError, match=r"is missing its file __1_0\.distcp; restore another checkpoint"):
        load_sharded(damaged, model, optimizer)


# ---------------------------------------------------------------- (e) export
@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_export_equals_the_full_state_dict(two_rank_save, tmp_path, kind):
    """The exported weights are the model's full state dict as the sharded
    run gathered it, and load into the unsharded model."""
    path = two_rank_save / "save" / kind / "checkpoint_last.dcp"
    weights = read_full_model_state(path)
    assert_same(weights, dumped(two_rank_save / "out", f"{kind}.saved.full")["model"])
    model, _ = worker.build(kind, shard=False)
    model.load_state_dict(weights)  # strict: every key, no other
    state = consolidated_state(path)
    assert_same(state["model"], weights)
    assert state["train"] == {"num_updates": 3}


@pytest.mark.slow
def test_export_command_takes_a_sharded_mnist_checkpoint(two_rank_save, tmp_path, capfd):
    """``python -m textbox_like.tools.export CKPT.dcp --to DIR``: the mnist run's
    weights as model.safetensors for the model the task builds."""
    from safetensors.torch import load_file
    path = two_rank_save / "save" / "mnist" / "checkpoint_last.dcp"
    out = export_in_process([path, "--to", tmp_path / "x"], capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "update 3: task mnist, MNISTNet" in out.stdout
    assert_same({k: v.contiguous() for k, v in load_file(tmp_path / "x" / "model.safetensors").items()},
                {k: v.contiguous() for k, v in dumped(two_rank_save / "out", "mnist.saved.full")["model"].items()})


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_manager_of_two_sharded_ranks_resumes_in_one_process(two_rank_loads, tmp_path, kind):
    """Two FSDP ranks save every update through the manager (each rank's own
    value of a per-rank part gathered); one process resumes from the newest: the same weights and Adam state."""
    directory = two_rank_loads / "managed" / kind
    assert [p.name for p in sharded_checkpoints_newest_first(directory)] == [
        "checkpoint_last.dcp", "checkpoint_1_6.dcp", "checkpoint_1_5.dcp"]
    model, optimizer = worker.build(kind, shard=False)
    manager, counter = worker.manager_for(directory, model, optimizer, False, "--resume")
    state, path = manager.load_newest(manager.resume_path(), print)
    assert path == directory / "checkpoint_last.dcp" and state["per_rank"] == ["rank 0", "rank 1"]
    assert manager.restore(state, path) == [] and counter.updates == 6
    assert_same(full_state(model, optimizer), dumped(two_rank_loads / "out", f"{kind}.managed.full"))


@pytest.mark.slow
def test_evaluate_takes_a_sharded_checkpoint(two_rank_save, small_mnist_dir, tmp_path):
    """``textbox_like.evaluate`` (``textbox-like eval``) of a sharded checkpoint
    gives what it gives for a file checkpoint of the same run state."""
    import textbox_like
    from textbox_like.storage.checkpoint import FORMAT, atomic_save
    sharded = two_rank_save / "save" / "mnist" / "checkpoint_last.dcp"
    atomic_save({"format": FORMAT, **consolidated_state(sharded)}, tmp_path / "checkpoint_last.pt")
    from_shards = textbox_like.evaluate(sharded, data=str(small_mnist_dir), cpu=True)
    from_file = textbox_like.evaluate(tmp_path / "checkpoint_last.pt", data=str(small_mnist_dir), cpu=True)
    assert from_shards["num_updates"] == 3 and from_shards["samples"] == from_file["samples"] > 0
    assert {k: v for k, v in from_shards.items() if k != "checkpoint"} == \
        {k: v for k, v in from_file.items() if k != "checkpoint"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ddp_run_prunes_the_interval_checkpoints_an_fsdp_run_left(small_mnist_dir, worker_runs):
    """A 2-rank --fsdp run saving every update leaves sharded interval
    checkpoints (worker_runs' last step, its directory this test's alone); a
    DDP run resuming in the same directory with --keep-interval-updates 1
    counts them with its own .pt ones: only its newest interval checkpoint
    stays, and the data directories of the removed .dcp names go with them."""
    import textbox_like
    save_dir = worker_runs[3]
    base = {"task": "mnist", "data": str(small_mnist_dir), "batch_size": 16, "threads": 1, "cpu": True,
            "report_to": "none", "disable_validation": True, "save_dir": str(save_dir), "save_interval_updates": 1}
    assert {"checkpoint_1_1.dcp", "checkpoint_1_2.dcp"} <= set(os.listdir(save_dir))
    assert textbox_like.train(base, max_update=4, resume=True, keep_interval_updates=1)["exit_code"] == 0
    names = set(os.listdir(save_dir))
    assert sorted(n for n in names if n.startswith("checkpoint_1_")) == ["checkpoint_1_4.pt"], names
    # only checkpoint_last.dcp's data directory is left of the sharded ones
    assert len([n for n in names if n.startswith(".checkpoint_")]) == 1, names
