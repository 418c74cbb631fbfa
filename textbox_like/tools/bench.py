"""Benchmarks of the trainer, in one place: against a plain PyTorch loop, across processes, and the BERT loader.

    python -m textbox_like.tools.bench mnist [--data DIR] [--updates 300] [--rounds 5] [--threads 1]
    python -m textbox_like.tools.bench bert --model-preset tiny --data DIR --dict vocab.txt --max-sentences 32
    python -m textbox_like.tools.bench hf --model_name_or_path GPT2_DIR --data DIR --max-sentences 16
    python -m textbox_like.tools.bench mnist --compile [--compile_mode MODE] [--compile-plain]
    python -m textbox_like.tools.bench scaling [--data DIR] [--processes 2] [--update-freq K] [--updates 300] [--hooks none,fp16,bf16,powersgd]
    python -m textbox_like.tools.bench bert-loader [--data DIR] [--batch 32] [--no-train]
    python -m textbox_like.tools.bench fsdp [--rounds 5] [--updates 3] [--model large] [--layers 12]
    python -m textbox_like.tools.bench peft [--rounds 5] [--updates 3] [--layers 12] (tools/bench_peft.py)
    python -m textbox_like.tools.bench hf --packing --streaming [--rounds 5] (tools/bench_data.py)

mnist, bert, hf: the trainer against a plain loop of the same work. Both sides
use the same model, batch size, optimizer, clipping, threads and data; the
trainer is run through its real command line, in this process. The plain loop
is timed over N updates after a warm-up. The trainer is timed over the same
window of one run (updates warm-up + 1 .. warm-up + N, read by a periodic
event of its own), so its start-up, data loading, warm-up and compilation
are outside; ``--trainer-timing difference`` times it as the difference of
two runs (warm-up + N updates, and warm-up alone) instead, the method of
figures before 2026-11-26 (one untimed trainer run first fills import and
compile caches). Rounds alternate the two so that
drift in machine load hits both alike; the report gives per round and as a
median the ratio trainer / plain of samples/s, by wall time and by CPU time
(the process's own CPU seconds: with one thread, the figure least disturbed
by other load on a shared machine). --compile compiles the trainer's side
(the trainer's own --compile); the plain loop stays eager unless
--compile-plain, which wraps its model in torch.compile.

On CUDA (unless --cpu) both sides run on the GPU: the plain loop moves its
model and data there, takes the trainer's precision (--bf16, --fp16 with a
loss scaler, --train_dtype) and its fused optimizer; the timings wait for
the GPU (torch.cuda.synchronize). Each side's peak memory is reported
(torch.cuda.max_memory_allocated). bert reports tokens/s and model FLOPs/s
on every device and, on a GPU whose bf16 peak is known (H100 SXM/PCIe, H200,
A100; --peak-tflops otherwise), MFU: model FLOPs per second over that peak,
counting 6 x parameters x tokens for a training step plus attention's
12 x layers x hidden x seq^2 per sequence.

scaling: samples/s of training with 1 process against N processes at one
thread each (whole trainer runs, subprocesses). Each process keeps its
batch, so N processes train on N times the samples per update. --hooks
none,fp16,bf16,powersgd runs the N processes once per --ddp-comm-hook.
Figures come from the trainer's own metrics.jsonl after its first log window
(start-up and compilation excluded). expansion = N-process samples/s /
(N x 1-process samples/s); 1.0 is perfect. Trainer options pass through
(--update-freq K, --compile, --task bert ...).

fsdp: the same model on 2 ranks (subprocess trainer runs; CPU: gloo, one
thread each; CUDA: one GPU per rank) under DDP and under --fsdp, the order
reversed every other round: each rank's peak memory from the trainer's log
(peak_rss_gib, on CUDA peak_mem_gib), samples/s after the first log window
(as scaling), and the medians of FSDP/DDP peak memory (the highest rank's)
and FSDP/DDP samples/s. BERT-large of --layers 12 on synthetic shards by
default.

bert-loader: how fast the BERT HDF5 loader serves batches (a fresh dataset
reading its shuffled-block order, cold: every block decompressed once),
against how fast tiny-BERT training (forward, backward, AdamW step) eats
them, with the masked-positions MLM head and with BertForPreTraining's full
head. Without --data, synthetic shards (seq 128, 20 predictions) are written
to a temporary directory. The target for loader / training is >= 20.

Each mode prints one line per round and a summary on stderr, and one JSON
object (medians and per-round figures) as the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PLAIN_LOOPS = {}


def plain_loop(name):
    def deco(fn):
        PLAIN_LOOPS[name] = fn
        return fn
    return deco


def _cfg_for(args_list):
    from textbox_like.resolve.resolution import parse
    cfg = parse(args_list)
    return cfg


def plain_optimizer(cfg, model, fused=False):
    """The same torch.optim class and arguments the trainer uses, one group
    (fused where the trainer fuses: on CUDA without a loss scaler)."""
    from textbox_like.optim import build_optimizer
    return build_optimizer(cfg.optim, [{"params": list(model.parameters())}], fused_default=fused)


# ---------------------------------------------------------------- devices and FLOPs
def bench_device(cfg):
    """The device the trainer takes for one process: CUDA when present,
    unless --cpu / --device cpu; --device cudaN / --device-id N pick the GPU."""
    import torch
    if cfg.runtime.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", (cfg.distributed.device_id or 0) % torch.cuda.device_count())


class PlainPrecision:
    """The trainer's precision for the plain loop on CUDA: autocast to bf16 or
    fp16, a GradScaler with fp16. On CPU the plain loop stays float32, as it
    always has."""

    def __init__(self, cfg, device):
        import torch
        from textbox_like.parallel.accelerator import mixed_precision
        chosen = mixed_precision(cfg.numerics, device.type == "cuda") if device.type == "cuda" else "no"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(chosen)
        self.device = device
        self.scaler = torch.amp.GradScaler("cuda") if chosen == "fp16" else None

    def dtype_name(self):
        return "float32" if self.dtype is None else str(self.dtype).replace("torch.", "")

    def autocast(self):
        import contextlib

        import torch
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, loss, model, optimizer, clip_norm):
        import torch
        if self.scaler is None:
            loss.backward()
            if clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            if clip_norm > 0:
                self.scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad(set_to_none=True)


def _sync(device):
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def _clock(device):
    """(wall, cpu) now, after the device's queued work is done."""
    _sync(device)
    return time.perf_counter(), time.process_time()


# dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a part of the GPU's name
PEAK_BF16 = (("H100", "PCIE", 756e12), ("H100", "SXM", 989e12), ("H100", "HBM3", 989e12),
             ("H200", "", 989e12), ("A100", "", 312e12))


def peak_bf16_flops(gpu_name):
    """The card's dense bf16 peak in FLOP/s from its name, or None when unknown
    (H100 NVL, consumer cards, ...): MFU is then left out."""
    name = (gpu_name or "").upper()
    for model, variant, peak in PEAK_BF16:
        if model in name and variant in name:
            return peak
    return None


def train_flops_per_sequence(params, layers, hidden, seq):
    """Model FLOPs of one training step on one sequence (forward and backward):
    6 x parameters x tokens for the matrix products with the weights, plus
    attention's scores and weighted sums, 12 x layers x hidden x seq^2."""
    return 6 * params * seq + 12 * layers * hidden * seq ** 2


def mfu(flops_per_s, peak):
    return flops_per_s / peak if peak else None


def bert_shape(cfg):
    """Parameters, layers, hidden size and sequence length of the bench's BERT
    (the parameters counted on the meta device: nothing is allocated)."""
    import torch
    from transformers import BertForPreTraining

    from textbox_like.tasks import TASKS
    task = TASKS.get("bert")(cfg)
    config = task.model_config()
    seq = int(task.build_dataset(cfg.data.train_subset).seq_length)
    with torch.device("meta"):
        params = sum(p.numel() for p in BertForPreTraining(config).parameters())
    return {"params": int(params), "layers": int(config.num_hidden_layers), "hidden": int(config.hidden_size),
            "seq_length": seq}


def _peak_gib(device):
    import torch
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def _reset_peak(device):
    if device.type == "cuda":
        import torch
        torch.cuda.reset_peak_memory_stats(device)


def _maybe_compile(model, compiled, mode):
    if not compiled:
        return model
    import torch
    return torch.compile(model, mode=None if mode == "default" else mode)


@plain_loop("mnist")
def plain_mnist(cfg, warmup, updates, compiled=False):
    """The loop a person would write for HetSeq's MNIST recipe."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from textbox_like.data.mnist import MNISTDataset, ensure_mnist, load_split
    from textbox_like.models.mnist_cnn import MNISTNet

    torch.manual_seed(cfg.numerics.seed)
    device = bench_device(cfg)
    data = MNISTDataset(*load_split(ensure_mnist(cfg.data.data), "train"))
    images, labels = data.images.to(device), data.labels.to(device)
    model = MNISTNet().to(device)
    amp = PlainPrecision(cfg, device)
    optimizer = plain_optimizer(cfg, model, fused=device.type == "cuda" and amp.scaler is None)
    forward = _maybe_compile(model, compiled, cfg.runtime.compile_mode)
    bs = cfg.data.max_sentences
    order = torch.from_numpy(np.random.default_rng(cfg.numerics.seed).permutation(len(data))).to(device)
    model.train()
    start = None
    for step in range(warmup + updates):
        if step == warmup:
            start = _clock(device)
        i = (step * bs) % max(len(data) - bs, 1)
        idx = order[i:i + bs]
        x, y = images.index_select(0, idx), labels.index_select(0, idx)
        with amp.autocast():
            loss = F.nll_loss(forward(x), y)
        amp.step(loss, model, optimizer, cfg.schedule.clip_norm)
    end = _clock(device)
    return end[0] - start[0], end[1] - start[1]


@plain_loop("bert")
def plain_bert(cfg, warmup, updates, compiled=False):
    """transformers' BertForPreTraining as its documentation uses it: labels
    over all positions, the 30k-way MLM head over every token."""
    import numpy as np
    import torch

    from textbox_like.models.bert import full_labels
    from textbox_like.tasks import TASKS
    from transformers import BertForPreTraining

    torch.manual_seed(cfg.numerics.seed)
    device = bench_device(cfg)
    task = TASKS.get("bert")(cfg)
    data = task.build_dataset(cfg.data.train_subset)
    n = min(len(data), (warmup + updates) * cfg.data.max_sentences)
    # in memory (on the GPU with CUDA): no I/O inside the timed loop
    batch_all = {k: v.to(device) for k, v in data.get_batch(np.arange(n)).items()}
    model = BertForPreTraining(task.model_config()).to(device)
    amp = PlainPrecision(cfg, device)
    optimizer = plain_optimizer(cfg, model, fused=device.type == "cuda" and amp.scaler is None)
    forward = _maybe_compile(model, compiled, cfg.runtime.compile_mode)
    bs = cfg.data.max_sentences
    model.train()
    start = None
    for step in range(warmup + updates):
        if step == warmup:
            start = _clock(device)
        i = (step * bs) % max(n - bs, 1)
        b = {k: v[i:i + bs] for k, v in batch_all.items()}
        labels = full_labels(b["input_ids"], b["masked_lm_positions"], b["masked_lm_ids"])
        with amp.autocast():
            out = forward(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                          token_type_ids=b["token_type_ids"], labels=labels,
                          next_sentence_label=b["next_sentence_labels"])
        amp.step(out.loss, model, optimizer, cfg.schedule.clip_norm)
    end = _clock(device)
    return end[0] - start[0], end[1] - start[1]


@plain_loop("hf")
def plain_hf(cfg, warmup, updates, compiled=False):
    """The hf task's model as transformers' documentation trains it (its own
    loss: ``model(..., labels=labels).loss``), on the very batches the trainer
    reads in one process (its epoch order cut in --max-sentences), gathered
    beforehand: the same tokens per update on both sides, so the ratio of
    samples/s is the ratio of tokens/s."""
    import numpy as np
    import torch

    from textbox_like.tasks import TASKS

    torch.manual_seed(cfg.numerics.seed)
    device = bench_device(cfg)
    task = TASKS.get("hf")(cfg)
    data = task.build_dataset(cfg.data.train_subset)
    bs, steps = cfg.data.max_sentences, warmup + updates
    batches, epoch, order = [], 1, np.zeros(0, dtype=np.int64)
    while len(batches) < steps:  # the trainer's plan: whole batches of each epoch's order
        order = data.epoch_order(cfg.numerics.seed, epoch, not cfg.data.no_shuffle)
        for i in range(0, len(order), bs):
            batches.append({k: v.to(device) for k, v in data.get_batch(order[i:i + bs]).items()})
        epoch += 1
    model = task.build_model().to(device)
    amp = PlainPrecision(cfg, device)
    optimizer = plain_optimizer(cfg, model, fused=device.type == "cuda" and amp.scaler is None)
    forward = _maybe_compile(model, compiled, cfg.runtime.compile_mode)
    model.train()
    start = None
    for step in range(steps):
        if step == warmup:
            start = _clock(device)
        with amp.autocast():
            out = forward(**batches[step])
        amp.step(out.loss, model, optimizer, cfg.schedule.clip_norm)
    end = _clock(device)
    return end[0] - start[0], end[1] - start[1]


def timed_run_argv(argv, updates, save_dir):
    """``argv`` as a timed trainer run: ``updates`` updates, nothing logged,
    validated or saved."""
    return argv + ["--max-update", str(updates), "--log-interval", "0", "--disable-validation",
                   "--log-format", "none", "--save-dir", save_dir, "--no-save", "--max-epoch", "0"]


def trainer_seconds(argv, updates):
    """(wall, cpu) seconds of a whole trainer run of ``updates`` updates."""
    from textbox_like.cli import main
    with tempfile.TemporaryDirectory() as out:
        start = (time.perf_counter(), time.process_time())
        code = main(timed_run_argv(argv, updates, out))
        if code != 0:
            raise SystemExit(f"trainer exited with {code}")
        _sync_cuda_if_used()
        return time.perf_counter() - start[0], time.process_time() - start[1]


def _sync_cuda_if_used():
    """Wait for the GPU's queued work, where this process used one (CPU: nothing)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def trainer_steady_seconds(argv, warmup, updates):
    """Seconds of ``updates`` steady-state updates: a run of warmup + updates
    minus a run of warmup, so start-up, data loading and warm-up cancel."""
    long_wall, long_cpu = trainer_seconds(argv, warmup + updates)
    short_wall, short_cpu = trainer_seconds(argv, warmup)
    return long_wall - short_wall, long_cpu - short_cpu


