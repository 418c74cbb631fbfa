"""The tests of test_balance.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from textbox_like.training import balance
from textbox_like.training.balance import even_split, split_name
from textbox_like.storage.checkpoint import load_checkpoint

from conftest import copy_of, read_jsonl
from test_distributed import NO_DROPOUT, assert_params_close, params
from test_bert_train import bert_data  # noqa: F401 (a fixture: tiny BERT shards)
from test_faults import build_trainer, run_trainer
from test_balance import FakeMemory, bert_args


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from conftest import write_mnist
    directory = tmp_path_factory.mktemp("mnist_balance")
    write_mnist(directory, n_train=640, n_test=100)
    return directory


def out_of_memory_above(limit, calls):
    """A loss that raises CUDA's out-of-memory error for a micro-batch above ``limit``."""
    from textbox_like.tasks.mnist import MNISTTask
    real = MNISTTask.loss

    def loss(self, model, batch):
        n = batch["target"].shape[0]
        calls.append(n)
        if n > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (mocked): a micro-batch of {n}")
        return real(self, model, batch)
    return loss

COMMON = ["--optimizer", "sgd", "--lr", "0.05", "--lr-scheduler", "constant", "--max-epoch", "0",
          "--threads", "1", "--log-format", "simple", "--report_to", "none", *NO_DROPOUT]


