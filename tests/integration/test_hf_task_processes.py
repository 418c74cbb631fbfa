"""The tests of test_hf_task.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, RUNS_IN_ONE_PROCESS, assert_bitwise_equal, clean_env, refusal_in_process, run_main, split_runs
from test_hf_task import (  # noqa: F401 (fixtures)
    PY, build, exactness_args, hf_args, models, records, text_data, write_text_data)


def params(save_dir):
    return torch.load(Path(save_dir) / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


def export_eval_loss(export_dir, data, head, *extra):
    """The valid loss of a save_pretrained directory, read as a fresh run reads its model."""
    from accelerate import Accelerator

    from textbox_like.resolve.resolution import parse
    from textbox_like.tasks import TASKS
    from textbox_like.training.validate import evaluate
    cfg = parse(["--task", "hf", "--model_name_or_path", str(export_dir), "--data", str(data), "--hf_head", head,
                 "--seed", "3",  # the run's: masked_lm's masks follow it
                 *extra])
    task = TASKS.get("hf")(cfg)
    return evaluate(task, task.build_model(), task.build_dataset("valid"), 8, Accelerator(cpu=True))["loss"]

HEAD_RUNS = {
    "sequence_classification": (),
    "causal_lm": (),
    "masked_lm": (),
    # TextBox's spellings of the metrics: the generation family, and one of its metrics for checkpoint_best.pt
    "seq2seq": ("--target_column", "target", "--metrics=['rouge']", "--metrics_for_best_model=['ROUGE-1']",
                "--generation_max_length", "12"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("head", list(HEAD_RUNS))
def test_each_head_trains_validates_and_its_export_loads_to_the_same_loss(models, text_data, tmp_path, head):
    from textbox_like.api import evaluate
    from textbox_like.tools.export import main as export_main

    out = tmp_path / "run"
    assert run_main(hf_args(models[head], text_data, out, "--max-update", "18", *HEAD_RUNS[head])) == 0
    train, valid = records(out, "train"), records(out, "valid")
    assert valid[-1]["loss"] < train[0]["loss"] - 0.05, (train[0], valid[-1])      # it learns
    expected = {"sequence_classification": {"accuracy", "f1"}, "causal_lm": {"ppl", "accuracy"},
                "masked_lm": {"ppl", "accuracy"}, "seq2seq": {"ROUGE-1", "ROUGE-2", "ROUGE-L", "ppl"}}[head]
    assert expected <= set(valid[-1]), valid[-1]
    if head == "seq2seq":  # --metrics rouge: no BLEU computed; the best checkpoint is the best ROUGE-1's
        assert "BLEU" not in valid[-1]
        best = torch.load(out / "checkpoint_best.pt", map_location="cpu", weights_only=True)
        assert best["train"]["best"] == pytest.approx(max(r["ROUGE-1"] for r in valid))
    # the export: the model's own class and its tokenizer, loading to the checkpoint's loss
    exported = tmp_path / "export"
    assert export_main([str(out / "checkpoint_last.pt"), "--to", str(exported)]) in (0, None)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    # the run exported its trained model itself: the same weights as the command's export of its last checkpoint
    from safetensors.torch import load_file
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / "hf_model").iterdir()}
    at_end, later = load_file(str(out / "hf_model" / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert at_end.keys() == later.keys() and all(torch.equal(at_end[k], later[k]) for k in later)
    ours = evaluate(out / "checkpoint_last.pt", cpu=True)["loss"]
    assert ours == pytest.approx(valid[-1]["loss"], abs=1e-5)
    extra = HEAD_RUNS[head][:2] if head == "seq2seq" else ()
    assert export_eval_loss(exported, text_data, head, *extra) == pytest.approx(ours, abs=1e-5)


def one_process(cmd):
    """The one-process reference of a command ([PY, run_hetseq.py, *args]) a process would run: the same
    run in this process (no ~3 s of imports), torch's thread count restored after it (--threads)."""
    assert [str(c) for c in cmd[:2]] in ([PY, "run_hetseq.py"], [PY, str(REPO / "run_hetseq.py")]), cmd[:2]
    threads = torch.get_num_threads()
    try:
        assert run_main(cmd[2:]) == 0
    finally:
        torch.set_num_threads(threads)


EXACT_HEADS = ["causal_lm", "sequence_classification", "masked_lm", "seq2seq"]
NO_SAMPLES_HEADS = ["causal_lm", "sequence_classification"]
#: the balance test's run: 12 updates, a re-split tried every 2
BALANCE_EXTRA = ("--max-update", "12", "--balance-interval", "2")


