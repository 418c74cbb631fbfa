"""Packed sequences: whole documents concatenated into rows of at most
``max_length`` tokens, so that a batch of variable-length text spends its
compute on real tokens, not on padding.

A row keeps its documents apart: position ids restart at 0 for each document,
a causal model sees them as separate sequences (transformers' flattened
format, as ``DataCollatorWithFlattening`` makes it: no 2-D attention mask, the
model finds the documents from the position ids), a bidirectional one is given
a block-diagonal 4-D mask, and no token is predicted across a document
boundary. So the loss of a packed row is the sum of its documents' losses
computed alone, and the loss, a sum over predicted tokens divided by the
update's predicted tokens over all ranks, is that of one process whatever the
split.

Which documents share a row is decided before the rows are split over the
ranks (:func:`pack_greedy` over the documents in one order that every rank
knows), so the global batch of an update is the same rows for any world size.

For a task of your own: ``pack_greedy`` on your documents' lengths gives the
rows; :func:`packed_arrays` turns a batch of rows into the model's inputs.
"""
from __future__ import annotations

import numpy as np

from textbox_like.core.errors import UserError

IGNORE_INDEX = -100


def pack_greedy(lengths, max_length: int) -> list:
    """The documents (``lengths``: their token counts, in the order they are
    taken) as rows of at most ``max_length`` tokens: each row is a run of
    consecutive documents, a new row starts where the next one does not fit.
    Returns a list of index arrays. A document longer than ``max_length`` is
    one line (truncate documents when they are tokenised: ``--max_length``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = np.flatnonzero(lengths > max_length)
    if len(too_long):
        i = int(too_long[0])
        raise UserError(f"document {i} has {int(lengths[i])} tokens, more than the packed row's {max_length} "
                        f"(--max_length): truncate documents to --max_length when tokenising them")
    rows, start, used = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > max_length and i > start:
            rows.append(np.arange(start, i, dtype=np.int64))
            start, used = i, 0
        used += n
    if start < len(lengths):
        rows.append(np.arange(start, len(lengths), dtype=np.int64))
    return rows


class RowPacker:
    """:func:`pack_greedy` one document at a time (a stream): ``add`` returns
    the row it closed, if the document did not fit in the open one; ``flush``
    the open row at the end. Its open row is its whole state."""

    def __init__(self, max_length: int):
        self.max_length = int(max_length)
        self.open, self.used = [], 0

    def add(self, doc, length: int):
        if length > self.max_length:
            raise UserError(f"a document has {length} tokens, more than the packed row's {self.max_length} "
                            f"(--max_length): truncate documents to --max_length when tokenising them")
        closed = None
        if self.open and self.used + length > self.max_length:
            closed, self.open, self.used = self.open, [], 0
        self.open.append(doc)
        self.used += length
        return closed

    def flush(self):
        closed, self.open, self.used = self.open, [], 0
        return closed or None


def packed_arrays(rows, pad_id: int, causal: bool) -> dict:
    """A batch of packed rows (each a list of 1-D token-id arrays, its
    documents) as numpy arrays: ``input_ids`` and ``position_ids`` (restarting
    per document; the padding after a row's documents is one more segment of
    its own), ``real`` (where tokens are real), ``segments`` (each token's
    document number in its row, -1 on padding) and ``labels`` for a causal
    model (each document's own tokens; its first token is predicted by no
    one, so the last token of the document before it predicts nothing)."""
    width = max((sum(len(d) for d in row) for row in rows), default=0)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    segments = np.full((len(rows), width), -1, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for s, doc in enumerate(row):
            n = len(doc)
            ids[r, at:at + n] = doc
            positions[r, at:at + n] = np.arange(n)
            segments[r, at:at + n] = s
            labels[r, at + 1:at + n] = doc[1:]
            at += n
        positions[r, at:] = np.arange(width - at)
    out = {"input_ids": ids, "position_ids": positions, "real": segments >= 0, "segments": segments}
    if causal:
        out["labels"] = labels
    return out


def block_mask(segments, dtype=None):
    """The additive 4-D attention mask (rows, 1, width, width) that lets a
    token attend only to the tokens of its own document (padding to itself):
    0 where attention is allowed, the dtype's most negative value elsewhere."""
    import torch
    dtype = dtype or torch.float32
    seg = torch.as_tensor(segments)
    pad_ids = torch.arange(seg.shape[1]).expand_as(seg) + seg.shape[1]  # padding: each token its own segment
    seg = torch.where(seg >= 0, seg, pad_ids)
    same = seg[:, :, None] == seg[:, None, :]
    mask = torch.zeros(same.shape, dtype=dtype)
    return mask.masked_fill(~same, torch.finfo(dtype).min)[:, None]
