"""python -m textbox_like.tools.bench, every mode on tiny settings. Nothing here is
timed: the tests check that each mode runs and reports what it promises
(medians, per-round figures, ratios), never the figures themselves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textbox_like.tools import bench


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable


def run_bench(*args, timeout=280):
    out = subprocess.run([PY, "-m", "textbox_like.tools.bench", *map(str, args)], capture_output=True, text=True,
                         cwd=REPO, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def bench_in_process(capsys, *args):
    threads = torch.get_num_threads()
    try:
        assert bench.main([str(a) for a in args]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return json.loads(out.out.strip().splitlines()[-1]), out.err


def test_compile_goes_to_the_trainer_and_compile_plain_to_the_plain_loop(small_mnist_dir, capsys, monkeypatch):
    """Wiring only (compiling for real takes minutes here): --compile reaches the
    trainer's command line, --compile-plain wraps the plain loop's model (the
    trainer timed by the difference of two runs, which the stub replaces)."""
    trainer_argvs, compiled = [], []
    monkeypatch.setattr(bench, "trainer_seconds", 
                        lambda argv, updates: (trainer_argvs.append(argv), (0.1 * updates, 0.1 * updates))[1])
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: (compiled.append((type(model).__name__, mode)),
                                                                    model)[1])
    report, err = bench_in_process(capsys, "mnist", "--data", small_mnist_dir, "--updates", 2, "--warmup", 1,
                                   "--rounds", 1, "--threads", 1, "--compile", "--compile_mode", "max-autotune",
                                   "--compile-plain", "--trainer-timing", "difference")
    assert trainer_argvs and all("--compile" in argv for argv in trainer_argvs)
    assert all(argv[argv.index("--compile_mode") + 1] == "max-autotune" for argv in trainer_argvs)
    assert compiled == [("MNISTNet", "max-autotune")]
    assert report["trainer_compiled"] is True and report["plain_compiled"] is True
    assert "trainer (compiled) / plain loop (compiled)" in err

    trainer_argvs.clear(), compiled.clear()
    report, err = bench_in_process(capsys, "mnist", "--data", small_mnist_dir, "--updates", 2, "--warmup", 1,
                                   "--rounds", 1, "--threads", 1, "--compile", "--trainer-timing", "difference")
    assert all("--compile" in argv for argv in trainer_argvs) and compiled == []
    assert report["trainer_compiled"] is True and report["plain_compiled"] is False


# ---------------------------------------------------------------- scaling
def test_scaling_expansion_and_update_freq(capsys, monkeypatch):
    """Per-round figures, medians and expansion = N-process / (N x 1-process), from stubbed runs."""
    rates = iter([100.0, 180.0, 90.0, 171.0, 110.0, 187.0])   # (1 process, 2 processes) per round
    calls = []
    monkeypatch.setattr(bench, "scaling_run", lambda base, n, args: (calls.append((base, n)), next(rates))[1])
    report, err = bench_in_process(capsys, "scaling", "--processes", 2, "--update-freq", 4, "--rounds", 3,
                                   "--updates", 5)
    assert [n for _, n in calls] == [1, 2] * 3
    base = calls[0][0]
    assert base[base.index("--update-freq") + 1] == "4" and base[base.index("--threads") + 1] == "1"
    assert report["mode"] == "scaling" and report["processes"] == 2 and report["update_freq"] == 4
    assert report["expansions"] == [0.9, 0.95, 0.85] and report["expansion_median"] == 0.9
    assert report["one_process_samples_per_s_rounds"] == [100.0, 90.0, 110.0]
    assert report["one_process_samples_per_s"] == 100.0 and report["n_processes_samples_per_s"] == 180.0
    assert "expansion (2-process / (2 x 1-process)): 0.900" in err


# ---------------------------------------------------------------- fsdp
def test_fsdp_rounds_alternate_and_ratios(capsys, monkeypatch):
    """Rounds alternate which run goes first; the ratios are FSDP/DDP of the
    highest rank's peak and of samples/s, per round and as medians (stubbed runs)."""
    figures = {False: iter([(10.0, [4.0, 4.2]), (12.0, [4.0, 4.0]), (11.0, [4.1, 4.0])]),
               True: iter([(8.0, [2.0, 2.1]), (9.0, [2.4, 2.0]), (8.8, [2.05, 2.05])])}
    calls = []
    monkeypatch.setattr(bench, "fsdp_run", lambda base, sharded, args, key: (
        calls.append((base, sharded, key)), next(figures[sharded]))[1])
    report, err = bench_in_process(capsys, "fsdp", "--rounds", 3, "--model", "tiny", "--layers", 2)
    assert [sharded for _, sharded, _ in calls] == [False, True, True, False, False, True]
    base, _, key = calls[0]
    assert key == "peak_rss_gib" and report["memory_key"] == "peak_rss_gib"
    assert base[base.index("--model-preset") + 1] == "tiny" and base[base.index("--num-layers") + 1] == "2"
    assert report["ddp_peak_gib_per_rank_rounds"] == [[4.0, 4.2], [4.0, 4.0], [4.1, 4.0]]
    assert report["fsdp_peak_gib_per_rank"] == [2.05, 2.05] and report["ddp_peak_gib_per_rank"] == [4.0, 4.0]
    assert report["memory_ratios"] == [0.5, 0.6, 0.5] and report["memory_ratio_median"] == 0.5
    assert report["samples_per_s_ratios"] == [0.8, 0.75, 0.8] and report["samples_per_s_ratio_median"] == 0.8
    assert "FSDP/DDP peak memory (max over ranks): 0.500" in err and "FSDP/DDP samples/s: 0.800" in err


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("args, words", [
    (["nosuchmode"], "invalid choice"),
    (["bert-loader", "--bogus"], "--bogus"),
    (["scaling", "--processes", "1"], "--processes"),
    (["fsdp", "--updates", "0"], "--updates"),
    (["mnist", "--updates", "0"], "--updates"),
    (["mnist", "--peak-tflops", "0"], "--peak-tflops"),
])
def test_bad_command_lines_are_one_line_errors(args, words, capfd, monkeypatch):
    """In-process (each is refused before anything runs): bench.main's exit
    code (argparse's SystemExit for a bad mode or option) and its stderr."""
    monkeypatch.chdir(REPO)
    threads = torch.get_num_threads()
    capfd.readouterr()
    try:
        code = bench.main(args)
    except SystemExit as exc:
        code = exc.code
    finally:
        torch.set_num_threads(threads)
    err = capfd.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


