"""The data of the run, update by update: epochs, the update frequency of
each epoch, the data position, and a data file failing mid-run."""
from __future__ import annotations

import itertools
import math
import time

from textbox_like.core import collectives
from textbox_like.storage.checkpoint import rng_state
from textbox_like.core.faults import DataCorrupt, DataUnavailable


class Feed:
    """The epoch batch iterator (the data position is its offset) and the
    epochs over it."""

    def __init__(self, trainer):
        from textbox_like.data.iterators import EpochBatchIterator, pin_for, read_ahead_workers
        self.trainer = t = trainer
        cfg, batches = t.cfg, t.global_batch
        pin_memory = pin_for(t.accelerator.device)
        self.iterator = EpochBatchIterator(t.train_data, cfg.numerics.seed, t.rank, t.world, batches.batch_sizes,
                                           batches.max_tokens, shuffle=not cfg.data.no_shuffle,
                                           multiple=cfg.data.required_batch_size_multiple,
                                           num_workers=read_ahead_workers(cfg.data.num_workers, t.train_data,
                                                                          pin_memory),
                                           pin_memory=pin_memory)
        # a dataset read from disk as it goes can fail mid-run: ranks agree on every update's data
        self.data_can_fail = t.world > 1 and getattr(t.train_data, "reads_from_disk", False)
        self.previous_data_failure = None  # where the attempt resumed from failed to read data, if it did

    def update_freq(self, epoch=None):
        freqs = self.trainer.cfg.schedule.update_freq
        return freqs[min((epoch or self.trainer.state.epoch) - 1, len(freqs) - 1)]

    def updates_of_epochs(self, epochs):
        """Updates in the first ``epochs`` epochs (what 'decay over the run' means under --max-epoch)."""
        steps = self.iterator.steps_in_epoch()
        cap = self.trainer.cfg.data.num_iters_per_epoch or steps
        return sum(min(math.ceil(steps / self.update_freq(e)), cap) for e in range(1, epochs + 1))

    def begin_epoch(self):
        t = self.trainer
        cfg, state = t.cfg, t.state
        k = self.update_freq()
        t.scheduler.step_epoch(state.epoch)
        total = self.iterator.steps_in_epoch()
        done = math.ceil((total - len(self.iterator)) / k)
        bar = math.ceil(total / k)
        if cfg.data.num_iters_per_epoch:
            bar = min(bar, cfg.data.num_iters_per_epoch)
        if cfg.schedule.max_update:
            bar = min(bar, done + cfg.schedule.max_update - state.num_updates)
        t.log.start_epoch(state.epoch, bar, done)

    def updates(self):
        """The rest of this epoch as (``update_freq`` micro-batches, the
        update's denominators), timing the wait for data. A data file that
        fails mid-run rewinds the position to the update's start, so the
        checkpoint saved on the way out skips nothing."""
        t = self.trainer
        k, clock, task, flight, timer = self.update_freq(), t.state.clock, t.task, t.in_flight, t.timing.timer
        batches, plan = iter(self.iterator), self.iterator.plan_version
        while True:
            if self.iterator.plan_version != plan:  # re-split: read on from the new plan
                batches.close()
                batches, plan = iter(self.iterator), self.iterator.plan_version
            started, offset = time.perf_counter(), self.iterator.offset
            flight.began = started  # a whole update's time runs from here (RankTimer.update_took)
            if t.world > 1:  # what an emergency save rewinds to if a peer is lost during this update
                flight.start = {"offset": offset, "updates": t.state.num_updates, "rng": rng_state()}
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
            if (task.denominators or self.data_can_fail) and t.world > 1:
                failed, counts = collectives.any_rank_failed(failure is not None, t.world, t.host_group, counts)
                if failed and failure is None:
                    failure = DataUnavailable("another rank could not read its data (see its message)")
            if failure is not None:
                self.iterator.offset = offset
                if self.previous_data_failure == self.data_position():
                    failure = DataCorrupt(f"{failure}; the previous attempt failed at this same position "
                                          f"(update {t.state.num_updates + 1}): the data is damaged, not "
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
                "update": int(self.trainer.state.num_updates)}

    def end_of_epoch(self) -> bool:
        cap = self.trainer.cfg.data.num_iters_per_epoch
        return self.iterator.end_of_epoch or bool(cap and self.trainer.state.updates_in_epoch >= cap)

    def next_epoch(self):
        state = self.trainer.state
        state.epoch, state.updates_in_epoch = state.epoch + 1, 0
        self.iterator.set_epoch(state.epoch)
