"""Plain datasets as the batch-read protocol (data/base.py).

A task's ``build_dataset`` may return a map-style ``torch.utils.data.Dataset``
(with an optional collate function of the task's) or a Hugging Face
``datasets.Dataset`` instead of a :class:`~.base.BatchDataset`;
:func:`as_batch_dataset` wraps it. What the protocol promises stays: the
epoch order is the inherited uniform permutation, a pure function of
(seed, epoch) and the dataset's length, so every rank reads the same order
and a resume continues mid-epoch exactly; a batch is read by its indices,
the trainer never iterates the dataset.
"""
from __future__ import annotations

import sys

import numpy as np

from textbox_like.core.errors import UserError
from textbox_like.data.base import BatchDataset, empty_like_batch, is_text_list, map_tensors

ACCEPTED = ("a textbox_like.BatchDataset, a map-style torch.utils.data.Dataset (with __len__ and __getitem__, "
            "e.g. TensorDataset), a datasets.Dataset, or an iterable one (torch's IterableDataset, "
            "datasets.IterableDataset)")


def as_batch_dataset(data, collate=None, source="build_dataset"):
    """``data`` as a BatchDataset (itself, where it is one already).
    ``collate``: a function of a list of samples to a batch (None: torch's
    ``default_collate``; for a datasets.Dataset, its columns as they are).
    ``source``: what returned ``data``, for the one line refusing it."""
    if isinstance(data, BatchDataset) or getattr(data, "streaming", False):
        return data
    hf = sys.modules.get("datasets")  # a datasets object means the library is imported already
    if hf is not None and isinstance(data, hf.Dataset):
        return HFBatches(data, collate)
    if hf is not None and isinstance(data, (hf.DatasetDict, hf.IterableDatasetDict)):
        raise UserError(f"{source} returned a {type(data).__name__} (splits {', '.join(data)}); return one "
                        f"split of it (dataset[split])")
    from torch.utils.data import Dataset, IterableDataset
    named = f"{type(data).__module__}.{type(data).__qualname__}".removeprefix("builtins.")
    if isinstance(data, IterableDataset) or hf is not None and isinstance(data, hf.IterableDataset):
        return streamed(data, collate)
    if isinstance(data, Dataset):
        if not hasattr(type(data), "__len__"):
            raise UserError(f"{source} returned {named}, a torch Dataset without __len__: an epoch needs the "
                            f"number of samples; give it a __len__")
        return MapBatches(data, collate)
    raise UserError(f"{source} returned {'None' if data is None else named}; return {ACCEPTED}")


class MapBatches(BatchDataset):
    """A map-style torch Dataset: a batch is ``collate([dataset[i] for i in
    indices])``. A ``TensorDataset`` under the default collate is gathered
    from its tensors in one index each, the batch ``default_collate`` would
    give (the same values, bit for bit)."""

    def __init__(self, dataset, collate=None):
        from torch.utils.data import TensorDataset, default_collate
        self.dataset = dataset
        self.collate = collate or default_collate
        self.tensors = dataset.tensors if collate is None and type(dataset) is TensorDataset else None

    def __len__(self):
        return len(self.dataset)

    def get_batch(self, indices):
        if len(indices) == 0:
            return empty_like_batch(lambda: self.get_batch(np.zeros(1, dtype=np.int64)))
        if self.tensors is not None:
            import torch
            index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
            return [t[index] for t in self.tensors]  # default_collate turns a tuple sample into a list
        return self.collate([self.dataset[i] for i in np.asarray(indices).tolist()])


class HFBatches(BatchDataset):
    """A Hugging Face ``datasets.Dataset``: a batch is one ``ds[indices]`` read
    in torch format (Arrow's take, not a read per sample), a dict of column
    tensors; with ``collate``, that function of the batch's rows (each a dict
    of the row's values), as a DataLoader with ``collate_fn`` would call it."""

    def __init__(self, dataset, collate=None):
        form = dataset.format  # the columns the user chose stay chosen
        # a transform of the user's (with_transform, set_transform: format "custom") is their batch: kept
        self.dataset = dataset if form["type"] == "custom" else \
            dataset.with_format("torch", columns=form["columns"], output_all_columns=form["output_all_columns"])
        self.collate = collate

    def __len__(self):
        return len(self.dataset)

    def get_batch(self, indices):
        if len(indices) == 0:  # datasets gives an empty read float tensors without their shapes
            return empty_like_batch(lambda: self.get_batch(np.zeros(1, dtype=np.int64)))
        columns = self.dataset[np.asarray(indices, dtype=np.int64)]
        if self.collate is not None:
            return self.collate([{k: v[i] for k, v in columns.items()} for i in range(len(indices))])
        for name, value in columns.items():
            if isinstance(value, list) and not is_text_list(value):
                raise UserError(f"column {name!r} of the datasets.Dataset holds samples of unlike shapes, which "
                                f"make no one tensor; pad them in the dataset (Dataset.map) or give the task a "
                                f"collate method (e.g. padding)")
        return columns


def streamed(data, collate=None):
    """A task's iterable dataset (torch's ``IterableDataset``, a
    ``datasets.IterableDataset``) as streamed training data (data/streams.py):
    its own order, the same on every rank, each update's samples cut over the
    ranks; a batch is ``collate`` of a rank's samples (torch's
    ``default_collate`` by default)."""
    from torch.utils.data import default_collate

    from textbox_like.data.stream_batches import StreamedData
    from textbox_like.data.streams import IterableSource, SampleStream
    return StreamedData(SampleStream(IterableSource(data), seed=0), collate or default_collate)