# ---------------------------------------------------------------- GPU figures (pure arithmetic)
def test_model_flops_of_bert_base():
    """6 x params x tokens + 12 x layers x hidden x seq^2: BERT-base (110M
    parameters with the pre-training heads) at seq 128 is about 675 MFLOP a
    token, attention 2% of it."""
    from transformers import BertConfig, BertForPreTraining
    with torch.device("meta"):
        params = sum(p.numel() for p in BertForPreTraining(BertConfig()).parameters())
    assert 109e6 < params < 111e6
    per_seq = bench.train_flops_per_sequence(params, 12, 768, 128)
    assert per_seq == 6 * params * 128 + 12 * 12 * 768 * 128 ** 2
    assert 670e6 < per_seq / 128 < 680e6
    assert bench.train_flops_per_sequence(1000, 2, 8, 4) == 6 * 1000 * 4 + 12 * 2 * 8 * 16


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 SXM5 80GB", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 NVL", None), ("NVIDIA GeForce RTX 4090", None), ("", None), (None, None)])
def test_peak_bf16_by_gpu_name(name, peak):
    assert bench.peak_bf16_flops(name) == peak


def test_mfu_figures_from_samples_per_s():
    shape = {"params": 110_000_000, "layers": 12, "hidden": 768, "seq_length": 128}
    report = {"plain_samples_per_s": 2000.0, "trainer_samples_per_s": 1900.0}
    out = bench.throughput_figures(report, shape, "NVIDIA H100 80GB HBM3")
    per_sample = bench.train_flops_per_sequence(110_000_000, 12, 768, 128)
    assert out["trainer_tokens_per_s"] == 1900.0 * 128 and out["model_flops_per_sample"] == per_sample
    assert out["trainer_mfu"] == round(1900.0 * per_sample / 989e12, 4) and out["peak_bf16_tflops"] == 989.0
    assert out["plain_mfu"] > out["trainer_mfu"]
    unknown = bench.throughput_figures(report, shape, "NVIDIA GeForce RTX 4090")
    assert "trainer_mfu" not in unknown and unknown["trainer_model_tflops_per_s"] > 0
    assert "no bf16 peak known" in bench.describe_throughput({**report, **unknown, "gpu": "NVIDIA GeForce RTX 4090"})
    given = bench.throughput_figures(report, shape, None, peak_tflops=500)
    assert given["trainer_mfu"] == round(1900.0 * per_sample / 500e12, 4) and given["peak_source"] == "--peak-tflops"
    assert "trainer_mfu" not in bench.throughput_figures(report, shape, None)  # CPU: no MFU
