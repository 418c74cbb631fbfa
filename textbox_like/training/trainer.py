"""The training loop, top to bottom: read :meth:`Trainer.train` first.

Accelerate places the model, wraps it in DDP and runs mixed precision; the
trainer builds the run in the order it needs, then runs epochs of updates,
asking each component after every update whether it is due. The components,
each owning its state and its own "is it due" check:

- :class:`~.step.UpdateStep` (step.py): one update and the non-finite guard;
  :class:`~.step.InFlight`: the update under way;
- :class:`~.global_batch.GlobalBatch`: the split of ``--global-batch-size``
  over the ranks, micro-batches, the memory guard, ``--balance``;
- :class:`~.feed.Feed`: epochs and the data position;
- :class:`~.reporting.Reporting`: ``should_log``, the records and lines;
- :class:`~.validation.Validation`: ``should_validate``;
- :class:`~.checkpointer.Checkpointer`: ``should_save`` and the save;
- :class:`~textbox_like.processes.preemption.Preemption`: ``due``, stopping on SIGTERM/SIGUSR1;
- :class:`~.lifecycle.Lifecycle`: restore, start, finish, the save-dir lock;
- :mod:`.outcome`: an exception as (save or not, one line, exit code);
  :mod:`.elastic`: a lost peer;
- :class:`~.callbacks.Callbacks`: the run's callbacks (``--callbacks``,
  ``train(callbacks=...)``, ``--patience``'s early stopping), called at the
  start, after each update, validation and checkpoint, and at the end;
- periodic events of one's own: a :class:`~.due.EveryUpdates` registered
  with :meth:`Trainer.add_event`.
"""
from __future__ import annotations

import os
from pathlib import Path

from textbox_like.processes import distributed
from textbox_like.parallel import sharding
from textbox_like.core.errors import UserError
from textbox_like.core.faults import check_writable
from textbox_like.metrics.meters import Logger
from textbox_like.processes.preemption import Preemption, raise_if_stopped
from textbox_like.tasks import TASKS
from textbox_like.tasks.base import best_metric_direction
from textbox_like.training.callbacks import Callbacks, run_callbacks
from textbox_like.training.checkpointer import Checkpointer
from textbox_like.training.feed import Feed
from textbox_like.training.global_batch import GlobalBatch, RankTiming
from textbox_like.training.hooks import TestHooks
from textbox_like.training.lifecycle import Lifecycle
from textbox_like.training.reporting import Reporting
from textbox_like.training.state import TrainState
from textbox_like.training.step import InFlight, UpdateStep
from textbox_like.training.validation import Validation


