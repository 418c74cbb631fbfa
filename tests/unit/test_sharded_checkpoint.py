"""Sharded checkpoints (textbox_like.storage.sharded_checkpoint): two real processes
over gloo shard an MLP and the MNIST network with FSDP2's ``fully_shard``,
train them with Adam and save (tests/sharded_checkpoint_worker.py); the
saves load bitwise in two ranks and go on training bitwise, load in one
process and from one process's save, take a DDP-style full state, survive a
kill -9 in the middle of a save, refuse a damaged shard in one line, and
export the full weights."""
from __future__ import annotations

import importlib.util
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from textbox_like.core.errors import UserError
from textbox_like.storage.sharded_checkpoint import (
    is_sharded_checkpoint,
    load_sharded,
    read_manifest,
    save_sharded,
    sharded_checkpoints_newest_first)


WORKER = Path(__file__).resolve().parents[1] / "sharded_checkpoint_worker.py"  # both tiers use it

spec_ = importlib.util.spec_from_file_location("sharded_checkpoint_worker", WORKER)

worker = importlib.util.module_from_spec(spec_)

spec_.loader.exec_module(worker)


def assert_same(a, b, where="state"):
    """Equal bit for bit: tensors of the same dtype, shape and bytes; the same keys and values elsewhere."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        as_bytes = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
        assert torch.equal(*as_bytes), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def export_in_process(argv, capfd):
    """``python -m textbox_like.tools.export ARGV`` by the main its process runs, in-process."""
    from textbox_like.tools.export import main
    capfd.readouterr()
    code = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def full_state(model, optimizer) -> dict:
    """A process's own (unsharded) model and optimizer as a DDP run's checkpoint holds them."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_not_a_sharded_checkpoint_is_one_line(tmp_path, capfd):
    (tmp_path / "empty.dcp").mkdir()
    with pytest.raises(UserError, match=r"is not a textbox_like sharded checkpoint \(no manifest.json\)"):
        load_sharded(tmp_path / "empty.dcp", *worker.build("mlp", shard=False))
    with pytest.raises(UserError, match="does not exist; check the path"):
        read_manifest(tmp_path / "missing.dcp")
    assert not is_sharded_checkpoint(tmp_path / "empty.dcp")
    (tmp_path / "empty.dcp" / "manifest.json").write_text("{not json")
    out = export_in_process([tmp_path / "empty.dcp", "--to", tmp_path / "x"], capfd)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert f"checkpoint {tmp_path / 'empty.dcp'}: its manifest.json cannot be read" in out.stderr


# ---------------------------------------------------------------- the trainer's manager
def manager_for(save_dir, saves_sharded, *flags):
    """A fresh run's model, Adam, update counter and checkpoint manager of ``save_dir``."""
    model, optimizer = worker.build("mlp", shard=False)
    manager, counter = worker.manager_for(save_dir, model, optimizer, saves_sharded, *flags)
    return model, optimizer, counter, manager


def train_and_save(model, optimizer, counter, manager, first, last):
    for update in range(first, last):
        worker.train("mlp", model, optimizer, update, update + 1, rank=0)
        counter.updates = update + 1
        manager.save(manager.names(1, update + 1, end_of_epoch=False, is_best=False))


def test_manager_saves_prunes_and_resumes_from_the_newest_that_verifies(tmp_path):
    model, optimizer, counter, manager = manager_for(tmp_path, True)
    train_and_save(model, optimizer, counter, manager, 0, 4)
    saved = full_state(model, optimizer)
    # --keep-interval-updates 2: the two newest interval checkpoints and last, each with its own data, nothing else
    assert [p.name for p in sharded_checkpoints_newest_first(tmp_path)] == [
        "checkpoint_last.dcp", "checkpoint_1_4.dcp", "checkpoint_1_3.dcp"]
    # (checkpoint_last's data of the save before stays, linked as .checkpoint_last.dcp.prev, until its next save)
    hidden = sorted(p.name.rsplit(".", 1)[0] if p.is_dir() and not p.is_symlink() else p.name
                    for p in tmp_path.iterdir() if p.name.startswith(".checkpoint"))
    assert hidden == [".checkpoint_1_3.dcp", ".checkpoint_1_4.dcp", ".checkpoint_last.dcp", ".checkpoint_last.dcp",
                      ".checkpoint_last.dcp.prev"], hidden
    assert (tmp_path / ".checkpoint_last.dcp.prev").resolve() != (tmp_path / "checkpoint_last.dcp").resolve()
    # a new run (no --resume) there is refused before anything is written, as for file checkpoints
    from textbox_like.storage.sharded_checkpoint import refuse_rerun
    # the newest named (this stand-in's train part has no num_updates to give)
    with pytest.raises(UserError, match=r"already holds a run \(checkpoint_last\.dcp and 2 other checkpoint\(s\)\)"):
        refuse_rerun(manager.cfg)

    model, optimizer, counter, resumed = manager_for(tmp_path, True, "--resume")
    path = resumed.resume_path()
    assert path == tmp_path / "checkpoint_last.dcp"
    state, path = resumed.load_newest(path, print)
    resumed.check_resumed_config(state, path, {})
    assert resumed.restore(state, path) == [] and counter.updates == 4
    assert_same(full_state(model, optimizer), saved)

    shard = tmp_path / "checkpoint_last.dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 0xFF]))
    model, optimizer, counter, resumed = manager_for(tmp_path, True, "--resume")
    said = []
    state, path = resumed.load_newest(resumed.resume_path(), said.append)
    assert path == tmp_path / "checkpoint_1_4.dcp"
    assert len(said) == 1 and "its file __0_0.distcp fails its digest check" in said[0]
    resumed.restore(state, path)
    assert_same(full_state(model, optimizer), saved)


