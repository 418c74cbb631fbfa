"""Deterministic, resumable, heterogeneous batch plans.

An epoch is the dataset's ``epoch_order(seed, epoch)``, a pure function of
the seed and the epoch, cut into *steps*. At every step each rank takes its
own contiguous slice of the order, of its own size (ranks may have different
``--max-sentences`` / ``--max-tokens``), so

* every sample of an epoch is used exactly once across ranks (the last step
  is split in proportion to the ranks' batch sizes; a rank may get an empty
  slice, which contributes nothing to the gradient);
* every rank knows every rank's slice, hence the number of samples of each
  update over all ranks, without communication;
* the position in an epoch is one number, the offset into the order. A
  restart rebuilds the plan from that offset, with the same or a different
  world size or batch size, and skips nothing and repeats nothing. For the
  same reason the ranks' sizes may change mid-epoch (``set_split``: a re-split
  of ``--global-batch-size``), planned again from the current offset.

With ``--global-batch-size`` in tokens (``plan_global_tokens``) a step is the
longest run of the order within the global token budget, whatever the split,
and the split only decides where each rank's slice of it starts.
"""
from __future__ import annotations

import queue
import threading

import numpy as np

from textbox_like.core.errors import UserError
from textbox_like.core.threads import start_thread


def round_batch_size(size: int, multiple: int) -> int:
    """--required-batch-size-multiple for fixed batches (as fairseq/HetSeq):
    rounded down to a multiple; a batch smaller than the multiple is kept."""
    size = int(size)
    if multiple <= 1 or size < multiple:
        return size
    return size - size % multiple


def plan_fixed(n_left: int, batch_sizes, multiple: int = 1) -> np.ndarray:
    """Step boundaries for ``n_left`` samples and per-rank batch sizes.

    Returns an int64 array (steps, world+1) of offsets relative to the start:
    rank r of step s takes ``[b[s, r], b[s, r+1])``.
    """
    sizes = np.asarray(batch_sizes, dtype=np.int64)
    total = int(sizes.sum())
    full = n_left // total
    rest = n_left - full * total
    cum = np.concatenate([[0], np.cumsum(sizes)])
    bounds = (np.arange(full, dtype=np.int64)[:, None] * total) + cum[None, :]
    if rest:
        share = (rest * sizes) // total
        if multiple > 1:
            share -= share % multiple
        short = rest - int(share.sum())
        # hand the remainder out one at a time, largest batches first
        for r in np.argsort(-sizes, kind="stable"):
            if short == 0:
                break
            add = min(short, int(sizes[r] - share[r]))
            share[r] += add
            short -= add
        last = full * total + np.concatenate([[0], np.cumsum(share)])
        bounds = np.vstack([bounds, last[None, :]])
    return bounds.reshape(-1, len(sizes) + 1)


def plan_tokens(tokens: np.ndarray, max_tokens, max_sentences, multiple: int = 1) -> np.ndarray:
    """Step boundaries when batches are limited by real tokens (and sentences).

    ``tokens`` are the token counts of the remaining samples in epoch order.
    Each step, ranks in turn take the longest run that fits their limits.
    """
    n = len(tokens)
    world = len(max_tokens)
    cum = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    rows = []
    pos = 0
    while pos < n:
        row = [pos]
        for r in range(world):
            limit_tokens = max_tokens[r]
            end = min(pos + (max_sentences[r] or n), n)
            if limit_tokens:
                # the largest end with cum[end] - cum[pos] <= limit_tokens
                end = min(end, int(np.searchsorted(cum, cum[pos] + limit_tokens, side="right")) - 1)
                if end <= pos < n:
                    raise UserError(f"a sample has {int(tokens[pos])} tokens, more than --max-tokens "
                                    f"{limit_tokens}; raise --max-tokens")
            count = max(end - pos, 0)
            if multiple > 1 and count > multiple:
                count -= count % multiple
            pos += count
            row.append(pos)
        rows.append(row)
    return np.asarray(rows, dtype=np.int64).reshape(-1, world + 1)


