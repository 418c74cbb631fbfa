"""The tests of test_elastic.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring. The faults and the
launchers stay real processes (torchrun agents, ranks killed or stopped by the
OS); the one-process reference, the runs a fault test starts from and the
resumes after a fault train in this process (_runs_runs.in_process), whose
torch is imported already. The ranks of runs started by hand over file://
that are not killed (the survivors of a killed peer, the ranks that resume
from different listings) are two rank processes imported once for the module
(the ``servers`` fixture: _runs_runs.RankServer), each running the runs the
tests send it one after another; a rank that is killed is a process of its
own, killed by the OS."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _runs_runs import RankServer, ServedRank, in_process, ok_in_process, train_in_process
from conftest import free_port
from test_distributed import assert_params_close, params
from test_elastic import (  # noqa: F401 (fixtures)
    GLOBAL, Node, PY, REPO, UPDATES, args, children, data, env, resumed_updates, running, start)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Ranks 0 and 1 of the module's runs by hand whose ranks 0 and 1 are not killed: two rank processes,
    each running, one after another, the runs the tests send it (main() with the run's arguments)."""
    where = tmp_path_factory.mktemp("servers")
    found = [RankServer(where / f"rank{r}.log", env()) for r in (0, 1)]
    yield found
    for server in found:
        server.close()


def by_hand(train, rdzv, rank, world):
    """The arguments of rank ``rank`` of ``world`` started by hand over file://RDZV."""
    return [*train, "--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", str(world),
            "--distributed-rank", str(rank), "--distributed-no-spawn"]


