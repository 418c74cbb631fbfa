"""BERT pre-training data: HDF5 shards in NVIDIA's create_pretraining_data layout.

Each shard holds, for N instances of length L with at most P masked tokens::

    input_ids            (N, L) int32   token ids, 0-padded
    input_mask           (N, L) int8    1 for real tokens
    segment_ids          (N, L) int8    0 for sentence A, 1 for B
    masked_lm_positions  (N, P) int32   masked positions; a 0 ends the list
    masked_lm_ids        (N, P) int32   original tokens at those positions
    next_sentence_labels (N,)   int8    1 when B is a random sentence

A split is every shard whose file name contains the split's name (HetSeq's
rule, on the name rather than the whole path); the shards are concatenated
and indexed globally. Reading is lazy: a file is opened once (a few stay
open), an epoch visits shuffled blocks of contiguous rows
(:func:`shuffled_blocks`) and the dataset reads a whole block per shard slice
at once, keeping only the last two blocks in memory. So a batch costs a
couple of contiguous, decompress-once HDF5 reads, and memory is bounded
whatever the corpus size.

A batch is a dict of int64 tensors: ``input_ids``, ``token_type_ids``,
``attention_mask`` (B, L); ``masked_lm_positions``, ``masked_lm_ids`` (B, P')
with P' = min(P, max_pred_length), ids set to -100 after the first 0
position (those are ignored by the loss); ``next_sentence_labels`` (B,).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import DataUnavailable, os_reason
from textbox_like.storage.fileio import what_file_holds
from textbox_like.data.base import BatchDataset, shuffled_blocks

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
        "masked_lm_ids", "next_sentence_labels")
DTYPES = {"input_ids": np.int32, "input_mask": np.int8, "segment_ids": np.int8,
          "masked_lm_positions": np.int32, "masked_lm_ids": np.int32,
          "next_sentence_labels": np.int8}
SUFFIXES = (".hdf5", ".h5", ".hdf")
IGNORE_INDEX = -100


def find_shards(data, split, num_file=0, training=False):
    """The shard files of ``split`` under ``data`` (a directory or one file),
    sorted by name; ``num_file`` > 0 keeps the first ``num_file``.

    In a directory a split is the shards whose names contain it. One named
    file is the training data whatever its name (``training``: ``split`` is
    the split trained on): the user chose it, so its name is not checked
    against ``--train-subset``. Another split of one file is that file only
    when its name contains the split; else there is nothing to validate on,
    and the message says how to go on.
    """
    if not data:
        raise UserError("no data given; pass --data DIR_OR_FILE with the BERT HDF5 shards")
    path = Path(data)
    if path.is_file():
        if training or split in path.name:
            return [path]
        raise UserError(f"--data {str(path)!r} is one file, the training data; no {split!r} shard to validate "
                        f"on: pass --disable-validation, or --data the directory holding it and a shard whose "
                        f"name contains {split!r}")
    if not path.is_dir():
        raise UserError(f"--data {str(path)!r} does not exist; check the path")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not files:
        raise UserError(f"--data {str(path)!r} holds no HDF5 shard (*.hdf5); "
                        f"create them with python -m textbox_like.tools.prepare_bert")
    chosen = [p for p in files if split in p.name]
    if not chosen:
        names = ", ".join(p.name for p in files[:5]) + (", ..." if len(files) > 5 else "")
        if training:
            fix = "set --train-subset to a part of the training shards' names, or give --data one shard file"
        else:
            fix = ("set --valid-subset to a part of the validation shards' names (prepare_bert names them "
                   "'_test_'), or pass --disable-validation")
        raise UserError(f"no shard of split {split!r} in {str(path)!r}: no file name contains {split!r} "
                        f"(found {names}); {fix}")
    if num_file and num_file > 0:
        chosen = chosen[:num_file]
    return chosen


def h5py_file(path):
    import h5py
    return h5py.File(path, "r")


def _open(path):
    try:
        return h5py_file(path)
    except (OSError, ValueError) as exc:
        kind = what_file_holds(path)
        if kind != "an HDF5 file":
            raise UserError(f"shard {str(path)!r} is {kind}, not an HDF5 file; "
                            f"recreate it with python -m textbox_like.tools.prepare_bert") from None
        first = first_line(exc)
        raise UserError(f"shard {str(path)!r} is not a readable HDF5 file ({first}); "
                        f"recreate it with python -m textbox_like.tools.prepare_bert") from None


def inspect_shard(path):
    """(N, L, P) of one shard after checking its keys, dtypes and shapes."""
    with _open(path) as handle:
        missing = [k for k in KEYS if k not in handle]
        if missing:
            raise UserError(f"shard {str(path)!r} lacks {', '.join(missing)}; a BERT shard holds "
                            f"{', '.join(KEYS)}")
        shapes = {}
        for key in KEYS:
            ds = handle[key]
            if not hasattr(ds, "shape") or not np.issubdtype(ds.dtype, np.integer):
                raise UserError(f"shard {str(path)!r}: {key} must be an integer array, got "
                                f"{getattr(ds, 'dtype', type(ds).__name__)}")
            shapes[key] = tuple(ds.shape)
    n_l = shapes["input_ids"]
    if len(n_l) != 2:
        raise UserError(f"shard {str(path)!r}: input_ids must be (N, L), got shape {n_l}")
    n, length = n_l
    p_shape = shapes["masked_lm_positions"]
    expected = {"input_mask": (n, length), "segment_ids": (n, length),
                "masked_lm_ids": p_shape, "next_sentence_labels": (n,)}
    if len(p_shape) != 2 or p_shape[0] != n:
        raise UserError(f"shard {str(path)!r}: masked_lm_positions must be ({n}, P), got shape {p_shape}")
    for key, shape in expected.items():
        if shapes[key] != shape:
            raise UserError(f"shard {str(path)!r}: {key} has shape {shapes[key]}, expected {shape}")
    return n, length, p_shape[1]


class BertHDF5Dataset(BatchDataset):
    """The concatenated shards of one split; see the module docstring.

    Read from disk as training goes (``reads_from_disk``): a shard that
    vanishes mid-run raises :class:`~textbox_like.core.faults.DataUnavailable`.

    ``block``: rows per shuffled block (the epoch order and the read unit).
    ``vocab_size``: when given, a block holding a larger token id raises
    ``UserError`` (data prepared with another vocabulary).
    """

    reads_from_disk = True

    def __init__(self, files, max_pred_length=512, block=8192, vocab_size=None, max_open=32):
        self.files = [str(f) for f in files]
        if not self.files:
            raise UserError("no BERT shard given")
        self.max_pred_length = int(max_pred_length)
        if self.max_pred_length <= 0:
            raise UserError(f"--max_pred_length must be positive, got {max_pred_length}")
        self.block = int(block)
        self.vocab_size = vocab_size
        self.max_open = max_open
        sizes, lengths, preds = [], [], []
        for f in self.files:
            n, length, p = inspect_shard(f)
            sizes.append(n)
            lengths.append(length)
            preds.append(p)
        if len(set(lengths)) > 1:
            raise UserError(f"shards of one split must share the sequence length; found "
                            f"{sorted(set(lengths))} in {self.files[lengths.index(max(lengths))]!r} and others")
        self.seq_length = lengths[0]
        self.pred_length = min(max(preds), self.max_pred_length)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._n = int(self.offsets[-1])
        self._num_tokens = None
        self._reset()

    # -- process-local state (file handles, block cache) --------------------
    def _reset(self):
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._handles = OrderedDict()
        self._blocks = OrderedDict()

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("_handles", "_blocks", "_lock"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def close(self):
        for handle in self._handles.values():
            try:
                handle.close()
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        self._blocks.clear()

    def __del__(self):
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:  # noqa: BLE001
            pass

    def _handle(self, i):
        if self._pid != os.getpid():  # forked: never share HDF5 handles
            self._reset()
        handle = self._handles.get(i)
        if handle is None:
            try:
                handle = h5py_file(self.files[i])
            except OSError as exc:  # it was readable at start: it went away or broke mid-run
                raise DataUnavailable(f"shard {self.files[i]!r} can no longer be opened ({os_reason(exc)})") \
                    from None
            self._handles[i] = handle
            while len(self._handles) > self.max_open:
                _, old = self._handles.popitem(last=False)
                old.close()
        else:
            self._handles.move_to_end(i)
        return handle

    # -- protocol -----------------------------------------------------------
    def __len__(self):
        return self._n

    def epoch_order(self, seed, epoch, shuffle=True):
        if not shuffle:
            return np.arange(self._n, dtype=np.int64)
        return shuffled_blocks(self._n, self.block, seed, epoch)

    def _read_rows(self, lo, hi):
        """Arrays of rows [lo, hi) of the concatenation (contiguous slices)."""
        first = int(np.searchsorted(self.offsets, lo, side="right") - 1)
        parts = {k: [] for k in KEYS}
        i, pos = first, lo
        while pos < hi:
            start = pos - int(self.offsets[i])
            stop = min(hi, int(self.offsets[i + 1])) - int(self.offsets[i])
            try:
                handle = self._handle(i)
            except DataUnavailable as exc:
                raise DataUnavailable(f"{exc} reading rows {start}..{stop}") from None
            try:
                for key in KEYS:
                    if key in ("masked_lm_positions", "masked_lm_ids"):
                        arr = handle[key][start:stop, :self.pred_length]
                        if arr.shape[1] < self.pred_length:  # a shard with fewer slots: pad
                            arr = np.pad(arr, ((0, 0), (0, self.pred_length - arr.shape[1])))
                    else:
                        arr = handle[key][start:stop]
                    parts[key].append(arr)
            except OSError as exc:
                raise DataUnavailable(f"shard {self.files[i]!r}: reading rows {start}..{stop} failed "
                                      f"({os_reason(exc)})") from None
            except (ValueError, KeyError) as exc:
                                raise UserError(f"shard {self.files[i]!r} is corrupt: reading rows {start}..{stop} "
                                f"failed ({first_line(exc)}); recreate it") from None
            pos += stop - start
            i += 1
        rows = {k: (v[0] if len(v) == 1 else np.concatenate(v)) for k, v in parts.items()}
        if self.vocab_size is not None and rows["input_ids"].size:
            top = int(rows["input_ids"].max())
            if top >= self.vocab_size or int(rows["input_ids"].min()) < 0:
                raise UserError(f"shard {self.files[first]!r} holds token id {top} but the model's vocabulary "
                                f"has {self.vocab_size} tokens; prepare the data with the model's vocab.txt "
                                f"or give the matching --dict/--config_file")
        return rows

    def _block(self, b):
        rows = self._blocks.get(b)
        if rows is None:
            lo = b * self.block
            rows = self._read_rows(lo, min(lo + self.block, self._n))
            self._blocks[b] = rows
            while len(self._blocks) > 2:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(b)
        return rows

    def get_batch(self, indices):
        with self._lock:
            return self._get_batch(indices)

    def _get_batch(self, indices):
        import torch

        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self._n):
            raise IndexError(f"sample index out of range 0..{self._n - 1}")
        blocks = indices // self.block
        out = {k: np.empty((indices.size,) + self._shape(k), dtype=DTYPES[k]) for k in KEYS}
        for b in np.unique(blocks):
            where = np.nonzero(blocks == b)[0]
            rows = self._block(int(b))
            local = indices[where] - int(b) * self.block
            for key in KEYS:
                out[key][where] = rows[key][local]
        positions = out["masked_lm_positions"].astype(np.int64)
        ids = out["masked_lm_ids"].astype(np.int64)
        # a 0 position ends the list: everything from the first 0 on is ignored
        ended = np.cumsum(positions == 0, axis=1) > 0
        ids[ended] = IGNORE_INDEX
        positions[ended] = 0
        return {
            "input_ids": torch.from_numpy(out["input_ids"].astype(np.int64)),
            "token_type_ids": torch.from_numpy(out["segment_ids"].astype(np.int64)),
            "attention_mask": torch.from_numpy(out["input_mask"].astype(np.int64)),
            "masked_lm_positions": torch.from_numpy(positions),
            "masked_lm_ids": torch.from_numpy(ids),
            "next_sentence_labels": torch.from_numpy(out["next_sentence_labels"].astype(np.int64)),
        }

    def _shape(self, key):
        if key in ("masked_lm_positions", "masked_lm_ids"):
            return (self.pred_length,)
        if key == "next_sentence_labels":
            return ()
        return (self.seq_length,)

    def batch_num_tokens(self, batch):
        return (batch["attention_mask"] != 0).sum(dim=1).numpy()

    def num_tokens(self):
        """Real tokens per sample (the input_mask row sums), read once in
        bounded chunks and cached."""
        with self._lock:
            return self._count_tokens()

    def _count_tokens(self):
        if self._num_tokens is None:
            dtype = np.int16 if self.seq_length < 32768 else np.int32
            counts = np.empty(self._n, dtype=dtype)
            chunk = max(self.block, 1)
            for i in range(len(self.files)):
                handle = self._handle(i)
                ds = handle["input_mask"]
                base = int(self.offsets[i])
                for lo in range(0, int(self.sizes[i]), chunk):
                    hi = min(lo + chunk, int(self.sizes[i]))
                    counts[base + lo:base + hi] = (ds[lo:hi] != 0).sum(axis=1)
            self._num_tokens = counts
        return self._num_tokens


def write_shard(path, arrays, chunk_rows=1024, compression_level=1):
    """Write one shard (dict of the six arrays) gzip-compressed, atomically.

    With HDF5's byte-shuffle filter before gzip (any HDF5 reader undoes it):
    on BERT shards that makes files ~15% smaller and reading ~1.5x faster
    than plain gzip, and level 1 reads faster than higher levels at about
    the same size."""
    import h5py

    from textbox_like.storage.fileio import atomic_path
    path = Path(path)
    n = len(arrays["input_ids"])
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as handle:
        for key in KEYS:
            arr = np.ascontiguousarray(arrays[key], dtype=DTYPES[key])
            if len(arr) != n:
                raise ValueError(f"{key} has {len(arr)} rows, expected {n}")
            if n:
                handle.create_dataset(key, data=arr, compression="gzip", compression_opts=compression_level,
                                      shuffle=True, chunks=(min(chunk_rows, n),) + arr.shape[1:])
            else:
                handle.create_dataset(key, data=arr)
    return path
