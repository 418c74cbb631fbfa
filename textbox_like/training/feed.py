"""The data of the run, update by update: epochs, the update frequency of
each epoch, the data position, and a data file failing mid-run."""
from __future__ import annotations

import itertools
import math
import time

from textbox_like.core import collectives
from textbox_like.storage.checkpoint import rng_state
from textbox_like.core.faults import DataCorrupt, DataUnavailable


def update_freq_of(schedule, epoch: int) -> int:
    """--update-freq of ``epoch`` (a list: one per epoch, the last for the rest)."""
    freqs = schedule.update_freq
    return freqs[min(epoch - 1, len(freqs) - 1)]


class Feed:
    """The epoch batch iterator (the data position is its offset) and the
    epochs over it."""

    def __init__(self, cfg, ranks, train_data, batch_sizes, max_tokens, device, *, task, state, scheduler, in_flight,
                 timing, log):
        from textbox_like.data.iterators import EpochBatchIterator, pin_for, read_ahead_workers
        from textbox_like.data.stream_batches import StreamBatchIterator
        self.cfg, self.ranks, self.task, self.state, self.scheduler = cfg, ranks, task, state, scheduler
        self.in_flight, self.timing, self.log = in_flight, timing, log
        pin_memory = pin_for(device)
        if getattr(train_data, "streaming", False):
            self.iterator = StreamBatchIterator(train_data, cfg.numerics.seed, ranks.rank, ranks.world, batch_sizes,
                                                max_tokens, shuffle=not cfg.data.no_shuffle,
                                                multiple=cfg.data.required_batch_size_multiple)
        else:
            self.iterator = EpochBatchIterator(
                train_data, cfg.numerics.seed, ranks.rank, ranks.world, batch_sizes, max_tokens,
                shuffle=not cfg.data.no_shuffle, multiple=cfg.data.required_batch_size_multiple,
                num_workers=read_ahead_workers(cfg.data.num_workers, train_data, pin_memory), pin_memory=pin_memory)
        # a dataset read from disk as it goes can fail mid-run: ranks agree on every update's data
        self.data_can_fail = ranks.world > 1 and getattr(train_data, "reads_from_disk", False)
        self.previous_data_failure = None  # where the attempt resumed from failed to read data, if it did

    def update_freq(self, epoch=None):
        return update_freq_of(self.cfg.schedule, epoch or self.state.epoch)

    def updates_of_epochs(self, epochs):
        """Updates in the first ``epochs`` epochs (what 'decay over the run' means under --max-epoch)."""
        steps = self.iterator.steps_in_epoch()
        if steps is None:  # a stream: its epochs' lengths are known at their ends
            cap = self.cfg.data.num_iters_per_epoch
            return cap * epochs if cap else 0
        cap = self.cfg.data.num_iters_per_epoch or steps
        return sum(min(math.ceil(steps / self.update_freq(e)), cap) for e in range(1, epochs + 1))

    def begin_epoch(self):
        cfg, state = self.cfg, self.state
        k = self.update_freq()
        self.scheduler.step_epoch(state.epoch)
        total = self.iterator.steps_in_epoch()
        if total is None:  # a stream: the bar runs to --max-update (or the epoch's updates cap)
            done, bar = state.updates_in_epoch, None
        else:
            done = math.ceil((total - len(self.iterator)) / k)
            bar = math.ceil(total / k)
        if cfg.data.num_iters_per_epoch:
            bar = min(bar or cfg.data.num_iters_per_epoch, cfg.data.num_iters_per_epoch)
        if cfg.schedule.max_update:
            left = done + cfg.schedule.max_update - state.num_updates
            bar = min(bar, left) if bar is not None else left
        self.log.start_epoch(state.epoch, bar, done)

    def updates(self):
        """The rest of this epoch as (``update_freq`` micro-batches, the
        update's denominators), timing the wait for data. A data file that
        fails mid-run rewinds the position to the update's start, so the
        checkpoint saved on the way out skips nothing."""
        state, ranks = self.state, self.ranks
        k, clock, task, flight, timer = self.update_freq(), state.clock, self.task, self.in_flight, self.timing.timer
        batches, plan = iter(self.iterator), self.iterator.plan_version
        while True:
            if self.iterator.plan_version != plan:  # re-split: read on from the new plan
                batches.close()
                batches, plan = iter(self.iterator), self.iterator.plan_version
            started, offset = time.perf_counter(), self.iterator.offset
            flight.began = started  # a whole update's time runs from here (RankTimer.update_took)
            if ranks.world > 1:  # what an emergency save rewinds to if a peer is lost during this update
                flight.start = {"offset": offset, "updates": state.num_updates, "rng": rng_state()}
            failure = None
            try:
                micro_batches = list(itertools.islice(batches, k))
            except DataUnavailable as exc:
                failure, micro_batches = exc, []
            waited = time.perf_counter() - started
            clock.data_wait += waited
            if timer is not None:
                timer.data += waited
            # every rank knows the update's sample count from the batch plan;
            # other denominators (BERT's masked tokens) are host numbers summed
            # over ranks, with the data's health, in one host all-reduce
            counts = [sum(task.count(batch)[name] for batch, _ in micro_batches) for name in task.denominators]
            if (task.denominators or self.data_can_fail) and ranks.world > 1:
                failed, counts = collectives.any_rank_failed(failure is not None, ranks.world, ranks.group, counts)
                if failed and failure is None:
                    failure = DataUnavailable("another rank could not read its data (see its message)")
            if failure is not None:
                self.iterator.offset = offset
                if self.previous_data_failure == self.data_position():
                    failure = DataCorrupt(f"{failure}; the previous attempt failed at this same position "
                                          f"(update {state.num_updates + 1}): the data is damaged, not "
                                          f"unavailable, and a retry would fail again; repair or regenerate it")
                raise failure
            if not micro_batches:
                return
            flight.offset = offset  # an update that fails (out of memory) is redone from here
            totals = {"nsamples": sum(count for _, count in micro_batches)}
            totals.update((name, max(count, 1)) for name, count in zip(task.denominators, counts))
            yield micro_batches, totals

    def data_position(self) -> dict:
        """Where the next update's data starts (the same on every rank)."""
        return {"epoch": int(self.iterator.epoch), "offset": int(self.iterator.offset),
                "update": int(self.state.num_updates)}

    def end_of_epoch(self) -> bool:
        cap = self.cfg.data.num_iters_per_epoch
        return self.iterator.end_of_epoch or bool(cap and self.state.updates_in_epoch >= cap)

    def due(self, update: int) -> bool:
        """After an update: the end of the epoch (its validation and save follow)."""
        return self.end_of_epoch()

    def next_epoch(self):
        state = self.state
        state.epoch, state.updates_in_epoch = state.epoch + 1, 0
        self.iterator.set_epoch(state.epoch)
