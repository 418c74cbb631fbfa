"""Distributed launching on CPU over loopback (issue 4). Every run is bounded by a timeout.

The launchers (run_hetseq.py's spawn, accelerate launch, torchrun, a node's
launcher of two ranks over file://) start as a user starts them. The runs whose
launcher is not what is tested (nodes started by hand that are refused, that
train with per-node settings or unequal batches, or that choose their threads;
a stale or missing rendezvous) are ranks as such a launcher starts them
(HetSeq's per-node launcher with --distributed-gpus 1 starts one rank, whose
local world is one: --distributed-no-spawn here), and run one after another in
ONE pair of rank processes (_runs_runs.run_plan: the ``pair`` fixture), each
with a rendezvous of its own."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _runs_runs import Ranks, nodes, run_plan, spawned
from conftest import free_port, write_mnist

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_dist")
    write_mnist(directory, n_train=640, n_test=100)
    return directory


def base(data, save_dir, *extra):
    return ["--task", "mnist", "--data", str(data), "--save-dir", str(save_dir), "--optimizer", "sgd",
            "--lr", "0.05", "--lr-scheduler", "constant", "--max-epoch", "0", "--max-update", "20",
            "--log-format", "simple", "--log-interval", "5", "--threads", "1", "--distributed-timeout", "60",
            *extra]


def run(cmd, timeout=300, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def params(save_dir):
    return torch.load(Path(save_dir) / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


def assert_params_close(a, b, rtol=1e-5):
    for key in a:
        x, y = a[key].double(), b[key].double()
        scale = y.abs().max().clamp(min=1e-12)
        assert ((x - y).abs().max() / scale).item() <= rtol, key


NO_DROPOUT = ["--model_conf", "dropout1=0", "--model_conf", "dropout2=0"]


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """The reference both exactness tests compare with: one process, batch 64, 20 updates."""
    from conftest import run_main
    save = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    try:   # in this process: a process's ~3 s of imports saved; --threads 1 undone after it
        assert run_main(base(data, save, "--max-sentences", "64", *NO_DROPOUT)) == 0
    finally:
        torch.set_num_threads(threads)
    return save


@pytest.mark.timeout(400)
def test_distributed_world_size_spawns_and_matches_one_process(data, tmp_path, one):
    two = tmp_path / "two"
    out = run([PY, "run_hetseq.py", *base(data, two, "--max-sentences", "32", "--distributed-world-size", "2",
                                          *NO_DROPOUT)])
    assert "world size 2" in out.stderr
    assert_params_close(params(two), params(one))
    results = json.loads((two / "results.json").read_text())
    assert results["world_size"] == 2 and results["num_updates"] == 20


def by_hand(data, rdzv, save_dirs, extras, world=2, common=()):
    """Two 'nodes' started by hand over file://, one rank each (a node's own launcher is not what these
    tests are about: the rank it would start, --distributed-no-spawn), each with its own save dir and
    extra arguments."""
    argvs = [base(data, save_dirs[r], "--distributed-init-method", f"file://{rdzv}", "--distributed-world-size",
                  str(world), "--distributed-gpus", "1", "--distributed-rank", str(r), "--distributed-no-spawn",
                  *common, *extras[r]) for r in range(len(extras))]
    return nodes(argvs)


REFUSED = {"seed": (["--seed", "1"], ["--seed", "2"]), "bf16": (["--bf16"], []), "no_save": ([], ["--no-save"])}
PER_NODE = (["--max-sentences", "8", "--threads", "2", "--num-workers", "1", "--amp-optimization-level", "O0"],
            ["--device-id", "1", "--cpu", "--log-format", "json", "--distributed-timeout", "50"])


@pytest.fixture(scope="module")
def pair(data, tmp_path_factory):
    """The runs of this module whose launcher is not what they test, in one pair of rank processes, one after
    another, each with a rendezvous file of its own: {name: Ranks (codes, output, seconds, rank by rank)}
    and the folder of their save directories."""
    where = tmp_path_factory.mktemp("pair")
    small = ["--max-sentences", "16", "--max-update", "4"]
    runs = {}
    for name, extras in REFUSED.items():   # nodes that disagree: refused
        saves = [where / name] * 2 if name == "seed" else [where / f"{name}{r}" for r in (0, 1)]
        runs[name] = by_hand(data, where / f"rdzv_{name}", saves, extras, common=small)
    # nodes differing only in per-node settings, each with its own --save-dir (out0, out1)
    runs["per_node"] = by_hand(data, where / "rdzv_per_node", [where / "out0", where / "out1"], PER_NODE,
                               common=small)
    # rank 0 with batch 48, rank 1 with batch 16
    runs["unequal"] = by_hand(data, where / "rdzv_unequal", [where / "het"] * 2,
                              (["--max-sentences", "48"], ["--max-sentences", "16"]), common=NO_DROPOUT)
    # a rendezvous file left by a crashed run an hour ago; the ranks as --distributed-gpus 2 spawns them
    stale = where / "rdzv_stale"
    stale.write_bytes(b"\x00stale store contents from a crashed run")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    runs["stale"] = spawned(base(data, where / "stale", "--max-sentences", "16", "--max-update", "4",
                                 "--distributed-init-method", f"file://{stale}", "--distributed-world-size", "2",
                                 "--distributed-gpus", "2"), 2, stale)
    # two ranks on this machine whose threads are theirs to choose
    one_by_one = by_hand(data, where / "rdzv_one_by_one", [where / "one_by_one"] * 2, ([], []),
                         common=["--max-sentences", "16", "--max-update", "2"])
    for argv in one_by_one.argv.values():
        del argv[argv.index("--threads"):argv.index("--threads") + 2]   # the threads are the run's to choose
    runs["one_by_one"] = one_by_one
    # rank 0 of two, alone: last, so that no other run waits for its timeout
    missing = by_hand(data, where / "rdzv_missing", [where / "missing"], [["--distributed-timeout", "5"]],
                      common=["--max-sentences", "8"])
    runs["missing"] = missing
    run_plan(list(runs.values()), where / "plan", timeout=900)
    return runs, where


@pytest.mark.timeout(900)
def test_unequal_ranks_match_one_process(pair, one):
    """Rank 0 with batch 48 and rank 1 with batch 16, started as two 'nodes'
    with their own --max-sentences, equal 1 x 64 over the same samples."""
    runs, where = pair
    save, unequal = where / "het", runs["unequal"]
    unequal.check(0)
    err_a, err_b = unequal.errs[0], unequal.errs[1]
    assert "batch sizes per rank [48, 16]" in err_a
    assert "task mnist" not in err_b  # only rank 0 prints
    assert_params_close(params(save), params(one))
    # validation over all test samples, split unevenly, equals the single process's
    valid = lambda d: [json.loads(x) for x in open(d / "metrics.jsonl") if '"valid"' in x][-1]
    assert valid(save)["loss"] == pytest.approx(valid(one)["loss"], rel=1e-5)
    assert valid(save)["accuracy"] == valid(one)["accuracy"]


@pytest.mark.timeout(900)
def test_ranks_started_one_by_one_on_one_machine_share_its_cores(pair):
    """Two ranks started by hand with HetSeq's flags, one process each
    (--distributed-gpus 1): each saw a local world of one and took every
    core of the machine (2 threads each on 2 cores). They count the ranks on
    their machine and split its cores, as torchrun's ranks do. (The pair's
    run one_by_one: each node's rank, whose local world is one as its
    launcher's child's was, choosing its threads.)"""
    from textbox_like.processes.distributed import usable_cpus
    run = pair[0]["one_by_one"]
    errs = [run.errs[0], run.errs[1]]
    assert [run.codes[0], run.codes[1]] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    threads = max(1, usable_cpus() // 2)
    start = next(line for line in errs[0].splitlines() if line.startswith("task mnist"))
    assert f"device cpu:0 ({threads} thread{'s' if threads > 1 else ''})" in start, start


@pytest.mark.timeout(400)
def test_two_nodes_file_rendezvous_world_size_3(data, tmp_path):
    rdzv = tmp_path / "rdzv"
    save = tmp_path / "out"
    common = ["--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", "3",
              "--max-sentences", "16", "--max-update", "8"]
    node_a = subprocess.Popen([PY, "run_hetseq.py", *base(data, save, *common, "--distributed-gpus", "2",
                                                          "--distributed-rank", "0")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # nodes never start together
    # node B's one rank as its launcher (--distributed-gpus 1) would start it: node A's launcher, which places
    # two ranks, is the one this test is about
    node_b = subprocess.Popen([PY, "run_hetseq.py", *base(data, save, *common, "--distributed-gpus", "1",
                                                          "--distributed-rank", "2", "--distributed-no-spawn")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err_a = node_a.communicate(timeout=300)
    _, err_b = node_b.communicate(timeout=300)
    assert node_a.returncode == 0 and node_b.returncode == 0, err_a[-3000:] + err_b[-3000:]
    assert "world size 3" in err_a
    # validation metrics are over all 100 test samples of all ranks
    valid = [json.loads(line) for line in open(save / "metrics.jsonl") if '"valid' in line]
    assert valid and 0.0 <= valid[-1]["accuracy"] <= 1.0
    results = json.loads((save / "results.json").read_text())
    assert results["world_size"] == 3


@pytest.mark.timeout(300)
def test_accelerate_launch_multi_gpu_on_cpu_gives_world_size_2(data, tmp_path):
    accelerate = shutil.which("accelerate", path=os.path.dirname(PY))
    assert accelerate, "accelerate's CLI is installed with the package"
    out = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
               "run_hetseq.py", *base(data, tmp_path / "out", "--max-sentences", "16", "--max-update", "6")])
    assert "world size 2" in out.stderr


@pytest.mark.timeout(300)
def test_torchrun_gives_world_size_2(data, tmp_path):
    port = free_port()  # torchrun's --master_port 0 hangs its workers (torch 2.14)
    out = run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "run_hetseq.py", *base(data, tmp_path / "out", "--max-sentences", "16", "--max-update", "6")])
    assert "world size 2" in out.stderr


@pytest.mark.timeout(300)
def test_killing_one_rank_stops_the_others_within_the_timeout(data, tmp_path):
    proc = subprocess.Popen([PY, "run_hetseq.py", *base(data, tmp_path / "out", "--max-sentences", "8",
                                                        "--max-update", "100000", "--max-epoch", "0",
                                                        "--distributed-world-size", "2",
                                                        "--distributed-timeout", "30")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp_path / "log", "w"), text=True)
    deadline = time.monotonic() + 120
    children = []
    while time.monotonic() < deadline and len(children) < 2:
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        children = [int(p) for p in out.stdout.split()]
        time.sleep(0.2)
    assert len(children) == 2
    deadline = time.monotonic() + 240
    while not re.search(r"\| update \d+ \|", (tmp_path / "log").read_text()):  # training is under way
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
        time.sleep(0.1)
    os.kill(children[1], signal.SIGKILL)
    start = time.monotonic()
    proc.communicate(timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    for child in children:  # no orphans left behind
        assert not Path(f"/proc/{child}").exists() or \
            "zombie" in Path(f"/proc/{child}/status").read_text().lower()


@pytest.mark.timeout(900)
def test_missing_node_fails_within_timeout_with_one_line(pair):
    missing = pair[0]["missing"]
    assert missing.codes[0] != 0
    assert missing.seconds[0] < 60
    stderr = missing.errs[0]
    lines = [line for line in stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "2 processes" in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr


@pytest.mark.timeout(900)
def test_stale_rendezvous_file_is_handled(pair):
    runs, where = pair
    assert "stale rendezvous file" in runs["stale"].check(0)
    assert (where / "stale" / "checkpoint_last.pt").is_file()


@pytest.mark.timeout(900)
def test_nodes_with_different_seeds_are_refused(pair):
    """Each node has its own command line; a different --seed would give the
    ranks different sample orders (samples skipped and repeated)."""
    codes, errs, _ = _two_nodes_differing(pair, "seed")
    assert codes == [2, 2], errs
    assert "disagree on --seed" in errs[0] and "Traceback" not in errs[0]


def _two_nodes_differing(pair, name):
    """The pair's run ``name``: two 'nodes' over file:// with one process each; (codes, stderrs, seconds)."""
    run: Ranks = pair[0][name]
    return [run.codes[0], run.codes[1]], [run.errs[0], run.errs[1]], max(run.seconds.values())


