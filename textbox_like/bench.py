"""Trainer vs. a plain PyTorch loop of the same work, in one process run.

    python -m textbox_like.bench mnist [--data DIR] [--updates 300] [--rounds 3]
    python -m textbox_like.bench bert --model-preset tiny --data DIR --dict vocab.txt

Both sides use the same model, batch size, optimizer, clipping, threads and
in-memory data; the trainer is run through its real command line (in this
process) and its steady-state samples/s read from its own log, after its first
log window (start-up and warm-up excluded). The plain loop is timed over the
same number of updates after the same warm-up. Rounds alternate the two so
that drift in machine load hits both alike; the report gives the median.
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
    from .cli import parse
    _, cfg, _ = parse(args_list)
    return cfg


def plain_optimizer(cfg, model):
    """The same torch.optim class and arguments the trainer uses, one group."""
    from .optim import build_optimizer
    return build_optimizer(cfg, [{"params": list(model.parameters())}])


@plain_loop("mnist")
def plain_mnist(cfg, warmup, updates):
    """The loop a person would write for HetSeq's MNIST recipe."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from .data.mnist import MNISTDataset, ensure_mnist, load_split
    from .models.mnist_cnn import MNISTNet

    torch.manual_seed(cfg.seed)
    data = MNISTDataset(*load_split(ensure_mnist(cfg.data), "train"))
    model = MNISTNet()
    optimizer = plain_optimizer(cfg, model)
    bs = cfg.max_sentences
    order = torch.from_numpy(np.random.default_rng(cfg.seed).permutation(len(data)))
    model.train()
    start = None
    for step in range(warmup + updates):
        if step == warmup:
            start = time.perf_counter()
        i = (step * bs) % (len(data) - bs)
        idx = order[i:i + bs]
        x, y = data.images.index_select(0, idx), data.labels.index_select(0, idx)
        loss = F.nll_loss(model(x), y)
        loss.backward()
        if cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return updates * bs / (time.perf_counter() - start)


@plain_loop("bert")
def plain_bert(cfg, warmup, updates):
    """transformers' BertForPreTraining as its documentation uses it: labels
    over all positions, the 30k-way MLM head over every token."""
    import numpy as np
    import torch

    from .models.bert import full_labels
    from .tasks import TASKS
    from transformers import BertForPreTraining

    torch.manual_seed(cfg.seed)
    task = TASKS.get("bert")(cfg)
    data = task.build_dataset(cfg.train_subset)
    n = min(len(data), (warmup + updates) * cfg.max_sentences)
    batch_all = data.get_batch(np.arange(n))  # in memory: no I/O inside the timed loop
    model = BertForPreTraining(task.model_config())
    optimizer = plain_optimizer(cfg, model)
    bs = cfg.max_sentences
    model.train()
    start = None
    for step in range(warmup + updates):
        if step == warmup:
            start = time.perf_counter()
        i = (step * bs) % max(n - bs, 1)
        b = {k: v[i:i + bs] for k, v in batch_all.items()}
        labels = full_labels(b["input_ids"], b["masked_lm_positions"], b["masked_lm_ids"])
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    token_type_ids=b["token_type_ids"], labels=labels,
                    next_sentence_label=b["next_sentence_labels"])
        out.loss.backward()
        if cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return updates * bs / (time.perf_counter() - start)


def trainer_samples_per_s(argv, warmup, updates):
    """Run the trainer; samples/s over the updates after the first log window."""
    from .cli import main
    with tempfile.TemporaryDirectory() as out:
        code = main(argv + ["--max-update", str(warmup + updates), "--log-interval", str(warmup),
                            "--disable-validation", "--log-format", "none", "--save-dir", out,
                            "--no-epoch-checkpoints", "--no-last-checkpoints", "--max-epoch", "0"])
        if code != 0:
            raise SystemExit(f"trainer exited with {code}")
        records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    # first window: start-up; the rest: steady state
    steady = train[1:]
    wall = sum(updates_window / r["updates_per_s"] for r, updates_window in
               zip(steady, [warmup] * len(steady)))
    samples = sum(warmup / r["updates_per_s"] * r["samples_per_s"] for r in steady)
    return samples / wall


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m textbox_like.bench", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(PLAIN_LOOPS))
    parser.add_argument("--updates", type=int, default=300, help="timed updates per round")
    parser.add_argument("--warmup", type=int, default=30, help="untimed updates first (also the log window)")
    parser.add_argument("--rounds", type=int, default=3)
    args, rest = parser.parse_known_args(argv)
    if args.updates % args.warmup:
        args.updates += args.warmup - args.updates % args.warmup
    task_args = ["--task", args.task] + rest
    cfg = _cfg_for(task_args)
    import torch
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    trainer_argv = task_args + ["--threads", str(threads)]
    plain, ours = [], []
    for r in range(args.rounds):
        plain.append(PLAIN_LOOPS[args.task](cfg, args.warmup, args.updates))
        ours.append(trainer_samples_per_s(trainer_argv, args.warmup, args.updates))
        print(f"round {r + 1}: plain {plain[-1]:.1f} samples/s, trainer {ours[-1]:.1f} samples/s, "
              f"ratio {ours[-1] / plain[-1]:.3f}", file=sys.stderr)
    p, t = statistics.median(plain), statistics.median(ours)
    print(json.dumps({"task": args.task, "threads": threads, "batch": cfg.max_sentences, "updates": args.updates,
                      "plain_samples_per_s": round(p, 1), "trainer_samples_per_s": round(t, 1),
                      "ratio": round(t / p, 3),
                      "ratios": [round(o / q, 3) for o, q in zip(ours, plain)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
