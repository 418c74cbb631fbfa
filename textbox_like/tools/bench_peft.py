"""``python -m textbox_like.tools.bench peft``: a full fine-tune against LoRA on 2 ranks.

A GPT-2-small-shaped model (124M parameters: 12 layers, hidden 768, GPT-2's
50,257-token vocabulary) from its config, random weights, saved once to a
temporary directory with a word-level tokenizer of the text (the shared
Wikipedia sample where it is there, else generated sentences); each round
trains it on 2 ranks (subprocess trainer runs, one thread each on CPU) once
fully and once with ``--peft lora --lora-r 8`` on its attention (c_attn),
the order reversed every other round, and reads from each run:

- trainable parameters (the start line),
- checkpoint bytes (checkpoint_last.pt) and optimizer-state bytes (its Adam state),
- peak memory per rank (the log's peak_rss_gib, on CUDA peak_mem_gib),
- tokens/s after the first log window.

The report gives the medians of LoRA / full for each, against the goals:
checkpoint and optimizer state <= 5%, peak memory per rank <= 0.7x, tokens/s >= 1.0x.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from textbox_like.tools.bench_records import steady_rate, train_records

#: the goals (LoRA / full): at most, at most, at most, at least
GOALS = {"checkpoint_bytes": 0.05, "optimizer_state_bytes": 0.05, "peak_gib_per_rank": 0.7, "tokens_per_s": 1.0}

SHARED_CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "corpus" / "enwiki-sample.txt"


def add_parser(modes):
    p = modes.add_parser("peft", allow_abbrev=False, help="full fine-tune vs LoRA on 2 ranks: parameters, "
                                                          "checkpoint, optimizer state, memory, tokens/s",
                         description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are reported (default 5)")
    p.add_argument("--updates", type=int, default=3, help="updates per run after the warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="updates in the first log window, left out (default 1)")
    p.add_argument("--max-sentences", "--max_sentences", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--max-length", "--max_length", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--layers", type=int, default=12, help="GPT-2 layers (default 12: GPT-2 small, 124M)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--corpus", default=None, help="a text file, one sample a line (default: the shared Wikipedia "
                                                  "sample, else generated sentences)")
    return p


def text_and_tokenizer(root: Path, lines, vocab_size: int):
    """ROOT/data/train.txt of ``lines``, and a word-level tokenizer of their ``vocab_size`` commonest words
    (<pad> 0, <unk> 1, <eos> 2 first)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(lines) + "\n")
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    special = ["<pad>", "<unk>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(special + sorted(counts, key=lambda w: -counts[w])[:vocab_size - 3])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return data, PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                         eos_token="<eos>", bos_token="<eos>")


def write_model_and_data(root: Path, layers: int, corpus, rows: int = 2000):
    """The model directory (config, random weights, a word-level tokenizer) and a data directory."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    source = Path(corpus) if corpus else SHARED_CORPUS
    if source.is_file():
        lines = [line.strip() for line in source.read_text(errors="replace").splitlines() if len(line.split()) > 8]
    else:
        import random
        rng = random.Random(0)
        words = [f"w{i}" for i in range(5000)]
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 200))) for _ in range(rows)]
    lines = (lines * (rows // max(len(lines), 1) + 1))[:rows]
    data, fast = text_and_tokenizer(root, lines, 50257)
    model_dir = root / "gpt2_small"
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, vocab_size=50257, bos_token_id=2, eos_token_id=2, pad_token_id=0,
                        architectures=["GPT2LMHeadModel"])
    GPT2LMHeadModel(config).save_pretrained(str(model_dir))
    fast.save_pretrained(str(model_dir))
    return model_dir, data


def run_once(model_dir, data, lora: bool, args):
    """One 2-rank run: its figures."""
    import os

    import torch
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "textbox_like", "train", "--task", "hf", "--model_name_or_path", str(model_dir),
               "--data", str(data), "--max_length", str(args.max_length), "--max-sentences", str(args.max_sentences),
               "--optimizer", "adam", "--lr", "1e-4", "--max-update", str(args.updates + args.warmup),
               "--max-epoch", "0", "--log-interval", str(args.warmup), "--log-format", "simple",
               "--disable-validation", "--no-epoch-checkpoints", "--save-dir", out, "--threads", str(args.threads),
               "--distributed-world-size", "2", *(["--peft", "lora", "--lora-r", "8"] if lora else [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TEXTBOX_LIKE_CURVES": "0"}
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"peft: the {'LoRA' if lora else 'full'} run exited with {done.returncode}")
        start = next(line for line in done.stderr.splitlines() if line.startswith("task hf"))
        train = train_records(out)
        key = "peak_mem_gib" if "peak_mem_gib" in train[-1] else "peak_rss_gib"
        checkpoint = Path(out) / "checkpoint_last.pt"
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        optimizer_bytes = sum(v.numel() * v.element_size() for entry in state["optimizer"]["state"].values()
                              for v in entry.values() if torch.is_tensor(v))
        return {"trainable_params": trainable_of(start), "checkpoint_bytes": checkpoint.stat().st_size,
                "optimizer_state_bytes": optimizer_bytes,
                "peak_gib_per_rank": max(max(r[key]) for r in train),
                "tokens_per_s": steady_rate(train, "tokens_per_s", "the peft run")}


def trainable_of(start_line: str) -> int:
    """The trained parameters the start line reports (all of them for a full fine-tune)."""
    import re
    found = re.search(r"\| ([\d,]+) parameters(?:, ([\d,]+) trained)?", start_line)
    return int((found.group(2) or found.group(1)).replace(",", ""))


def peft_main(args, rest):
    if rest:
        raise SystemExit(f"peft: unknown options {' '.join(rest)}")
    with tempfile.TemporaryDirectory() as root:
        model_dir, data = write_model_and_data(Path(root), args.layers, args.corpus)
        print(f"peft: GPT-2 of {args.layers} layers (hidden 768, vocabulary 50,257) on 2 ranks, {args.threads} "
              f"thread(s) each, {args.max_sentences} x {args.max_length} tokens per rank, Adam; full vs --peft lora "
              f"--lora-r 8 (c_attn); {args.updates} updates after {args.warmup}, {args.rounds} rounds",
              file=sys.stderr)
        runs = {"full": [], "lora": []}
        for r in range(args.rounds):
            order = ("full", "lora") if r % 2 == 0 else ("lora", "full")
            for side in order:
                runs[side].append(run_once(model_dir, data, side == "lora", args))
            full, lora = runs["full"][-1], runs["lora"][-1]
            print(f"round {r + 1}: " + "; ".join(f"{k} full {full[k]:,.4g} LoRA {lora[k]:,.4g} ({lora[k] / full[k]:.3f})"
                                                 for k in full), file=sys.stderr)
    keys = list(runs["full"][0])
    medians = {side: {k: statistics.median(run[k] for run in runs[side]) for k in keys} for side in runs}
    ratios = {k: round(statistics.median(lo[k] / fu[k] for fu, lo in zip(runs["full"], runs["lora"])), 4)
              for k in keys}
    met = {k: (ratios[k] >= goal if k == "tokens_per_s" else ratios[k] <= goal) for k, goal in GOALS.items()}
    report = {"mode": "peft", "layers": args.layers, "processes": 2, "threads_per_rank": args.threads,
              "tokens_per_rank_step": args.max_sentences * args.max_length, "rounds": args.rounds,
              "full": medians["full"], "lora": medians["lora"], "lora_over_full": ratios, "goals": GOALS,
              "goals_met": met, "rounds_full": runs["full"], "rounds_lora": runs["lora"]}
    print("medians, LoRA / full: " + ", ".join(f"{k} {ratios[k]:.4f}" + (f" (goal {'>=' if k == 'tokens_per_s' else '<='}"
                                                                         f" {GOALS[k]}: {'met' if met[k] else 'NOT met'})"
                                                                         if k in GOALS else "") for k in keys),
          file=sys.stderr)
    print(json.dumps(report))
    return 0
