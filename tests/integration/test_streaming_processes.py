"""Streaming and packing with real ranks (the slow tier; test_streams.py in
tests/unit holds the in-process tests).

- 3+5 = 1 x 8: two ranks, one with --max-sentences 3 and one with 5, each its own command line (a file
  rendezvous, as two unlike nodes), train the losses and weights of one process over 8, within 1e-5, over
  30 updates of a streamed corpus of 100 documents (three epochs: their partial last steps too): plain, with
  a token budget (--global-batch-size 120 tokens, --max-tokens 50), re-split by --balance, accumulated
  (--update-freq 2), packed (--packing, streamed and held whole) for GPT-2 and packed BERT masked LM;
- kill -9: both ranks of a streamed two-rank run killed (SIGKILL, their process group) after the checkpoint
  of update 15; --resume on one rank and on three (2+3+3) trains the uninterrupted run's losses of updates
  16-30 within 1e-5, and the sample ids each rank was handed (TEXTBOX_LIKE_TEST_SAMPLE_LOG) show every
  document of every epoch trained exactly once, in the uninterrupted run's order;
- worker processes (--num-workers 2) tokenise the stream the inline reader gives;
- two runs on the same data at once, the cache in --cache-dir: both train, one tokenises, the data
  directory is left as it was (nothing written beside the data: a read-only directory works).
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env
from test_fsdp import PY, assert_close, checkpoint, in_process, train_records
from test_hf_task import hf_args, write_model, write_text_data
from _fsdp_runs import Plan, by_rank, one_rank
from _runs_runs import in_process as run_in_process, ok_in_process

pytestmark = pytest.mark.slow

#: a global batch of 8 re-split by --balance (every 2 updates), each rank's 3 or 5 its micro-batch cap
BALANCED = ("--global-batch-size", "8", "--balance", "--balance-interval", "2")
TOKENS = ("--global-batch-size", "120", "--max-tokens", "50")
STREAMING = ("--streaming", "--shuffle-buffer", "16")
EXACT = {"streamed": ("causal_lm", STREAMING), "streamed_tokens": ("causal_lm", STREAMING + TOKENS),
         "streamed_balanced": ("causal_lm", STREAMING + BALANCED),
         "streamed_accumulated": ("causal_lm", STREAMING + ("--update-freq", "2")),
         "streamed_packed": ("causal_lm", STREAMING + ("--packing",)),
         "packed": ("causal_lm", ("--packing",)), "packed_masked": ("masked_lm", ("--packing",))}
SAMPLE_LOG = "TEXTBOX_LIKE_TEST_SAMPLE_LOG"


def args_of(models, data, save_dir, head, *extra, max_update=30):
    """SGD (Adam would scale rounding noise where a gradient is ~0), one record per update, no validation."""
    return hf_args(models[head], data, save_dir, "--optimizer", "sgd", "--lr", "0.5", "--max-epoch", "0",
                   "--disable-validation",
                   "--threads", "1", "--log-format", "simple", "--log-interval", "1", "--distributed-timeout", "120",
                   *extra, max_update=max_update)


def nodes(models, data, save_dir, rdzv, head, batches, *extra, env=None):
    """One rank per batch size (``batches``), each its own command line (a file rendezvous)."""
    common = ["--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", len(batches),
              "--distributed-gpus", "1", "--distributed-no-spawn", *extra]
    return by_rank([args_of(models, data, save_dir, head, "--max-sentences", batch, *common,
                            "--distributed-rank", rank) for rank, batch in enumerate(batches)], env=env)


@pytest.fixture(scope="module")
def stream_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_models")
    return {head: write_model(root / head, head) for head in ("causal_lm", "masked_lm")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_data(tmp_path_factory.mktemp("stream_corpus"), n_train=100, n_valid=8)


@pytest.fixture(scope="module")
def stream_runs(stream_models, corpus, tmp_path_factory):
    """Every two-rank run of this file in one pair of rank processes; the killed run in a pair of its own
    (killed once its checkpoint of update 15 is there); then the resumes on one and on three ranks."""
    root = tmp_path_factory.mktemp("stream_runs")
    runs = {name: nodes(stream_models, corpus, root / name, root / f"rdzv_{name}", head, (3, 5), *extra)
            for name, (head, extra) in EXACT.items()}
    runs["reference"] = nodes(stream_models, corpus, root / "reference", root / "rdzv_reference", "causal_lm", (3, 5),
                              *STREAMING, env={SAMPLE_LOG: str(root / "reference.samples")})
    with Plan(list(runs.values()), root / "plan") as plan:
        plan.finish()
    # rank 1 20 ms a sample slower: ~0.1 s an update, so that the kill falls mid-run
    from textbox_like.training import balance
    killed = nodes(stream_models, corpus, root / "killed", root / "rdzv_killed", "causal_lm", (3, 5), *STREAMING,
                   "--save-interval-updates", 5, env={SAMPLE_LOG: str(root / "killed.samples"),
                                                      balance.SLOW_RANK_ENV: "1:0.02@0"})
    with Plan([killed], root / "plan_killed") as plan:
        plan.wait_for(lambda: list((root / "killed").glob("checkpoint_*_15.pt")), timeout=1500)
        time.sleep(0.2)
        plan.kill()
        plan.finish()
    runs["killed"] = killed
    at_kill = checkpoint(root / "killed")
    shutil.copytree(root / "killed", root / "killed_three")
    resumed = {"resumed_one": one_rank(args_of(stream_models, corpus, root / "killed", "causal_lm", *STREAMING,
                                               "--max-sentences", 8, "--resume"),
                                       env={SAMPLE_LOG: str(root / "resumed_one.samples")}),
               "resumed_three": nodes(stream_models, corpus, root / "killed_three", root / "rdzv_three", "causal_lm",
                                      (2, 3, 3), *STREAMING, "--resume",
                                      env={SAMPLE_LOG: str(root / "resumed_three.samples")})}
    with Plan(list(resumed.values()), root / "plan_resumed", ranks=3) as plan:
        plan.finish()
    return root, {**runs, **resumed}, at_kill


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(EXACT))
def test_three_and_five_equal_one_process_of_eight(stream_models, corpus, stream_runs, tmp_path, name):
    root, runs, _ = stream_runs
    head, extra = EXACT[name]
    start = next(line for line in runs[name].check().splitlines() if line.startswith("task hf"))
    split = "global batch" if "--global-batch-size" in extra else "batch sizes per rank [3, 5]"
    assert split in start, start
    assert ("train streamed" in start) == ("--streaming" in extra), start
    one = tmp_path / "one"
    in_process([PY, "run_hetseq.py", *args_of(stream_models, corpus, one, head, *extra, "--max-sentences", 8)])
    losses = [[r["loss"] for r in train_records(d)] for d in (one, root / name)]
    assert len(losses[0]) == len(losses[1]) == 30
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert_close(checkpoint(root / name)["model"], checkpoint(one)["model"])
    assert losses[0][-1] < losses[0][0]   # it learns


def steps(path_prefix: Path) -> dict:
    """{(epoch, offset at the step's end): the ids of the step, ranks in order}, from each rank's sample log
    (a step logged twice, an update redone, counts as its last)."""
    by_rank = {}
    for log in sorted(path_prefix.parent.glob(path_prefix.name + ".rank*")):
        rank = int(log.name.rsplit("rank", 1)[1])
        for line in log.read_text().splitlines():
            record = json.loads(line)
            by_rank.setdefault(rank, {})[(record["epoch"], record["offset"])] = record["ids"]
    keys = sorted({key for steps in by_rank.values() for key in steps})
    return {key: [i for rank in sorted(by_rank) for i in by_rank[rank].get(key, [])] for key in keys}


@pytest.mark.timeout(1800)
def test_killed_at_update_15_and_resumed_on_one_and_three_ranks_equals_the_uninterrupted_run(stream_runs):
    root, runs, at_kill = stream_runs
    assert runs["killed"].codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}, runs["killed"].stderr[-2000:]
    assert at_kill["train"]["num_updates"] >= 15
    reference = [r["loss"] for r in train_records(root / "reference")]
    assert len(reference) == 30
    saved = checkpoint(root / "killed", f"checkpoint_{at_kill['train']['epoch']}_15")
    position = (saved["iterator"]["epoch"], saved["iterator"]["offset"])
    whole = steps(root / "reference.samples")
    for name, save_dir in (("resumed_one", "killed"), ("resumed_three", "killed_three")):
        start = runs[name].check()
        assert "resum" in start.lower(), start[-2000:]
        losses = {r["num_updates"] if "num_updates" in r else r["update"]: r["loss"]
                  for r in train_records(root / save_dir)}
        resumed = [losses[u] for u in range(16, 31)]
        assert resumed == pytest.approx(reference[15:], abs=1e-5), name
        # what trained: the killed run's steps up to the checkpoint, then the resumed run's
        lineage = {k: v for k, v in steps(root / "killed.samples").items() if k <= position}
        lineage.update(steps(root / f"{name}.samples"))
        assert lineage == whole, name
        epochs = {}
        for (epoch, _), ids in sorted(lineage.items()):
            epochs.setdefault(epoch, []).extend(ids)
        for epoch, ids in epochs.items():
            assert len(ids) == len(set(ids)), (name, epoch)        # none twice
            if epoch < max(epochs):
                assert len(ids) == 100, (name, epoch)              # none skipped in a whole epoch


def test_worker_processes_tokenise_the_stream_the_inline_reader_gives(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_streams import epoch_steps, flat, ranks_of, write_shards
    data = write_shards(tmp_path / "data", sizes=(120, 90, 70))
    inline = flat(epoch_steps(ranks_of(data, [3, 5])))
    its = ranks_of(data, [8], workers=2)
    try:
        assert flat(epoch_steps(its)) == inline and len(set(inline)) == 280
    finally:
        its[0].stream.close()


def test_two_runs_at_once_on_one_data_directory_both_train_and_write_nothing_beside_it(stream_models, tmp_path):
    data = write_text_data(tmp_path / "data", n_train=3000, n_valid=8)
    before = {p: p.stat().st_mtime_ns for p in data.rglob("*")}
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([PY, "run_hetseq.py", *args_of(stream_models, data, tmp_path / f"run{i}", "causal_lm",
                                                            "--cache-dir", cache, max_update=3)],
                              cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    tokenised = [line for _, err in outs for line in err.splitlines() if line.startswith("note: tokenizing 3,000")]
    assert len(tokenised) == 1, [err[-2000:] for _, err in outs]         # one tokenised, the other read it
    assert {p: p.stat().st_mtime_ns for p in data.rglob("*")} == before  # nothing written beside the data
    assert list(cache.glob("tokenized-*.arrow")) and not (data / ".hf_cache").exists()


def test_a_shard_gone_mid_run_saves_the_update_before_exits_75_and_resume_skips_nothing(stream_models, tmp_path,
                                                                                       monkeypatch, capfd):
    """The second shard is renamed away as the stream comes to open it (updates in): the OS answers ENOENT, the
    run saves the state before the update it was reading for, exits 75 with one line, and --resume, once the
    file is back, trains the uninterrupted run's losses (in this process: the fault is the file system's, its
    moment the test's)."""
    from textbox_like.data import streams
    data = write_text_data(tmp_path / "data", n_train=600, n_valid=8)
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").unlink()
    shards = [data / "train-00000.jsonl", data / "train-00001.jsonl"]
    shards[0].write_text("".join(lines[:300]))
    shards[1].write_text("".join(lines[300:]))
    read, moved = {}, []
    read_json = streams.READERS["json"]

    def reader(path, offset):
        """The first shard read as it is; the other one renamed away once 100 records of the first were read
        (before then it is only looked at: its columns, or the epoch's order putting it first)."""
        if not moved and any(count >= 100 for other, count in read.items() if other != path):
            moved.append(path.rename(path.with_name(path.name + ".gone")))
        read.setdefault(path, 0)
        for item in read_json(path, offset):
            read[path] += 1
            yield item

    monkeypatch.setitem(streams.READERS, "json", reader)
    run = ["--max-sentences", 8, *STREAMING]
    cut = run_in_process([*args_of(stream_models, data, tmp_path / "cut", "causal_lm", *run,
                                                    max_update=40)], capfd)
    assert moved, "the stream never came to its second shard"
    moved[0].rename(moved[0].with_name(moved[0].name[:-len(".gone")]))
    errors = [line for line in cut.stderr.splitlines() if line.startswith("error") or "can no longer" in line]
    assert cut.returncode == 75, cut.stderr[-3000:]
    assert len(errors) == 1 and "can no longer be read" in errors[0] and "--resume" in errors[0], errors
    assert "Traceback" not in cut.stderr
    saved = checkpoint(tmp_path / "cut")["train"]["num_updates"]
    assert 10 < saved < 40, saved  # mid-run: the first shard's records trained, the second's not yet
    monkeypatch.setitem(streams.READERS, "json", read_json)
    ok_in_process(args_of(stream_models, data, tmp_path / "cut", "causal_lm", *run, "--resume", max_update=40), capfd)
    ok_in_process(args_of(stream_models, data, tmp_path / "whole", "causal_lm", *run, max_update=40), capfd)
    losses = {r["update"]: r["loss"] for r in train_records(tmp_path / "cut")}  # the resumed run's last
    expected = {r["update"]: r["loss"] for r in train_records(tmp_path / "whole")}
    assert sorted(losses) == sorted(expected) == list(range(1, 41))
    assert max(abs(losses[u] - expected[u]) for u in losses) <= 1e-6, (losses, expected)