def mnist_args(data, out, *extra):
    return ["--task", "mnist", "--data", str(data), "--save-dir", str(out), *COMMON, *map(str, extra)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_out_of_memory_lowers_the_cap_and_redoes_the_update(data, tmp_path, monkeypatch, one_process_64_first):
    """Mocked CUDA memory: micro-batches above 16 run out of memory. The first
    update is tried at 64, 32, then 16 and trained once; the run equals one
    process of 64 without the mock, and counts every sample once."""
    from textbox_like.tasks.mnist import MNISTTask
    calls = []
    monkeypatch.setattr(balance, "memory_probe", lambda device: FakeMemory(capacity=1 << 40))
    monkeypatch.setattr(MNISTTask, "loss", out_of_memory_above(16, calls))
    trainer, _, _ = build_trainer(mnist_args(data, tmp_path / "oom", "--global-batch-size", "64",
                                             "--max-sentences", "64", "--max-sentences-valid", "16",
                                             "--max-update", "6", "--log-interval", "3"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run_trainer(trainer) == 0
    monkeypatch.undo()
    # the first updates all-reduce by hand once every micro-batch ran: no empty micro-batch
    assert calls[:6] == [64, 32, 16, 16, 16, 16] and trainer.global_batch.micro_cap == 16
    assert "out of memory on a micro-batch of 64" in err.getvalue()
    state = trainer.state
    assert state.num_updates == 6 and state.samples_trained == 6 * 64 and state.samples_seen == 6 * 64
    train = [r for r in read_jsonl(tmp_path / "oom" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["update"] for r in train] == [3, 6]
    assert_params_close(params(tmp_path / "oom"), at_update(one_process_64_first, 6))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_out_of_memory_after_the_first_updates_joins_ddps_all_reduce_empty(data, tmp_path, monkeypatch,
                                                                           one_process_64_first):
    """Once the memory is measured DDP all-reduces in the last backward: an
    out-of-memory error in a forward at update 4 is retried, the failing try
    taking part in the all-reduce with an empty micro-batch."""
    from textbox_like.tasks.mnist import MNISTTask
    calls, real = [], MNISTTask.loss

    def loss(self, model, batch):
        n = batch["target"].shape[0]
        calls.append(n)
        if model.training and len(calls) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory (mocked)")
        return real(self, model, batch)
    monkeypatch.setattr(balance, "memory_probe", lambda device: FakeMemory(capacity=1 << 40))
    monkeypatch.setattr(MNISTTask, "loss", loss)
    trainer, _, _ = build_trainer(mnist_args(data, tmp_path / "oom", "--global-batch-size", "64",
                                             "--max-sentences", "64", "--max-sentences-valid", "16",
                                             "--max-update", "6"))
    assert run_trainer(trainer) == 0
    monkeypatch.undo()
    assert calls[:8] == [64, 64, 64, 64, 0, 32, 32, 32] and trainer.global_batch.micro_cap == 32
    assert trainer.state.samples_trained == 6 * 64
    assert_params_close(params(tmp_path / "oom"), at_update(one_process_64_first, 6))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_measured_memory_lowers_the_cap(data, tmp_path, monkeypatch, one_process_64_first):
    """Mocked CUDA memory: 100 bytes a sample over 1000 in use, a capacity of
    3334 (10% kept free): 20 samples fit. Measured on the second update, the
    cap of 64 drops to 20, later shares of 64 run as 4 micro-batches of 16,
    and the run equals one process of 64. A resume measures again, on the
    second update after it."""
    from textbox_like.tasks.mnist import MNISTTask
    memory, calls, real = FakeMemory(capacity=3334), [], MNISTTask.loss

    def loss(self, model, batch):
        memory.last = batch["target"].shape[0]
        calls.append(memory.last)
        return real(self, model, batch)
    monkeypatch.setattr(balance, "memory_probe", lambda device: memory)
    monkeypatch.setattr(MNISTTask, "loss", loss)
    trainer, _, _ = build_trainer(mnist_args(data, tmp_path / "cap", "--global-batch-size", "64",
                                             "--max-sentences", "64", "--max-sentences-valid", "16",
                                             "--max-update", "4"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run_trainer(trainer) == 0
    monkeypatch.undo()
    assert "rank 0: micro-batches of at most 20 fit in its memory (measured at update 2)" in err.getvalue()
    assert calls[:10] == [64, 64, 16, 16, 16, 16, 16, 16, 16, 16] and trainer.global_batch.micro_cap == 20
    assert_params_close(params(tmp_path / "cap"), at_update(one_process_64_first, 4))
    # a resume measures again, on its own second update
    monkeypatch.setattr(balance, "memory_probe", lambda device: memory)
    monkeypatch.setattr(MNISTTask, "loss", loss)
    memory.capacity_bytes = 2000  # (1800 - 1000) / 100: 8 samples fit now
    trainer, _, _ = build_trainer(mnist_args(data, tmp_path / "cap", "--global-batch-size", "64",
                                             "--max-sentences", "64", "--max-sentences-valid", "16",
                                             "--max-update", "7", "--resume"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run_trainer(trainer) == 0
    monkeypatch.undo()
    assert "rank 0: micro-batches of at most 8 fit in its memory (measured at update 6)" in err.getvalue()
    assert trainer.global_batch.micro_cap == 8


# ------------------------------------------------------------------ exact maths
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_share_above_the_cap_runs_micro_batches_with_one_all_reduce(data, tmp_path, monkeypatch, one_process_64_first):
    """One process, global batch 64, cap 16: 4 micro-batches per update, 3 of
    them under no_sync; the same parameters as batch 64 in one pass."""
    from textbox_like.tasks.mnist import MNISTTask
    sizes = []
    real = MNISTTask.loss
    monkeypatch.setattr(MNISTTask, "loss", lambda self, model, batch: (sizes.append(batch["target"].shape[0]),
                                                                       real(self, model, batch))[1])
    trainer, _, _ = build_trainer(mnist_args(data, tmp_path / "micro", "--global-batch-size", "64",
                                             "--max-sentences", "16", "--max-update", "5"))
    no_sync = []
    real_no_sync = trainer.accelerator.no_sync
    monkeypatch.setattr(trainer.accelerator, "no_sync", lambda model: (no_sync.append(1), real_no_sync(model))[1])
    assert run_trainer(trainer) == 0
    monkeypatch.undo()
    train_sizes = sizes[:20]
    assert train_sizes == [16] * 20 and len(no_sync) == 15
    assert_params_close(params(tmp_path / "micro"), at_update(one_process_64_first, 5))


def in_process(argv):
    """A one-process reference run in this process (no ~3 s of a process's imports); torch's thread
    count (--threads) restored after it."""
    from conftest import run_main
    threads = torch.get_num_threads()
    try:
        assert run_main(argv) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process_64_first(data, tmp_path_factory):
    """The reference of the one-process tests above: one process, batch 64, 6
    updates, a checkpoint after each (one run instead of one per test)."""
    out = tmp_path_factory.mktemp("one64_first")
    in_process(mnist_args(data, out, "--max-sentences", "64", "--max-update", "6", "--save-interval-updates", "1"))
    return out


@pytest.fixture(scope="module")
def one_process_64(data, tmp_path_factory):
    """The reference: one process, batch 64, 40 updates, a checkpoint every 10."""
    out = tmp_path_factory.mktemp("one64")
    in_process(mnist_args(data, out, "--max-sentences", "64", "--max-update", "40", "--save-interval-updates", "10"))
    return out


def at_update(save_dir, update):
    """The weights saved at ``update`` (10 updates an epoch: an epoch's end is checkpointN.pt)."""
    found = list(Path(save_dir).glob(f"checkpoint_*_{update}.pt"))
    state = load_checkpoint(found[0] if found else Path(save_dir) / f"checkpoint{update // 10}.pt")
    assert state["train"]["num_updates"] == update
    return state["model"]

SEARCHED_ARGS = ("--global-batch-size", "64", "--max-sentences", "64", "--balance", "--balance-interval", "5",
                 "--distributed-world-size", "2", "--save-interval-updates", "10")


def slow_env(rank, seconds, from_update=0):
    return {balance.SLOW_RANK_ENV: f"{rank}:{seconds}@{from_update}"}


@pytest.fixture(scope="module")
def multi_rank_runs(data, bert_data, tmp_path_factory):  # noqa: F811
    """Every run of two or three ranks of this module but the out-of-memory ones, in one set of three rank
    processes started as the trainer's spawn starts its ranks (_tasks_runs.rank_runs: their imports once for
    all the runs, no parent process per run; the third process takes part in the three-rank run only):
    {name: (RankRun, save dir)}. The first is the search the resume tests continue (each in a copy of it,
    made once it ended): two ranks, rank 1 slowed, --balance, 20 updates ("searched", its folder left as it
    ended for the tests that copy it again)."""
    from _tasks_runs import Copy, Run, rank_runs
    root = tmp_path_factory.mktemp("multi_rank")
    dirs = {name: root / name for name in ("searched", "resumed", "resumed_3", "caps", "bal", "tb", "fp16",
                                            "powersgd", "tokens")}
    tensorboard = mnist_args(data, dirs["tb"], "--global-batch-size", "64", "--max-sentences", "64", "--balance",
                             "--balance-interval", "3", "--distributed-world-size", "2", "--max-update", "9",
                             "--log-interval", "3")
    tensorboard[tensorboard.index("--report_to") + 1] = "tensorboard"
    steps = {
        "searched": Run(mnist_args(data, dirs["searched"], *SEARCHED_ARGS, "--max-update", "20"),
                        env=slow_env(1, 0.004)),
        "copy resumed": Copy(dirs["searched"], dirs["resumed"]),
        "copy resumed_3": Copy(dirs["searched"], dirs["resumed_3"]),
        # the three-rank one first: the third process waits for nothing else
        "resumed_3": Run(resume_on_another_world_size_args(data, dirs["resumed_3"], 3), world=3),
        "resumed": Run([*mnist_args(data, dirs["resumed"], *SEARCHED_ARGS), "--max-update", "40", "--resume"],
                       env=slow_env(1, 0.004)),
        "caps": Run(mnist_args(data, dirs["caps"], "--global-batch-size", "64", "--max-sentences", "16",
                               "--distributed-world-size", "2", "--max-update", "20", "--log-interval", "10")),
        "bal": Run(mnist_args(data, dirs["bal"], "--global-batch-size", "64", "--max-sentences", "64", "--balance",
                              "--balance-interval", "5", "--distributed-world-size", "2", "--max-update", "40",
                              "--log-interval", "10", "--save-interval-updates", "10", "--log-format", "json"),
                   env=slow_env(1, 0.004, 15)),
        "tb": Run(tensorboard, env=slow_env(1, 0.004)),
        **{hook: Run(mnist_args(data, dirs[hook], "--max-sentences", "32", "--distributed-world-size", "2",
                                "--max-update", "6", "--ddp-comm-hook", hook)) for hook in ("fp16", "powersgd")},
        "tokens": Run(bert_args(bert_data, dirs["tokens"], "--global-batch-size", 256, "--max-tokens", 64,
                                "--distributed-world-size", 2, "--balance", "--balance-interval", 2),
                      env=slow_env(1, 0.01)),
    }
    results = rank_runs(list(steps.values()), timeout=1500)
    runs = [name for name, step in steps.items() if isinstance(step, Run)]
    return {name: (result, dirs[name]) for name, result in zip(runs, results)}


def multi_rank_run(multi_rank_runs, name):
    """(its RankRun, its save dir) of a run of multi_rank_runs that exited 0."""
    proc, out = multi_rank_runs[name]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, out


@pytest.fixture(scope="module")
def searched_20(multi_rank_runs):
    """Two ranks, rank 1 slowed, --balance: 20 updates of the search, the
    first leg that the resume tests below continue (each in a copy)."""
    return multi_rank_run(multi_rank_runs, "searched")[1]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_ranks_with_caps_16_equal_one_process_of_64(multi_rank_runs, one_process_64):
    proc, out = multi_rank_run(multi_rank_runs, "caps")
    assert "global batch 64 | batch sizes per rank [32, 32] | micro-batch caps [16, 16]" in proc.stderr
    assert_params_close(params(out), at_update(one_process_64, 20))
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    for record in train:  # who waits for whom, in every record
        for key in ("compute_s_per_rank", "data_s_per_rank", "wait_s_per_rank"):
            assert len(record[key]) == 2 and min(record[key]) >= 0, record
    assert proc.stderr.strip().splitlines()[-1].startswith("slowest rank ")
    saved = load_checkpoint(out / "checkpoint_last.pt")["balance"]
    assert (saved["global_batch_size"], saved["split"], saved["unit"]) == (64, [32, 32], "samples")


def balance_line(record, split_name="batch sizes per rank", unit="samples"):
    """The log line of a ``balance`` record: the split, why, each tried split's measured time."""
    was = "kept" if record["batch_sizes"] == record["was"] else f"was {record['was']}"
    measured = ", ".join(f"{split} {seconds:.4f}" for split, seconds in record["s_per_update"].items())
    return (f"update {record['update']} | balance: {split_name} {record['batch_sizes']} ({was}): {record['reason']} "
            f"| s per update {measured} | {unit}/s per rank {record[unit + '_per_s']}")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_balance_follows_a_slow_rank_and_stays_exact(multi_rank_runs, one_process_64):
    """Rank 1 becomes 4 ms/sample slower at update 15; with an interval of 5
    the split favours rank 0 by update 25 (2 intervals: the search restarts
    from the best moved as far as the proportional split moved). Every
    re-split is the same on every rank (checked by the trainer at each
    re-split), each line and record says why and what each split tried took,
    and the splits tried give the parameters of one process of 64."""
    proc, out = multi_rank_run(multi_rank_runs, "bal")
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "balance"]
    # a record is a change of split (or the search settling on the current one)
    assert records
    lines = [line for line in proc.stderr.splitlines() if "| balance: batch sizes per rank" in line]
    assert lines == [balance_line(r) for r in records]  # one line per record, in the json format too
    for r in records:
        assert sum(r["batch_sizes"]) == 64 and len(r["samples_per_s"]) == 2 and r["reason"]
        assert split_name(r["was"]) in r["s_per_update"] or r["was"] == r["batch_sizes"], r  # the split left: timed
        assert all(seconds > 0 for seconds in r["s_per_update"].values())
    assert any(r["reason"].startswith("the ranks' speeds changed") and 15 < r["update"] <= 25 for r in records), \
        records
    split_at = {}
    for r in records:
        split_at[r["update"]] = r["batch_sizes"]
    current = [32, 32]
    for update in range(1, 41):
        current = split_at.get(update, current)
        if update == 25:
            assert current[0] > current[1] + 8, (records, current)
    assert current[0] > current[1]
    for update in (10, 20, 30, 40):
        assert_params_close(at_update(out, update), at_update(one_process_64, update))
    # once balanced, the ranks' update times are close: either may be the slower one at the end
    assert proc.stderr.strip().splitlines()[-1].startswith(("slowest rank 0: ", "slowest rank 1: "))
    saved = load_checkpoint(out / "checkpoint_last.pt")["balance"]
    assert saved["split"] == current and len(saved["search"]["tried"]) >= 3


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_resume_continues_the_search(multi_rank_runs, one_process_64, searched_20):
    """The search's state is a checkpoint part: a resume keeps the splits
    measured before it and goes on from the saved split; the maths is that
    of one process of 64 whatever the splits tried."""
    before = load_checkpoint(searched_20 / "checkpoint_last.pt")["balance"]   # what the resumed copy started from
    measured_before = [e for e in before["search"]["tried"]]
    assert measured_before and before["search"]["phase"] != "start"
    proc, out = multi_rank_run(multi_rank_runs, "resumed")
    assert f"batch sizes per rank {before['split']}" in proc.stderr  # the saved split, not an even one
    after = load_checkpoint(out / "checkpoint_last.pt")["balance"]["search"]
    assert any(e["at"] <= 20 for e in after["tried"]), after["tried"]  # measured before the resume, still known
    assert_params_close(at_update(out, 40), at_update(one_process_64, 40))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_per_rank_seconds_and_re_splits_reach_tensorboard_and_the_simple_log(multi_rank_runs):
    """Two ranks, rank 1 slowed, --balance, the simple log format and
    TensorBoard: the event file holds each rank's compute, data and wait
    seconds at every log update and the re-splits; stderr has the balance line."""
    from test_trackers import scalar_series
    proc, out = multi_rank_run(multi_rank_runs, "tb")
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "balance"]
    assert records, proc.stderr[-3000:]
    r = records[0]
    assert balance_line(r) in proc.stderr.splitlines()
    series = scalar_series(out / "tensorboard")
    for name in ("compute", "data", "wait"):
        for rank in (0, 1):
            tag = f"train/{name}_s_per_rank/rank{rank}"
            assert [step for step, _ in series.get(tag, [])] == [3, 6, 9], sorted(series)
            assert all(value >= 0 for _, value in series[tag])
    assert [step for step, _ in series["balance/batch_sizes/rank0"]] == [r["update"] for r in records]
    assert series["balance/batch_sizes/rank1"][0][1] == r["batch_sizes"][1]
    for name, seconds in r["s_per_update"].items():  # each tried split's measured update time
        assert series[f"balance/s_per_update/{name}"][0] == (r["update"], pytest.approx(seconds))


def resume_on_another_world_size_args(data, out, world):
    return mnist_args(data, out, "--global-batch-size", "64", "--max-sentences", "32", "--balance",
                      "--balance-interval", "5", "--distributed-world-size", str(world), "--max-update", "30",
                      "--save-interval-updates", "10", "--resume")


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world", [1, 3])
def test_resume_on_another_world_size_keeps_the_global_batch(data, tmp_path, one_process_64, searched_20, world,
                                                             capfd, multi_rank_runs):
    saved = load_checkpoint(searched_20 / "checkpoint_last.pt")["balance"]   # what each copy starts from
    assert saved["split"][0] > saved["split"][1]
    if world == 1:   # one process: in this one, its output captured
        from conftest import refusal_in_process
        out = copy_of(searched_20, tmp_path)
        threads = torch.get_num_threads()
        try:
            proc = refusal_in_process(resume_on_another_world_size_args(data, out, world), capfd)
        finally:
            torch.set_num_threads(threads)
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:   # three ranks, resumed from a copy of searched_20 (multi_rank_runs)
        proc, out = multi_rank_run(multi_rank_runs, "resumed_3")
    assert f"batch sizes per rank {even_split(64, world)}" in proc.stderr
    assert_params_close(at_update(out, 30), at_update(one_process_64, 30))
    split = load_checkpoint(out / "checkpoint_last.pt")["balance"]["split"]
    assert len(split) == world and sum(split) == 64


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_comm_hooks_train_on_two_ranks(multi_rank_runs, hook):
    proc, out = multi_rank_run(multi_rank_runs, hook)
    assert f"--ddp-comm-hook {hook}" in proc.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["ddp_comm_hook"] == hook
    assert json.loads((out / "results.json").read_text())["num_updates"] == 6

#: one rank (argv[1]) of each run of the JSON list in argv[2], in turn: HetSeq's node flags (each rank its own
#: --distributed-rank, a file:// rendezvous of the run's own), the trainer's main() with Accelerate's state reset
#: around it (conftest.run_main), and the run's mocks installed for it alone (its "settings": which rank runs out
#: of memory, above what, in the forward or the backward; which ranks have mocked CUDA memory to guard); each
#: run's stderr between split_runs' marks, the variables the trainer exported for it gone after it
OOM_RANKS = '''
import json, os, sys, torch
sys.path.insert(0, %r)
from conftest import run_main
from textbox_like.training import balance
from textbox_like.tasks.mnist import MNISTTask

class Memory:  # mocked CUDA allocator figures: room for anything
    def capacity(self): return 1 << 40
    def allocated(self): return 0
    def reset_peak(self): pass
    def peak(self): return 0
    def release(self): pass

class OutOfMemoryInBackward(torch.autograd.Function):  # the loss, unchanged; its backward runs out of memory
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (mocked, in backward)")

rank = sys.argv[1]
real_probe, real_loss = balance.memory_probe, MNISTTask.loss
for i, run in enumerate(json.loads(sys.argv[2])):
    settings = run["settings"]
    if rank in settings["GUARDED_RANKS"]:  # the others: CPU, no memory to guard
        balance.memory_probe = lambda device: Memory()
    if rank == settings["OOM_RANK"]:
        def loss(self, model, batch, settings=settings):
            too_big = model.training and batch["target"].shape[0] > int(settings["OOM_ABOVE"])
            if too_big and settings["OOM_IN"] != "backward":
                raise torch.OutOfMemoryError("CUDA out of memory (mocked)")
            loss_sum, stats = real_loss(self, model, batch)
            return (OutOfMemoryInBackward.apply(loss_sum) if too_big else loss_sum), stats
        MNISTTask.loss = loss
    before = dict(os.environ)
    print(f"--- run {i}", file=sys.stderr, flush=True)
    code = run_main(run["argv"][int(rank)])
    print(f"--- exit {i} {0 if code is None else code}", file=sys.stderr, flush=True)
    os.environ.clear()
    os.environ.update(before)
    balance.memory_probe, MNISTTask.loss = real_probe, real_loss
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
''' % str(REPO / "tests")

OOM_WHERE = ["forward", "backward"]


@pytest.fixture(scope="module")
def oom_runs(data, tmp_path_factory):
    """{where: ([each rank's (exit code, stderr)], save dir)} of the two runs of
    test_out_of_memory_on_one_rank_is_redone_by_every_rank, in one pair of rank processes (OOM_RANKS)."""
    from conftest import split_runs
    root = tmp_path_factory.mktemp("oom_runs")
    script = root / "oom_ranks.py"
    script.write_text(OOM_RANKS)
    runs = []
    for where in OOM_WHERE:
        out, rdzv = root / where, root / f"rdzv_{where}"
        runs.append({"argv": [mnist_args(data, out, "--global-batch-size", "64", "--max-sentences", "32",
                                         "--max-update", "20", "--distributed-init-method", f"file://{rdzv}",
                                         "--distributed-world-size", "2", "--distributed-gpus", "1",
                                         "--distributed-rank", rank, "--distributed-no-spawn") for rank in (0, 1)],
                     "settings": {"OOM_RANK": "1", "OOM_ABOVE": "16", "OOM_IN": where,
                                  "GUARDED_RANKS": "0,1" if where == "forward" else "1"}})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([PY, str(script), str(rank), json.dumps(runs)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    per_rank = [split_runs(err, len(runs)) for err in errs]
    return {where: ([per_rank[rank][i] for rank in (0, 1)], root / where) for i, where in enumerate(OOM_WHERE)}


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("where", OOM_WHERE)
def test_out_of_memory_on_one_rank_is_redone_by_every_rank(oom_runs, one_process_64, where):
    """Two ranks, mocked CUDA memory; rank 1 runs out of memory above 16
    samples, in the forward or in the backward of its one micro-batch (the
    one that all-reduces once the memory is measured); in the second case
    rank 0 has no memory to guard (a CPU beside a GPU). Both ranks redo the
    update (rank 0 never waits in a lone all-reduce), and the run equals one
    process of 64."""
    ranks, out = oom_runs[where]
    (code0, err0), (code1, err1) = ranks
    assert [code0, code1] == [0, 0], err0[-2000:] + err1[-2000:]
    assert "rank 1: out of memory on a micro-batch of 32 at update 1" in err1
    assert "out of memory" not in err0
    assert "Traceback" not in err0 + err1
    assert_params_close(params(out), at_update(one_process_64, 20))
    assert json.loads((out / "results.json").read_text())["num_updates"] == 20


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_global_batch_in_tokens_balanced_over_two_ranks_equals_one_process(bert_data, tmp_path, multi_rank_runs):
    """Tiny BERT (at most 32 tokens a sample): --global-batch-size 256 with
    --max-tokens counts tokens. Two ranks with micro-batch caps of 64 tokens,
    rank 1 slowed and re-split by --balance every 2 updates, reach the
    parameters of one process training each 256-token update in one pass."""
    from test_bert_train import assert_close, model_state
    in_process(bert_args(bert_data, tmp_path / "one", "--global-batch-size", 256, "--max-tokens", 256))
    proc, out = multi_rank_run(multi_rank_runs, "tokens")
    assert "global batch 256 tokens (balanced) | tokens per rank [128, 128] | micro-batch caps [64, 64] tokens" \
        in proc.stderr
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "balance"]
    assert records and records[0]["unit"] == "tokens", proc.stderr[-3000:]
    r = records[0]
    assert sum(r["batch_sizes"]) == 256 and r["batch_sizes"][0] > r["batch_sizes"][1]
    assert r["was"] == [128, 128] and balance_line(r, "tokens per rank", "tokens") in proc.stderr.splitlines()
    assert_close(model_state(out), model_state(tmp_path / "one"))
    saved = load_checkpoint(out / "checkpoint_last.pt")["balance"]
    assert saved["unit"] == "tokens" and sum(saved["split"]) == 256


@pytest.mark.slow
def test_a_sample_above_a_ranks_token_cap_is_one_line(bert_data, tmp_path, capfd):
    from conftest import refusal_in_process   # one process's refusal: in this one
    threads = torch.get_num_threads()
    try:
        proc = refusal_in_process(bert_args(bert_data, tmp_path / "out", "--global-batch-size", 256,
                                            "--max-tokens", 8), capfd)
    finally:
        torch.set_num_threads(threads)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: a sample has ")
    assert "more than --max-tokens 8 of rank 0" in proc.stderr and "Traceback" not in proc.stderr