def _refused_naming(codes, errs, seconds, setting):
    assert codes == [2, 2], errs
    assert seconds < 60, seconds
    for err in errs:
        lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
        assert len(lines) == 1, err[-3000:]
        assert setting in lines[0], lines[0]
        assert "Traceback" not in err


@pytest.mark.timeout(900)
def test_nodes_with_and_without_bf16_are_refused(pair):
    """Issue 14: one node with --bf16 and one without trained each at its own precision."""
    _refused_naming(*_two_nodes_differing(pair, "bf16"), "precision")


@pytest.mark.timeout(900)
def test_nodes_differing_only_in_no_save_are_refused(pair):
    """Issue 14: a node with --no-save skipped the collectives of saving; the other hung for the timeout."""
    _refused_naming(*_two_nodes_differing(pair, "no_save"), "--no-save")


@pytest.fixture(scope="module")
def nodes_with_per_node_settings(pair):
    """Two 'nodes' differing only in per-node settings, each with its own
    --save-dir (out0, out1): one run (the pair's) for the two tests below."""
    codes, errs, _ = _two_nodes_differing(pair, "per_node")
    return pair[1], codes, errs


@pytest.mark.timeout(900)
def test_per_node_settings_stay_allowed(nodes_with_per_node_settings):
    """Batch size, threads, read-ahead, --device-id, --cpu, the log format, the
    timeout, the save dir and --amp-optimization-level O0 (= float32) may differ."""
    _, codes, errs = nodes_with_per_node_settings
    assert codes == [0, 0], errs


@pytest.mark.timeout(60)
def test_missing_rendezvous_directory_is_one_line(data, tmp_path, capfd):
    from conftest import refusal_in_process   # refused while the ranks are planned, before any starts: in this process
    out = refusal_in_process(base(data, tmp_path / "out", "--max-sentences", "8",
                                  "--distributed-init-method", f"file://{tmp_path}/no/rdzv",
                                  "--distributed-world-size", "2", "--distributed-gpus", "1"), capfd)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.timeout(900)
def test_second_node_creates_no_save_directory(nodes_with_per_node_settings):
    """Only rank 0 writes: rank 1, another 'node' with its own --save-dir,
    leaves no empty directory behind."""
    where, codes, errs = nodes_with_per_node_settings
    assert codes == [0, 0], errs
    assert (where / "out0" / "checkpoint_last.pt").is_file()
    assert not (where / "out1").exists(), list((where / "out1").iterdir())