class Trainer:
    """Built in the order a run needs: processes and Accelerate, data, model
    and optimizer, batch plan, then the components that watch over them."""

    def __init__(self, cfg, callbacks=()):
        self.cfg = cfg  # a settings.RunConfig
        self.given_callbacks = callbacks  # instances from Python (textbox_like.train(callbacks=...))
        placement = distributed.placement_from_env(cfg)
        made = None if cfg.checkpoint.no_save or Path(cfg.checkpoint.save_dir).exists() else cfg.checkpoint.save_dir
        if not cfg.checkpoint.no_save:
            # before minutes of data loading, not at the first save; only the writer
            # creates the directory (on another node it would stay empty)
            check_writable(cfg.checkpoint.save_dir, create=placement is None or placement.rank == 0)
        from textbox_like.processes.elastic import Agent
        self.agent = Agent.from_env()  # torchrun's, if it started this worker
        self.setup_processes()
        self.lifecycle = Lifecycle(self)
        if made is not None and (placement is None or placement.rank == 0):
            self.lifecycle.made_save_dir = Path(made)
        try:
            self.lifecycle.claim_save_dir()  # inside: a signal during it ends here, where the lock is released
            self.hooks = TestHooks(self.rank)
            from accelerate.utils import set_seed
            set_seed(cfg.numerics.seed)
            self.task = TASKS.get(cfg.data.task)(cfg)
            for build in (self.build_data, self.build_model, self.build_components):
                raise_if_stopped()  # a start-up signal whose stop the code it landed in swallowed
                build()
        except BaseException:
            self.lifecycle.release_save_dir()
            raise

    def setup_processes(self):
        from textbox_like.parallel.accelerator import build_accelerator
        from textbox_like.parallel.malloc import keep_freed_heap, mmap_threshold_for
        from textbox_like.metrics.trackers import log_with, requested
        cfg = self.cfg
        trackers = requested(cfg.logging)  # before any process group: a missing package is one line
        self.placement = placement = distributed.placement_from_env(cfg) or distributed.Placement()
        # processes sharing a node share its cores; Accelerate would otherwise
        # set 2 threads each, whatever the machine
        threads = cfg.runtime.threads or max(1, distributed.usable_cpus() // max(placement.local_world_size, 1))
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("MKL_NUM_THREADS", str(threads))
        # before any data or model is allocated: updates reuse freed heap
        # instead of faulting fresh pages in; under --fsdp on CPU ranks large
        # chunks are unmapped when freed (malloc.py says why). uses_cuda asks
        # torch.cuda.is_available(), which allocates nothing on a device
        keep_freed_heap(mmap_threshold_for(cfg.sharding.fsdp, placement.world_size, distributed.uses_cuda(cfg)))
        import torch
        distributed.init_process_group(placement, cfg)
        self.accelerator, self.sources = build_accelerator(
            cfg, placement, log_with(trackers, cfg.checkpoint.save_dir) if trackers and not cfg.checkpoint.no_save else None)
        acc = self.accelerator
        self.rank, self.world, self.is_main = acc.process_index, acc.num_processes, acc.is_main_process
        self.host_group = distributed.host_group()
        if not cfg.runtime.threads and self.world > 1:  # ranks started one by one share a machine's cores too
            sharing = max(placement.local_world_size, distributed.ranks_on_this_machine(self.host_group))
            threads = max(1, distributed.usable_cpus() // sharing)
        self.preemption = Preemption(self.host_group, self.world, announce=self.is_main)
        self.log = Logger(cfg, self.is_main, acc)
        torch.set_num_threads(threads)
        self.threads = threads

    def build_data(self):
        import time
        cfg, task = self.cfg, self.task
        # once per run, then once per node (nodes may not share a file system),
        # on a long-timeout group: preparing data can take long
        time.sleep(self.hooks.start_delay)  # test-only: slow data
        with distributed.main_then_local_main_first(self.accelerator):
            task.prepare_data()
        self.train_data = task.batch_dataset(cfg.data.train_subset)
        if len(self.train_data) == 0:
            where = (f"--data {cfg.data.data}" if cfg.data.data else
                     f"task {cfg.data.task} ({type(task).__qualname__}.build_dataset({cfg.data.train_subset!r}) returned "
                     f"an empty dataset)")
            raise UserError(f"the {cfg.data.train_subset!r} split of {where} holds no samples")
        self.valid_data = {} if cfg.validation.disable_validation else {s: task.batch_dataset(s) for s in cfg.data.valid_subset}

    def build_model(self):
        import torch

        from textbox_like.parallel.accelerator import compile_regions
        from textbox_like.optim.lr_scheduler import build_scheduler
        from textbox_like.optim import build_optimizer
        cfg = self.cfg
        if cfg.numerics.train_dtype == "float64":
            from textbox_like.processes.distributed import remember_torch_settings
            remember_torch_settings()  # distributed.cleanup() puts the default back
            torch.set_default_dtype(torch.float64)
        model = self.task.build_model()
        self.n_params = sum(p.numel() for p in model.parameters())
        acc = self.accelerator
        # before prepare(): a model may name the parts worth compiling here
        self.compiled_regions = compile_regions(acc, model)
        if self.compiled_regions is not None:
            self.sources["compile"] += f", regions {', '.join(self.compiled_regions)} on {acc.device.type}"
        cuda = acc.device.type == "cuda"
        ours = sharding.applied_by_us(cfg, self.placement, cuda)
        if ours:  # CPU, or a shard degree of 1: sharded here, before the optimizer holds the parameters
            sharding.shard_model(model, cfg, self.placement, acc.device.type, acc.mixed_precision)
        optimizer = build_optimizer(cfg.optim, self.task.param_groups(model, cfg.optim.weight_decay),
                                    fused_default=cuda and acc.scaler is None)
        if ours:  # placement and autocast, without the DDP wrapper prepare() would add
            self.model, self.optimizer = acc.prepare_model(model, evaluation_mode=True), acc.prepare_optimizer(optimizer)
        else:
            with sharding.units_for_accelerate(acc, model, cfg):  # Accelerate shards (CUDA): shard_model's units
                self.model, self.optimizer = acc.prepare(model, optimizer)
        self.sharding_line = None  # the start line's sharding, where the model is sharded
        if sharding.is_sharded(self.model):
            sharding.reduce_unused_parameters(self.model, cfg)
        if sharding.enabled(cfg):
            self.sharding_line = sharding.describe(self.model, cfg, self.placement, cuda, self.n_params) \
                if sharding.is_sharded(self.model) else "sharding none (--fsdp with one process: nothing to shard)"
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.grad_params = [p for p in self.model.parameters() if p.requires_grad]
        # each rank its own dropout stream; rank 0 keeps the seed's own stream
        if self.rank:
            torch.manual_seed(cfg.numerics.seed + self.rank)

    def build_components(self):
        """In the order of their collectives (the same on every rank)."""
        best_metric, maximize = best_metric_direction(self.cfg.validation, self.task)
        self.state = TrainState(best_metric, maximize)
        self.callbacks = Callbacks(run_callbacks(self.cfg, self.given_callbacks), self.state, self.rank, self.world,
                                   self.host_group, self.cfg)
        self.global_batch = GlobalBatch(self)
        self.feed = Feed(self)
        self.iterator = self.feed.iterator
        if self.global_batch.balancer is not None:
            self.global_batch.check_token_caps()
            self.global_batch.apply_split()
        self.planned_updates = self.scheduler.planned_updates = \
            self.feed.updates_of_epochs(self.cfg.schedule.max_epoch or 0)
        self.validation = Validation(self, best_metric, maximize, self.callbacks)
        self.checkpointer = Checkpointer(self, self.callbacks)
        self.timing = RankTiming(self)
        self.global_batch.build_memory_guard()
        self.in_flight = InFlight(compile_pending=self.sources["compile"] != "default")
        self.step = UpdateStep(self)
        self.reporting = Reporting(self)
        self.events = []  # periodic events of one's own (add_event)

    def add_event(self, event):
        """A periodic event (a due.EveryUpdates): asked after every update
        taken, and counted in anything_due."""
        self.events.append(event)

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        """Restore, start, epochs of updates until stop_reason() names one, finish: the exit code."""
        self.lifecycle.restore()
        self.lifecycle.start()
        self.hooks.limit_memory(self.state.num_updates)
        while self.stop_reason() is None:
            self.feed.begin_epoch()
            self.checkpointer.new_epoch()
            for micro_batches, totals in self.updates_of_this_epoch():
                stepped = self.train_step(micro_batches, totals)
                self.in_flight.update_over(self.timing.timer)
                if stepped and self.after_update():
                    break  # the end of the epoch (its own validation and save follow) or of the run
            self.log.end_epoch()
            if self.feed.end_of_epoch():
                self.end_epoch()
        self.step.refuse_a_run_of_skips()
        return self.lifecycle.finish()

    def after_update(self) -> bool:
        """Whatever is due after an update that moved the weights, each
        component deciding by its own check; True where the epoch's loop
        ends here: at the end of the epoch, or of the run."""
        state = self.state
        self.reporting.log_train()
        self.global_batch.rebalance()
        self.preemption.poll(state.num_updates)
        self.hooks.limit_memory(state.num_updates)
        for event in self.events:
            if event.should_run(state.num_updates):
                event.run(self)
        self.callbacks.update_end()
        if self.feed.end_of_epoch():
            return True
        stopping = self.stop_reason() is not None
        saving = self.checkpointer.should_save(state.num_updates)
        # HetSeq validates at every interval save; a run that ends
        # validates its final weights (unless preempted: leave fast)
        improved = self.validation.validate() if (self.validation.should_validate(state.num_updates) or saving or (
            stopping and not self.preemption.agreed)) else False
        stopping = stopping or self.stop_reason() is not None  # a callback (--patience) asked at this validation
        if saving or improved or stopping:
            self.checkpointer.save(end_of_epoch=False, is_best=improved, final=stopping,
                                   snapshot=self.checkpointer.snapshot)
        return stopping

    def anything_due(self) -> bool:
        """Whether after_update will act after this update beyond the next
        one: the same components' checks (UpdateStep reads the gradient norm
        at once then, so every decision sees the settled count)."""
        update = self.state.num_updates
        return (self.reporting.should_log() or self.checkpointer.should_save(update)
                or self.validation.should_validate(update) or self.preemption.due(update)
                or self.feed.end_of_epoch() or self.stop_reason() is not None or self.callbacks.every_update
                or any(event.should_run(update) for event in self.events))

    def end_epoch(self):
        """The epoch's record, its validation (every --validate-interval epochs), its save, the next epoch."""
        self.reporting.log_epoch()
        final = self.stop_reason(next_epoch=True) is not None
        due = self.validation.should_validate_epoch(self.state.epoch, self.state.num_updates,
                                                    final and not self.preemption.agreed)
        improved = self.validation.validate() if due else False
        self.checkpointer.save(end_of_epoch=True, is_best=improved, final=final, snapshot=self.checkpointer.snapshot)
        if not self.preemption.agreed:
            self.feed.next_epoch()

    def stop_reason(self, next_epoch=False):
        """Why the run stops now, or None: the one place that knows."""
        cfg, state = self.cfg, self.state
        if self.preemption.agreed:
            return "preempted"
        if cfg.schedule.max_update and state.num_updates >= cfg.schedule.max_update:
            return "max_update"
        if cfg.schedule.max_epoch and state.epoch + int(next_epoch) > cfg.schedule.max_epoch:
            return "max_epoch"
        return self.callbacks.stop_reason  # agreed by every rank (--patience's early stopping is one)

    def train_step(self, micro_batches, totals) -> bool:
        """One update (UpdateStep.update); False when it was skipped."""
        return self.step.update(micro_batches, totals)

    def updates_of_this_epoch(self):
        """The rest of this epoch, update by update (Feed.updates)."""
        return self.feed.updates()

    # ------------------------------------------------------------- helpers
    def to_device(self, batch):
        batch = self.task.collate_to_device(batch, self.accelerator.device)
        if self.cfg.numerics.train_dtype == "float64":
            from textbox_like.data.base import map_tensors
            batch = map_tensors(lambda v: v.double() if v.is_floating_point() else v, batch)
        return batch

    def reseed(self, why):
        import torch
        torch.manual_seed(self.cfg.numerics.seed + 7919 * self.state.num_updates + self.rank)
        self.log.info(f"{why}: reseeding")