def trainer_window_seconds(argv, warmup, updates):
    """(wall, cpu) seconds of updates warmup + 1 .. warmup + updates of one
    trainer run, the window the plain loop times: a periodic event of its
    own (Trainer.add_event) reads the clocks after update ``warmup`` and
    after the last. One run instead of two: the start-up's noise is not in
    the figure."""
    from textbox_like.resolve.resolution import parse
    from textbox_like.processes.distributed import apply_determinism
    from textbox_like.training.due import EveryUpdates
    from textbox_like.training.outcome import build_trainer, run

    class Stopwatch(EveryUpdates):
        def __init__(self):
            super().__init__(0)
            self.marks = {}

        def should_run(self, update):
            return update in (warmup, warmup + updates)

        def run(self, trainer):
            _sync_cuda_if_used()
            self.marks[trainer.state.num_updates] = (time.perf_counter(), time.process_time())

    with tempfile.TemporaryDirectory() as out:
        cfg = parse(timed_run_argv(argv, warmup + updates, out))
        apply_determinism(cfg)
        trainer = build_trainer(cfg)
        watch = Stopwatch()
        trainer.add_event(watch)
        code = run(trainer)
    if code != 0 or len(watch.marks) != 2:
        raise SystemExit(f"trainer exited with {code} after {sorted(watch.marks)} of updates {warmup}, "
                         f"{warmup + updates}")
    (w0, c0), (w1, c1) = watch.marks[warmup], watch.marks[warmup + updates]
    return w1 - w0, c1 - c0


#: how the trainer's steady state is timed (--trainer-timing)
TRAINER_TIMINGS = {"window": trainer_window_seconds, "difference": trainer_steady_seconds}


def _r(x, digits=3):
    return round(x, digits)


def _fmt_rounds(values):
    return " ".join(f"{v:.3f}" for v in values)