def plan_global_tokens(tokens: np.ndarray, budget: int, shares) -> np.ndarray:
    """Step boundaries for a global token budget split over the ranks.

    Each step is the longest run of the remaining samples (``tokens``: their
    token counts in epoch order) holding at most ``budget`` tokens: which
    samples an update trains on depends on the budget alone, never on the
    split, so any split gives the update of one process. Rank r's slice of a
    step ends at the sample boundary nearest to its cumulative share of the
    step's tokens (``shares``: per-rank token shares summing to ``budget``);
    a rank whose share is below one sample may get an empty slice.
    """
    n, world = len(tokens), len(shares)
    cum = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    fractions = np.cumsum(np.asarray(shares, dtype=np.float64))[:-1] / float(budget)
    rows, pos = [], 0
    while pos < n:
        end = int(np.searchsorted(cum, cum[pos] + budget, side="right")) - 1
        if end <= pos:
            raise UserError(f"a sample has {int(tokens[pos])} tokens, more than the global batch of {budget} "
                            f"tokens (--global-batch-size with --max-tokens); raise --global-batch-size")
        within = cum[pos:end + 1] - cum[pos]
        targets = fractions * within[-1]
        after = np.minimum(np.searchsorted(within, targets), len(within) - 1)
        before = np.maximum(after - 1, 0)
        nearest = np.where(targets - within[before] <= within[after] - targets, before, after)
        rows.append([pos, *(pos + nearest), end])
        pos = end
    return np.asarray(rows, dtype=np.int64).reshape(-1, world + 1)


def pin_for(device) -> bool:
    """Whether read-ahead batches should be pinned for ``device``: only for a
    CUDA device (pinning needs the CUDA runtime and gains nothing on CPU)."""
    return getattr(device, "type", str(device)) == "cuda"


def read_ahead_workers(num_workers: int, dataset, pin_memory: bool) -> int:
    """``--num-workers`` where a read-ahead thread has work to overlap with
    compute (reading from disk, or pinning for a CUDA copy), else 0. For data
    already in memory on CPU the thread only competes with training's threads
    for the cores: MNIST on 2 cores trained ~10% slower with 2 than with 0."""
    return num_workers if pin_memory or getattr(dataset, "reads_from_disk", False) else 0


def pin(batch):
    """``batch`` (a tensor, or a dict/list/tuple of them) in page-locked memory."""
    from textbox_like.data.base import map_tensors
    return map_tensors(lambda v: v.pin_memory() if v.device.type == "cpu" else v, batch)


