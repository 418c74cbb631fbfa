"""Saving: when a save is due (every --save-interval-updates, a
--snapshot-interval crossed), and the save itself, which every rank takes
part in (a file checkpoint is written by the main one; under --fsdp every
rank writes its shards of a sharded checkpoint: sharded_checkpoint.py)."""
from __future__ import annotations

import time

from textbox_like.core import collectives
from textbox_like.processes import distributed
from textbox_like.parallel import sharding
from textbox_like.config.files import to_yaml
from textbox_like.core.faults import Diverged, SaveFailed
from textbox_like.storage.sharded_checkpoint import ShardedCheckpointManager
from textbox_like.training.due import crosses, every
from textbox_like.training.state import LossScalerPart, ModelPart, OptimizerPart, RNGPart


def weights_finite(params, world: int, group=None) -> bool:
    """Whether every weight is finite on every rank: one check over this
    rank's own values (its shards under --fsdp: no weight is gathered), then
    one collective of one number."""
    import torch
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    finite = bool(torch.stack([value.isfinite().all() for value in local]).all()) if local else True
    return not collectives.any_rank_failed(not finite, world, group)[0]


class Checkpointer:
    """The checkpoint parts of the run, the save schedule and the save."""

    def __init__(self, trainer, callbacks):
        self.trainer = t = trainer
        self.callbacks = callbacks
        cfg, acc = t.cfg, t.accelerator
        parts = {"model": ModelPart(acc, t.model),
                 "optimizer": OptimizerPart(t.optimizer, cfg.optim.optimizer, not cfg.checkpoint.no_save_optimizer_state),
                 "scheduler": t.scheduler, "iterator": t.iterator, "train": t.state,
                 "scaler": LossScalerPart(acc), "rng": RNGPart(acc, t.reseed, t.host_group)}
        if t.global_batch.balancer is not None:
            parts["balance"] = t.global_batch.balancer
        # --fsdp saves sharded checkpoints (every rank its shards); any run
        # resumes from the newest of either format, so a run moves between
        # DDP and --fsdp across a --resume
        self.checkpoints = ShardedCheckpointManager(
            cfg.checkpoint, metadata={"task": cfg.data.task, "world_size": t.world, "config": to_yaml(cfg),
                                  "precision": {"mixed": acc.mixed_precision, "source": t.sources["precision"]}},
            parts=parts, is_main=t.is_main, saves_sharded=sharding.enabled(cfg), group=distributed.long_group())
        self.snapshot = False  # the last update taken crossed a multiple of --snapshot-interval samples
        self.saved_update = None  # the update this run saved last, once every rank knows the save succeeded

    def count_samples(self, samples_in_update: int):
        """An update taken: its samples, and kanachan's --snapshot-interval:
        whether they crossed a multiple of N training samples."""
        state = self.trainer.state
        before = state.samples_trained
        state.samples_trained += samples_in_update
        self.snapshot = crosses(before, state.samples_trained, self.trainer.cfg.checkpoint.snapshot_interval)

    def take_back_samples(self, samples_in_update: int):
        """The last update turned out skipped (UpdateStep.settle, one update
        late): its samples are not trained. It crossed no snapshot (an update
        that crosses one is due, so settled at once); an earlier crossing was
        saved when it happened."""
        self.trainer.state.samples_trained -= samples_in_update
        self.snapshot = False

    def new_epoch(self):
        self.snapshot = False

    def should_save(self, update: int) -> bool:
        """Every --save-interval-updates, and where the update crossed a snapshot."""
        return every(update, self.trainer.cfg.checkpoint.save_interval_updates) or self.snapshot

    def save(self, end_of_epoch, is_best, final=False, snapshot=False):
        t = self.trainer
        t.step.settle()
        state = t.state
        names = self.checkpoints.names(state.epoch, state.num_updates, end_of_epoch, is_best, final,
                                       snapshot)
        if not names:
            return
        started = time.perf_counter()
        t.reporting.fold_log_window()  # so the saved meters are already summed over ranks
        if not weights_finite(t.grad_params, t.world, t.host_group):
            raise Diverged(f"the weights are not finite at update {state.num_updates}; not saving them. "
                           f"The last finite checkpoint is {self.checkpoints.newest_good()}")
        failure = None
        time.sleep(t.hooks.save_delay)
        try:
            self.checkpoints.save(names)
        except SaveFailed as exc:
            failure = exc
        # instead of a barrier: every rank learns whether the main one could
        # write (on the long-timeout group: a large checkpoint takes a while)
        if collectives.any_rank_failed(failure is not None, t.world, distributed.long_group())[0] \
                and failure is None:
            failure = SaveFailed("rank 0 could not write a checkpoint (see its message); stopping")
        if failure is not None:
            raise failure
        self.saved_update = state.num_updates
        state.clock.paused += time.perf_counter() - started
        self.callbacks.checkpoint_saved(self.checkpoints.dir / names[0])
