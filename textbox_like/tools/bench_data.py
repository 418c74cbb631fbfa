"""``python -m textbox_like.tools.bench hf --packing --streaming``: text data at scale.

A GPT-2 from its config (random weights; --layers, --hidden) with a
word-level tokenizer of the corpus (the shared Wikipedia sample's lines as
they are, or --corpus FILE), inputs cut at --max_length 128 tokens. Each
round runs, as subprocesses with one thread, in an order that alternates:

- ours, padded: batches of --max-sentences samples padded to their longest;
- ours, packed (--packing): rows of --max_length tokens;
- ours, streamed (--streaming) padded, and streamed and packed;
- transformers' ``Trainer``, padded (DataCollatorForLanguageModeling) and
  packed (DataCollatorWithFlattening: a batch's samples flattened into one
  row, position ids restarting per sample), the same model, data, batch,
  optimizer (AdamW, constant lr) and steps;

and reads real (non-padding) tokens per second after the warm-up. Both read
the corpus in its order (ours --no-shuffle, the Trainer a sequential
sampler), so the padded sides train the same batches. Then the
time to resume a streamed run at update 10 and at update --resume-at (1,000)
(the whole ``--resume`` command of one more update, from its start to its
exit), alternating. The report gives the medians and their ratios against
the goals: packed / padded >= 1.5, streamed / held whole >= 0.9, ours /
the Trainer >= 1.0 padded, packed, and best against best; resume at 1,000 /
at 10 <= 2.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from textbox_like.tools.bench_peft import SHARED_CORPUS, text_and_tokenizer
from textbox_like.tools.bench_records import steady_rate, train_records

GOALS = {"packed_over_padded": (">=", 1.5), "streamed_over_held": (">=", 0.9),
         "ours_over_trainer_padded": (">=", 1.0), "ours_over_trainer_packed": (">=", 1.0),
         "ours_best_over_trainer_best": (">=", 1.0), "resume_late_over_early": ("<=", 2.0)}
OURS = {"padded": (), "packed": ("--packing",), "streamed": ("--streaming",),
        "streamed_packed": ("--streaming", "--packing")}
TRAINERS = ("trainer_padded", "trainer_packed")

#: transformers' Trainer on the same data: argv[1] JSON settings; prints the real tokens/s of its window
TRAINER_SCRIPT = r'''
import json, sys, time
import torch
s = json.loads(sys.argv[1])
torch.set_num_threads(s["threads"])
import datasets, transformers
from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, DataCollatorWithFlattening,
                          GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments)
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(s["model"])
raw = datasets.load_dataset("text", data_files={"train": s["data"]}, split="train", cache_dir=s["cache"])
data = raw.map(lambda rows: tok(rows["text"], truncation=True, max_length=s["max_length"]), batched=True,
               remove_columns=["text"]).filter(lambda row: len(row["input_ids"]) > 1)
inner = DataCollatorWithFlattening() if s["packed"] else DataCollatorForLanguageModeling(tok, mlm=False)
real = []
def collate(features):
    batch = inner(features)
    real.append(int(batch["attention_mask"].sum()) if "attention_mask" in batch else int(batch["input_ids"].numel()))
    return batch
marks = {}
class Window(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step in (s["warmup"], s["warmup"] + s["updates"]):
            marks[state.global_step] = time.perf_counter()
model = GPT2LMHeadModel.from_pretrained(s["model"], dtype=torch.float32)
args = TrainingArguments(output_dir=s["out"], per_device_train_batch_size=s["batch"], max_steps=s["warmup"] + s["updates"],
                         learning_rate=1e-4, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
                         max_grad_norm=1.0, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                         dataloader_num_workers=0, disable_tqdm=True, seed=1, data_seed=1)
class InOrder(Trainer):   # the corpus in its order, as ours reads it under --no-shuffle: the same padded batches
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
InOrder(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Window()]).train()
tokens = sum(real[s["warmup"]:s["warmup"] + s["updates"]])
print(json.dumps({"tokens_per_s": tokens / (marks[s["warmup"] + s["updates"]] - marks[s["warmup"]])}))
'''


def add_arguments(p):
    p.add_argument("--packing", action="store_true", help="the text-data comparison (with --streaming: both)")
    p.add_argument("--streaming", action="store_true", help="the text-data comparison (with --packing: both)")
    p.add_argument("--corpus", default=None, help="text data, one sample a line (default: the shared Wikipedia "
                                                  "sample)")
    p.add_argument("--layers", type=int, default=2, help="--packing/--streaming: GPT-2 layers (default 2)")
    p.add_argument("--hidden", type=int, default=256, help="--packing/--streaming: GPT-2 width (default 256)")
    p.add_argument("--vocab", type=int, default=8000, help="--packing/--streaming: the word vocabulary (8000)")
    p.add_argument("--resume-at", type=int, default=1000, help="--streaming: the late resume's update (1000)")


def write_model_and_data(root: Path, args):
    """A GPT-2 directory (config, random weights, a word-level tokenizer of the corpus) and train.txt."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    source = Path(args.corpus) if args.corpus else SHARED_CORPUS
    if not source.is_file():
        raise SystemExit(f"no corpus: {source} is not there; give --corpus FILE (one sample a line)")
    lines = [line.strip() for line in source.read_text(errors="replace").splitlines() if line.strip()]
    data, fast = text_and_tokenizer(root, lines, args.vocab)
    model_dir = root / "gpt2"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, n_positions=args.max_length,
                        vocab_size=len(fast), bos_token_id=2, eos_token_id=2, pad_token_id=0,
                        architectures=["GPT2LMHeadModel"])
    GPT2LMHeadModel(config).save_pretrained(str(model_dir))
    fast.save_pretrained(str(model_dir))
    return model_dir, data, len(lines)