class EpochBatchIterator:
    """Yields, for this rank, ``(indices, global_count)`` per step of an epoch.

    ``batch_sizes`` / ``max_tokens`` are per rank (lists of length world
    size), gathered from all ranks by the trainer.
    """

    def __init__(self, dataset, seed, rank, world_size, batch_sizes, max_tokens=None,
                 shuffle=True, multiple=1, num_workers=0, pin_memory=False):
        self.dataset = dataset
        # pin read-ahead batches (only when training on CUDA: pinning needs a
        # CUDA runtime) so the trainer's non_blocking copies overlap compute
        self.pin_memory = bool(pin_memory)
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.max_tokens = list(max_tokens) if max_tokens and any(max_tokens) else None
        self.batch_sizes = list(batch_sizes) if self.max_tokens else \
            [round_batch_size(b, multiple) for b in batch_sizes]
        self.shuffle = shuffle
        self.multiple = multiple
        self.num_workers = num_workers
        self.epoch = 1
        self.offset = 0          # samples of this epoch's order already consumed
        self.plan_version = 0    # changes when set_split re-plans: iterators over the old plan are stale
        self.token_shares = None  # --global-batch-size in tokens: each rank's share of the budget
        self._order = None
        self._bounds = None
        self._start = 0
        self._tokens = dataset.num_tokens() if self.max_tokens else None
        if self.max_tokens and self._tokens is None:
            raise UserError("--max-tokens needs a task whose data counts tokens; use --max-sentences")

    # -- plan ---------------------------------------------------------------
    def _plan(self):
        order = self.dataset.epoch_order(self.seed, self.epoch, self.shuffle)
        left = len(order) - self.offset
        if self.token_shares:
            bounds = plan_global_tokens(self._tokens[order[self.offset:]], sum(self.token_shares),
                                        self.token_shares)
        elif self.max_tokens:
            bounds = plan_tokens(self._tokens[order[self.offset:]], self.max_tokens,
                                 self.batch_sizes, self.multiple)
        else:
            bounds = plan_fixed(left, self.batch_sizes, self.multiple)
        self._order, self._bounds, self._start = order, bounds + self.offset, self.offset

    def set_split(self, batch_sizes, by_tokens=False):
        """Each rank's share of a step from now on (--global-batch-size: the
        split of the global batch, already a multiple where it must be; in
        tokens with ``by_tokens``, see plan_global_tokens): the rest of the
        epoch is planned again from the current offset."""
        if by_tokens:
            if self._tokens is None:
                raise UserError("--max-tokens needs a task whose data counts tokens; use --max-sentences")
            self.token_shares = [int(b) for b in batch_sizes]
        else:
            self.batch_sizes = [int(b) for b in batch_sizes]
        self.plan_version += 1
        if self._order is not None:
            self.set_epoch(self.epoch, self.offset)

    def set_epoch(self, epoch, offset=0):
        self.epoch, self.offset = epoch, offset
        self._plan()

    def __len__(self):
        """Steps left in the current epoch."""
        if self._bounds is None:
            self._plan()
        return int(np.sum(self._bounds[:, 0] >= self.offset))

    def steps_in_epoch(self):
        """Steps of a whole epoch (for progress bars and --update-freq)."""
        if self._bounds is None:
            self._plan()
        done = int(np.sum(self._bounds[:, 0] < self.offset))
        return done + len(self)

    @property
    def end_of_epoch(self):
        return self._order is not None and self.offset >= len(self._order)

    def _steps(self):
        if self._bounds is None:
            self._plan()
        first = int(np.searchsorted(self._bounds[:, 0], self.offset))
        for s in range(first, len(self._bounds)):
            row = self._bounds[s]
            yield self._order[row[self.rank]:row[self.rank + 1]], int(row[-1] - row[0]), int(row[-1])

    def __iter__(self):
        """Yields (batch, global_count). ``self.offset`` advances when a batch
        is handed out, so a checkpoint taken between updates records exactly
        what has been trained on."""
        steps = self._steps()
        if self.num_workers > 0:
            yield from self._prefetched(steps)
            return
        for indices, count, end in steps:
            batch = self.dataset.get_batch(indices)
            self.offset = end
            yield batch, count

    def _prefetched(self, steps):
        """Read ahead in a thread: I/O and decompression overlap compute, the
        order stays exactly the plan's."""
        q = queue.Queue(maxsize=max(2, 2 * self.num_workers))
        stop = threading.Event()
        sentinel = object()

        def work():
            try:
                for indices, count, end in steps:
                    if stop.is_set():
                        return
                    batch = self.dataset.get_batch(indices)
                    if self.pin_memory:
                        batch = pin(batch)
                    q.put((batch, count, end))
                q.put(sentinel)
            except BaseException as exc:  # handed to the consumer
                q.put(exc)

        thread = start_thread(threading.Thread(target=work, daemon=True))
        try:
            while True:
                item = q.get()
                if item is sentinel:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, count, end = item
                self.offset = end
                yield batch, count
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    q.get_nowait()
                except queue.Empty:
                    thread.join(0.01)

    # -- state --------------------------------------------------------------
    def state_dict(self):
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "world_size": self.world_size, "batch_sizes": list(self.batch_sizes),
                "max_tokens": list(self.max_tokens) if self.max_tokens else None,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state):
        if int(state["dataset_size"]) != len(self.dataset):
            raise UserError(f"the checkpoint was trained on {state['dataset_size']} samples, this data has "
                            f"{len(self.dataset)}; resume on the same data or pass --reset-dataloader")
        if int(state["seed"]) != self.seed:
            raise UserError(f"the checkpoint was trained with --seed {state['seed']}, not {self.seed}; "
                            f"use the same seed or pass --reset-dataloader")
        if bool(state.get("shuffle", True)) != self.shuffle:
            raise UserError("the checkpoint was trained with" + ("out" if not state.get("shuffle", True) else "")
                            + " --no-shuffle; use the same setting or pass --reset-dataloader")
        # Another world size or batch size just re-plans the rest of the epoch
        # from the same offset: nothing skipped, nothing repeated.
        self.set_epoch(int(state["epoch"]), int(state["offset"]))
