"""The tests of test_bench.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring. The modes that start no process of their own (mnist,
bert, bert-loader) and those whose trainer runs are processes of the command's own (scaling, fsdp) run bench.main,
the command's, in this process (bench_here: a process's ~3 s of imports saved each); the bert-loader's
loader-only run is the command itself (python -m textbox_like.tools.bench)."""
from __future__ import annotations

import json
import math

import pytest

from test_bert_train import bert_data  # noqa: F401  (fixture)
from test_bench import run_bench


def bench_here(capfd, *args):
    """(report, stderr) of bench.main(args) in this process, Accelerate's state reset around it (its trainer
    runs are in-process) and torch's thread count (--threads) restored after it."""
    import torch

    from conftest import _reset_accelerate
    from textbox_like.tools import bench
    capfd.readouterr()
    threads = torch.get_num_threads()
    _reset_accelerate()
    try:
        assert bench.main([str(a) for a in args]) == 0
    finally:
        torch.set_num_threads(threads)
        _reset_accelerate()
    out, err = capfd.readouterr()
    return json.loads(out.strip().splitlines()[-1]), err


# ---------------------------------------------------------------- trainer vs plain loop
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_runs_for_mnist(small_mnist_dir, capfd):
    report, err = bench_here(capfd, "mnist", "--data", small_mnist_dir, "--updates", 4, "--warmup", 2, "--rounds", 2,
                            "--threads", 1)
    assert report["mode"] == report["task"] == "mnist" and report["rounds"] == 2
    assert report["trainer_compiled"] is False and report["plain_compiled"] is False
    for key in ("ratios_wall", "ratios_cpu", "plain_samples_per_s_rounds", "trainer_samples_per_s_rounds"):
        # a steady state measured by differencing two runs can come out at
        # any value on a loaded machine: the shape is checked, not the speed
        assert len(report[key]) == 2 and all(math.isfinite(x) for x in report[key])
    assert math.isfinite(report["ratio_wall_median"]) and math.isfinite(report["ratio_cpu_median"])
    assert err.count("round ") >= 2 and "trainer (eager) / plain loop (eager): wall" in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_runs_for_bert(bert_data, capfd):  # noqa: F811
    report, _ = bench_here(capfd, "bert", "--data", bert_data / "shards", "--dict", bert_data / "vocab.txt",
                          "--config_file", bert_data / "bert_config.json", "--max-sentences", 8,
                          "--updates", 3, "--warmup", 1, "--rounds", 1, "--threads", 1)
    assert report["task"] == "bert" and math.isfinite(report["ratio_wall_median"]) and len(report["ratios_cpu"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaling_runs_two_processes(small_mnist_dir, capfd):
    # the fewest updates that measure (one window after the first log): start-up is most of the time
    report, err = bench_here(capfd, "scaling", "--data", small_mnist_dir, "--updates", 1, "--warmup", 1, "--rounds", 1,
                            "--update-freq", 2, "--max-sentences", 32)
    assert report["processes"] == 2 and report["update_freq"] == 2 and report["batch_per_process"] == 32
    assert report["one_process_samples_per_s"] > 0 and report["n_processes_samples_per_s"] > 0
    assert len(report["expansions"]) == 1 and report["expansion_median"] > 0
    assert "expansion (2-process / (2 x 1-process))" in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_runs_two_ranks_both_ways(capfd):
    report, err = bench_here(capfd, "fsdp", "--model", "tiny", "--layers", 2, "--rounds", 1, "--updates", 1,
                             "--warmup", 1, "--synthetic-samples", 64, "--seq-length", 32)
    assert report["mode"] == "fsdp" and report["processes"] == 2 and report["memory_key"] == "peak_rss_gib"
    for side in ("ddp", "fsdp"):
        (per_rank,) = report[f"{side}_peak_gib_per_rank_rounds"]
        # the log's figure per rank: each rank is a whole Python process with torch, well above 0.1 GiB
        assert len(per_rank) == 2 and all(0.1 < gib < 64 for gib in per_rank), report
        assert report[f"{side}_samples_per_s"] > 0
    assert len(report["memory_ratios"]) == 1 and report["memory_ratio_median"] > 0
    assert len(report["samples_per_s_ratios"]) == 1 and report["samples_per_s_ratio_median"] > 0
    assert "FSDP/DDP peak memory (max over ranks)" in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_peft_compares_a_full_fine_tune_with_lora_on_two_ranks(tmp_path, capfd):
    """One round of one layer on generated sentences: each side's figures measured from its own run (the
    trained parameters of its start line, its checkpoint's and optimizer state's bytes, each rank's peak), and
    the LoRA side the smaller in every one of them."""
    report, err = bench_here(capfd, "peft", "--layers", 1, "--rounds", 1, "--updates", 1, "--warmup", 1,
                             "--max-length", 16, "--corpus", tmp_path / "none.txt")
    assert report["mode"] == "peft" and report["processes"] == 2 and report["layers"] == 1
    full, lora = report["full"], report["lora"]
    # GPT-2's 50,257 x 768 embeddings and one block all trained, against LoRA r 8 on c_attn (768 in, 2,304 out)
    assert full["trainable_params"] > 38_000_000 and lora["trainable_params"] == 8 * (768 + 2304)
    for key in ("checkpoint_bytes", "optimizer_state_bytes"):
        assert lora[key] < 0.05 * full[key], (key, lora[key], full[key])
    assert 0.1 < lora["peak_gib_per_rank"] < full["peak_gib_per_rank"]
    assert full["tokens_per_s"] > 0 and lora["tokens_per_s"] > 0
    assert set(report["lora_over_full"]) == set(full) and "medians, LoRA / full" in err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_packing_and_streaming_compare_ours_with_transformers_trainer(tmp_path, capfd):
    """One round on a corpus of varied lengths: every side trains and reports real tokens/s (ours padded,
    packed, streamed, streamed and packed; transformers' Trainer padded and packed; the figures are the
    benchmark's to report, not asserted), and a streamed run saved at update 3 and one saved at update 10
    each resume for one more update."""
    import random
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    (tmp_path / "corpus.txt").write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(2, 60)))
                                                 + "\n" for _ in range(400)))
    report, err = bench_here(capfd, "hf", "--packing", "--streaming", "--rounds", 1, "--updates", 6, "--warmup", 2,
                             "--layers", 1, "--hidden", 32, "--max-length", 64, "--max-sentences", 8,
                             "--resume-at", 3, "--corpus", tmp_path / "corpus.txt")
    rates = report["real_tokens_per_s"]
    assert set(rates) == {"padded", "packed", "streamed", "streamed_packed", "trainer_padded", "trainer_packed"}
    assert all(rate > 0 for rate in rates.values()), rates
    assert set(report["ratios"]) == set(report["goals"]) and set(report["resume_seconds"]) == {"10", "3"}
    assert "medians:" in err


# ---------------------------------------------------------------- BERT loader
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bert_loader_synthetic(capfd):
    report, err = bench_here(capfd, "bert-loader", "--synthetic-samples", 64, "--batch", 8, "--steps", 1, "--rounds", 1,
                            "--threads", 1)
    assert report["mode"] == "bert-loader" and report["synthetic"] and report["samples"] == 64
    assert report["seq_length"] == 128 and report["predictions"] == 20
    for key in ("loader_samples_per_s_rounds", "train_masked_samples_per_s_rounds",
                "train_full_samples_per_s_rounds", "loader_over_training", "masked_head_speedups"):
        assert len(report[key]) == 1 and all(x > 0 for x in report[key])
    assert report["loader_over_training_median"] > 0 and "loader / training (masked head)" in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bert_loader_on_shards_loader_only(bert_data):  # noqa: F811
    report, _ = run_bench("bert-loader", "--data", bert_data / "shards", "--batch", 4, "--no-train", "--rounds", 2)
    assert len(report["loader_samples_per_s_rounds"]) == 2 and report["synthetic"] is False and report["seq_length"] == 32 and report["loader_samples_per_s"] > 0
    assert "train_masked_samples_per_s" not in report