def _user_error(exc):
    print(f"error: {exc}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------- trainer vs plain loop
def compare_main(args, rest):
    from textbox_like.core.errors import UserError
    task_args = ["--task", args.mode] + rest + (["--compile"] if args.compile else [])
    try:
        cfg = _cfg_for(task_args)
        if not cfg.data.max_sentences:
            raise UserError("the benchmark compares fixed batches: give --max-sentences N")
        if args.updates < 1 or args.warmup < 1 or args.rounds < 1:
            raise UserError("--updates, --warmup and --rounds must be at least 1")
        if args.peak_tflops is not None and not args.peak_tflops > 0:
            raise UserError(f"--peak-tflops expects a number of TFLOP/s above 0, got {args.peak_tflops}")
        device = bench_device(cfg)
        shape = bert_shape(cfg) if args.mode == "bert" else None
    except UserError as exc:
        return _user_error(exc)
    import torch
    threads = cfg.runtime.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    trainer_argv = task_args + ["--threads", str(threads)]
    batch, n = cfg.data.max_sentences, args.updates
    sides = (f"trainer ({'compiled' if args.compile else 'eager'}) / "
             f"plain loop ({'compiled' if args.compile_plain else 'eager'})")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"{args.mode}: {sides}, {n} timed updates after {args.warmup}, batch {batch}, {threads} thread(s), "
          f"{args.rounds} rounds" + (f", on {device} ({gpu})" if gpu else ""), file=sys.stderr)
    trainer_seconds(trainer_argv, args.warmup)  # untimed: imports, compile caches
    plain, ours, plain_mem, ours_mem = [], [], [], []
    for r in range(args.rounds):
        _reset_peak(device)
        plain.append(PLAIN_LOOPS[args.mode](cfg, args.warmup, n, compiled=args.compile_plain))
        plain_mem.append(_peak_gib(device))
        _reset_peak(device)
        ours.append(TRAINER_TIMINGS[args.trainer_timing](trainer_argv, args.warmup, n))
        ours_mem.append(_peak_gib(device))
        if min(ours[-1]) <= 0 or min(plain[-1]) <= 0:
            raise SystemExit(f"round {r + 1}: {n} updates took no measurable time; raise --updates")
        print(f"round {r + 1}: samples/s plain {n * batch / plain[-1][0]:.1f}, trainer {n * batch / ours[-1][0]:.1f}; "
              f"trainer/plain wall {plain[-1][0] / ours[-1][0]:.3f}, cpu {plain[-1][1] / ours[-1][1]:.3f}",
              file=sys.stderr)
    wall = [p[0] / o[0] for p, o in zip(plain, ours)]
    cpu = [p[1] / o[1] for p, o in zip(plain, ours)]
    report = {
        "mode": args.mode, "task": args.mode, "trainer_compiled": args.compile, "plain_compiled": args.compile_plain,
        "threads": threads, "batch": batch, "updates": n, "warmup": args.warmup, "rounds": args.rounds,
        "trainer_timing": args.trainer_timing,
        "plain_samples_per_s": round(n * batch / statistics.median(p[0] for p in plain), 1),
        "trainer_samples_per_s": round(n * batch / statistics.median(o[0] for o in ours), 1),
        "ratio_wall_median": _r(statistics.median(wall)), "ratio_cpu_median": _r(statistics.median(cpu)),
        "ratios_wall": [_r(x) for x in wall], "ratios_cpu": [_r(x) for x in cpu],
        "plain_samples_per_s_rounds": [round(n * batch / p[0], 1) for p in plain],
        "trainer_samples_per_s_rounds": [round(n * batch / o[0], 1) for o in ours],
        "ratio": "trainer samples/s / plain samples/s (plain seconds / trainer seconds)"}
    if device.type == "cuda":
        report.update({"device": str(device), "gpu": gpu, "precision": PlainPrecision(cfg, device).dtype_name(),
                       "plain_peak_mem_gib": round(max(plain_mem), 3), "trainer_peak_mem_gib": round(max(ours_mem), 3)})
    lines = []
    if shape is not None:
        report.update(throughput_figures(report, shape, gpu, args.peak_tflops))
        lines.append(describe_throughput(report))
    if device.type == "cuda":
        lines.append(f"peak memory (max of rounds): plain {report['plain_peak_mem_gib']:.2f} GiB, "
                     f"trainer {report['trainer_peak_mem_gib']:.2f} GiB")
    print(f"median of {args.rounds} rounds: samples/s plain {report['plain_samples_per_s']}, trainer "
          f"{report['trainer_samples_per_s']}\n{sides}: wall {report['ratio_wall_median']:.3f} "
          f"(rounds {_fmt_rounds(wall)}), cpu {report['ratio_cpu_median']:.3f} (rounds {_fmt_rounds(cpu)})"
          + "".join("\n" + line for line in lines), file=sys.stderr)
    print(json.dumps(report))
    return 0


def throughput_figures(report, shape, gpu, peak_tflops=None):
    """Tokens/s, model FLOPs/s and (where the peak is known) MFU of both
    sides, from their median samples/s and the model's shape."""
    seq = shape["seq_length"]
    per_sample = train_flops_per_sequence(shape["params"], shape["layers"], shape["hidden"], seq)
    peak = peak_tflops * 1e12 if peak_tflops else (peak_bf16_flops(gpu) if gpu else None)
    out = {"params": shape["params"], "layers": shape["layers"], "hidden": shape["hidden"], "seq_length": seq,
           "model_flops_per_sample": per_sample,
           "model_flops": "6 x params x tokens + 12 x layers x hidden x seq^2 per sequence (training step)"}
    if peak:
        out.update({"peak_bf16_tflops": round(peak / 1e12, 1),
                    "peak_source": "--peak-tflops" if peak_tflops else "table by GPU name"})
    for side in ("plain", "trainer"):
        rate = report[f"{side}_samples_per_s"]
        out[f"{side}_tokens_per_s"] = round(rate * seq, 1)
        out[f"{side}_model_tflops_per_s"] = round(rate * per_sample / 1e12, 3)
        if peak:
            out[f"{side}_mfu"] = round(mfu(rate * per_sample, peak), 4)
    return out


def describe_throughput(report):
    text = (f"tokens/s plain {report['plain_tokens_per_s']:,.0f}, trainer {report['trainer_tokens_per_s']:,.0f} "
            f"(seq {report['seq_length']}); model TFLOP/s plain {report['plain_model_tflops_per_s']:.2f}, "
            f"trainer {report['trainer_model_tflops_per_s']:.2f}")
    if "trainer_mfu" in report:
        text += (f"; MFU plain {100 * report['plain_mfu']:.1f}%, trainer {100 * report['trainer_mfu']:.1f}% "
                 f"of {report['peak_bf16_tflops']:.0f} TFLOP/s bf16")
    elif report.get("gpu"):
        text += f"; MFU left out: no bf16 peak known for {report['gpu']} (give --peak-tflops)"
    return text


