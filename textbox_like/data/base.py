"""The dataset protocol every task's data follows.

A dataset is read a batch at a time, by an array of sample indices, so that a
task can serve a batch with one tensor gather (MNIST in memory) or a few
contiguous slices (BERT HDF5) instead of per-sample ``__getitem__`` and a
collate function.

The order of an epoch is the dataset's to choose (``epoch_order``) because
only the dataset knows which orders are cheap to read: a uniform permutation
for data in memory, shuffled blocks of contiguous rows for data on disk. It
must be a pure function of ``(seed, epoch)``: the same on every rank and on
every restart, which is what makes resuming mid-epoch exact.
"""
from __future__ import annotations

import numpy as np


class BatchDataset:
    #: True when batches are read from files as training goes (not all in
    #: memory at start): such a read can fail mid-run, and ranks then agree on
    #: every update's data before using it; and --num-workers reads such data
    #: ahead in a thread (data in memory is read inline on CPU: see
    #: iterators.read_ahead_workers)
    reads_from_disk = False

    def __len__(self) -> int:
        raise NotImplementedError

    def get_batch(self, indices: np.ndarray) -> dict:
        """A dict of CPU tensors for the samples ``indices`` (in that order).
        ``indices`` may be empty: return tensors with a leading dimension 0."""
        raise NotImplementedError

    def epoch_order(self, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        """The sample indices of one epoch, in the order they are trained on."""
        if not shuffle:
            return np.arange(len(self), dtype=np.int64)
        return np.random.default_rng([seed, epoch]).permutation(len(self)).astype(np.int64)

    def num_tokens(self):
        """Per-sample token counts (np.ndarray) for ``--max-tokens`` batching,
        or None when the dataset has no notion of tokens."""
        return None

    def batch_num_tokens(self, batch):
        """Per-sample token counts (np.ndarray) of a batch from ``get_batch``,
        counted as ``num_tokens`` counts them; None without tokens."""
        return None


def shuffled_blocks(n: int, block: int, seed: int, epoch: int) -> np.ndarray:
    """An epoch order for data on disk: blocks of ``block`` contiguous rows in
    random order, rows shuffled within each block. Reading a batch then
    touches one or two contiguous slices, and memory is bounded by a block."""
    rng = np.random.default_rng([seed, epoch])
    starts = np.arange(0, n, block, dtype=np.int64)
    rng.shuffle(starts)
    parts = []
    for s in starts:
        part = np.arange(s, min(s + block, n), dtype=np.int64)
        rng.shuffle(part)
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def batch_samples(batch: dict) -> int:
    """The samples in a batch of the protocol above (its tensors' leading dimension)."""
    return int(next(iter(batch.values())).shape[0]) if batch else 0


def cut_batch(batch: dict, sizes) -> list:
    """A batch of the protocol above cut into consecutive micro-batches of
    ``sizes`` samples (views: no copy)."""
    out, start = [], 0
    for size in sizes:
        out.append({k: v[start:start + size] for k, v in batch.items()})
        start += size
    return out
