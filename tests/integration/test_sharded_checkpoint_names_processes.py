"""The tests of test_sharded_checkpoint_names.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from textbox_like.storage.sharded_checkpoint import (
    consolidated_state,
    pinned_on_every_rank,
    read_extra_state,
    read_full_model_state,
    read_manifest)
from textbox_like.tools.export import main as export_main

from conftest import clean_env
from test_sharded_checkpoint_names import (  # noqa: F401 (fixtures)
    PY, copy_run, data_directories_of, error_lines, four_updates, kept_links, mnist, mnist_args, run_in_process)
from _fsdp_runs import Plan, Run, script


# the tests that start processes (ranks, a killed or held run, a second reader) carry the marker; the rest
# run the trainer in-process: what they test is the names a run leaves, not a process
slow = pytest.mark.slow


def run(cmd, expect=0, **kwargs):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), **kwargs)
    assert out.returncode == expect, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def two_rank_runs(mnist, four_updates, tmp_path_factory):  # noqa: F811
    """The steps of this file's tests that need no process of their own, one after the other in one pair of
    rank processes (_fsdp_runs.Plan): "unshared", two ranks whose --save-dir is the same relative path from
    different working directories (each rank's own, as two nodes without a shared disk); "check",
    CHECK_SCRIPT with the variables torchrun gives its workers; "late", two ranks on a shared file system
    whose client shows a fresh file late: rank 1's --save-dir appears only after its first look (linked to
    rank 0's directory once rank 1 says it looks again); "paths", --resume on two ranks where rank 1's
    process (in a mount namespace of its own, where it can make one) sees the save directory elsewhere.
    Then, at once, one process each, the last step of
    each rank process: "killed" (rank 0), a run held between its save's renames (renamed=3600) in a copy of
    four_updates, killed with SIGKILL once checkpoint_1_4's new data is in place; "taken_over" (rank 1), a
    run held there for 10 s in another copy while the test's newer run takes the directory over (its lock
    and a data directory of its own renamed into place, not linked), which exits 77 by itself.
    (root, {name: its _fsdp_runs.Run}, {"killed"/"taken_over": what their tests need})"""
    root = tmp_path_factory.mktemp("names_two_ranks")
    nodes = [root / "node0", root / "node1"]
    for node in nodes:
        node.mkdir()
    unshared = Run({str(rank): [str(a) for a in rank_args(mnist, "save", rank, root / "rdzv", "--max-update", 4)[2:]]
                    for rank in (0, 1)},
                   # ranks that never see the lock look again for 3 s, not LOCK_LOOKS (30 s): the same refusal
                   {str(rank): {"TEXTBOX_LIKE_TEST_DELAY": "lock_looks=3"} for rank in (0, 1)},
                   cwd={str(rank): node for rank, node in enumerate(nodes)})
    (root / "check.py").write_text(CHECK_SCRIPT)
    shared, late, rdzv = root / "shared" / "save", root / "late", root / "rdzv_late"
    held = {}
    for name in ("killed", "taken_over"):
        save = copy_run(four_updates, root / name / "save")
        held[name] = {"save": save, "before": set(data_directories_of(save)["checkpoint_1_4.dcp"]),
                      "linked": os.readlink(save / "checkpoint_1_4.dcp")}
    to_4 = {name: [str(a) for a in mnist_args(mnist, held[name]["save"], "--max-update", 4, "--restore-file",
                                              "checkpoint_1_2.dcp")[2:]] for name in held}
    runs = {"unshared": unshared, "check": script(root / "check.py", 2, [root / "said"]),
            "late": Run({"0": [str(a) for a in rank_args(mnist, shared, 0, rdzv, "--max-update", 4)[2:]],
                         "1": [str(a) for a in rank_args(mnist, late / "save", 1, rdzv, "--max-update", 4)[2:]]},
                        {"0": {}, "1": {}})}
    # rank 1's process in a mount namespace of its own: it sees paths/shared only at paths/mnt1
    paths, mount1 = root / "paths" / "shared", root / "paths" / "mnt1"
    held["paths"] = {"save": copy_run(four_updates, paths / "save")}
    prefix, held["paths"]["why_not"] = own_mount_namespace(paths, mount1)
    if prefix is not None:
        rdzv = root / "rdzv_paths"
        runs["paths"] = Run({"0": [str(a) for a in rank_args(mnist, paths / "save", 0, rdzv, "--resume",
                                                              "--max-update", 6)[2:]],
                             "1": [str(a) for a in rank_args(mnist, mount1 / "save", 1, rdzv, "--resume",
                                                              "--max-update", 6)[2:]]}, {"0": {}, "1": {}})
    runs["killed"] = Run({"0": to_4["killed"]}, {"0": {"TEXTBOX_LIKE_TEST_DELAY": "renamed=3600"}})
    runs["taken_over"] = Run({"1": to_4["taken_over"]}, {"1": {"TEXTBOX_LIKE_TEST_DELAY": "renamed=10"}})

    def new_data(name):
        return set(data_directories_of(held[name]["save"])["checkpoint_1_4.dcp"]) - held[name]["before"]

    with Plan(list(runs.values()), root / "plan", prefixes={1: prefix} if prefix else None) as plan:
        plan.wait_for(lambda: "looking again" in (plan.output(2, 1) or ""), timeout=600, poll=0.1)
        late.symlink_to(shared.parent)  # the lock shows up on rank 1's node
        waiting = {"killed": 0, "taken_over": 1}   # each held run and its rank
        deadline = time.monotonic() + 600
        while waiting:
            for name, rank in list(waiting.items()):
                if plan.output(list(runs).index(name), rank) is None or not new_data(name):
                    assert plan.procs[rank].poll() is None and time.monotonic() < deadline, plan.text(rank)[-3000:]
                    continue
                del waiting[name]
                if name == "killed":
                    plan.kill(rank)
                    continue
                save = held[name]["save"]   # the newer run takes the directory over
                lock = json.loads((save / "run.lock").read_text())
                (save / ".run.lock.newer").write_text(json.dumps({**lock, "token": "f" * len(lock["token"]),
                                                                  "pid": 1}))
                os.replace(save / ".run.lock.newer", save / "run.lock")  # the newer run's lock
                newer = save / ".checkpoint_1_4.dcp.feedf00d"
                newer.mkdir()
                (newer / ".metadata").write_bytes(b"the newer run's shards")
                held[name]["newer"] = newer
            time.sleep(0.1)
        plan.finish(exits={1: 77})
    return root, runs, held


# ------------------------------------------------------------------ item 10: copies and readers of a name
@slow  # the README's cp -rL, as a user runs it
def test_cp_rL_copies_a_sharded_checkpoint_whole(mnist, four_updates, tmp_path, capfd):
    """The README's copy: the copy is a directory of plain files that verifies
    and exports after the run's own directory is gone."""
    save = copy_run(four_updates, tmp_path / "save")
    expected = consolidated_state(save / "checkpoint_last.dcp")
    subprocess.run(["cp", "-rL", str(save / "checkpoint_last.dcp"), str(tmp_path / "keep.dcp")], check=True)
    shutil.rmtree(save)
    copy = tmp_path / "keep.dcp"
    assert copy.is_dir() and not copy.is_symlink() and not any(p.is_symlink() for p in copy.iterdir())
    copied = consolidated_state(copy)  # every file's digest checked first
    assert copied["train"]["num_updates"] == 4
    assert all(torch.equal(copied["model"][k], expected["model"][k]) for k in expected["model"])
    capfd.readouterr()
    assert export_main([str(copy), "--to", str(tmp_path / "export")]) == 0
    assert "update 4: task mnist" in capfd.readouterr().out and (tmp_path / "export" / "model.safetensors").is_file()

