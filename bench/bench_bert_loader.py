"""How fast the BERT HDF5 loader serves batches, against how fast training eats them.

    python bench/bench_bert_loader.py --data DIR [--split train] [--batch 32]

Without --data, writes synthetic shards (seq 128, 20 predictions) to a
temporary directory. Reports:

* loader samples/s: a fresh dataset reading one epoch in its shuffled-block
  order, batch by batch (cold: every block decompressed once);
* training samples/s for tiny BERT (forward + backward + AdamW step) with
  the masked-positions MLM head, and with BertForPreTraining's own forward
  (full head over all positions), on the same batches;
* the ratio loader / training (the target is >= 20).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic(directory, n=40000, length=128, preds=20, vocab=30522, seed=0):
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
    import torch  # noqa: F401  (imported by training anyway; keep it out of the timing)

    from textbox_like.data.bert_hdf5 import BertHDF5Dataset

    ds = BertHDF5Dataset(files, block=block)
    order = ds.epoch_order(seed=1, epoch=1)
    n_batches = min(max_batches, len(order) // batch)
    t0 = time.perf_counter()
    for b in range(n_batches):
        ds.get_batch(order[b * batch:(b + 1) * batch])
    elapsed = time.perf_counter() - t0
    return n_batches * batch / elapsed, ds, order


def bench_train(ds, order, batch, steps, full_head, threads):
    import torch

    from textbox_like.models.bert import BertForPreTrainingMasked, build_bert_config, full_labels
    from textbox_like.tasks.bert import BertTask

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = BertForPreTrainingMasked(build_bert_config(preset="tiny"))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    task = BertTask(argparse.Namespace())
    batches = [ds.get_batch(order[i * batch:(i + 1) * batch]) for i in range(steps + 2)]

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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="directory or file of shards (default: synthetic)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-batches", type=int, default=2000, help="loader batches to time")
    parser.add_argument("--block", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10, help="training steps to time")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--no-train", action="store_true", help="time the loader only")
    args = parser.parse_args()

    from textbox_like.data.bert_hdf5 import find_shards

    tmp = None
    data = args.data
    if data is None:
        tmp = tempfile.TemporaryDirectory()
        synthetic(tmp.name)
        data = tmp.name
    files = find_shards(data, args.split)
    loader_rate, ds, order = bench_loader(files, args.batch, args.max_batches, args.block)
    print(f"loader: {loader_rate:,.0f} samples/s ({len(ds):,} samples, seq {ds.seq_length}, "
          f"{ds.pred_length} predictions, batch {args.batch}, block {args.block})")
    if not args.no_train:
        masked_rate, masked_step = bench_train(ds, order, args.batch, args.steps, False, args.threads)
        full_rate, full_step = bench_train(ds, order, args.batch, args.steps, True, args.threads)
        print(f"train tiny BERT, masked-positions head: {masked_rate:,.1f} samples/s ({masked_step * 1000:.0f} ms/step)")
        print(f"train tiny BERT, BertForPreTraining full head: {full_rate:,.1f} samples/s "
              f"({full_step * 1000:.0f} ms/step); masked head {full_step / masked_step:.1f}x faster")
        print(f"loader / training (masked head): {loader_rate / masked_rate:,.0f}x (target >= 20x)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
