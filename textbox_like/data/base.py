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

A task may also return a plain map-style ``torch.utils.data.Dataset`` or a
``datasets.Dataset``: ``data/plain.py`` wraps it in this protocol. Its
batches then have the structure the task's collate gives (a list, a tuple,
a dict, nested): :func:`map_tensors` is how the trainer moves, cuts and
counts any of them.
"""
from __future__ import annotations


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
        import numpy as np
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
    import numpy as np  # here, not at the top: tasks/base.py imports this module to build --help
    rng = np.random.default_rng([seed, epoch])
    starts = np.arange(0, n, block, dtype=np.int64)
    rng.shuffle(starts)
    parts = []
    for s in starts:
        part = np.arange(s, min(s + block, n), dtype=np.int64)
        rng.shuffle(part)
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def is_text_list(x) -> bool:
    """A list of strings: per-sample text, as ``default_collate`` and
    ``datasets`` batch a text column or field."""
    return type(x) is list and bool(x) and isinstance(x[0], (str, bytes))


def map_tensors(fn, batch, text=None):
    """``batch`` with ``fn`` applied to each of its tensors: a tensor, or a
    dict, list or tuple (a named tuple too) of batches, nested, rebuilt in the
    same structure. A list of strings (per-sample text) goes to ``text``
    where given; it and other values are otherwise kept as they are."""
    from torch import Tensor
    if type(batch) is dict:  # the built-in tasks' flat dict of tensors: one pass, no recursion
        flat = {}
        for k, v in batch.items():
            if not isinstance(v, Tensor):
                break
            flat[k] = fn(v)
        else:
            return flat

    from collections.abc import Mapping

    def walk(x):
        if isinstance(x, Tensor):
            return fn(x)
        if isinstance(x, Mapping):  # a dict, or a Mapping such as transformers' BatchEncoding, kept as its type
            mapped = {k: walk(v) for k, v in x.items()}
            if type(x) is dict:
                return mapped
            try:
                return type(x)(mapped)
            except TypeError:
                return mapped
        if text is not None and is_text_list(x):
            return text(x)
        if isinstance(x, (list, tuple)):
            items = [walk(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x
    return walk(batch)


def empty_like_batch(read_one):
    """A batch of no samples with the structure and dtypes of a real one:
    ``read_one()`` (a batch of one sample) cut to none."""
    return map_tensors(lambda v: v[:0], read_one(), text=lambda v: v[:0])


def batch_samples(batch) -> int:
    """The samples in a batch of the protocol above: the leading dimension
    of its first tensor, or the length of its first list of strings (depth
    first, in a nested batch); 0 without either."""
    from collections.abc import Mapping

    from torch import Tensor
    if type(batch) is dict and batch:  # the built-in tasks' flat dict of tensors
        first = next(iter(batch.values()))
        if isinstance(first, Tensor):
            return int(first.shape[0])
    stack = [batch]
    while stack:
        x = stack.pop()
        if isinstance(x, Tensor):
            return int(x.shape[0])
        if is_text_list(x):
            return len(x)
        if isinstance(x, (Mapping, list, tuple)):
            stack.extend(reversed(list(x.values()) if isinstance(x, Mapping) else x))
    return 0


def cut_batch(batch, sizes) -> list:
    """A batch of the protocol above cut into consecutive micro-batches of
    ``sizes`` samples (views of its tensors: no copy)."""
    out, start = [], 0
    for size in sizes:
        cut = lambda v, a=start, b=start + size: v[a:b]  # noqa: E731
        out.append(map_tensors(cut, batch, text=cut))
        start += size
    return out


def samples_held(data):
    """The samples of a dataset held whole, or None for a stream (its length
    is known only at its epoch's end)."""
    return None if getattr(data, "streaming", False) else len(data)