# ---------------------------------------------------------------- scaling
def steady_samples_per_s(save_dir):
    """Samples/s over every train log window after the first, weighted by its length."""
    from textbox_like.tools.bench_records import steady_rate, train_records
    return steady_rate(train_records(save_dir), "samples_per_s", str(save_dir))


def trainer_processes_run(base_argv, processes, args, read):
    """A whole trainer run of ``processes`` ranks (a subprocess, one thread
    each: --threads), timed from its metrics.jsonl: ``read(save_dir)`` after
    it ends."""
    import os
    import subprocess
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "textbox_like", "train", *base_argv,
               "--max-update", str(args.updates + args.warmup), "--max-epoch", "0",
               "--log-interval", str(args.warmup), "--log-format", "none", "--disable-validation",
               "--no-epoch-checkpoints", "--no-last-checkpoints", "--save-dir", out, "--distributed-world-size", str(processes)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{args.mode}: the {processes}-process run exited with {done.returncode}")
        return read(out)


def scaling_run(base_argv, processes, args):
    return trainer_processes_run(base_argv, processes, args, steady_samples_per_s)


def scaling_main(args, rest):
    from textbox_like.core.errors import UserError
    base = ["--task", "mnist", "--max-sentences", "64", *rest, "--threads", str(args.threads)]
    if args.update_freq:
        base += ["--update-freq", args.update_freq]
    if args.compile:
        base += ["--compile"]
    try:
        if args.processes < 2 or args.updates < 1 or args.warmup < 1 or args.rounds < 1:
            raise UserError("--processes must be at least 2; --updates, --warmup and --rounds at least 1")
        cfg = _cfg_for(base + ["--max-update", "1"])
    except UserError as exc:
        return _user_error(exc)
    n = args.processes
    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    bad = [h for h in hooks if h not in ("none", "fp16", "bf16", "powersgd")]
    if bad or not hooks:
        return _user_error(f"--hooks {args.hooks}: choose from none, fp16, bf16, powersgd")
    update_freq = cfg.schedule.update_freq[0] if isinstance(cfg.schedule.update_freq, (list, tuple)) else cfg.schedule.update_freq
    print(f"scaling {cfg.data.task}: 1 process vs {n}, {args.threads} thread(s) each, batch {cfg.data.max_sentences} per "
          f"process, --update-freq {update_freq}, {args.updates} updates after {args.warmup}, {args.rounds} rounds"
          + (f", DDP comm hooks {', '.join(hooks)}" if hooks != ["none"] else ""), file=sys.stderr)
    one, by_hook = [], {h: [] for h in hooks}
    for r in range(args.rounds):
        one.append(scaling_run(base, 1, args))
        for hook in hooks:  # alternating with the 1-process run, so drift in load hits all alike
            by_hook[hook].append(scaling_run(base + ["--ddp-comm-hook", hook], n, args))
        print(f"round {r + 1}: samples/s 1 process {one[-1]:.1f}; " + "; ".join(
            f"{n} processes ({hook}) {by_hook[hook][-1]:.1f}, expansion {by_hook[hook][-1] / (n * one[-1]):.3f}"
            for hook in hooks), file=sys.stderr)
    many = by_hook[hooks[0]]
    expansion = [m / (n * o) for o, m in zip(one, many)]
    hook_expansion = {h: [m / (n * o) for o, m in zip(one, by_hook[h])] for h in hooks}
    report = {
        "mode": "scaling", "task": cfg.data.task, "processes": n, "threads_per_process": args.threads,
        "batch_per_process": cfg.data.max_sentences, "update_freq": update_freq, "compiled": args.compile,
        "updates": args.updates, "warmup": args.warmup, "rounds": args.rounds,
        "one_process_samples_per_s": round(statistics.median(one), 1),
        "n_processes_samples_per_s": round(statistics.median(many), 1),
        "speedup_median": _r(statistics.median(m / o for o, m in zip(one, many))),
        "expansion_median": _r(statistics.median(expansion)), "ideal_expansion": 1.0,
        "expansions": [_r(x) for x in expansion],
        "one_process_samples_per_s_rounds": [round(x, 1) for x in one],
        "n_processes_samples_per_s_rounds": [round(x, 1) for x in many],
        "expansion": f"{n}-process samples/s / ({n} x 1-process samples/s)",
        "comm_hooks": {h: {"expansion_median": _r(statistics.median(e)), "expansions": [_r(x) for x in e],
                           "n_processes_samples_per_s": round(statistics.median(by_hook[h]), 1)}
                       for h, e in hook_expansion.items()}}
    print(f"median of {args.rounds} rounds: samples/s 1 process {report['one_process_samples_per_s']}, {n} processes "
          f"{report['n_processes_samples_per_s']}\nexpansion ({n}-process / ({n} x 1-process)): "
          f"{report['expansion_median']:.3f} (rounds {_fmt_rounds(expansion)})"
          + "".join(f"\n  --ddp-comm-hook {h}: {statistics.median(e):.3f} (rounds {_fmt_rounds(e)})"
                    for h, e in hook_expansion.items() if len(hooks) > 1), file=sys.stderr)
    print(json.dumps(report))
    return 0


# ---------------------------------------------------------------- fsdp
def peak_memory_key(device_type):
    """The log's per-rank peak memory key (training/reporting.py): the CUDA
    allocator's peak, or elsewhere the process's peak resident set."""
    return "peak_mem_gib" if device_type == "cuda" else "peak_rss_gib"


def peak_memory_per_rank(save_dir, key):
    """Each rank's highest peak memory over the run's train records."""
    records = [json.loads(line) for line in open(Path(save_dir) / "metrics.jsonl")]
    rows = [r[key] for r in records if r["kind"] == "train" and key in r]
    if not rows:
        raise SystemExit(f"fsdp: no {key} in {save_dir}/metrics.jsonl")
    return [max(column) for column in zip(*rows)]


