"""Faults as the operating system delivers them (issue 25): a really full
disk, a save directory removed under a run, two runs on one save directory,
two signals a second apart, a signal during start-up, a corrupt HDF5 chunk,
bad files. Real processes, real files and real signals sent at a real moment
(a line in the log, a file appearing); no fault is raised from Python.

The full disk is a small tmpfs (root can mount one here and in CI); where
mounting is refused, RLIMIT_FSIZE with SIGXFSZ ignored makes the kernel
refuse the write instead (EFBIG)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import refusal_in_process, small_mnist_fixture, write_mnist
from test_faults import mnist_args as fault_args
from textbox_like.resolve.resolution import parse


data = small_mnist_fixture("mnist_os_faults", seed=12)


def mnist_args(data, out, *extra, max_update=6):
    """test_faults' command line, without validation."""
    return fault_args(data, out, "--disable-validation", *extra, max_update=max_update)


def error_lines(stderr):
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_torch_writer_full_disk_is_recognised():
    """What torch's zip writer raises on a full disk: an OSError, then a
    RuntimeError while closing; both are a failed write, a plain bug is not."""
    from textbox_like.core.faults import failed_writing, os_reason
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as exc:
        assert failed_writing(exc) and os_reason(exc) == "No space left on device"
    assert not failed_writing(RuntimeError("a bug")) and not failed_writing(ValueError("x"))


def test_lock_of_another_host_refused_while_fresh_taken_over_when_stale(tmp_path, capsys):
    from textbox_like.storage import savelock
    from textbox_like.core.errors import UserError
    lock_file = tmp_path / savelock.LOCK_NAME
    holder = {"host": "other-node-17", "pid": 4242, "started": time.time() - 50, "token": "x"}
    lock_file.write_text(json.dumps(holder))
    with pytest.raises(UserError) as refused:
        savelock.SaveDirLock.acquire(tmp_path)
    assert "other-node-17" in str(refused.value) and "pid 4242" in str(refused.value)
    old = time.time() - 2 * savelock.STALE_AFTER_S
    os.utime(lock_file, (old, old))
    lock = savelock.SaveDirLock.acquire(tmp_path)
    try:
        assert "took over" in capsys.readouterr().err
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
        assert lock.lost() is None
        lock_file.unlink()  # the directory emptied under the run
        assert "removed" in lock.lost()
    finally:
        lock.release()
    # garbage in the lock file: judged by its age alone
    lock_file.write_bytes(b"\xff\x00garbage")
    with pytest.raises(UserError, match="unknown run"):
        savelock.SaveDirLock.acquire(tmp_path)


def test_a_lock_takers_passing_files_are_named_as_temporary_files(tmp_path, monkeypatch):
    """What a taker of the lock writes on its way (its new lock before the link, a stale lock moved aside) is
    a ``.tmp`` file: a taker killed between writing and removing one leaves what a killed save leaves, never
    a name of its own (test_resume_processes' kill -9 at a resume's start found a ``.run.lock.stale.*``)."""
    from textbox_like.storage import savelock
    lock_file = tmp_path / savelock.LOCK_NAME
    lock_file.write_text(json.dumps({"host": "other-node-17", "pid": 4242, "started": 0, "token": "x"}))
    old = time.time() - 2 * savelock.STALE_AFTER_S
    os.utime(lock_file, (old, old))
    passing = []   # the name of each passing file: a link's source (to the lock) or a rename's target (aside)

    def recorded(real):
        def call(src, dst):
            passing.append(Path(src).name if Path(dst).name == savelock.LOCK_NAME else Path(dst).name)
            return real(src, dst)
        return call
    monkeypatch.setattr(os, "link", recorded(os.link))
    monkeypatch.setattr(os, "rename", recorded(os.rename))
    lock = savelock.SaveDirLock.acquire(tmp_path)
    lock.release()
    assert len(set(passing)) == 2 and all(name.startswith(".run.lock.") and name.endswith(".tmp") for name in passing), \
        passing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_signal_while_the_lock_starts_its_refresh_thread_still_releases_it(tmp_path, monkeypatch):
    """SIGTERM lands in take() while its refresh thread is starting (under
    load, 2 in 25 tries of the start-up test): release() removes the file and
    does not fail on the thread that never ran (join() of a thread not started
    raised, and the run left a traceback and exit 1 instead of 75)."""
    from textbox_like.storage import savelock

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    def signalled_start(thread):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, before the thread runs
        time.sleep(5)

    previous = signal.signal(signal.SIGTERM, stop)
    monkeypatch.setattr(threading.Thread, "start", signalled_start)
    lock = savelock.SaveDirLock(tmp_path)
    try:
        with pytest.raises(Stopped):
            lock.take()
    finally:
        signal.signal(signal.SIGTERM, previous)
        monkeypatch.undo()
    assert (tmp_path / savelock.LOCK_NAME).exists() and not lock._thread.is_alive()
    lock.release()
    assert not (tmp_path / savelock.LOCK_NAME).exists()