def exact_columns(head):
    return ("--target_column", "target") if head == "seq2seq" else ()


#: the runs of test_a_rank_with_no_samples_in_a_step_trains_validates_and_equals_one_process
NO_SAMPLES_COMMON = ["--optimizer", "sgd", "--lr", "0.5", "--max-update", "5", "--threads", "1", "--log-format",
                     "simple", "--max-sentences-valid", "8", "--validate-interval-updates", "5"]


@pytest.fixture(scope="module")
def no_samples_data(tmp_path_factory):
    """{head: its data}: 41 training rows and 17 validation rows; classification's a save_to_disk dataset
    whose labels are a ClassLabel (numbers that stand for its names), as Hub datasets have them."""
    import datasets
    root = tmp_path_factory.mktemp("no_samples_data")
    source = write_text_data(root / "src", n_train=41, n_valid=17)
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["bad", "good"])})
    splits = {split: datasets.Dataset.from_list(
        [{"text": r["text"], "label": r["label"]} for r in map(json.loads, (source / f"{split}.jsonl").open())],
        features=features) for split in ("train", "valid")}
    saved = root / "saved"
    datasets.DatasetDict(splits).save_to_disk(str(saved))
    return {"causal_lm": source, "sequence_classification": saved}


@pytest.fixture(scope="module")
def two_rank_runs(models, text_data, no_samples_data, tmp_path_factory):
    """Every two-rank run of this module, in one pair of rank processes started as the trainer's spawn
    starts its ranks (_tasks_runs.rank_runs: their imports once for all the runs, no parent process per
    run): {key: (RankRun, save dir)}; keys ("exact", head), ("no_samples", head), "balance"."""
    from textbox_like.training import balance

    from _tasks_runs import Run, rank_runs
    root = tmp_path_factory.mktemp("two_ranks")
    runs, dirs = {}, {}
    for head in EXACT_HEADS:
        dirs["exact", head] = root / f"exact_{head}"
        runs["exact", head] = Run(exactness_args(models[head], text_data, dirs["exact", head], *exact_columns(head),
                                                 "--distributed-world-size", "2")[2:])
    for head in NO_SAMPLES_HEADS:
        dirs["no_samples", head] = root / f"no_samples_{head}"
        runs["no_samples", head] = Run(hf_args(models[head], no_samples_data[head], dirs["no_samples", head],
                                               *NO_SAMPLES_COMMON, "--max-sentences", "5",
                                               "--distributed-world-size", "2"))
    # --balance moves tokens away from a slow rank 1 mid-run
    dirs["balance"] = root / "balance"
    runs["balance"] = Run(exactness_args(models["causal_lm"], text_data, dirs["balance"], *BALANCE_EXTRA, "--balance",
                                         "--distributed-world-size", "2")[2:], env={balance.SLOW_RANK_ENV: "1:0.003@0"})
    results = rank_runs(list(runs.values()), timeout=900)
    return {key: (result, dirs[key]) for key, result in zip(runs, results)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("head", EXACT_HEADS)
def test_two_ranks_with_unlike_batches_equal_one_process(models, text_data, tmp_path, head, two_rank_runs):
    """Two ranks, each micro-batch its own number of samples and tokens, and the
    loss's denominator (tokens; samples for classification) summed over both:
    the update of one process over the same global batch."""
    columns = exact_columns(head)
    one_process(exactness_args(models[head], text_data, tmp_path / "one", *columns))
    two, two_dir = two_rank_runs["exact", head]
    assert two.returncode == 0, two.stderr[-3000:]
    assert "tokens per rank [60, 60]" in two.stderr
    # the plan the two ranks ran: their slices of an update hold unlike numbers of samples
    from textbox_like.resolve.resolution import parse
    from textbox_like.data.iterators import plan_global_tokens
    from textbox_like.tasks import TASKS
    task = TASKS.get("hf")(parse(exactness_args(models[head], text_data, tmp_path / "plan", *columns)[2:]))
    data = task.build_dataset("train")
    order = data.epoch_order(3, 1)
    rows = plan_global_tokens(data.num_tokens()[order], 120, [60, 60])[:6]
    assert any(row[1] - row[0] != row[2] - row[1] for row in rows), rows
    one_state, two_state = params(tmp_path / "one"), params(two_dir)
    for key in one_state:
        assert torch.allclose(one_state[key], two_state[key], atol=1e-5, rtol=0), key
    train1, train2 = records(tmp_path / "one", "train"), records(two_dir, "train")
    assert train1[-1]["loss"] == pytest.approx(train2[-1]["loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("head", NO_SAMPLES_HEADS)
def test_a_rank_with_no_samples_in_a_step_trains_validates_and_equals_one_process(models, tmp_path, head,
                                                                                 no_samples_data, two_rank_runs):
    """41 training rows in steps of 5 + 5: the fifth update holds one row, all
    rank 0's, and 17 validation rows in 8 + 8 leave rank 1 one empty batch.
    The empty rank still runs its backward (DDP) and sends the same stats.
    Classification reads a save_to_disk dataset whose labels are a ClassLabel
    (numbers that stand for its names), as Hub datasets have them."""
    data = no_samples_data[head]
    one_process([PY, "run_hetseq.py", *hf_args(models[head], data, tmp_path / "one", *NO_SAMPLES_COMMON,
                                               "--max-sentences", "10")])
    two, two_dir = two_rank_runs["no_samples", head]
    assert two.returncode == 0, two.stderr[-3000:]
    one_state, two_state = params(tmp_path / "one"), params(two_dir)
    for key in one_state:
        assert torch.allclose(one_state[key], two_state[key], atol=1e-5, rtol=0), key
    valid1, valid2 = records(tmp_path / "one", "valid")[-1], records(two_dir, "valid")[-1]
    assert valid1["loss"] == pytest.approx(valid2["loss"], abs=1e-5)
    if head == "sequence_classification":
        assert valid1["accuracy"] == pytest.approx(valid2["accuracy"]) and "f1" in valid2
        config = json.loads((two_dir / "hf_model" / "config.json").read_text())
        assert config["id2label"] == {"0": "bad", "1": "good"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_then_resume_is_bitwise_identical(models, text_data, tmp_path, capfd):
    from test_resume import kill_after_checkpoint
    cmd = lambda out: [PY, str(REPO / "run_hetseq.py"), *hf_args(  # noqa: E731
        models["causal_lm"], text_data, out, "--max-update", "40", "--max-epoch", "0", "--save-interval-updates", "5",
        "--threads", "1", "--max-sentences", "4")]
    one_process(cmd(tmp_path / "ref"))   # the uninterrupted run: in this process, bitwise a process's
    code, err = kill_after_checkpoint(cmd(tmp_path / "run"), tmp_path / "run", signal.SIGKILL, seed=1)
    assert code == -signal.SIGKILL, f"the run was not killed (exit {code}): {err[-1000:]}"
    killed_at = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)["train"]["num_updates"]
    assert 5 <= killed_at < 40
    # the resume of what the kill left: in this process too (the kill is a process's, the resume reads its files)
    threads = torch.get_num_threads()
    try:
        resumed = refusal_in_process(cmd(tmp_path / "run")[2:] + ["--resume", "--log-format", "simple"], capfd)
    finally:
        torch.set_num_threads(threads)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    final = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)
    ref = torch.load(tmp_path / "ref" / "checkpoint_last.pt", weights_only=True)
    assert final["train"]["num_updates"] == 40
    assert_bitwise_equal(final["model"], ref["model"], "model")
    assert_bitwise_equal(final["optimizer"], ref["optimizer"], "optimizer")


def batches_of(data):
    return [data.get_batch(np.arange(i, min(i + 5, len(data)))) for i in range(0, len(data), 5)]


@pytest.mark.slow
def test_tokenised_data_is_cached_in_the_cache_dir_and_reused(models, tmp_path, monkeypatch):
    import textbox_like.data.hf_text as hf_text

    data = write_text_data(tmp_path / "data")
    store = tmp_path / "cache"
    args = ("--model_name_or_path", models["sequence_classification"], "--data", data, "--cache-dir", store)
    first = build(*args).build_dataset("train")
    cached = sorted(store.glob("tokenized-*.arrow"))
    assert len(cached) == 1
    written = cached[0].stat().st_mtime_ns

    def refuse(*_, **__):
        raise AssertionError("tokenised again: the cache was not used")
    with monkeypatch.context() as patch:   # a second run reads the cache, never the tokenizer
        patch.setattr(hf_text, "tokenize_rows", refuse)
        second = build(*args).build_dataset("train")
    assert sorted(store.glob("tokenized-*.arrow")) == cached
    assert cached[0].stat().st_mtime_ns == written
    assert_bitwise_equal(batches_of(first), batches_of(second), "batches")
    # another setting is another cache; worker processes tokenise to the same ids
    shorter = build(*args, "--max_length", "6", "--num-workers", "2").build_dataset("train")
    assert len(sorted(store.glob("tokenized-*.arrow"))) > 1
    assert int(shorter.num_tokens().max()) == 6
    batch = first.get_batch(np.arange(8))
    assert batch["input_ids"].shape[1] == int(first.num_tokens()[:8].max())   # padded to this batch's longest
    assert (batch["attention_mask"].sum(1).numpy() == first.num_tokens()[:8]).all()

CACHED_REPO_README = """---
configs:
- config_name: small
  data_files:
  - split: train
    path: data/train-*
  - split: validation
    path: data/validation-*
---
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dataset_name_in_the_local_datasets_cache_trains_offline_or_says_how_to_get_it(models, tmp_path, capfd):
    """--data NAME --dataset_config CONFIG: the dataset datasets.load_dataset
    left in the local cache (here from a Hub-style repository folder of parquet
    files, deleted afterwards), read offline; it trains on exactly the rows of
    the same data given as files. A name not in the cache: one line."""
    import shutil

    import datasets
    files = write_text_data(tmp_path / "files")
    repo = tmp_path / "repo" / "tiny_reviews"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text(CACHED_REPO_README)
    for split, name in (("train", "train"), ("valid", "validation")):
        rows = [json.loads(line) for line in (files / f"{split}.jsonl").read_text().splitlines()]
        datasets.Dataset.from_list(rows).to_parquet(str(repo / "data" / f"{name}-00000-of-00001.parquet"))
    env = {**clean_env(), "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache"), "HF_HOME": str(tmp_path / "home")}
    connected = {k: v for k, v in env.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    subprocess.run([PY, "-c", f"import datasets; datasets.load_dataset({str(repo)!r}, 'small')"], env=connected,
                   check=True, capture_output=True, timeout=200)
    shutil.rmtree(tmp_path / "repo")   # only the cache is left
    args = lambda data, out, *extra: [  # noqa: E731
        PY, "run_hetseq.py", *hf_args(models["sequence_classification"], data, out, "--threads", "1",
                                      "--max-update", "10", *extra)]
    # the named run and the two refusals that ask the cache: one process with HF_DATASETS_CACHE set (datasets
    # reads it when imported), main() run in it for each in turn, each with its own exit code and stderr
    not_cached = [(["someone/not_cached"], "error: --data someone/not_cached: no such file or directory, and no "
                                           "dataset 'someone/not_cached' in the local Hugging Face datasets cache"),
                  (["tiny_reviews", "--dataset_config", "large"],
                   "error: --data tiny_reviews --dataset_config large: the local Hugging Face datasets cache")]
    named, *refused = runs_in_one_process(
        [args("tiny_reviews", tmp_path / "named", "--dataset_config", "small")[2:]]
        + [args(data, tmp_path / "refused", *extra)[2:] for (data, *extra), _ in not_cached], env)
    assert named.returncode == 0, named.stderr[-3000:]
    one_process(args(files, tmp_path / "from_files"))   # the same rows as files: no cache, no process needed
    train, valid = records(tmp_path / "named", "train"), records(tmp_path / "named", "valid")
    assert valid[-1]["loss"] < train[0]["loss"] - 0.05, (train[0], valid[-1])
    assert_bitwise_equal(params(tmp_path / "named"), params(tmp_path / "from_files"), "model")  # the same rows
    assert list((tmp_path / "datasets_cache").rglob("tokenized-*.arrow"))   # tokenised into the datasets cache
    # not in the cache, another config only, a path that is not there: one line each
    threads = torch.get_num_threads()
    try:   # a path, not a name: the cache is not asked, and this process says it as well as another
        not_here = refusal_in_process(args("./not_here", tmp_path / "refused")[2:], capfd)
    finally:
        torch.set_num_threads(threads)
    cases = not_cached + [(["./not_here"], "error: --data './not_here' does not exist; check the path")]
    for ((data, *extra), start), proc in zip(cases, refused + [not_here]):
        line = one_error_line(proc)
        assert line.startswith(start), line
        if data != "./not_here":
            assert "datasets.load_dataset(" in line and "save_to_disk" in line, line
    assert not (tmp_path / "refused").exists()

def runs_in_one_process(argvs, env, timeout=300):
    """main(argv) for each argv in turn in one child process with ``env`` (one process's imports instead of
    one per run): a CompletedProcess per run, its exit code and its own stderr."""
    proc = subprocess.run([PY, "-c", RUNS_IN_ONE_PROCESS,
                           json.dumps([[str(a) for a in argv] for argv in argvs])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]   # an exception out of main() ends the process
    return [subprocess.CompletedProcess(argv, code, "", err)
            for argv, (code, err) in zip(argvs, split_runs(proc.stderr, len(argvs)))]


# ---------------------------------------------------------------- models: hub names, heads, metrics
def one_error_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[-1]


#: main() for argv[1] (a JSON list) twice in one process: before and after the model of argv[2] is copied into
#: the hub cache as argv[3] (snapshots/<commit>, refs/main), each run's stderr between split_runs' marks
MISSING_THEN_FOUND = f'''
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, {str(REPO / "tests")!r})
from conftest import run_main
args, model, repo = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
for i in range(2):
    if i == 1:
        shutil.copytree(model, repo / "snapshots" / ("0" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    print(f"--- run {{i}}", file=sys.stderr, flush=True)
    code = run_main(args)
    print(f"--- exit {{i}} {{0 if code is None else code}}", file=sys.stderr, flush=True)
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_textbox_model_path_names_a_model_in_the_local_cache_or_says_how_to_get_it(models, text_data, tmp_path):
    cache = tmp_path / "hub"
    env = {**clean_env(), "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    textbox = ["--task", "hf", "--model_path=facebook/bart-base", "--data", str(text_data), "--target_column", "target",
               "--metrics=['rouge']", "--metrics_for_best_model=['ROUGE-1']", "--max-sentences", "8",
               "--max-update", "2", "--generation_max_length", "6", "--save-dir", str(tmp_path / "run")]
    # one process (the hub cache's location is read as huggingface_hub is imported): main() refuses the name
    # while the cache lacks it, then the model is put where huggingface-cli download leaves one (the hub
    # cache's own layout), then main() trains it
    repo = cache / "models--facebook--bart-base"
    script = tmp_path / "missing_then_found.py"
    script.write_text(MISSING_THEN_FOUND)
    proc = subprocess.run([PY, str(script), json.dumps([str(a) for a in textbox]), str(models["seq2seq"]), str(repo)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (missing_code, missing_err), (found_code, found_err) = split_runs(proc.stderr, 2)
    line = one_error_line(subprocess.CompletedProcess(textbox, missing_code, "", missing_err))
    assert line.startswith("error: --model_path facebook/bart-base: no such directory, and no model")
    assert "huggingface-cli download facebook/bart-base" in line, line
    assert found_code == 0, found_err[-3000:]
    valid = records(tmp_path / "run", "valid")[-1]
    assert {"ROUGE-1", "ROUGE-2", "ROUGE-L"} <= set(valid) and "BLEU" not in valid


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_balance_re_splits_the_tokens_and_stays_one_process(models, text_data, tmp_path, two_rank_runs):
    """--balance moves tokens away from a slow rank 1 mid-run; every split
    tried gives the causal LM the update of one process."""
    one_process(exactness_args(models["causal_lm"], text_data, tmp_path / "one", *BALANCE_EXTRA))
    out, two_dir = two_rank_runs["balance"]
    assert out.returncode == 0, out.stderr[-3000:]
    splits = [r["batch_sizes"] for r in records(two_dir, "balance")]
    assert any(split != [60, 60] for split in splits), (splits, out.stderr[-2000:])
    one_state, two_state = params(tmp_path / "one"), params(two_dir)
    for key in one_state:
        assert torch.allclose(one_state[key], two_state[key], atol=1e-5, rtol=0), key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_runs_for_the_hf_causal_lm(models, text_data, capfd):
    """python -m textbox_like.tools.bench hf: the trainer against the model's own loss in a plain loop over the
    trainer's batches (bench.main, the command's, in this process: the mode starts no process of its own)."""
    import math

    from conftest import _reset_accelerate
    from textbox_like.tools import bench
    capfd.readouterr()
    threads = torch.get_num_threads()
    _reset_accelerate()
    try:
        assert bench.main([str(a) for a in ("hf", "--model_name_or_path", models["causal_lm"], "--data", text_data,
                                            "--max-sentences", 8, "--updates", 40, "--warmup", 2, "--rounds", 1,
                                            "--threads", 1)]) == 0
    finally:
        torch.set_num_threads(threads)
        _reset_accelerate()
    out, err = capfd.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert report["mode"] == "hf" and report["rounds"] == 1 and report["trainer_timing"] == "window"
    assert math.isfinite(report["ratio_wall_median"]) and math.isfinite(report["ratio_cpu_median"])
    assert "trainer (eager) / plain loop (eager): wall" in err
