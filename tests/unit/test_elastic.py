"""Elastic runs (issue 22): nodes leave and join, the run goes on from the
update in flight, and ends equal to one process of the same global batch.

Two torchrun agents on this machine are two "nodes"; a node dies by SIGKILL
of its agent and its worker (what a machine that dies looks like to the
others), and joins by starting its agent late. Without an agent (file://),
the survivor saves and exits 75, and --resume on another number of ranks
continues. The NCCL dead-peer path is tested with the collective mocked."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import write_mnist
from test_distributed import NO_DROPOUT, params


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable

UPDATES, GLOBAL = 30, 64

_SHARED = {}  # the data and the reference, made once for this module and test_fsdp_elastic (which imports them)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    if "data" not in _SHARED:
        directory = tmp_path_factory.mktemp("mnist_elastic")
        write_mnist(directory, n_train=640, n_test=64)
        _SHARED["data"] = directory
    return _SHARED["data"]


def args(data, save_dir, *extra):
    return ["--task", "mnist", "--data", str(data), "--save-dir", str(save_dir), "--optimizer", "sgd", "--lr", "0.01",
            "--lr-scheduler", "constant", "--max-epoch", "0", "--max-update", str(UPDATES), "--threads", "1",
            "--log-format", "simple", "--log-interval", "1", "--disable-validation", "--no-epoch-checkpoints",
            "--report_to", "none", *NO_DROPOUT, *map(str, extra)]


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The reference: one process, batch 64, no interruption."""
    if "one_process" not in _SHARED:
        out = tmp_path_factory.mktemp("elastic_one")
        done = subprocess.run([PY, "run_hetseq.py", *args(data, out, "--max-sentences", GLOBAL)], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        _SHARED["one_process"] = params(out)
    return _SHARED["one_process"]


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("WORLD_SIZE", None)
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # else a joining node waits forever (elastic.joining_note)
    return e

# torchrun's own main(), entered once every node of the test is ready: the agents' imports (seconds apart on a
# loaded machine) are behind them, so the nodes join the first rendezvous together and a short last call holds
AGENT = """
import os, sys, time
import torch.distributed.run as torchrun
ready, go = sys.argv[1:3]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
sys.argv = ["torchrun", *sys.argv[3:]]
torchrun.main()
"""


class Node:
    """One torchrun agent (a "node") in a session of its own, logging to a
    file. Its agent waits, imported, for ``start`` (every node started
    together); a node started later (``start`` done before) goes at once."""

    def __init__(self, port, log: Path, train_args, hosts_rendezvous=False, nproc=1):
        self.log = log
        self.ready, self.go = log.with_name(log.name + ".ready"), log.parent / "nodes.go"
        # every "node" is on this host: only A may host the rendezvous store (a real cluster's --rdzv-endpoint node)
        cmd = [PY, "-c", AGENT, str(self.ready), str(self.go), "--nnodes", "1:2", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf",
               # torch's defaults: a lost node is dead after 3 missed 5 s heartbeats, then a 30 s last call
               # for more nodes before the survivor restarts alone; shorter here (the same events, ~35 s
               # sooner): the nodes join the first rendezvous together (start), and a node joining a run
               # polls the rendezvous every second
               f"is_host={hosts_rendezvous},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
               "--max-restarts", "3", "--monitor-interval", "0.5",
               "run_hetseq.py", *train_args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def last_update(self) -> int:
        found = re.findall(r"\| update (\d+) \|", self.text())
        return int(found[-1]) if found else 0

    def wait_for_update(self, n, timeout=240):
        deadline = time.monotonic() + timeout
        while self.last_update() < n:
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)

    def wait_for_resume(self, timeout=240):
        """Until this node's worker says it resumed (torchrun restarted it after a lost peer), its agent running."""
        deadline = time.monotonic() + timeout
        while not resumed_updates(self.text()):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.1)

    def die(self):
        """SIGKILL of the agent and its workers at once (torchrun puts each worker in a session of its own)."""
        pids = [self.proc.pid] + children(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def finish(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.die()
            pytest.fail(f"node still running {timeout}s later:\n{self.text()[-3000:]}")


def start(*nodes, timeout=240):
    """Let the agents of ``nodes`` go at once, each imported and waiting."""
    deadline = time.monotonic() + timeout
    for node in nodes:
        while not node.ready.exists():
            assert node.proc.poll() is None and time.monotonic() < deadline, node.text()[-3000:]
            time.sleep(0.01)
    nodes[0].go.touch()


def children(pid) -> list:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def resumed_updates(text) -> list:
    return [int(u) for u in re.findall(r"resumed from \S+: epoch \d+, update (\d+)", text)]


def running(pid) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def test_nccl_dead_peer_is_saved_from_the_start_of_the_update_in_flight(data, tmp_path, monkeypatch):
    """NCCL's watchdog aborts the communicator when a peer dies, and the next
    collective raises DistBackendError in the training thread. Mocked at the
    collective (no GPU here): the survivor saves the last completed update,
    its data position rewound to where the update in flight started."""
    from conftest import _reset_accelerate
    from test_faults import build_trainer
    from textbox_like.core import collectives
    from textbox_like.training import outcome as T
    from textbox_like.training.balance import RankTimer
    trainer, _, _ = build_trainer(args(data, tmp_path / "save", "--max-sentences", 16, "--max-update", 10))
    trainer.world, trainer.feed.data_can_fail = 2, True  # one of two ranks: every update sums a flag over them
    trainer.timing.timer = RankTimer(trainer.grad_params, trainer.accelerator.device, trainer.model)  # as 2 ranks time
    seen = {}

    def sum_over_ranks(numbers, group=None):
        # update 6's data read: its sum of flags (not the log's, after update 5)
        if trainer.state.num_updates == 5 and trainer.in_flight.start["updates"] == 5:
            seen["start"], seen["read_to"] = dict(trainer.in_flight.start), trainer.iterator.offset
            monkeypatch.setenv("WORLD_SIZE", "2")
            raise torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0. Original reason for "
                                                     "failure was: watchdog caught collective operation timeout")
        return list(numbers)
    monkeypatch.setattr(collectives, "host_sum", sum_over_ranks)
    monkeypatch.setattr(collectives, "one_per_rank", lambda value, world, group=None: [value] * world)
    try:
        assert T.run(trainer) == 75
    finally:
        _reset_accelerate()
    assert seen["read_to"] > seen["start"]["offset"]  # the update in flight had read its data
    saved = torch.load(tmp_path / "save" / "checkpoint_1_5.pt", map_location="cpu", weights_only=True)
    assert saved["train"]["num_updates"] == 5 and saved["iterator"]["offset"] == seen["start"]["offset"]
    assert saved["rng"][0] is not None and saved["rng"][1] is None


@pytest.mark.parametrize("restart,handoff,taken", [(1, False, True), (0, True, True), (0, False, False)])
def test_a_dead_workers_lock_on_another_host_is_taken_over_by_the_next_worker_group(tmp_path, monkeypatch, capsys,
                                                                                   restart, handoff, taken):
    """A node that died held the save directory's lock: the next worker group
    of the same torchrun run takes it over at once (not after 10 minutes);
    another run, or the same group, is refused as before."""
    from textbox_like.processes import elastic
    from textbox_like.storage import savelock
    from textbox_like.core.errors import UserError
    holder = {"host": "node-b", "pid": 4242, "started": time.time() - 60, "token": "x", "elastic_run": "job7",
              "elastic_restart": 0}
    (tmp_path / savelock.LOCK_NAME).write_text(json.dumps(holder))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    if handoff:
        elastic.write_handoff(tmp_path, elastic.Agent.from_env(), 15, 64, "lost peer")
    if not taken:
        with pytest.raises(UserError, match="node-b"):
            savelock.SaveDirLock.acquire(tmp_path)
        return
    lock = savelock.SaveDirLock.acquire(tmp_path)
    try:
        assert "took over the lock" in capsys.readouterr().err
        assert json.loads((tmp_path / savelock.LOCK_NAME).read_text())["elastic_restart"] == restart
    finally:
        lock.release()


def test_a_restart_resumes_by_itself_and_keeps_the_first_starts_global_batch(tmp_path, monkeypatch):
    from textbox_like.processes import elastic
    from textbox_like.cli import elastic_restart
    from textbox_like.resolve.resolution import parse
    cfg = parse(["--task", "mnist", "--save-dir", str(tmp_path), "--max-sentences", "32"])
    assert elastic_restart(cfg) is cfg  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not elastic_restart(cfg).checkpoint.resume  # a first start
    elastic.write_handoff(tmp_path, elastic.Agent.from_env(), 10, 96, "membership change or preemption")
    resumed = elastic_restart(cfg)
    assert resumed.checkpoint.resume and resumed.data.global_batch_size == 96
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-run")
    assert not elastic_restart(cfg).checkpoint.resume  # another run's note
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic_restart(cfg).checkpoint.resume  # restarted after a failure
    elastic.clear_handoff(tmp_path)
    assert elastic_restart(cfg).data.global_batch_size is None


def test_torchs_shared_rendezvous_store_is_named_where_a_node_could_not_join():
    from textbox_like.processes import elastic
    agent = elastic.Agent("job7", 0, 3)
    line = elastic.joining_note(agent, {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    assert elastic.joining_note(agent, {"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # opted out
    assert elastic.joining_note(elastic.Agent("job7", 0, 0), {"TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