def env_of(args):
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TEXTBOX_LIKE_CURVES": "0"}


def ours_argv(model_dir, data, args, extra, save_dir, max_update, log_interval, batch=None):
    return [sys.executable, "-m", "textbox_like", "train", "--task", "hf", "--model_name_or_path", str(model_dir),
            "--data", str(data), "--max_length", str(args.max_length), "--max-sentences", str(batch or args.max_sentences),
            "--optimizer", "adam", "--lr", "1e-4", "--lr-scheduler", "constant", "--clip-norm", "1.0",
            "--max-update", str(max_update), "--max-epoch", "0", "--log-interval", str(log_interval),
            "--log-format", "simple", "--disable-validation", "--no-epoch-checkpoints", "--save-dir", str(save_dir),
            "--threads", str(args.threads), "--cache-dir", str(Path(save_dir).parent / "cache"), "--no-shuffle", *extra]


def run_ours(model_dir, data, args, side, scratch):
    out = Path(scratch) / f"ours_{side}"
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run(ours_argv(model_dir, data, args, OURS[side], out, args.warmup + args.updates, args.warmup),
                          env=env_of(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"hf data: our {side} run exited with {done.returncode}")
    return steady_rate(train_records(out), "tokens_per_s", f"our {side} run")


def run_trainer(model_dir, data, args, side, scratch):
    settings = {"model": str(model_dir), "data": str(Path(data) / "train.txt"), "cache": str(Path(scratch) / "hf"),
                "max_length": args.max_length, "batch": args.max_sentences, "warmup": args.warmup,
                "updates": args.updates, "threads": args.threads, "packed": side == "trainer_packed",
                "out": str(Path(scratch) / side)}
    done = subprocess.run([sys.executable, "-c", TRAINER_SCRIPT, json.dumps(settings)], env=env_of(args),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"hf data: transformers' Trainer ({side}) exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def resume_seconds(model_dir, data, args, saved, update, scratch):
    """Wall seconds of ``--resume`` for one more update of the streamed run saved at ``update`` (a copy)."""
    run = Path(scratch) / f"resume_{update}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(saved, run)
    argv = ours_argv(model_dir, data, args, ("--streaming", "--resume"), run, update + 1, 0, batch=1)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env_of(args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or f"done | updates {update + 1}" not in done.stderr:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"hf data: the resume at update {update} exited with {done.returncode}")
    return seconds


def streamed_run_to(model_dir, data, args, update, scratch):
    out = Path(scratch) / f"streamed_to_{update}"
    done = subprocess.run(ours_argv(model_dir, data, args, ("--streaming",), out, update, 0, batch=1), env=env_of(args),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"hf data: the streamed run to update {update} exited with {done.returncode}")
    return out


def data_main(args, rest):
    import argparse
    sizes = argparse.ArgumentParser(prog="bench hf --packing --streaming", allow_abbrev=False)
    sizes.add_argument("--max-length", "--max_length", type=int, default=128)
    sizes.add_argument("--max-sentences", "--max_sentences", type=int, default=16)
    sizes.add_argument("--threads", type=int, default=1)
    known, unknown = sizes.parse_known_args(rest)
    if unknown:
        raise SystemExit(f"hf --packing/--streaming: unknown options {' '.join(unknown)}")
    args.max_length, args.max_sentences, args.threads = known.max_length, known.max_sentences, known.threads
    with tempfile.TemporaryDirectory() as scratch:
        model_dir, data, lines = write_model_and_data(Path(scratch), args)
        print(f"hf data: GPT-2 of {args.layers} layers, width {args.hidden}, {lines:,} corpus lines cut at "
              f"{args.max_length} tokens, batches of {args.max_sentences} (samples, or packed rows), Adam, one "
              f"thread; {args.updates} updates after {args.warmup}, {args.rounds} alternating rounds",
              file=sys.stderr)
        sides = list(OURS) + list(TRAINERS)
        rates = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                run = run_trainer if side in TRAINERS else run_ours
                rates[side].append(run(model_dir, data, args, side, scratch))
            print(f"round {r + 1}: real tokens/s " + ", ".join(f"{s} {rates[s][-1]:,.0f}" for s in sides),
                  file=sys.stderr)
        resumes = {10: [], args.resume_at: []}
        saved = {u: streamed_run_to(model_dir, data, args, u, scratch) for u in resumes}
        for r in range(args.rounds):
            for update in (list(resumes) if r % 2 == 0 else list(resumes)[::-1]):
                resumes[update].append(resume_seconds(model_dir, data, args, saved[update], update, scratch))
            print(f"resume round {r + 1}: " + ", ".join(f"at {u} {resumes[u][-1]:.2f} s" for u in resumes),
                  file=sys.stderr)
    med = {side: statistics.median(rates[side]) for side in sides}

    def ratio(a, b):
        return round(statistics.median(x / y for x, y in zip(a, b)), 3)
    ours_best = [max(p, q) for p, q in zip(rates["padded"], rates["packed"])]
    trainer_best = [max(p, q) for p, q in zip(rates["trainer_padded"], rates["trainer_packed"])]
    ratios = {"packed_over_padded": ratio(rates["packed"], rates["padded"]),
              "streamed_over_held": ratio(rates["streamed"], rates["padded"]),
              "ours_over_trainer_padded": ratio(rates["padded"], rates["trainer_padded"]),
              "ours_over_trainer_packed": ratio(rates["packed"], rates["trainer_packed"]),
              "ours_best_over_trainer_best": ratio(ours_best, trainer_best),
              "resume_late_over_early": ratio(resumes[args.resume_at], resumes[10])}
    met = {k: (ratios[k] >= goal if how == ">=" else ratios[k] <= goal) for k, (how, goal) in GOALS.items()}
    print("medians: " + ", ".join(f"{k} {v:.3f} (goal {GOALS[k][0]} {GOALS[k][1]}: {'met' if met[k] else 'NOT met'})"
                                  for k, v in ratios.items()), file=sys.stderr)
    report = {"mode": "hf-data", "layers": args.layers, "hidden": args.hidden, "max_length": args.max_length,
              "batch": args.max_sentences, "threads": args.threads, "rounds": args.rounds,
              "real_tokens_per_s": med, "ratios": ratios, "goals": {k: list(v) for k, v in GOALS.items()},
              "goals_met": met, "resume_seconds": {str(u): statistics.median(v) for u, v in resumes.items()},
              "per_round": rates, "resume_rounds": {str(u): v for u, v in resumes.items()}}
    print(json.dumps(report))
    return 0
