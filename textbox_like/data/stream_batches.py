"""Batch plans over a stream (data/streams.py), as data/iterators.py's
:class:`EpochBatchIterator` plans them over an order held whole.

Each step takes the stream's next units: a fixed number (the ranks' batch
sizes summed), the longest run within the ranks' ``--max-tokens``, or within
the global token budget of ``--global-batch-size`` in tokens; the step is cut
into the ranks' slices by the same functions as for data held whole
(``plan_fixed``, ``plan_tokens``, ``plan_global_tokens``), so which units an
update trains on does not depend on the split. The position is the units
consumed this epoch (``offset``) and the stream's state at that point: a
state kept for the last steps, so that an update in flight can be redone from
its start (``offset = ...``), and saved in the checkpoint."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from textbox_like.core.errors import UserError
from textbox_like.data.base import empty_like_batch
from textbox_like.data.iterators import plan_fixed, plan_global_tokens, plan_tokens, round_batch_size

#: the states of this many recent step boundaries are kept (an update redone starts at one of them)
KEPT_STATES = 64


class StreamBatchIterator:
    """Yields, for this rank, ``(batch, global_count)`` per step of an epoch of a stream."""

    #: the length of an epoch is known only at its end
    knows_length = False

    def __init__(self, data, seed, rank, world_size, batch_sizes, max_tokens=None, shuffle=True, multiple=1):
        self.data, self.stream = data, data.stream
        self.seed, self.rank, self.world_size, self.shuffle, self.multiple = seed, rank, world_size, shuffle, multiple
        self.max_tokens = list(max_tokens) if max_tokens and any(max_tokens) else None
        self.batch_sizes = list(batch_sizes) if self.max_tokens else \
            [round_batch_size(b, multiple) for b in batch_sizes]
        if self.max_tokens and self.stream.sample_tokens is None:
            raise UserError("--max-tokens needs a task whose data counts tokens; use --max-sentences")
        self.num_workers = 0       # the stream reads ahead in its own worker processes
        self.token_shares = None
        self.plan_version = 0
        self.epoch, self._offset = 1, 0
        self.states = OrderedDict()
        self.planned = False
        self.sample_log = None     # test-only (training/hooks.py): where each step's sample ids are written

    # -- position -------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self._offset

    @offset.setter
    def offset(self, value):
        """Back to a step boundary of this epoch (an update redone from its start)."""
        value = int(value)
        if value != self._offset:
            if value not in self.states:
                raise RuntimeError(f"the stream's state at unit {value} of epoch {self.epoch} is no longer kept")
            self.stream.restore(self.states[value])
            self._offset = value

    def _keep_state(self):
        self.states[self._offset] = self.stream.snapshot()
        while len(self.states) > KEPT_STATES:
            self.states.popitem(last=False)

    def set_epoch(self, epoch, offset=0):
        epoch, offset = int(epoch), int(offset)
        if self.planned and epoch == self.epoch and offset == self._offset:
            return  # the same position (a re-split, or the start after a restore)
        if offset:
            raise RuntimeError("a stream is positioned mid-epoch by its saved state (load_state_dict)")
        self.epoch, self._offset, self.planned = epoch, 0, True
        self.stream.start_epoch(epoch)
        self.states.clear()
        self._keep_state()

    def set_split(self, batch_sizes, by_tokens=False):
        if by_tokens:
            if self.stream.sample_tokens is None:
                raise UserError("--max-tokens needs a task whose data counts tokens; use --max-sentences")
            self.token_shares = [int(b) for b in batch_sizes]
        else:
            self.batch_sizes = [int(b) for b in batch_sizes]
        self.plan_version += 1

    def __len__(self):
        raise TypeError("a streamed epoch has no known length")

    def steps_in_epoch(self):
        return None

    @property
    def end_of_epoch(self) -> bool:
        return self.planned and self.stream.exhausted()

    # -- steps ----------------------------------------------------------------
    def _next_bounds(self):
        """This step's row of bounds (relative to its first unit), or None at the epoch's end."""
        stream = self.stream
        if self.token_shares:
            window = stream.peek_tokens(sum(self.token_shares))
            if not window:
                return None
            return plan_global_tokens(self._tokens(window), sum(self.token_shares), self.token_shares)[0]
        if self.max_tokens:
            # a step takes at most the ranks' token caps, plus the samples of ranks capped by count only
            caps = [t or 0 for t in self.max_tokens]
            window = stream.peek_tokens(sum(caps))
            by_count = sum(b or 0 for b, cap in zip(self.batch_sizes, caps) if not cap)
            if by_count:
                window = stream.peek(len(window) + by_count)
            if not window:
                return None
            return plan_tokens(self._tokens(window), self.max_tokens, self.batch_sizes, self.multiple)[0]
        window = stream.peek(sum(self.batch_sizes))
        if not window:
            return None
        return plan_fixed(len(window), self.batch_sizes, self.multiple)[0]

    def _tokens(self, units) -> np.ndarray:
        return np.asarray([self.stream.unit_tokens(u) for u in units], dtype=np.int64)

    def __iter__(self):
        """Yields (batch, global_count); ``offset`` advances (and the stream's
        state there is kept) when a batch is handed out."""
        if not self.planned:
            self.set_epoch(self.epoch)
        while True:
            bounds = self._next_bounds()
            if bounds is None:
                return
            units = self.stream.take(int(bounds[-1] - bounds[0]))
            mine = units[int(bounds[self.rank]):int(bounds[self.rank + 1])]
            batch = self.data.batch(mine, units)
            self._offset += len(units)
            self._keep_state()
            if self.sample_log:
                self._log_samples(mine)
            yield batch, len(units)

    def _log_samples(self, mine):
        import json
        ids = [s["id"] for unit in mine for s in (unit if isinstance(unit, list) else [unit])]
        with open(self.sample_log, "a") as log:
            log.write(json.dumps({"epoch": self.epoch, "offset": self._offset, "ids": ids}) + "\n")

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        return {"epoch": self.epoch, "offset": self._offset, "seed": self.seed, "shuffle": self.shuffle,
                "world_size": self.world_size, "batch_sizes": list(self.batch_sizes),
                "max_tokens": list(self.max_tokens) if self.max_tokens else None,
                "stream": self.stream.to_json(self.states[self._offset]), "stream_of": self.data.identity()}

    def load_state_dict(self, state):
        if "stream" not in state:
            raise UserError("the checkpoint was trained on data held whole, this run streams it (--streaming); "
                            "resume the same way or pass --reset-dataloader")
        if state["stream_of"] != self.data.identity():
            raise UserError("the streamed data changed since the checkpoint (its files' names or sizes differ); "
                            "resume on the same data or pass --reset-dataloader")
        if int(state["seed"]) != self.seed:
            raise UserError(f"the checkpoint was trained with --seed {state['seed']}, not {self.seed}; "
                            f"use the same seed or pass --reset-dataloader")
        snap = self.stream.from_json(state["stream"])
        self.epoch, self._offset, self.planned = int(state["epoch"]), int(state["offset"]), True
        self.stream.restore(snap)
        self.states.clear()
        self._keep_state()


class StreamedData:
    """The training data of a streamed run: its stream, how a rank's units
    become a batch (``collate``), and what identifies it in a checkpoint. No
    length: an epoch ends where its stream does."""

    streaming = True
    reads_from_disk = True

    def __init__(self, stream, collate):
        self.stream, self.collate = stream, collate

    def batch(self, mine, step):
        """A rank's units of a step as a batch; a rank with none of them gets a
        batch of no samples shaped as the step's first one would be."""
        if mine:
            return self.collate(mine)
        return empty_like_batch(lambda: self.collate(step[:1]))

    def identity(self):
        return self.stream.source.identity()

    def num_tokens(self):
        return None

    def batch_num_tokens(self, batch):
        if "real" in batch:
            return batch["real"].sum(dim=1).numpy()
        return batch["attention_mask"].sum(dim=1).numpy()

    def close(self):
        self.stream.close()