READER = '''
import json, sys, time
from pathlib import Path
from torch.distributed.checkpoint.filesystem import FileSystemReader
from textbox_like.storage.sharded_checkpoint import consolidated_state
name, reading, go, out = map(Path, sys.argv[1:])
read_data = FileSystemReader.read_data

def paused_read_data(self, *args, **kwargs):  # verified and planned: the shards are read next
    reading.write_text("reading")
    while not go.exists():
        time.sleep(0.05)
    return read_data(self, *args, **kwargs)

FileSystemReader.read_data = paused_read_data
state = consolidated_state(name)
out.write_text(json.dumps({"update": state["train"]["num_updates"],
                           "model": {k: v.double().sum().item() for k, v in state["model"].items()}}))
'''


@slow
def test_reader_of_a_name_reads_the_checkpoint_it_began_with_across_a_save(mnist, four_updates, tmp_path):
    """``textbox-like export``/``eval``'s read of checkpoint_last.dcp, a second
    process, has verified the update-4 checkpoint when the training run
    (resumed) saves update 6 under that name and goes on (held in update 7 by
    the slow-rank hook: the run's end drops the replaced data); it goes on
    reading: weights and train state of update 4, whole, not files of the new save."""
    save = copy_run(four_updates, tmp_path / "save")
    expected = read_full_model_state(save / "checkpoint_1_4.dcp")
    (tmp_path / "reader.py").write_text(READER)
    files = [tmp_path / name for name in ("reading", "go", "out.json")]
    reader = subprocess.Popen([PY, str(tmp_path / "reader.py"), str(save / "checkpoint_last.dcp"), *map(str, files)],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    training = None
    try:
        while not files[0].exists():
            assert reader.poll() is None, reader.communicate()[1][-3000:]
            time.sleep(0.05)
        data4 = os.readlink(save / "checkpoint_last.dcp")
        training = subprocess.Popen(mnist_args(mnist, save, "--max-update", 8, "--resume"),
                                    env={**clean_env(), "TEXTBOX_LIKE_SLOW_RANK": "0:1000@7"},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while os.readlink(save / "checkpoint_last.dcp") == data4:  # published: the run goes on to update 7
            assert training.poll() is None, training.communicate()[1][-3000:]
            time.sleep(0.05)
        assert read_extra_state(save / "checkpoint_last.dcp")["train"]["num_updates"] == 6
        files[1].write_text("go")
        _, err = reader.communicate(timeout=300)
        assert training.poll() is None  # still in update 7: not finished
    finally:
        for proc in (reader, training):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert reader.returncode == 0, err[-3000:]
    got = json.loads(files[2].read_text())
    assert got["update"] == 4
    assert got["model"] == {k: v.double().sum().item() for k, v in expected.items()}


# ------------------------------------------------------------------ item 11: a save directory not shared
@slow
def test_fsdp_ranks_that_do_not_share_the_save_directory_stop_at_start(two_rank_runs):
    """Two ranks whose --save-dir is the same relative path from different
    working directories, as two nodes without a shared disk: both stop with
    one line before training, rank 0's lock released, nothing saved
    (two_rank_runs' "unshared")."""
    root, runs, _ = two_rank_runs
    run = runs["unshared"]
    run.check(expect=2)
    errs = [run.errs[rank] for rank in (0, 1)]
    line = (f"error: --fsdp needs a --save-dir that every rank shares (each writes its shards of every checkpoint "
            f"there): rank(s) 1 do not see rank 0's lock file in save; give every node the same directory on a "
            f"shared file system, or pass --no-save")
    for err in errs:
        assert error_lines(err) == [line] and "Traceback" not in err, err[-3000:]
    saved = root / "node0" / "save"
    assert not list(saved.glob("checkpoint*")) and not (saved / "run.lock").exists()
    assert not any("| update" in err for err in errs)  # stopped before the first update


def rank_args(mnist, save_dir, rank, rdzv, *extra):
    """Rank ``rank`` of two, a "node" of one rank, started by itself (no launcher)."""
    return mnist_args(mnist, save_dir, "--distributed-world-size", 2, "--distributed-gpus", 1, "--distributed-rank",
                      rank, "--distributed-init-method", f"file://{rdzv}", "--distributed-timeout", 120,
                      "--distributed-no-spawn", *extra)


@slow
def test_fsdp_rank_that_sees_rank_0s_lock_late_goes_on(two_rank_runs):
    """A shared file system whose client shows a fresh file late (NFS's
    lookup cache): rank 1's --save-dir appears only after its first look
    (two_rank_runs links it to rank 0's directory once rank 1 says it looks
    again: its "late"); both ranks train and save, each its own shards."""
    root, runs, _ = two_rank_runs
    shared, late, run = root / "shared" / "save", root / "late", runs["late"]
    run.check()
    assert [line for line in run.errs[1].splitlines() if line.startswith("warning: rank 1")] == [
        f"warning: rank 1 does not see rank 0's lock file in {late / 'save'} (yet?); looking again for up to 30 s, "
        f"as a shared file system may show a new file late"]
    last = shared / "checkpoint_last.dcp"
    assert read_extra_state(last)["train"]["num_updates"] == 4
    assert read_manifest(last)["world_size"] == 2 and (last / "__1_0.distcp").is_file()


def own_mount_namespace(real, seen_as):
    """(the command prefix of a process that sees the directory ``real`` only
    at ``seen_as`` (a node that mounts the shared file system elsewhere):
    ``real`` bind-mounted there in a mount namespace of its own, an empty
    tmpfs over ``real`` itself, or None; why not, where None)."""
    if shutil.which("unshare") is None:
        return None, "needs unshare(1) (util-linux) to give a rank a mount namespace of its own"
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]  # the latter: user namespaces
    seen_as.mkdir(parents=True)
    # a machine or container without user namespaces (or without the right to
    # mount in one) cannot run this test: a skip that says so, not a failure
    probe = subprocess.run([*unshare, "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0"', str(seen_as)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, (f"needs a mount namespace (root, or user namespaces): {' '.join(unshare)} failed: "
                      f"{probe.stderr.strip()}")
    script = 'mount --bind "$0" "$1" && mount -t tmpfs -o size=1m tmpfs "$0" && shift && exec "$@"'
    return [*unshare, "sh", "-c", script, str(real), str(seen_as)], None


@slow
def test_fsdp_ranks_reaching_the_save_directory_through_different_paths_resume_and_save(two_rank_runs):
    """Rank 1's node mounts the shared file system elsewhere: rank 0's path
    of the save directory (and of the data directory checkpoint_last.dcp
    points to) does not exist there (two_rank_runs' rank 1 process runs in a
    mount namespace of its own). --resume on two ranks (its "paths") reads the
    update-4 checkpoint on both and saves updates 6 with both ranks' shards."""
    root, runs, held = two_rank_runs
    if "paths" not in runs:
        pytest.skip(held["paths"]["why_not"])
    save, run = held["paths"]["save"], runs["paths"]
    run.check()
    assert f"resumed from {save / 'checkpoint_last.dcp'}: epoch 1, update 4" in run.errs[0]
    for name in ("checkpoint_1_6.dcp", "checkpoint_last.dcp"):
        assert read_extra_state(save / name)["train"]["num_updates"] == 6
        assert read_manifest(save / name)["world_size"] == 2 and (save / name / "__1_0.distcp").is_file()


@slow
def test_pinned_data_directory_is_named_beside_the_link_or_is_the_path_itself(four_updates, tmp_path):
    """What crosses to the other ranks is a name beside the path each rank
    gives: a published name's data directory, a copy itself, and the
    directory a link of the user's to elsewhere points to when rank 0 looks,
    reached through each rank's own path."""
    save = copy_run(four_updates, tmp_path / "save")
    alias = tmp_path / "alias"
    alias.symlink_to(save)  # another path to the same directory
    name = os.readlink(save / "checkpoint_last.dcp")
    assert pinned_on_every_rank(alias / "checkpoint_last.dcp") == alias / name
    copy = tmp_path / "copy.dcp"
    subprocess.run(["cp", "-rL", str(save / "checkpoint_last.dcp"), str(copy)], check=True)
    assert pinned_on_every_rank(copy) == copy
    (save / "elsewhere.dcp").symlink_to(copy)
    read = pinned_on_every_rank(alias / "elsewhere.dcp")
    assert read.resolve() == copy.resolve() and str(read).startswith(f"{alias}{os.sep}")
    # the link repointed after rank 0 pinned it (another run saving its published name anew):
    # the path every rank reads is still the pinned checkpoint
    later = tmp_path / "later.dcp"
    later.mkdir()
    (save / "elsewhere.dcp").unlink()
    (save / "elsewhere.dcp").symlink_to(later)
    assert read.resolve() == copy.resolve()


# ------------------------------------------------------------------ kept data directories
@slow
def test_kill_between_a_saves_renames_leaves_nothing_after_the_next_start(mnist, four_updates, two_rank_runs,
                                                                          capfd):
    """A finished run keeps one data directory per name and no kept link. A
    run killed (SIGKILL) between its save's renames, after checkpoint_1_4's
    new data is in place and before the name points to it (two_rank_runs'
    "killed"): the name keeps its update-4 checkpoint, and the next start
    removes the new data (no link points to it) although checkpoint_1_4.dcp
    is never saved again."""
    assert kept_links(four_updates) == []
    assert {name: len(dirs) for name, dirs in data_directories_of(four_updates).items()} == {
        "checkpoint_1_2.dcp": 1, "checkpoint_1_4.dcp": 1, "checkpoint_last.dcp": 1}
    root, runs, held = two_rank_runs
    save, before = held["killed"]["save"], held["killed"]["before"]
    assert runs["killed"].codes == {0: -signal.SIGKILL}, runs["killed"].stderr[-3000:]
    orphan, = set(data_directories_of(save)["checkpoint_1_4.dcp"]) - before
    assert [save / os.readlink(save / "checkpoint_1_4.dcp")] == sorted(before)
    assert read_extra_state(save / "checkpoint_1_4.dcp")["train"]["num_updates"] == 4

    # the next start, in this process: at update 4 already, no save
    out = run_in_process(mnist_args(mnist, save, "--resume", "--max-update", 4), capfd)
    assert f"resumed from {save / 'checkpoint_last.dcp'}: epoch 1, update 4" in out.stderr
    assert not orphan.exists()
    assert not list(save.glob(".checkpoint*.partial")) and not list(save.glob(".checkpoint*.link"))
    assert data_directories_of(save)["checkpoint_1_4.dcp"] == sorted(before)
    assert read_extra_state(save / "checkpoint_1_4.dcp")["train"]["num_updates"] == 4


@slow
def test_a_run_taken_over_between_a_saves_renames_removes_nothing_of_the_new_owner(two_rank_runs):
    """A run held between its save's renames (TEXTBOX_LIKE_TEST_DELAY=renamed)
    while a newer run takes the directory over (run.lock now holds another
    token) and renames its own data directory of checkpoint_1_4.dcp into
    place, not linked yet (two_rank_runs' "taken_over"): the old run wakes
    and exits 77 without removing that directory, and without repointing the name."""
    root, runs, held = two_rank_runs
    save, linked, newer = held["taken_over"]["save"], held["taken_over"]["linked"], held["taken_over"]["newer"]
    stderr = runs["taken_over"].errs[1]
    assert runs["taken_over"].codes == {1: 77}, stderr[-3000:]
    assert "no longer owns the run" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert (newer / ".metadata").read_bytes() == b"the newer run's shards"
    assert os.readlink(save / "checkpoint_1_4.dcp") == linked

# ------------------------------------------------------------------ item 16: the check before a save
CHECK_SCRIPT = '''
import json, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from textbox_like.training.checkpointer import weights_finite
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
said = {}
for case in ("finite", "nan in rank 1's shard"):
    if case != "finite" and rank == 1:
        with torch.no_grad():
            model[2].weight.to_local()[0, 0] = float("nan")
    with CommDebugMode() as comm:
        said[case] = [weights_finite(list(model.parameters()), 2), comm.get_total_counts()]
open(sys.argv[1] + str(rank), "w").write(json.dumps(said))
dist.destroy_process_group()
'''


@slow
def test_non_finite_check_before_a_save_is_one_collective_and_gathers_no_weight(two_rank_runs):
    """Two FSDP ranks: every rank learns that one rank's shard holds a NaN,
    through one collective (no all-gather of a weight per parameter)
    (two_rank_runs' "check")."""
    root, runs, _ = two_rank_runs
    runs["check"].check()
    for rank in (0, 1):
        said = json.loads((root / f"said{rank}").read_text())
        assert said == {"finite": [True, 1], "nan in rank 1's shard": [False, 1]}, (rank, said)
