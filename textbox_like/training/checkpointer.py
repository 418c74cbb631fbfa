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
from textbox_like.training.due import every
from textbox_like.models import adapters
from textbox_like.tasks import TASKS
from textbox_like.training.state import BaseModelPart, LossScalerPart, ModelPart, OptimizerPart, RNGPart


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

    def __init__(self, cfg, ranks, accelerator, *, task_model, optimizer, scheduler, iterator, balancer, state, samples,
                 grad_params, sources, reseed, reporting, callbacks, hooks):
        self.cfg, self.ranks, self.state, self.samples = cfg, ranks, state, samples
        self.grad_params, self.reporting, self.callbacks, self.hooks = grad_params, reporting, callbacks, hooks
        acc = accelerator
        self.task_model = task_model  # the module the task built, under any wrapper
        trained_only = adapters.enabled(cfg.adapters)
        # --peft: the base model's identity first, so that a resume onto another base is refused before any load
        base = adapters.base_model_path(cfg.task_options, TASKS.get(cfg.data.task).initial_weights_setting)
        parts = {"base_model": BaseModelPart(adapters.base_identity(task_model, cfg.adapters, base))} \
            if trained_only else {}
        parts |= {"model": ModelPart(task_model, trained_only),
                 "optimizer": OptimizerPart(optimizer, cfg.optim.optimizer, not cfg.checkpoint.no_save_optimizer_state),
                 "scheduler": scheduler, "iterator": iterator, "train": state,
                 "scaler": LossScalerPart(acc), "rng": RNGPart(acc, reseed, ranks.group)}
        if balancer is not None:
            parts["balance"] = balancer
        # --fsdp saves sharded checkpoints (every rank its shards); any run
        # resumes from the newest of either format, so a run moves between
        # DDP and --fsdp across a --resume
        self.checkpoints = ShardedCheckpointManager(
            cfg.checkpoint, metadata={"task": cfg.data.task, "world_size": ranks.world, "config": to_yaml(cfg),
                                  "precision": {"mixed": acc.mixed_precision, "source": sources["precision"]}},
            parts=parts, is_main=ranks.is_main, saves_sharded=sharding.enabled(cfg), group=distributed.long_group())
        self.saved_update = None  # the update this run saved last, once every rank knows the save succeeded

    @property
    def snapshot(self) -> bool:
        """The last update taken crossed a multiple of --snapshot-interval samples (state.SamplesTrained)."""
        return self.samples.crossed_snapshot

    def new_epoch(self):
        self.samples.new_epoch()

    def due(self, update: int) -> bool:
        """Every --save-interval-updates, and where the update crossed a snapshot."""
        return every(update, self.cfg.checkpoint.save_interval_updates) or self.samples.crossed_snapshot

    def save(self, end_of_epoch, is_best, final=False, snapshot=False):
        """Every rank takes part; the last update is settled by then (the
        trainer, and a fault's save on the way out, settle it first)."""
        state = self.state
        names = self.checkpoints.names(state.epoch, state.num_updates, end_of_epoch, is_best, final,
                                       snapshot)
        if not names:
            return
        started = time.perf_counter()
        self.reporting.fold_log_window()  # so the saved meters are already summed over ranks
        if not weights_finite(self.grad_params, self.ranks.world, self.ranks.group):
            raise Diverged(f"the weights are not finite at update {state.num_updates}; not saving them. "
                           f"The last finite checkpoint is {self.checkpoints.newest_good()}")
        failure = None
        time.sleep(self.hooks.save_delay)
        try:
            self.checkpoints.save(names)
        except SaveFailed as exc:
            failure = exc
        # instead of a barrier: every rank learns whether the main one could
        # write (on the long-timeout group: a large checkpoint takes a while)
        if collectives.any_rank_failed(failure is not None, self.ranks.world, distributed.long_group())[0] \
                and failure is None:
            failure = SaveFailed("rank 0 could not write a checkpoint (see its message); stopping")
        if failure is not None:
            raise failure
        self.saved_update = state.num_updates
        state.clock.paused += time.perf_counter() - started
        self.callbacks.checkpoint_saved(self.checkpoints.dir / names[0])