def a_rank(argv, log, **extra_env):
    """A rank of its own: run_hetseq.py in a process, its stderr to ``log`` (a rank that is killed)."""
    return subprocess.Popen([PY, "run_hetseq.py", *map(str, argv)], cwd=REPO, env={**env(), **extra_env},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The reference: one process, batch 64, no interruption; trained in this process (test_elastic's fixture
    starts a process for it)."""
    out = tmp_path_factory.mktemp("elastic_one")
    train_in_process(args(data, out, "--max-sentences", GLOBAL))
    return params(out)


def signal_pending(pid, signum) -> bool:
    """Whether ``signum`` waits to be delivered to process ``pid`` (a stopped
    one receives it when continued): its bit in /proc's pending masks."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$", status, re.M)
    return any(int(mask, 16) >> (signum - 1) & 1 for mask in masks)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_leaves_then_one_joins_and_the_run_equals_one_process(data, tmp_path, one_process):
    save = tmp_path / "save"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30)
    port = free_port()
    nodes = []
    try:
        a = Node(port, tmp_path / "a.log", train, hosts_rendezvous=True)
        nodes.append(a)
        b = Node(port, tmp_path / "b.log", train)
        nodes.append(b)
        start(a, b)
        a.wait_for_update(15)
        k = a.last_update()
        b.die()
        killed = time.monotonic()
        # A notices, saves the last completed update, torchrun restarts it alone: it resumes there
        a.wait_for_resume()
        left_at = resumed_updates(a.text())[0]
        assert left_at in (k, k + 1) or left_at >= k - 1, (k, left_at)  # at most the update in flight is redone
        # then a node joins: A's workers stop by SIGTERM, save, and both resume at world size 2
        a.wait_for_update(left_at + 10)
        assert "lost a peer of this run" in a.text() and "world size 1" in a.text().split("resumed from")[1]
        # A's worker is held (SIGSTOP) until its agent has seen C and asked it to stop: on a loaded machine it could
        # otherwise train to the end alone before C's agent has started, and C find no run to join
        (worker,) = children(a.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        try:
            c = Node(port, tmp_path / "c.log", train)
            nodes.append(c)
            deadline = time.monotonic() + 240
            while not signal_pending(worker, signal.SIGTERM):
                assert a.proc.poll() is None and c.proc.poll() is None, (a.text()[-2000:], c.text()[-2000:])
                assert time.monotonic() < deadline, c.text()[-3000:]
                time.sleep(0.05)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert a.finish(300) == 0, a.text()[-3000:]
        assert c.finish(120) == 0, c.text()[-3000:]
        assert time.monotonic() - killed < 300
        joined = resumed_updates(a.text())
        assert len(joined) == 2 and joined[1] > left_at, a.text()[-3000:]
        assert "world size 2" in a.text().split("resumed from")[-1]
        results = json.loads((save / "results.json").read_text())
        assert results["num_updates"] == UPDATES and results["samples_trained"] == UPDATES * GLOBAL
        assert results["world_size"] == 2
        assert not (save / "elastic.json").exists()  # the run ended: no restart would resume it
        assert_params_close(params(save), one_process)
    finally:  # no agent left running (each is in a session of its own) when an assertion fails
        for node in nodes:
            if node.proc.poll() is None:
                node.die()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_dies_with_its_agent_and_the_survivor_goes_on_from_the_update_in_flight(data, tmp_path,
                                                                                          one_process):
    """A node dies as a machine does: its agent's whole process group is
    killed (SIGKILL). torchrun started the worker in a session of its own, so
    only the kernel's parent-death signal, asked for by the worker itself,
    ends it; the survivor then saves the last completed update and goes on
    alone from the update in flight, ending equal to one process."""
    save = tmp_path / "save"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30)
    port = free_port()
    a = Node(port, tmp_path / "a.log", train, hosts_rendezvous=True)
    b = Node(port, tmp_path / "b.log", train)
    try:
        start(a, b)
        a.wait_for_update(15)
        (worker,) = children(b.proc.pid)
        k = a.last_update()
        os.killpg(b.proc.pid, signal.SIGKILL)  # the agent's group: its worker is not in it
        b.proc.wait()
        deadline = time.monotonic() + 60
        while running(worker):
            assert time.monotonic() < deadline, f"the worker {worker} of the killed agent trains on"
            time.sleep(0.05)
        a.wait_for_resume()   # A's worker lost its peer: torchrun restarts it alone
        assert a.finish(400) == 0, a.text()[-3000:]
    finally:
        for node in (a, b):
            if node.proc.poll() is None:
                node.die()
    text = a.text()
    assert "lost a peer of this run" in text, text[-3000:]
    (left_at,) = resumed_updates(text)
    assert left_at >= k - 1, (k, left_at)  # at most the update in flight is redone
    assert "world size 1" in text.split("resumed from")[1]
    results = json.loads((save / "results.json").read_text())
    assert results["num_updates"] == UPDATES and results["samples_trained"] == UPDATES * GLOBAL
    assert results["world_size"] == 1
    assert_params_close(params(save), one_process)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_without_an_agent_the_survivor_saves_and_resume_on_one_rank_continues(data, tmp_path, one_process, capfd,
                                                                             servers):
    """Two ranks started by hand over a file:// rendezvous; rank 1 killed
    (kill -9) during training. Rank 0 saves the last completed update, stops
    with one line and 75, and removes the rendezvous file, so that a rerun
    does not meet a stale one (also what test_os_faults_processes'
    test_rank_killed_over_a_file_rendezvous_saves_and_removes_the_file held);
    --resume on one rank continues and ends equal to one process."""
    save, rdzv = tmp_path / "save", tmp_path / "rdzv"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30)
    survivor = ServedRank(servers[0], servers[0].begin(by_hand(train, rdzv, 0, 2)))
    peer = a_rank(by_hand(train, rdzv, 1, 2), tmp_path / "r1.log")
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"\| update 1[5-9] \|", survivor.text()):
            assert survivor.poll() is None and time.monotonic() < deadline, survivor.text()[-3000:]
            time.sleep(0.05)
    finally:
        peer.kill()
    assert survivor.wait(timeout=120) == 75
    text = survivor.text()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert "rank 0: lost a peer of this run" in lines[0] and "rerun with --resume" in lines[0]
    saved = int(re.search(r"saved update (\d+)", lines[0]).group(1))
    (emergency,) = save.glob(f"checkpoint_*_{saved}.pt")  # checkpoint_EPOCH_UPDATE.pt
    assert not rdzv.exists()
    done = ok_in_process([*train, "--resume"], capfd)   # a run like any other: in this process
    assert re.search(rf"resumed from {re.escape(str(emergency))}: epoch \d+, update {saved}\n", done.stderr)
    assert_params_close(params(save), one_process)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_lost_after_the_last_update_was_saved_ends_the_run_normally(data, tmp_path, servers):
    """Rank 1 is killed (SIGKILL) once the run's last update is done and
    saved, while rank 0 is in the run's end (results.json written, its
    collectives ahead: TEXTBOX_LIKE_TEST_DELAY=finish holds it there):
    rank 0 exits 0 with one warning line, as a completed run; no emergency
    checkpoint, no hand-off note (torchrun would restart a finished run)."""
    from textbox_like.storage.checkpoint import load_checkpoint
    from textbox_like.core.faults import DELAY_ENV
    save, rdzv = tmp_path / "save", tmp_path / "rdzv"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30,
                 "--max-update", 3)
    ranks = [ServedRank(servers[0], servers[0].begin(by_hand(train, rdzv, 0, 2), {DELAY_ENV: "finish=10"})),
             a_rank(by_hand(train, rdzv, 1, 2), tmp_path / "r1.log")]
    try:
        deadline = time.monotonic() + 240
        while not (save / "results.json").exists():
            assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].text()[-3000:]
            time.sleep(0.05)
    finally:
        ranks[1].kill()
    assert ranks[1].wait(timeout=60) == -signal.SIGKILL
    assert ranks[0].wait(timeout=180) == 0, ranks[0].text()[-3000:]
    text = ranks[0].text()
    warnings = [line for line in text.splitlines() if line.startswith("warning:")]
    assert "Traceback" not in text and not [line for line in text.splitlines() if line.startswith("error:")], \
        text[-3000:]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: rank 0: a peer was lost during the run's end (update 3 finished and saved"), warnings
    assert warnings[0].endswith("; nothing is lost"), warnings
    results = json.loads((save / "results.json").read_text())
    assert results["num_updates"] == 3 and results["stopped"] == "completed"
    assert load_checkpoint(save / "checkpoint_last.pt")["train"]["num_updates"] == 3
    assert not list(save.glob("checkpoint_*_*.pt")) and not (save / "elastic.json").exists(), list(save.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ranks_whose_save_directories_list_different_checkpoints_resume_from_rank_0s_choice(data, tmp_path, servers):
    """--resume picks its checkpoint from a listing of the save directory;
    rank 1's (a save directory per node here; a shared one whose client
    answers from its cache alike) shows a newer checkpoint_1_6.pt that rank
    0's does not: both resume from rank 0's choice, checkpoint_last.pt at
    update 4, each from its own directory, and the run ends normally."""
    import shutil
    first = tmp_path / "first"
    train = ["--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 60]
    train_in_process(args(data, first, *train, "--max-update", 6, "--save-interval-updates", 2))  # in this process
    own = [tmp_path / "rank0", tmp_path / "rank1"]
    for directory in own:
        directory.mkdir()
        shutil.copy2(first / "checkpoint_1_4.pt", directory / "checkpoint_last.pt")
    shutil.copy2(first / "checkpoint_1_6.pt", own[1] / "checkpoint_1_6.pt")
    os.utime(own[1] / "checkpoint_1_6.pt", ns=(time.time_ns() + 10**9,) * 2)  # newer than checkpoint_last.pt
    rdzv = tmp_path / "rdzv"
    ranks = [ServedRank(servers[r], servers[r].begin(by_hand(args(data, own[r], *train, "--max-update", 8,
                                                                  "--resume"), rdzv, r, 2)))
             for r in (0, 1)]
    codes = [rank.wait(timeout=300) for rank in ranks]
    outs = [rank.text() for rank in ranks]
    assert codes == [0, 0], [out[-2000:] for out in outs]
    assert f"resumed from {own[0] / 'checkpoint_last.pt'}: epoch 1, update 4\n" in outs[0], outs[0][-3000:]
    assert "done | updates 8" in outs[0]


def three_ranks_at_update_5(data, tmp_path, servers):
    """Three ranks over file:// (rank 0 holds the run's lock), once rank 0 is
    past update 4: (the ranks, the save directory, the rendezvous file).
    Ranks 0 and 1, the survivors, are the servers' (ServedRank: pid, poll,
    wait, text); rank 2, which the tests kill, is a process of its own."""
    save, rdzv = tmp_path / "save", tmp_path / "rdzv"
    train = args(data, save, "--global-batch-size", GLOBAL, "--max-sentences", 32, "--distributed-timeout", 30)
    ranks = [ServedRank(servers[r], servers[r].begin(by_hand(train, rdzv, r, 3))) for r in (0, 1)]
    ranks.append(a_rank(by_hand(train, rdzv, 2, 3), tmp_path / "r2.log"))
    deadline = time.monotonic() + 300
    try:
        while not re.search(r"\| update (?:[5-9]|1\d) \|", ranks[0].text()):
            assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].text()[-3000:]
            time.sleep(0.05)
    except BaseException:
        for rank in ranks:
            rank.kill()
        raise
    return ranks, save, rdzv


def survivors_lines(ranks, survivors=(0, 1)):
    """Each survivor's one error line (no traceback, nobody refused as no
    longer owning the run), and the update the one writer saved."""
    lines = []
    for r in survivors:
        text = ranks[r].text()
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in text and "no longer owns" not in text, text[-3000:]
        lines.append(errors[0])
    writers = [line for line in lines if re.search(r"saved update \d+ to ", line)]
    assert len(writers) == 1 and sum("another survivor saved update" in line for line in lines) == 1, lines
    return lines, int(re.search(r"saved update (\d+)", writers[0]).group(1))

HOLD_A_CLAIM = """
import sys, time
from pathlib import Path
from textbox_like.processes.elastic import Claim
claim_path, done, seconds = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
with Claim(claim_path, stale_after=2, note="7") as claim:
    assert claim.held
    print("held", flush=True)
    time.sleep(seconds)  # longer than stale_after: a writer waiting for the others' shards
    done.write_text("written")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("holder", ["works", "is killed"])
def test_a_survivor_waits_for_a_live_writer_past_the_claims_staleness_and_not_for_a_dead_one(tmp_path, holder):
    """A real second process holds the claim (stale after 2 s) for 6 s, as a
    writer that waits for the others or writes a large model does: the
    survivor waiting for it returns only once it has written, and is not
    taken over as stale meanwhile. Killed, it leaves a claim that goes stale,
    and the waiter goes on."""
    from textbox_like.processes.elastic import Claim
    claim, done = tmp_path / ".emergency-run.claim", tmp_path / "done"
    writer = subprocess.Popen([PY, "-c", HOLD_A_CLAIM, str(claim), str(done), "6"], cwd=REPO, env=env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "held"
        if holder == "is killed":
            writer.kill()
            writer.wait()
        waiting = Claim(claim, stale_after=2)
        time.sleep(3)  # past the claim's staleness since it was made
        with waiting:
            assert not waiting.held or holder == "is killed"  # a live writer's claim is not taken over
            if not waiting.held:
                waiting.wait_for_writer()
        if holder == "works":
            assert done.read_text() == "written" and writer.wait(timeout=60) == 0
        else:
            assert not done.exists()
    finally:
        writer.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_run_removes_the_claim_and_shard_files_an_earlier_runs_killed_survivors_left(data, tmp_path):
    """Survivors of a lost peer killed mid-way (torchrun kills a worker 30 s
    after its SIGTERM) leave their claim and shard files, named by their
    run's token; the next run in the directory removes them and nothing else."""
    save = tmp_path / "save"
    save.mkdir()
    left = [save / ".emergency-0123456789abcdef.claim", save / ".emergency-0123456789abcdef.update-7.shard-1.rank-3.pt",
            save / "..emergency-0123456789abcdef.update-7.shard-0.rank-0.pt.x1y2.tmp"]
    for path in left:
        path.write_text("left by a killed survivor")
    (save / "notes.txt").write_text("the user's")
    train_in_process([*args(data, save, "--max-sentences", GLOBAL), "--max-update", "2"])  # in this process
    assert not [path for path in left if path.exists()] and (save / "notes.txt").read_text() == "the user's"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_survivors_both_stop_with_75_and_one_of_them_writes(data, tmp_path, servers):
    """Three ranks over file://, rank 2 killed: ranks 0 and 1 both exit 75
    with one line each; one writes the emergency checkpoint, the hand-off
    note and removes the rendezvous file, before the other (rank 0, the lock
    holder, or not) lets go of the run; nobody is refused as no longer
    owning it (77)."""
    ranks, save, rdzv = three_ranks_at_update_5(data, tmp_path, servers)
    ranks[2].kill()
    assert [ranks[r].wait(timeout=180) for r in (0, 1)] == [75, 75], \
        [ranks[r].text()[-2000:] for r in (0, 1)]
    _, saved = survivors_lines(ranks)
    assert list(save.glob(f"checkpoint_*_{saved}.pt")) and (save / "elastic.json").exists()
    assert not rdzv.exists() and not (save / "run.lock").exists() and not list(save.glob(".emergency-*"))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("late", [0, 1])
def test_a_survivor_that_comes_after_the_writer_has_left_writes_nothing(data, tmp_path, late, servers):
    """Survivors see a lost peer at different times (on a loaded machine,
    seconds apart). One survivor is held (SIGSTOP, before the peer dies) until
    the other has saved, written its note and exited 75; continued, it finds
    the writer's hand-off note and exits 75 without writing: not a second
    save of the run (the late one holds the run's lock, rank 0), nor a refusal
    as no longer owning it (rank 1: the writer, rank 0, ended the run)."""
    ranks, save, rdzv = three_ranks_at_update_5(data, tmp_path, servers)
    writer = 1 - late
    try:
        os.kill(ranks[late].pid, signal.SIGSTOP)  # first: it must not see the loss before the writer has left
        ranks[2].kill()
        assert ranks[writer].wait(timeout=180) == 75, ranks[writer].text()[-2000:]
        # checkpoint_last.pt left out: a rank 0 held mid-way through the end of an epoch's save finishes it
        written = {path.name: path.stat().st_mtime_ns for path in save.glob("checkpoint_*_*.pt")}
        note = (save / "elastic.json").read_text()
    finally:
        os.kill(ranks[late].pid, signal.SIGCONT)
    assert ranks[late].wait(timeout=180) == 75, ranks[late].text()[-2000:]
    lines, saved = survivors_lines(ranks)
    assert re.search(rf"saved update {saved} to ", lines[writer]) and \
        f"another survivor saved update {saved}" in lines[late], lines
    # the late survivor wrote nothing: the emergency checkpoint and the note as the writer left them
    assert {path.name: path.stat().st_mtime_ns for path in save.glob("checkpoint_*_*.pt")} == written
    assert (save / "elastic.json").read_text() == note and json.loads(note)["update"] == saved
    assert not rdzv.exists() and not (save / "run.lock").exists() and not list(save.glob(".emergency-*"))

# A peer lost at update 7 of a run of "two" ranks (the process group is not
# needed for the survivor's path: the failing collective is what it sees).
LOSE_A_PEER = """
import os, sys
from textbox_like.core import collectives
from textbox_like.training import balance as B, elastic as E, trainer as T
real_init, real_step = T.Trainer.__init__, T.Trainer.train_step
def init(self, *given, **named):
    real_init(self, *given, **named)
    self.world = 2  # one of two ranks, whose host collectives give its own numbers
    collectives.host_sum = lambda numbers, group=None: list(numbers)
    collectives.one_per_rank = lambda value, world, group=None: [value] * world
    self.timing.timer = B.RankTimer(self.grad_params, self.accelerator.device, self.model)  # timed as 2 ranks are
def step(self, micro_batches, totals):
    if self.state.num_updates == 6:
        os.environ["WORLD_SIZE"] = "2"
        raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1234")
    return real_step(self, micro_batches, totals)
T.Trainer.__init__, T.Trainer.train_step = init, step
"""

KILLED_WHILE_WRITING = """
import signal, torch
def half_then_killed(obj, handle, *a, **k):
    handle.write(b"PK" + bytes(1 << 20)); handle.flush(); os.fsync(handle.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
real_emergency = E.emergency_save
def emergency(trainer):
    torch.save = half_then_killed
    return real_emergency(trainer)
E.emergency_save = emergency
"""


def lose_a_peer(argv, *extra_code):
    script = LOSE_A_PEER + "".join(extra_code) + (
        f"from textbox_like.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))\n")
    return subprocess.run([PY, "-c", script], cwd=REPO, env=env(), capture_output=True, text=True, timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_kill_during_the_emergency_save_leaves_the_previous_checkpoint(data, tmp_path, capfd):
    """The survivor is killed (SIGKILL, delivered by the OS) half-way through
    writing its emergency checkpoint: the previous checkpoint is intact, and
    the run resumes from it."""
    save = tmp_path / "save"
    train = args(data, save, "--max-sentences", 64, "--save-interval-updates", 4, "--max-update", 8)
    done = lose_a_peer(train, KILLED_WHILE_WRITING)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert list(save.glob(".checkpoint_1_6.pt.*.tmp")) and not (save / "checkpoint_1_6.pt").exists()
    from textbox_like.storage.checkpoint import load_checkpoint
    assert load_checkpoint(save / "checkpoint_last.pt")["train"]["num_updates"] == 4
    again = ok_in_process([*train, "--resume"], capfd)   # the resume after the kill: in this process
    assert "epoch 1, update 4" in again.stderr, again.stderr[-3000:]
    assert not list(save.glob(".checkpoint*.tmp"))  # the half-written file is cleaned up


def lose_a_peer_in_process(argv, monkeypatch, capfd):
    """LOSE_A_PEER's run (the same patches, undone after the test) in this process: main()'s exit code and
    output, as lose_a_peer's CompletedProcess."""
    from textbox_like.core import collectives
    from textbox_like.training import balance as B, trainer as T
    real_init, real_step = T.Trainer.__init__, T.Trainer.train_step

    def init(self, *given, **named):
        real_init(self, *given, **named)
        self.world = 2  # one of two ranks, whose host collectives give its own numbers
        monkeypatch.setattr(collectives, "host_sum", lambda numbers, group=None: list(numbers))
        monkeypatch.setattr(collectives, "one_per_rank", lambda value, world, group=None: [value] * world)
        self.timing.timer = B.RankTimer(self.grad_params, self.accelerator.device, self.model)  # timed as 2 ranks are

    def step(self, micro_batches, totals):
        if self.state.num_updates == 6:
            os.environ["WORLD_SIZE"] = "2"   # undone after the test (conftest._restore_environ)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1234")
        return real_step(self, micro_batches, totals)
    monkeypatch.setattr(T.Trainer, "__init__", init)
    monkeypatch.setattr(T.Trainer, "train_step", step)
    return in_process(argv, capfd)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_peer_saves_the_last_completed_update_and_exits_75(data, tmp_path, monkeypatch, capfd):
    """The lost peer is LOSE_A_PEER's mocked collective (nothing of the OS): the run is in this process."""
    save = tmp_path / "save"
    done = lose_a_peer_in_process(args(data, save, "--max-sentences", 64, "--max-update", 8), monkeypatch, capfd)
    assert done.returncode == 75, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "lost a peer of this run at update 7" in lines[0] and "saved update 6" in lines[0]
    saved = torch.load(save / "checkpoint_1_6.pt", map_location="cpu", weights_only=True)
    assert saved["train"]["num_updates"] == 6 and saved["iterator"]["offset"] == 6 * 64
    assert json.loads((save / "elastic.json").read_text())["update"] == 6
    assert not list(save.glob(".emergency-*"))  # the writer's claim is gone once written
