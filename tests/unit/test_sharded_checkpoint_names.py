"""The names of sharded (--fsdp, ``.dcp``) checkpoints in a save directory
(review of issue 32): --restore-file of the run's own ``.dcp`` continues the
run; a new run there is refused naming the newest checkpoint and its update;
a name's replaced data stays until its next save, so a reader (export, eval)
that began before a save reads the checkpoint it began with, whole; ``cp -rL``
copies a checkpoint whole (README); a --fsdp run whose ranks do not share the
save directory stops at start in one line, and one that sees rank 0's lock
late (a shared file system's cache) goes on; two ranks that reach the save
directory through different paths (another mount point) resume and save; the
non-finite check before a save gathers no weights; what a kill between a
save's renames leaves goes at the next start, a finished run keeps one copy
of each checkpoint, and the data a user's ``mv`` or ``ln -s`` of a ``.dcp``
points to stays. Real processes: the trainer, two ranks over gloo, a rank in
a mount namespace of its own."""
from __future__ import annotations

import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest

from textbox_like.storage.sharded_checkpoint import read_extra_state

from conftest import refusal_in_process, run_main, write_mnist


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable


def mnist_args(data, save_dir, *extra):
    """One process, --fsdp (nothing to shard, saved sharded all the same), a save every 2 updates."""
    return [PY, str(REPO / "run_hetseq.py"), "--task", "mnist", "--data", str(data), "--save-dir", str(save_dir),
            "--optimizer", "sgd", "--lr", "0.05", "--lr-scheduler", "constant", "--max-epoch", "0",
            "--max-sentences", "16", "--save-interval-updates", "2", "--log-format", "simple", "--log-interval", "1",
            "--threads", "1", "--disable-validation", "--fsdp", *map(str, extra)]


def run_in_process(cmd, capfd, expect=0):
    """mnist_args' command run by the trainer's main in this process."""
    out = refusal_in_process(cmd[2:], capfd)
    assert out.returncode == expect, out.stderr[-4000:]
    return out


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_names")
    write_mnist(directory, n_train=256, n_test=32)
    return directory


@pytest.fixture(scope="module")
def four_updates(mnist, tmp_path_factory):
    """A --fsdp run to update 4: checkpoint_1_2.dcp, checkpoint_1_4.dcp, checkpoint_last.dcp."""
    save = tmp_path_factory.mktemp("four") / "save"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert run_main(mnist_args(mnist, save, "--max-update", 4)[2:]) == 0
    # one process saving sharded is what it asked for: DCP's "torch.distributed is disabled" is not printed
    assert not [w for w in said if "torch.distributed is disabled" in str(w.message)]
    assert sorted(p.name for p in save.glob("checkpoint*")) == [
        "checkpoint_1_2.dcp", "checkpoint_1_4.dcp", "checkpoint_last.dcp"]
    return save


def data_directories_of(save):
    """{name: [its data directories]} of a save directory's sharded names
    (``.checkpoint_last.dcp.3f9a2c1e`` under ``checkpoint_last.dcp``)."""
    found = {}
    for path in save.iterdir():
        match = re.fullmatch(r"\.(.+\.dcp)\.[0-9a-f]{8}", path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.setdefault(match.group(1), []).append(path)
    return found


def kept_links(save):
    return sorted(p.name for p in save.iterdir() if p.name.endswith(".prev"))


def copy_run(save, target):
    """The save directory as it is, its names' relative links kept."""
    shutil.copytree(save, target, symlinks=True)
    return target


# ------------------------------------------------------------------ item 9: the run a directory holds
def test_new_run_in_a_sharded_runs_directory_names_its_newest_checkpoint(mnist, four_updates, capfd):
    out = run_in_process(mnist_args(mnist, four_updates, "--max-update", 6), capfd, expect=2)
    assert error_lines(out.stderr) == [
        f"error: --save-dir {four_updates} already holds a run (checkpoint_last.dcp at update 4 and 2 other "
        f"checkpoint(s)); continue it with --resume, or start a new run in another --save-dir"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------ item 8: --restore-file of its own .dcp
def test_restore_file_of_the_runs_own_sharded_checkpoint_goes_on_from_it(mnist, four_updates, tmp_path, capfd):
    """fairseq's way to go on from an earlier point of the same run, as with a .pt."""
    save = copy_run(four_updates, tmp_path / "save")
    out = run_in_process(mnist_args(mnist, save, "--max-update", 6, "--restore-file", "checkpoint_1_2.dcp"), capfd)
    assert f"resumed from {save / 'checkpoint_1_2.dcp'}: epoch 1, update 2" in out.stderr
    assert read_extra_state(save / "checkpoint_last.dcp")["train"]["num_updates"] == 6
    assert read_extra_state(save / "checkpoint_1_6.dcp")["train"]["num_updates"] == 6


def test_users_mv_and_ln_of_a_sharded_checkpoint_survive_the_next_start_and_saves(mnist, four_updates, tmp_path,
                                                                                   capfd):
    """``mv checkpoint_1_2.dcp keep2.dcp`` and ``ln -s`` of checkpoint_last's
    data directory as ``at4.dcp``: after --resume to update 8 (a start, saves
    of checkpoint_last at 6 and 8, the run's end) both still hold their
    checkpoints whole; the run's own kept copies are gone."""
    save = copy_run(four_updates, tmp_path / "save")
    os.rename(save / "checkpoint_1_2.dcp", save / "keep2.dcp")  # mv: the link itself moves
    data4 = os.readlink(save / "checkpoint_last.dcp")
    os.symlink(data4, save / "at4.dcp")  # ln -s
    out = run_in_process(mnist_args(mnist, save, "--resume", "--max-update", 8), capfd)
    assert f"resumed from {save / 'checkpoint_last.dcp'}: epoch 1, update 4" in out.stderr
    assert read_extra_state(save / "keep2.dcp")["train"]["num_updates"] == 2  # every file's digest checked
    assert read_extra_state(save / "at4.dcp")["train"]["num_updates"] == 4
    assert read_extra_state(save / "checkpoint_last.dcp")["train"]["num_updates"] == 8
    assert kept_links(save) == []
    # checkpoint_last's data at 6 went with the run's end; at 4 stays for at4.dcp
    assert sorted(p.name for p in data_directories_of(save)["checkpoint_last.dcp"]) == sorted(
        [data4, os.readlink(save / "checkpoint_last.dcp")])