def test_a_write_into_a_save_directory_taken_over_is_refused_before_it_lands(tmp_path):
    """The fence every write primitive passes: while run.lock holds this
    run's token, writes land; once another run's token is there, or the lock
    is gone, nothing is written or removed in the directory (77; 74 for the
    lock holder, whose lock vanished with the directory's contents), and a
    file elsewhere (data a rank prepares) is not the run's to guard."""
    from textbox_like.storage import savelock
    from textbox_like.core.faults import SaveFailed, Superseded
    from textbox_like.storage.fileio import atomic_write_text, remove
    save = tmp_path / "save"
    save.mkdir()
    lock = savelock.SaveDirLock.acquire(save)
    kept = save / "checkpoint_1_3.pt"
    kept.write_text("the old run's")
    try:
        savelock.own(save, lock.token, holds_lock=False, who="rank 1")
        atomic_write_text(save / "elastic.json", "{}")
        newer = {**json.loads((save / "run.lock").read_text()), "pid": 4242, "token": "newer"}
        (save / "run.lock").write_text(json.dumps(newer))
        with pytest.raises(Superseded, match=r"rank 1 .*no longer owns the run .*another run .*pid 4242"):
            atomic_write_text(kept, "the woken rank's")
        with pytest.raises(Superseded):
            remove(save / "elastic.json")
        with pytest.raises(Superseded):
            remove(tmp_path / "rendezvous")  # the run's file elsewhere: checked too
        atomic_write_text(tmp_path / "data.txt", "prepared")  # not the save directory's
        assert kept.read_text() == "the old run's" and (save / "elastic.json").exists()
        assert sorted(p.name for p in save.iterdir()) == ["checkpoint_1_3.pt", "elastic.json", "run.lock"]
        (save / "run.lock").unlink()
        with pytest.raises(Superseded, match="is gone"):
            atomic_write_text(kept, "the woken rank's")
        savelock.own(save, lock.token, holds_lock=True, who="rank 0")
        with pytest.raises(SaveFailed, match="removed"):
            atomic_write_text(kept, "the woken rank's")
        assert kept.read_text() == "the old run's"
        assert Superseded.exit_code == 77
    finally:
        savelock.disown()
        lock.release()


# ------------------------------------------------------------------ bad files
@pytest.mark.parametrize("content, says", [
    (b"PK\x03\x04\x14\x00binary", "zip archive"),
    (b"lr: 0.1\nname: caf\xe9\n", "not UTF-8 text (byte 0xe9 on line 2)"),
    (b"", "empty"),
    (b"\x00\x01\x02\x03", "binary data"),
])
def test_bad_config_file_is_one_line(data, tmp_path, content, says, capfd):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    proc = refusal_in_process(mnist_args(data, tmp_path / "out", "--config", bad, max_update=2), capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-3000:]
    assert str(bad) in lines[0] and says in lines[0], lines[0]


def test_out_of_memory_while_building_is_one_user_error(monkeypatch):
    """An allocation that really fails (more than any machine has) while the
    trainer is built: a UserError naming the batch size, not a traceback."""
    from textbox_like import cli
    from textbox_like.core.errors import UserError
    from textbox_like.training import outcome as trainer
    from textbox_like.core.faults import allocation_failed

    def build(cfg, callbacks=()):
        return torch.empty(1 << 60, dtype=torch.uint8)
    monkeypatch.setattr(trainer, "Trainer", build)
    cfg = parse(["--task", "mnist", "--data", "x", "--max-sentences", "64", "--max-update", "1"])
    with pytest.raises(UserError, match=r"out of memory while loading the data and building the model "
                                        r"\(DefaultCPUAllocator: can't allocate memory.*lower --max-sentences "
                                        r"\(now 64\)"):
        trainer.build_trainer(cfg)
    with pytest.raises(MemoryError) as numpy_failure:
        import numpy
        numpy.empty(1 << 60, dtype=numpy.uint8)
    assert allocation_failed(numpy_failure.value)
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                  "of 79.19 GiB of which 1.00 GiB is free.")
    assert allocation_failed(cuda)
    assert not allocation_failed(RuntimeError("a bug")) and not allocation_failed(ValueError("memory"))


# ------------------------------------------- files of the wrong kind: checkpoints and data
@pytest.mark.parametrize("content, says", [
    (b"", "is empty (0 bytes), not a checkpoint"),
    (b"lr: 0.1\nmax_update: 4\n", "is a text file (YAML?), first line 'lr: 0.1', not a checkpoint"),
])
def test_restore_file_that_is_empty_or_yaml_is_named(data, tmp_path, content, says, capfd):
    bad = tmp_path / "model.pt"
    bad.write_bytes(content)
    proc = refusal_in_process(mnist_args(data, tmp_path / "out", "--restore-file", bad, max_update=2), capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and str(bad) in errors[0] and says in errors[0], proc.stderr[-3000:]


def test_resume_from_an_empty_checkpoint_last_is_named(data, tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint_last.pt").write_bytes(b"")  # a run killed as the file system filled, say
    proc = refusal_in_process(mnist_args(data, out, "--resume", max_update=2), capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and f"{out / 'checkpoint_last.pt'} is empty (0 bytes)" in errors[0], errors


def test_mnist_file_that_is_empty_is_named(tmp_path, capfd):
    copy = tmp_path / "mnist"
    write_mnist(copy, n_train=32, n_test=8, seed=1)
    images = copy / "train-images-idx3-ubyte.gz"
    images.write_bytes(b"")
    proc = refusal_in_process(mnist_args(copy, tmp_path / "out", max_update=1), capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and f"{images} is empty (0 bytes)" in errors[0], proc.stderr[-3000:]


def test_a_checkpoint_without_loss_scaler_state_leaves_the_scaler_at_its_start():
    """A GPU's --fp16 run continued on a CPU (bf16, no scaler) saves no scaler
    state; back on the GPU its fresh scaler starts from the initial scale
    (tests/integration/test_gpu_processes.py runs the whole round trip on CUDA)."""
    from types import SimpleNamespace
    from textbox_like.training.state import LossScalerPart
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    part = LossScalerPart(SimpleNamespace(scaler=scaler))
    part.load_state_dict(None)
    assert scaler.state_dict()["scale"] == 1024.0
    part.load_state_dict({**scaler.state_dict(), "scale": 8.0})
    assert scaler.state_dict()["scale"] == 8.0
    assert LossScalerPart(SimpleNamespace(scaler=None)).state_dict() is None
