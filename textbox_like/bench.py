"""Trainer vs. a plain PyTorch loop of the same work, in one process run.

    python -m textbox_like.bench mnist [--data DIR] [--updates 300] [--rounds 5] [--threads 1]
    python -m textbox_like.bench bert --model-preset tiny --data DIR --dict vocab.txt --max-sentences 32

Both sides use the same model, batch size, optimizer, clipping, threads and
data; the trainer is run through its real command line, in this process. The
plain loop is timed over N updates after a warm-up. The trainer's steady state
is the difference of two runs (warm-up + N updates, and warm-up alone), so its
start-up, data loading and warm-up cancel. Rounds alternate the two so that
drift in machine load hits both alike; the report gives the median ratio of
wall time and of CPU time (the process's own CPU seconds: with one thread,
the figure least disturbed by other load on a shared machine).
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
            start = (time.perf_counter(), time.process_time())
        i = (step * bs) % (len(data) - bs)
        idx = order[i:i + bs]
        x, y = data.images.index_select(0, idx), data.labels.index_select(0, idx)
        loss = F.nll_loss(model(x), y)
        loss.backward()
        if cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start[0], time.process_time() - start[1]


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
            start = (time.perf_counter(), time.process_time())
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
    return time.perf_counter() - start[0], time.process_time() - start[1]


def trainer_seconds(argv, updates):
    """(wall, cpu) seconds of a whole trainer run of ``updates`` updates."""
    from .cli import main
    with tempfile.TemporaryDirectory() as out:
        start = (time.perf_counter(), time.process_time())
        code = main(argv + ["--max-update", str(updates), "--log-interval", "0", "--disable-validation",
                            "--log-format", "none", "--save-dir", out, "--no-save", "--max-epoch", "0"])
        if code != 0:
            raise SystemExit(f"trainer exited with {code}")
        return time.perf_counter() - start[0], time.process_time() - start[1]


def trainer_steady_seconds(argv, warmup, updates):
    """Seconds of ``updates`` steady-state updates: a run of warmup + updates
    minus a run of warmup, so start-up, data loading and warm-up cancel."""
    long_wall, long_cpu = trainer_seconds(argv, warmup + updates)
    short_wall, short_cpu = trainer_seconds(argv, warmup)
    return long_wall - short_wall, long_cpu - short_cpu


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m textbox_like.bench", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(PLAIN_LOOPS))
    parser.add_argument("--updates", type=int, default=300, help="timed updates per round")
    parser.add_argument("--warmup", type=int, default=30, help="untimed updates first (also the log window)")
    parser.add_argument("--rounds", type=int, default=3)
    args, rest = parser.parse_known_args(argv)
    task_args = ["--task", args.task] + rest
    from .errors import UserError
    try:
        cfg = _cfg_for(task_args)
        if not cfg.max_sentences:
            raise UserError("the benchmark compares fixed batches: give --max-sentences N")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    trainer_argv = task_args + ["--threads", str(threads)]
    batch = cfg.max_sentences
    plain, ours = [], []
    for r in range(args.rounds):
        plain.append(PLAIN_LOOPS[args.task](cfg, args.warmup, args.updates))
        ours.append(trainer_steady_seconds(trainer_argv, args.warmup, args.updates))
        print(f"round {r + 1}: samples/s plain {args.updates * batch / plain[-1][0]:.1f}, "
              f"trainer {args.updates * batch / ours[-1][0]:.1f}; ratio wall {plain[-1][0] / ours[-1][0]:.3f}, "
              f"cpu {plain[-1][1] / ours[-1][1]:.3f}", file=sys.stderr)
    wall = [p[0] / o[0] for p, o in zip(plain, ours)]
    cpu = [p[1] / o[1] for p, o in zip(plain, ours)]
    print(json.dumps({
        "task": args.task, "threads": threads, "batch": batch, "updates": args.updates, "rounds": args.rounds,
        "plain_samples_per_s": round(args.updates * batch / statistics.median(p[0] for p in plain), 1),
        "trainer_samples_per_s": round(args.updates * batch / statistics.median(o[0] for o in ours), 1),
        "ratio_wall_median": round(statistics.median(wall), 3),
        "ratio_cpu_median": round(statistics.median(cpu), 3),
        "ratios_wall": [round(x, 3) for x in wall], "ratios_cpu": [round(x, 3) for x in cpu]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