def fsdp_run(base_argv, sharded, args, key):
    """(samples/s in the steady window, peak memory per rank) of one 2-rank run, DDP or --fsdp."""
    return trainer_processes_run(base_argv + (["--fsdp"] if sharded else []), 2, args,
                                 lambda out: (steady_samples_per_s(out), peak_memory_per_rank(out, key)))


def fsdp_main(args, rest):
    import torch

    from textbox_like.core.errors import UserError
    base = ["--task", "bert", "--model-preset", args.model, "--max-sentences", str(args.max_sentences),
            *(["--num-layers", str(args.layers)] if args.layers else []), *rest, "--threads", str(args.threads)]
    with tempfile.TemporaryDirectory() as shards:
        try:
            if args.updates < 1 or args.warmup < 1 or args.rounds < 1 or args.max_sentences < 1:
                raise UserError("--updates, --warmup, --rounds and --max-sentences must be at least 1")
            if not any(a == "--data" or a.startswith("--data=") for a in rest):
                synthetic_shards(shards, n=args.synthetic_samples, length=args.seq_length, preds=args.seq_length // 8)
                base += ["--data", shards]
            cfg = _cfg_for(base + ["--max-update", "1", "--distributed-world-size", "2"])
            cuda = bench_device(cfg).type == "cuda"
            if cuda and torch.cuda.device_count() < 2:
                raise UserError(f"fsdp: 2 ranks take one GPU each, this machine has {torch.cuda.device_count()}; "
                                f"give --cpu to measure on the CPU")
        except UserError as exc:
            return _user_error(exc)
        key = peak_memory_key("cuda" if cuda else "cpu")
        where = f"one GPU per rank ({torch.cuda.get_device_name(0)})" if cuda else f"CPU, gloo, {args.threads} thread(s) per rank"
        print(f"fsdp {cfg.data.task}: DDP vs --fsdp on 2 ranks, {where}, batch {cfg.data.max_sentences} per rank, "
              f"{args.updates} updates after {args.warmup}, {args.rounds} rounds; peak memory: {key}", file=sys.stderr)
        runs = {"ddp": [], "fsdp": []}
        for r in range(args.rounds):
            order = ("ddp", "fsdp") if r % 2 == 0 else ("fsdp", "ddp")  # drift in load hits both alike
            for side in order:
                runs[side].append(fsdp_run(base, side == "fsdp", args, key))
            (ddp_rate, ddp_mem), (fsdp_rate, fsdp_mem) = runs["ddp"][-1], runs["fsdp"][-1]
            print(f"round {r + 1} ({' first, '.join(order)} second): peak {key} per rank DDP {ddp_mem}, FSDP {fsdp_mem}, "
                  f"FSDP/DDP {max(fsdp_mem) / max(ddp_mem):.3f}; samples/s DDP {ddp_rate:.2f}, FSDP {fsdp_rate:.2f}, "
                  f"FSDP/DDP {fsdp_rate / ddp_rate:.3f}", file=sys.stderr)
    memory = [max(f[1]) / max(d[1]) for d, f in zip(runs["ddp"], runs["fsdp"])]
    speed = [f[0] / d[0] for d, f in zip(runs["ddp"], runs["fsdp"])]
    report = {
        "mode": "fsdp", "task": cfg.data.task, "model": args.model, "layers": args.layers, "processes": 2,
        "device": "cuda" if cuda else "cpu", "threads_per_process": args.threads,
        "batch_per_rank": cfg.data.max_sentences, "updates": args.updates, "warmup": args.warmup,
        "rounds": args.rounds, "memory_key": key,
        "ddp_peak_gib_per_rank_rounds": [d[1] for d in runs["ddp"]],
        "fsdp_peak_gib_per_rank_rounds": [f[1] for f in runs["fsdp"]],
        "ddp_peak_gib_per_rank": [round(statistics.median(c), 3) for c in zip(*(d[1] for d in runs["ddp"]))],
        "fsdp_peak_gib_per_rank": [round(statistics.median(c), 3) for c in zip(*(f[1] for f in runs["fsdp"]))],
        "memory_ratio_median": _r(statistics.median(memory)), "memory_ratios": [_r(x) for x in memory],
        "memory_ratio": "max over ranks of FSDP's peak / max over ranks of DDP's peak",
        "ddp_samples_per_s": round(statistics.median(d[0] for d in runs["ddp"]), 2),
        "fsdp_samples_per_s": round(statistics.median(f[0] for f in runs["fsdp"]), 2),
        "ddp_samples_per_s_rounds": [round(d[0], 2) for d in runs["ddp"]],
        "fsdp_samples_per_s_rounds": [round(f[0], 2) for f in runs["fsdp"]],
        "samples_per_s_ratio_median": _r(statistics.median(speed)), "samples_per_s_ratios": [_r(x) for x in speed],
        "samples_per_s_ratio": "FSDP samples/s / DDP samples/s (both 2 ranks, steady window)"}
    print(f"median of {args.rounds} rounds: peak {key} per rank DDP {report['ddp_peak_gib_per_rank']}, FSDP "
          f"{report['fsdp_peak_gib_per_rank']}\nFSDP/DDP peak memory (max over ranks): "
          f"{report['memory_ratio_median']:.3f} (rounds {_fmt_rounds(memory)})\nFSDP/DDP samples/s: "
          f"{report['samples_per_s_ratio_median']:.3f} (rounds {_fmt_rounds(speed)}); DDP {report['ddp_samples_per_s']}, "
          f"FSDP {report['fsdp_samples_per_s']}", file=sys.stderr)
    print(json.dumps(report))
    return 0


# ---------------------------------------------------------------- BERT loader
def synthetic_shards(directory, n=40000, length=128, preds=20, vocab=30522, seed=0):
    import numpy as np

    from textbox_like.data.bert_hdf5 import write_shard

    rng = np.random.default_rng(seed)
    for i, rows in enumerate((n // 2, n - n // 2)):
        pos = np.sort(rng.choice(np.arange(1, length - 1), (rows, preds)), axis=1).astype(np.int32)
        write_shard(Path(directory) / f"synth_train_{i}.hdf5", {
            "input_ids": rng.integers(1000, vocab, (rows, length)).astype(np.int32),
            "input_mask": np.ones((rows, length), np.int8),
            "segment_ids": (np.arange(length)[None] >= length // 2).repeat(rows, 0).astype(np.int8),
            "masked_lm_positions": pos,
            "masked_lm_ids": rng.integers(1000, vocab, (rows, preds)).astype(np.int32),
            "next_sentence_labels": rng.integers(0, 2, rows).astype(np.int8)})


def bench_loader(files, batch, max_batches, block):
    """Samples/s of a fresh dataset reading its epoch order batch by batch (cold)."""
    import torch  # noqa: F401  (imported by training anyway; keep it out of the timing)

    from textbox_like.data.bert_hdf5 import BertHDF5Dataset

    ds = BertHDF5Dataset(files, block=block)
    order = ds.epoch_order(seed=1, epoch=1)
    n_batches = min(max_batches, len(order) // batch)
    if n_batches < 1:
        raise SystemExit(f"bert-loader: {len(order)} samples make no batch of {batch}")
    t0 = time.perf_counter()
    for b in range(n_batches):
        ds.get_batch(order[b * batch:(b + 1) * batch])
    elapsed = time.perf_counter() - t0
    return n_batches * batch / elapsed, ds, order


def bench_train(ds, order, batch, steps, full_head):
    """Samples/s and seconds per step of tiny-BERT training on the loader's batches."""
    import torch

    from textbox_like.models.bert import BertForPreTrainingMasked, build_bert_config, full_labels
    from textbox_like.tasks.bert import BertTask

    torch.manual_seed(0)
    model = BertForPreTrainingMasked(build_bert_config(preset="tiny"))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    task = BertTask(argparse.Namespace())
    n_batches = max(len(order) // batch, 1)
    batches = [ds.get_batch(order[(i % n_batches) * batch:(i % n_batches + 1) * batch]) for i in range(steps + 2)]

    def step(b):
        opt.zero_grad(set_to_none=True)
        if full_head:
            labels = full_labels(b["input_ids"], b["masked_lm_positions"], b["masked_lm_ids"])
            loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         token_type_ids=b["token_type_ids"], labels=labels,
                         next_sentence_label=b["next_sentence_labels"]).loss
        else:
            terms, _ = task.loss(model, b)
            counts = {"nsamples": b["input_ids"].shape[0], **task.count(b)}
            loss = sum(term / counts[name] for name, term in terms.items())
        loss.backward()
        opt.step()

    for b in batches[:2]:  # warm-up
        step(b)
    t0 = time.perf_counter()
    for b in batches[2:]:
        step(b)
    elapsed = time.perf_counter() - t0
    return steps * batch / elapsed, elapsed / steps


def bert_loader_main(args, rest):
    from textbox_like.core.errors import UserError
    if rest:
        return _user_error(f"bert-loader: unknown option(s) {' '.join(rest)}")
    if args.rounds < 1 or args.batch < 1 or args.steps < 1:
        return _user_error("--rounds, --batch and --steps must be at least 1")
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from textbox_like.data.bert_hdf5 import find_shards
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            synthetic_shards(tmp, n=args.synthetic_samples)
            data = tmp
        try:
            files = find_shards(data, args.split)
        except UserError as exc:
            return _user_error(exc)
        loader, masked, full = [], [], []
        ds = None
        for r in range(args.rounds):
            rate, ds, order = bench_loader(files, args.batch, args.max_batches, args.block)
            loader.append(rate)
            line = f"round {r + 1}: loader {rate:,.0f} samples/s"
            if not args.no_train:
                masked.append(bench_train(ds, order, args.batch, args.steps, False))
                full.append(bench_train(ds, order, args.batch, args.steps, True))
                line += (f"; training masked head {masked[-1][0]:,.1f}, full head {full[-1][0]:,.1f} samples/s; "
                         f"loader/training {rate / masked[-1][0]:,.1f}x")
            print(line, file=sys.stderr)
    report = {"mode": "bert-loader", "samples": len(ds), "seq_length": int(ds.seq_length),
              "predictions": int(ds.pred_length), "batch": args.batch, "block": args.block, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "synthetic": args.data is None,
              "loader_samples_per_s": round(statistics.median(loader), 1),
              "loader_samples_per_s_rounds": [round(x, 1) for x in loader]}
    summary = (f"median of {args.rounds} rounds: loader {report['loader_samples_per_s']:,.0f} samples/s "
               f"({len(ds):,} samples, seq {ds.seq_length}, {ds.pred_length} predictions, batch {args.batch}, "
               f"block {args.block})")
    if not args.no_train:
        ratio = [lo / m[0] for lo, m in zip(loader, masked)]
        head = [f[1] / m[1] for m, f in zip(masked, full)]
        report.update({
            "train_masked_samples_per_s": round(statistics.median(m[0] for m in masked), 1),
            "train_full_samples_per_s": round(statistics.median(f[0] for f in full), 1),
            "loader_over_training_median": _r(statistics.median(ratio), 1),
            "loader_over_training": [_r(x, 1) for x in ratio], "loader_over_training_target": 20,
            "masked_head_speedup_median": _r(statistics.median(head), 2),
            "masked_head_speedups": [_r(x, 2) for x in head],
            "train_masked_samples_per_s_rounds": [round(m[0], 1) for m in masked],
            "train_full_samples_per_s_rounds": [round(f[0], 1) for f in full]})
        summary += (f"\ntrain tiny BERT: masked-positions head {report['train_masked_samples_per_s']:,.1f} samples/s, "
                    f"BertForPreTraining full head {report['train_full_samples_per_s']:,.1f}; masked head "
                    f"{report['masked_head_speedup_median']:.2f}x faster"
                    f"\nloader / training (masked head): {report['loader_over_training_median']:,.1f}x "
                    f"(rounds {' '.join(f'{x:.1f}' for x in ratio)}; target >= 20x)")
    print(summary, file=sys.stderr)
    print(json.dumps(report))
    return 0


# ---------------------------------------------------------------- command line
def build_parser():
    parser = argparse.ArgumentParser(prog="python -m textbox_like.tools.bench", allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="\n\n".join(__doc__.split("\n\n")[:2]),
                                     epilog="python -m textbox_like.tools.bench MODE --help: the mode's options")
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)

    def common(p, updates=300, rounds_help="alternating rounds; medians are reported"):
        p.add_argument("--rounds", type=int, default=5, help=f"{rounds_help} (default 5)")
        p.add_argument("--updates", type=int, default=updates, help=f"timed updates per run (default {updates})")
        p.add_argument("--warmup", type=int, default=30,
                       help="untimed updates first (scaling: the first log window, left out) (default 30)")
        p.add_argument("--compile", action="store_true",
                       help="compile the trainer's model (the trainer's --compile; --compile_mode passes through)")

    for task in sorted(PLAIN_LOOPS):
        p = modes.add_parser(task, allow_abbrev=False, help=f"{task}: trainer vs. a plain PyTorch loop",
                             description=f"{task}: the trainer against a plain PyTorch loop of the same work. "
                                         f"Other options go to the trainer (--data, --threads, --max-sentences ...).")
        common(p)
        p.add_argument("--compile-plain", "--compile_plain", action="store_true",
                       help="wrap the plain loop's model in torch.compile (--compile_mode) too")
        p.add_argument("--peak-tflops", "--peak_tflops", type=float, default=None,
                       help="the GPU's dense bf16 peak in TFLOP/s for MFU (default: from a table by GPU name: "
                            "H100 SXM 989, H100 PCIe 756, H200 989, A100 312)")
        if task == "hf":
            from textbox_like.tools.bench_data import add_arguments
            add_arguments(p)
        p.add_argument("--trainer-timing", "--trainer_timing", choices=sorted(TRAINER_TIMINGS), default="window",
                       help="window: the plain loop's window of updates in one trainer run; difference: a run "
                            "of warm-up + N updates minus one of warm-up (default window)")
    p = modes.add_parser("scaling", allow_abbrev=False, help="1 process vs N processes at one thread each",
                         description="1 process vs N processes (subprocess trainer runs), samples/s and expansion. "
                                     "Other options go to the trainer (--data, --task, --max-sentences 64 ...).")
    common(p)
    p.add_argument("--processes", type=int, default=2, help="N (default 2)")
    p.add_argument("--hooks", default="none",
                   help="the N-process run once per DDP comm hook, comma-separated: none, fp16, bf16, powersgd "
                        "(default none; the first is the headline expansion)")
    p.add_argument("--update-freq", "--update_freq", default=None, help="the trainer's --update-freq K")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p = modes.add_parser("fsdp", allow_abbrev=False, help="DDP vs --fsdp on 2 ranks: peak memory per rank and samples/s",
                         description="DDP vs --fsdp on 2 ranks (subprocess trainer runs; CPU: gloo, CUDA: one GPU per "
                                     "rank): peak memory per rank and samples/s, their FSDP/DDP ratios. Other options "
                                     "go to the trainer (--data DIR of BERT shards, --fsdp-wrap size, --bf16 ...).")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds, order reversed every other; medians "
                                                         "are reported (default 5)")
    p.add_argument("--updates", type=int, default=3, help="updates per run after the warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="updates in the first log window, left out (default 1)")
    p.add_argument("--model", default="large", help="the BERT preset (default large: hidden 1024, 16 heads)")
    p.add_argument("--layers", type=int, default=12,
                   help="its layers (default 12: 185M parameters, ~4.5 GiB per DDP rank on CPU; 0: the preset's)")
    p.add_argument("--max-sentences", "--max_sentences", type=int, default=2, help="batch per rank (default 2)")
    p.add_argument("--seq-length", type=int, default=32, help="synthetic shards' sequence length (default 32)")
    p.add_argument("--synthetic-samples", type=int, default=512, help="rows of synthetic shards without --data")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    from textbox_like.tools.bench_peft import add_parser as add_peft_parser
    add_peft_parser(modes)
    p = modes.add_parser("bert-loader", aliases=["bert_loader"], allow_abbrev=False,
                         help="the BERT HDF5 loader alone vs tiny-BERT training",
                         description="samples/s of the BERT HDF5 loader against tiny-BERT training.")
    p.add_argument("--rounds", type=int, default=5, help="rounds; medians are reported (default 5)")
    p.add_argument("--data", default=None, help="directory or file of shards (default: synthetic)")
    p.add_argument("--split", default="train")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-batches", type=int, default=2000, help="loader batches to time per round")
    p.add_argument("--block", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="training steps to time per round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--no-train", action="store_true", help="time the loader only")
    p.add_argument("--synthetic-samples", type=int, default=40000, help="rows of synthetic shards without --data")
    return parser


def main(argv=None):
    args, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.mode == "scaling":
        return scaling_main(args, rest)
    if args.mode in ("bert-loader", "bert_loader"):
        return bert_loader_main(args, rest)
    if args.mode == "fsdp":
        return fsdp_main(args, rest)
    if args.mode == "peft":
        from textbox_like.tools.bench_peft import peft_main
        return peft_main(args, rest)
    if args.mode == "hf" and (args.packing or args.streaming):
        from textbox_like.tools.bench_data import data_main
        return data_main(args, rest)
    return compare_main(args, rest)


if __name__ == "__main__":
    sys.exit(main())
