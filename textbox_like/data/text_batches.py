"""Batches of tokenised text for the ``hf`` task's heads, from samples held
as arrays: padded to the batch's longest sample, or packed rows
(data/packing.py). A sample is a dict: ``input_ids`` (a 1-D int array),
``id`` (what its masking is drawn from: the same masks whatever its batch,
its rank or its row), and where the head has them ``token_type_ids`` and
``labels`` (a class, or a seq2seq target's ids)."""
from __future__ import annotations

import numpy as np

from textbox_like.data.base import BatchDataset
from textbox_like.data.packing import IGNORE_INDEX, block_mask, packed_arrays


def pad_rows(seqs, pad: int):
    """(ids, real) of 1-D arrays ``seqs``: padded to the longest, and where the ids are real."""
    width = max((len(s) for s in seqs), default=0)
    ids = np.full((len(seqs), width), pad, dtype=np.int64)
    real = np.zeros((len(seqs), width), dtype=bool)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = seq
        real[row, :len(seq)] = True
    return ids, real


def mask_tokens(ids, real, keys, masking):
    """BERT's masking: of the non-special tokens, ``probability`` are
    predicted; of those 80% become the mask token, 10% a random token, 10%
    stay. Each row's draws come from (seed, its key) over its own tokens: the
    same masks whatever the batch's padding, the rank or the packed row."""
    seed, probability, mask_id, vocab_size, special = masking
    inputs, labels = ids.copy(), np.full_like(ids, IGNORE_INDEX)
    candidates = real & ~np.isin(ids, special)
    for row, key in enumerate(keys):
        rng, n = np.random.default_rng([seed, int(key)]), int(real[row].sum())
        draw, how = np.ones(ids.shape[1]), np.ones(ids.shape[1])
        draw[:n], how[:n] = rng.random(n), rng.random(n)
        chosen = candidates[row] & (draw < probability)
        if not chosen.any() and candidates[row].any():  # every sample teaches something
            chosen[np.flatnonzero(candidates[row])[rng.integers(candidates[row].sum())]] = True
        labels[row, chosen] = ids[row, chosen]
        inputs[row, chosen & (how < 0.8)] = mask_id
        randomised = chosen & (how >= 0.8) & (how < 0.9)
        inputs[row, randomised] = rng.integers(0, vocab_size, size=int(randomised.sum()))
    return inputs, labels


def as_tensors(batch: dict) -> dict:
    import torch
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in batch.items()}


class TextBatcher:
    """Batches of one head from lists of samples (``samples``) or of packed
    rows (``rows``: each a list of samples)."""

    def __init__(self, head: str, pad_id: int, masking=None):
        self.head, self.pad_id, self.masking = head, int(pad_id), masking

    def samples(self, samples) -> dict:
        ids, real = pad_rows([s["input_ids"] for s in samples], self.pad_id)
        batch = {"input_ids": ids, "attention_mask": real.astype(np.int64)}
        if samples and "token_type_ids" in samples[0]:
            batch["token_type_ids"] = pad_rows([s["token_type_ids"] for s in samples], 0)[0]
        if self.head == "sequence_classification":
            batch["labels"] = np.asarray([int(s["labels"]) for s in samples], dtype=np.int64)
        elif self.head == "causal_lm":
            batch["labels"] = np.where(real, ids, IGNORE_INDEX)
        elif self.head == "masked_lm":
            batch["input_ids"], batch["labels"] = mask_tokens(ids, real, [s["id"] for s in samples], self.masking)
        elif self.head == "seq2seq":
            targets, target_real = pad_rows([s["labels"] for s in samples], IGNORE_INDEX)
            batch["labels"] = np.where(target_real, targets, IGNORE_INDEX)
        return as_tensors(batch)

    def rows(self, rows) -> dict:
        """Packed rows (causal and masked LM): the causal ones in transformers'
        flattened format (position ids, no 2-D mask), the masked ones with a
        block-diagonal 4-D mask; ``real`` marks the real tokens."""
        docs = [[s["input_ids"] for s in row] for row in rows]
        if self.head == "masked_lm":  # each document masked as it is alone, then packed
            masked = []
            for row in rows:
                ids, real = pad_rows([s["input_ids"] for s in row], self.pad_id)
                inputs, labels = mask_tokens(ids, real, [s["id"] for s in row], self.masking)
                masked.append([(inputs[i, :len(s["input_ids"])], labels[i, :len(s["input_ids"])])
                               for i, s in enumerate(row)])
            docs = [[inputs for inputs, _ in row] for row in masked]
        arrays = packed_arrays(docs, self.pad_id, causal=self.head == "causal_lm")
        batch = {"input_ids": arrays["input_ids"], "position_ids": arrays["position_ids"],
                 "real": arrays["real"].astype(np.int64)}
        if self.head == "causal_lm":
            batch["labels"] = arrays["labels"]
        else:
            labels = np.full_like(arrays["input_ids"], IGNORE_INDEX)
            for r, row in enumerate(masked):
                at = 0
                for _, doc_labels in row:
                    labels[r, at:at + len(doc_labels)] = doc_labels
                    at += len(doc_labels)
            batch["labels"] = labels
            if rows and "token_type_ids" in rows[0][0]:
                batch["token_type_ids"] = packed_arrays([[s["token_type_ids"] for s in row] for row in rows], 0,
                                                        causal=False)["input_ids"]
        tensors = as_tensors(batch)
        if self.head == "masked_lm":
            tensors["attention_mask"] = block_mask(arrays["segments"])
        return tensors


class PackedTextDataset(BatchDataset):
    """``--packing`` on data held whole: the documents of a tokenised
    dataset (an HFTextDataset) packed once, in a seeded order (so rows mix
    documents from all over the data), into rows of at most ``max_length``
    tokens; a row is a sample of the batch protocol (data/base.py), shuffled
    per epoch like any other. Its token count is its real tokens."""

    def __init__(self, documents, max_length: int, seed: int, batcher: TextBatcher):
        from textbox_like.data.packing import pack_greedy
        self.documents, self.batcher = documents, batcher
        order = np.random.default_rng([seed, 0x9ac]).permutation(len(documents)).astype(np.int64)
        lengths = documents.num_tokens()[order]
        cut = pack_greedy(lengths, max_length)
        self.rows = [order[row] for row in cut]
        self.row_tokens = np.asarray([int(lengths[row].sum()) for row in cut], dtype=np.int64)

    def __len__(self):
        return len(self.rows)

    def num_tokens(self):
        return self.row_tokens

    def batch_num_tokens(self, batch):
        return batch["real"].sum(dim=1).numpy()

    def get_batch(self, indices):
        return self.batcher.rows([[self.documents.sample(int(i)) for i in self.rows[int(r)]] for r in indices])
