"""The tests of test_resume.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring. The faults are real
processes killed by the OS (SIGKILL, SIGTERM); the uninterrupted references
they are compared with and the resumes after them are runs like any other:
they train in this process (_runs_runs.in_process), whose torch is imported
already. The runs of two ranks that are not a fault (a reference, the resumes)
are the ranks as run_hetseq.py --distributed-world-size 2 starts them, one run
after another in ONE pair of rank processes (the ``two_rank_runs`` fixture)."""
from __future__ import annotations

import json
import re
import signal

import pytest

from _runs_runs import argv_of, in_process, ok_in_process, run_plan, spawned, train_in_process
from conftest import assert_bitwise_equal
from test_resume import command, compare_final, data, kill_after_checkpoint, load  # noqa: F401 (fixtures)


def args(data, save_dir, *extra):
    """test_resume.command's trainer arguments, for a run in this process."""
    return argv_of(command(data, save_dir, *extra))


def resumed_update(stderr):
    """The update the resume line names (it comes before training's lines): the newest save the kill left.
    A kill between a save's first name and its copy to checkpoint_last.pt leaves an earlier name of that
    save the newest (checkpoint_1_15.pt, checkpoint_best.pt, an epoch's checkpoint1.pt)."""
    resumed = re.search(r"resumed from \S*checkpoint\w*\.pt: epoch \d+, update (\d+)\b", stderr)
    assert resumed, stderr[:3000]
    return int(resumed.group(1))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """Uninterrupted runs, by --update-freq, each trained once for the module, in this process."""
    refs = {}

    def get(update_freq, *extra):
        key = (update_freq, extra)
        if key not in refs:
            out = tmp_path_factory.mktemp(f"ref{update_freq}")
            train_in_process(args(data, out, "--update-freq", str(update_freq), *extra))
            refs[key] = load(out / "checkpoint_last.pt")
        return refs[key]
    return get


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("update_freq", [1, 3])
def test_sigkill_then_resume_is_bitwise_identical(data, tmp_path, reference, update_freq, capfd):
    """Also (formerly test_metrics_jsonl_has_no_repeated_updates_after_kill_and_resume): metrics.jsonl of
    the killed run and its resume holds every update once."""
    # dropout stays on (the MNIST CNN's defaults): the RNG state must be restored too
    save_dir = tmp_path / "run"
    cmd = command(data, save_dir, "--update-freq", str(update_freq), "--log-interval", "1")
    code, err = kill_after_checkpoint(cmd, save_dir, signal.SIGKILL, seed=update_freq)
    assert code == -signal.SIGKILL, f"the run was not killed (exit {code}): {err[-1000:]}"
    out = ok_in_process(argv_of(cmd) + ["--log-format", "simple", "--resume"], capfd)
    assert 5 <= resumed_update(out.stderr) < 60
    compare_final(load(save_dir / "checkpoint_last.pt"), reference(update_freq))
    updates = [json.loads(x)["update"] for x in open(save_dir / "metrics.jsonl") if '"kind": "train"' in x]
    assert updates == list(range(1, 61))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_run_killed_and_resumed_equals_the_uninterrupted_compiled_run(data, tmp_path, reference, capfd):
    # --compile (issue 12): the checkpoint holds the uncompiled module's keys and
    # the resumed run compiles again; dropout on, in eager and compiled code
    save_dir = tmp_path / "run"
    cmd = command(data, save_dir, "--compile")
    code, err = kill_after_checkpoint(cmd, save_dir, signal.SIGKILL, seed=5)
    assert code == -signal.SIGKILL, f"the run was not killed (exit {code}): {err[-1000:]}"
    out = ok_in_process(argv_of(cmd) + ["--log-format", "simple", "--resume"], capfd)
    assert 5 <= resumed_update(out.stderr) < 60, out.stderr[:3000]
    assert "compiled: the first update took" in out.stderr
    compare_final(load(save_dir / "checkpoint_last.pt"), reference(1, "--compile"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_exits_75_and_resume_is_identical(data, tmp_path, reference, capfd):
    save_dir = tmp_path / "run"
    cmd = command(data, save_dir)
    code, err = kill_after_checkpoint(cmd, save_dir, signal.SIGTERM, seed=7)
    assert code == 75, err[-2000:]
    assert "--resume" in err
    state = load(save_dir / "checkpoint_last.pt")
    assert 5 <= state["train"]["num_updates"] < 60
    ok_in_process(argv_of(cmd) + ["--resume"], capfd)
    compare_final(load(save_dir / "checkpoint_last.pt"), reference(1))


TWO = ["--distributed-world-size", "2", "--max-sentences", "8"]


@pytest.fixture(scope="module")
def two_rank_runs(data, tmp_path_factory):
    """The module's runs of two ranks. First the fault: a run of two processes (its launcher and two ranks)
    killed at once (kill -9 of the process group), and the first, one-process part of the run resumed at
    another world size (in this process). Then, one after another in one pair of rank processes, the two-rank
    runs that are no fault: the uninterrupted reference of the killed run, its resume, and the resume at world
    size 2. {name: what the tests assert}."""
    where = tmp_path_factory.mktemp("two_ranks")
    found = {"killed": where / "run", "ref": where / "ref", "other": where / "other"}
    cmd = command(data, found["killed"], *TWO)
    # kill -9 every process of the run (its launcher and ranks) at once: no rank gets to save
    found["kill"] = kill_after_checkpoint(cmd, found["killed"], signal.SIGKILL, seed=3, group=True)
    found["killed_at"] = load(found["killed"] / "checkpoint_last.pt")["train"]["num_updates"]
    # 1 process x 16 for 10 updates
    train_in_process(args(data, found["other"], "--max-update", "10"))
    found["first"] = load(found["other"] / "checkpoint_last.pt")
    found["runs"] = run_plan([spawned(args(data, found["ref"], *TWO), 2, where / "rdzv_ref"),
                              spawned(argv_of(cmd) + ["--resume"], 2, where / "rdzv_resume"),
                              spawned(args(data, found["other"], "--max-update", "20", "--resume", *TWO), 2,
                                      where / "rdzv_other")], where / "plan", timeout=900)
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_sigkill_then_resume_is_identical(two_rank_runs):
    code, err = two_rank_runs["kill"]
    assert code == -signal.SIGKILL, err[-1000:]
    killed_at = two_rank_runs["killed_at"]
    assert killed_at % 5 == 0 and killed_at < 60  # an interval checkpoint, not a save on the way out
    ref_run, resume_run, _ = two_rank_runs["runs"]
    ref_run.check(0)
    resume_run.check(0)
    final = load(two_rank_runs["killed"] / "checkpoint_last.pt")
    ref = load(two_rank_runs["ref"] / "checkpoint_last.pt")
    assert len(final["rng"]) == 2
    compare_final(final, ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_while_saving_never_leaves_last_checkpoint_unloadable(data, tmp_path):
    save_dir = tmp_path / "run"
    # a checkpoint at every update: most of the run is spent writing them
    cmd = command(data, save_dir, "--save-interval-updates", "1")
    for attempt in range(4):
        code, _ = kill_after_checkpoint(cmd + (["--resume"] if attempt else []), save_dir, signal.SIGKILL,
                                        min_checkpoint="checkpoint_last.pt", seed=attempt)
        state = load(save_dir / "checkpoint_last.pt")  # must always load
        assert state["format"].startswith("textbox_like")
    leftovers = [p for p in save_dir.iterdir() if p.name.startswith(".")]
    # temporary files of a killed writer may remain, but never under a checkpoint name
    assert all(p.name.endswith((".tmp", ".lnk")) for p in leftovers)


@pytest.mark.slow
def test_truncated_or_foreign_checkpoint_gives_one_clear_error(data, tmp_path, capfd):
    import torch

    from textbox_like.storage import checkpoint as ck
    from textbox_like.core.errors import UserError
    good = tmp_path / "good.pt"
    ck.atomic_save({"format": ck.FORMAT, "x": torch.ones(1000)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:500])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    for path in (truncated, foreign):
        with pytest.raises(UserError, match=path.name):
            ck.load_checkpoint(path)
    # and from the command line's main(): one line, exit 2
    out = in_process(args(data, tmp_path / "out", "--restore-file", str(truncated)), capfd)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "truncated.pt" in lines[0], out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keep_interval_updates_keeps_the_two_newest(data, tmp_path):
    save_dir = tmp_path / "run"
    train_in_process(args(data, save_dir, "--max-update", "30", "--keep-interval-updates", "2"))
    names = [p.name for p in save_dir.glob("checkpoint_*_*.pt")]
    updates = sorted(int(n.split("_")[2][:-3]) for n in names)
    assert updates == [25, 30]


SCHEDULE = ["--lr-scheduler", "polynomial_decay", "--total-num-update", "100", "--warmup-updates", "4"]


@pytest.fixture(scope="module")
def ten_scheduled_updates(data, tmp_path_factory):
    """A finished run of 10 updates under a warm-up and linear decay: the two tests below start from it (a
    copy to resume in, its checkpoint to restore)."""
    save_dir = tmp_path_factory.mktemp("scheduled") / "a"
    train_in_process(args(data, save_dir, "--max-update", "10", *SCHEDULE))
    return save_dir


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_raising_max_update_continues(data, tmp_path, ten_scheduled_updates):
    import shutil
    save_dir = tmp_path / "run"
    shutil.copytree(ten_scheduled_updates, save_dir)
    first = load(save_dir / "checkpoint_last.pt")
    assert first["train"]["num_updates"] == 10
    train_in_process(args(data, save_dir, "--max-update", "20", "--resume", *SCHEDULE))
    second = load(save_dir / "checkpoint_last.pt")
    assert second["train"]["num_updates"] == 20
    assert second["scheduler"]["num_updates"] == 20
    # the LR at update 20 of a 100-update linear decay after 4 warm-up updates
    assert second["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.001 * (1 - 16 / 96))
    # and it equals the uninterrupted 20-update run
    ref_dir = tmp_path / "ref"
    train_in_process(args(data, ref_dir, "--max-update", "20", *SCHEDULE))
    assert_bitwise_equal(second["model"], load(ref_dir / "checkpoint_last.pt")["model"], "model")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reset_lr_scheduler_starts_the_schedule_at_the_restored_update(data, tmp_path, ten_scheduled_updates,
                                                                       capfd):
    logged = ["--log-format", "json", "--log-interval", "1"]
    out = ok_in_process(args(data, tmp_path / "b", "--max-update", "12", "--restore-file",
                             str(ten_scheduled_updates / "checkpoint_last.pt"), "--reset-lr-scheduler", *SCHEDULE,
                             *logged), capfd)
    lrs = [json.loads(x)["lr"] for x in out.stderr.splitlines() if x.startswith("{") and '"train"' in x]
    # update 11 trained with the LR of update 10 -> logged after the step as lr_at(11)
    assert lrs[0] == pytest.approx(0.001 * (1 - (11 - 4) / 96))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_with_another_world_size_and_batch_continues_the_epoch(two_rank_runs):
    """1 process x 16 for 10 updates, then 2 processes x 8: the rest of the
    epoch is re-planned from the same offset, nothing skipped or repeated.
    (The two_rank_runs fixture trains both parts.)"""
    first = two_rank_runs["first"]
    assert (first["iterator"]["epoch"], first["iterator"]["offset"]) == (1, 160)
    two_rank_runs["runs"][2].check(0)
    second = load(two_rank_runs["other"] / "checkpoint_last.pt")
    assert second["train"]["num_updates"] == 20 and second["world_size"] == 2
    # 10 more updates of 2 x 8 samples: 160 + 160 samples into the 384-sample epoch
    assert (second["iterator"]["epoch"], second["iterator"]["offset"]) == (1, 320)
    assert len(second["rng"]) == 2