def test_manager_switches_between_ddp_files_and_sharded_saves(tmp_path):
    """A DDP run's file checkpoints resume into a sharded run (load_full_state),
    whose sharded saves resume into a DDP run again, with the same numbers."""
    model, optimizer, counter, ddp = manager_for(tmp_path, False)
    train_and_save(model, optimizer, counter, ddp, 0, 2)
    assert (tmp_path / "checkpoint_last.pt").is_file() and not sharded_checkpoints_newest_first(tmp_path)
    expected = full_state(model, optimizer)

    model, optimizer, counter, sharded = manager_for(tmp_path, True, "--resume")
    state, path = sharded.load_newest(sharded.resume_path(), print)
    assert path == tmp_path / "checkpoint_last.pt"
    assert sharded.restore(state, path) == [] and counter.updates == 2
    assert_same(full_state(model, optimizer), expected)
    train_and_save(model, optimizer, counter, sharded, 2, 3)
    expected = full_state(model, optimizer)

    model, optimizer, counter, ddp = manager_for(tmp_path, False, "--resume")
    state, path = ddp.load_newest(ddp.resume_path(), print)
    assert path == tmp_path / "checkpoint_last.dcp"  # the newer of the two checkpoint_last
    assert ddp.restore(state, path) == [] and counter.updates == 3
    assert_same(full_state(model, optimizer), expected)

    model, optimizer, counter, reset = manager_for(tmp_path, False, "--resume", "--reset-optimizer")
    state, path = reset.load_newest(reset.resume_path(), print)
    assert reset.restore(state, path) == ["optimizer"] and not optimizer.state
    assert_same(model.state_dict(), expected["model"])


def test_sharded_pruning_counts_an_emergency_file_checkpoint_with_the_interval_checkpoints(tmp_path):
    """What a survivor of a lost peer leaves under --fsdp-sharding none (an
    emergency checkpoint_1_1.pt, alone): the restarted run resumes from it
    and saves sharded; under --keep-interval-updates 2 the file goes once two
    newer interval checkpoints exist, as an older .dcp would, instead of
    staying forever."""
    model, optimizer, counter, ddp = manager_for(tmp_path, False)
    train_and_save(model, optimizer, counter, ddp, 0, 1)
    (tmp_path / "checkpoint_last.pt").unlink()  # the emergency save writes checkpoint_E_U.pt only
    model, optimizer, counter, sharded = manager_for(tmp_path, True, "--resume")
    state, path = sharded.load_newest(sharded.resume_path(), print)
    assert path == tmp_path / "checkpoint_1_1.pt" and sharded.restore(state, path) == [] and counter.updates == 1
    train_and_save(model, optimizer, counter, sharded, 1, 2)
    assert (tmp_path / "checkpoint_1_1.pt").is_file()  # one of the two newest interval checkpoints: kept
    train_and_save(model, optimizer, counter, sharded, 2, 4)
    assert [p.name for p in sharded.candidates()] == ["checkpoint_last.dcp", "checkpoint_1_4.dcp", "checkpoint_1_3.dcp"]
    assert not list(tmp_path.glob("*.pt"))


def test_failed_write_publishes_nothing_and_a_superseded_process_writes_nothing(tmp_path):
    """A save whose shard cannot be written (the file size limit: EFBIG, as a
    full disk gives ENOSPC) is SaveFailed naming the reason, leaves no partial
    directory and the previous checkpoint the newest; a process whose run no
    longer owns the save directory writes nothing at all."""
    import resource

    from textbox_like.storage import savelock
    from textbox_like.core.faults import SaveFailed, Superseded
    model, optimizer = worker.build("mlp", shard=False)
    worker.train("mlp", model, optimizer, 0, 1, rank=0)
    save_sharded(tmp_path, ["checkpoint_1_1.pt", "checkpoint_last.pt"], model, optimizer, {"task": "test"})
    before = sorted(p.name for p in tmp_path.iterdir())

    worker.train("mlp", model, optimizer, 1, 2, rank=0)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with pytest.raises(SaveFailed, match=r"could not write the shards of .*checkpoint_1_2\.dcp \(File too large\)"):
            save_sharded(tmp_path, ["checkpoint_1_2.pt", "checkpoint_last.pt"], model, optimizer, {"task": "test"})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sharded_checkpoints_newest_first(tmp_path)[0].name == "checkpoint_last.dcp"
    load_sharded(tmp_path / "checkpoint_last.dcp", *worker.build("mlp", shard=False))

    lock = savelock.SaveDirLock.acquire(tmp_path)
    try:
        savelock.own(tmp_path, "the token of an older run", holds_lock=False, who="rank 0")
        with pytest.raises(Superseded, match="no longer owns the run"):
            save_sharded(tmp_path, ["checkpoint_1_2.pt", "checkpoint_last.pt"], model, optimizer, {"task": "test"})
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["run.lock"])
    finally:
        savelock.disown()
        lock.release()
