"""The training loop, top to bottom: read :meth:`Trainer.train` first.

Accelerate places the model, wraps it in DDP and runs mixed precision; the
trainer builds the run in the order it needs, then runs epochs of updates,
asking each component after every update whether it is due. Each component
is given the few objects it uses (never the trainer); what two share is one
object both are given (:class:`~.state.Ranks`, :class:`~.state.StepRecord`,
:class:`~.state.SamplesTrained`, :class:`~.global_batch.RankTiming`,
:class:`~.step.InFlight`), and where one needs another's work, the loop
asks for it (settling the update before anything reads the counts, the
start, the restored position) or the one is given the other. The
components, each owning its state and its one check ``due(update)``:

- :class:`~.step.UpdateStep` (step.py): one update and the non-finite guard;
  :class:`~.step.ForwardBackward`: forward and backward over micro-batches;
  :class:`~.step.InFlight`: the update under way;
- :class:`~.global_batch.GlobalBatch`: the split of ``--global-batch-size``
  over the ranks, micro-batches, the memory guard, ``--balance``;
- :class:`~.feed.Feed`: epochs and the data position; ``due`` at an epoch's end;
- :class:`~.reporting.Reporting`: ``due`` to log, the records and lines;
- :class:`~.validation.Validation`: ``due`` to validate;
- :class:`~.checkpointer.Checkpointer`: ``due`` to save, and the save;
- :class:`~textbox_like.processes.preemption.Preemption`: ``due``, stopping on SIGTERM/SIGUSR1;
- :class:`~.lifecycle.Lifecycle`: restore, start, finish;
  :class:`~.lifecycle.SaveDir`: the save-dir lock;
- :mod:`.outcome`: an exception as (save or not, one line, exit code);
  :mod:`.elastic`: a lost peer;
- :class:`~.callbacks.Callbacks`: the run's callbacks (``--callbacks``,
  ``train(callbacks=...)``, ``--patience``'s early stopping), called at the
  start, after each update, validation and checkpoint, and at the end;
- periodic events of one's own: a :class:`~.due.EveryUpdates` registered
  with :meth:`Trainer.add_event`.

:attr:`Trainer.due_after_update` is the one list of what can be due after an
update: :meth:`Trainer.anything_due` asks it, and :meth:`Trainer.after_update`
asks the same components, each once.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from textbox_like.processes import distributed
from textbox_like.parallel import sharding
from textbox_like.models import adapters
from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import check_writable
from textbox_like.data.base import samples_held
from textbox_like.metrics.meters import Logger
from textbox_like.processes.preemption import Preemption, raise_if_stopped
from textbox_like.tasks import TASKS
from textbox_like.tasks.base import best_metric_direction
from textbox_like.callbacks.records import record_callbacks
from textbox_like.training.callbacks import Callbacks, run_callbacks
from textbox_like.training.checkpointer import Checkpointer
from textbox_like.training.feed import Feed
from textbox_like.training.global_batch import GlobalBatch, RankTiming, per_rank_batch_sizes
from textbox_like.training.hooks import TestHooks
from textbox_like.training.lifecycle import Lifecycle, SaveDir
from textbox_like.training.reporting import Reporting, RunFacts
from textbox_like.training.state import Ranks, Reseeding, SamplesTrained, StepRecord, TrainState
from textbox_like.training.step import ForwardBackward, InFlight, ToDevice, UpdateStep
from textbox_like.training.validation import Validation


#: what a run publishes for the libraries it loads later (Accelerate would set 2 threads a process otherwise)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


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
        self.save_dir = SaveDir(cfg, self.ranks)
        if made is not None and (placement is None or placement.rank == 0):
            self.save_dir.made_save_dir = Path(made)
        try:
            self.save_dir.claim()  # inside: a signal during it ends here, where the lock is released
            self.hooks = TestHooks(self.rank)
            from accelerate.utils import set_seed
            set_seed(cfg.numerics.seed)
            self.task = TASKS.get(cfg.data.task)(cfg)
            for build in (self.build_data, self.build_model, self.build_components):
                raise_if_stopped()  # a start-up signal whose stop the code it landed in swallowed
                build()
        except BaseException:
            self.save_dir.release()
            self.hand_back_environment()
            raise

    def hand_back_environment(self):
        """The thread variables as they were before this run: a caller from Python (a notebook, a search's
        process) keeps its own environment, and its next processes are not held to this run's threads."""
        for key, value in getattr(self, "environment_before", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    # one view of the processes (state.Ranks), which every component is given
    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world(self) -> int:
        return self.ranks.world

    @world.setter
    def world(self, world: int):  # one process standing in for one of several (the lost-peer tests)
        self.ranks.world = world

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    @property
    def host_group(self):
        return self.ranks.group

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
        self.environment_before = {key: os.environ.get(key) for key in THREAD_VARIABLES}
        for key in THREAD_VARIABLES:
            os.environ.setdefault(key, str(threads))
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
        self.ranks = Ranks(acc.process_index, acc.num_processes, distributed.host_group(), acc.is_main_process)
        if not cfg.runtime.threads and self.world > 1:  # ranks started one by one share a machine's cores too
            sharing = max(placement.local_world_size, distributed.ranks_on_this_machine(self.host_group))
            threads = max(1, distributed.usable_cpus() // sharing)
        self.preemption = Preemption(self.host_group, self.world, announce=self.is_main)
        self.log = Logger(cfg, self.is_main)
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
        if samples_held(self.train_data) == 0:
            where = (f"--data {cfg.data.data}" if cfg.data.data else
                     f"task {cfg.data.task} ({type(task).__qualname__}.build_dataset({cfg.data.train_subset!r}) returned "
                     f"an empty dataset)")
            raise UserError(f"the {cfg.data.train_subset!r} split of {where} holds no samples")
        self.valid_data = {} if cfg.validation.disable_validation else {s: task.batch_dataset(s) for s in cfg.data.valid_subset}

    def build_model(self):
        import torch

        from textbox_like.parallel.accelerator import compile_regions, device_placement
        from textbox_like.optim.lr_scheduler import build_scheduler
        from textbox_like.optim import build_optimizer
        cfg = self.cfg
        if cfg.numerics.train_dtype == "float64":
            from textbox_like.processes.distributed import remember_torch_settings
            remember_torch_settings()  # distributed.cleanup() puts the default back
            torch.set_default_dtype(torch.float64)
        # the task's model with the run's adapters (--peft), under the wrappers prepare() may add
        model = self.task_model = adapters.build_model(self.task, cfg.adapters)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
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
                self.model, self.optimizer = acc.prepare(model, optimizer,
                                                         device_placement=device_placement(acc, model, optimizer))
        self.sharding_line = None  # the start line's sharding, where the model is sharded
        if sharding.is_sharded(self.model):
            sharding.reduce_unused_parameters(self.model, cfg)
        if sharding.enabled(cfg):
            self.sharding_line = sharding.describe(self.model, cfg, self.placement, cuda, self.n_params, self.n_trained) \
                if sharding.is_sharded(self.model) else "sharding none (--fsdp with one process: nothing to shard)"
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.grad_params = [p for p in self.model.parameters() if p.requires_grad]
        # each rank its own dropout stream; rank 0 keeps the seed's own stream
        if self.rank:
            torch.manual_seed(cfg.numerics.seed + self.rank)

    def build_components(self):
        """In the order of their collectives (the same on every rank); each
        component given what it uses, the shared objects built once here."""
        cfg, ranks, acc, task, model = self.cfg, self.ranks, self.accelerator, self.task, self.model
        optimizer, scheduler, grad_params, log, hooks = \
            self.optimizer, self.scheduler, self.grad_params, self.log, self.hooks
        best_metric, maximize = best_metric_direction(cfg.validation, task)
        self.state = state = TrainState(best_metric, maximize)
        records = record_callbacks(log, acc, None if cfg.checkpoint.no_save else cfg.checkpoint.save_dir)
        self.callbacks = callbacks = Callbacks(run_callbacks(cfg, self.given_callbacks), state, ranks.rank,
                                               ranks.world, ranks.group, cfg, records=records)
        log.records = callbacks  # the run's records reach metrics.jsonl, the trackers and the progress through them
        self.reseed = Reseeding(cfg.numerics.seed, state, ranks, log)
        self.in_flight = in_flight = InFlight(compile_pending=self.sources["compile"] != "default")
        batch_sizes, max_tokens = per_rank_batch_sizes(cfg.data, self.train_data, ranks)
        # several ranks to compare, or a global batch to balance: timed
        self.timing = timing = RankTiming.for_run(grad_params, acc.device, model,
                                                  ranks.world > 1 or bool(cfg.data.global_batch_size))
        self.feed = Feed(cfg, ranks, self.train_data, batch_sizes, max_tokens, acc.device, task=task, state=state,
                         scheduler=scheduler, in_flight=in_flight, timing=timing, log=log)
        self.iterator = self.feed.iterator
        if hooks.sample_log and hasattr(self.iterator, "sample_log"):
            self.iterator.sample_log = hooks.sample_log
        self.global_batch = GlobalBatch(cfg, ranks, batch_sizes, max_tokens, train_data=self.train_data,
                                        iterator=self.iterator, feed=self.feed, state=state, optimizer=optimizer,
                                        grad_params=grad_params, sharded=sharding.is_sharded(model),
                                        in_flight=in_flight, timing=timing, log=log)
        if self.global_batch.balancer is not None:
            self.global_batch.check_token_caps()
            self.global_batch.apply_split()
        self.planned_updates = scheduler.planned_updates = self.feed.updates_of_epochs(cfg.schedule.max_epoch or 0)
        self.to_device = ToDevice(task, acc.device, cfg.numerics.train_dtype == "float64")
        self.validation = Validation(cfg, ranks, self.valid_data, task=task, accelerator=acc, model=model,
                                     to_device=self.to_device, state=state, scheduler=scheduler,
                                     callbacks=callbacks, log=log)
        self.record = StepRecord(scheduler.get_lr())  # the step writes it, the reporting folds it
        self.samples = SamplesTrained(state, cfg.checkpoint.snapshot_interval)  # the step counts, the saves read
        facts = RunFacts(self.n_params, self.threads, self.sources, self.sharding_line,
                         samples_held(self.train_data),
                         not self.iterator.num_workers, self.planned_updates, n_trained=self.n_trained)
        self.reporting = Reporting(cfg, ranks, acc, state=state, record=self.record, timing=timing, task=task,
                                   facts=facts, log=log)
        self.checkpointer = Checkpointer(cfg, ranks, acc, task_model=self.task_model, optimizer=optimizer, scheduler=scheduler,
                                         iterator=self.iterator, balancer=self.global_batch.balancer, state=state,
                                         samples=self.samples, grad_params=grad_params, sources=self.sources,
                                         reseed=self.reseed, reporting=self.reporting, callbacks=callbacks,
                                         hooks=hooks)
        self.global_batch.build_memory_guard(acc.device)
        self.forward_backward = ForwardBackward(acc, task, model, ranks, state, in_flight, timing, hooks,
                                                self.to_device)
        self.step = UpdateStep(cfg, acc, model, optimizer, scheduler, grad_params, state=state, in_flight=in_flight,
                               timing=timing, forward_backward=self.forward_backward, global_batch=self.global_batch,
                               record=self.record, samples=self.samples, logs_at=self.reporting.due,
                               checkpoints=self.checkpointer.checkpoints, log=log)
        self.lifecycle = Lifecycle(cfg, ranks, acc, save_dir=self.save_dir, agent=self.agent, task=task,
                                   train_data=self.train_data, model=model, optimizer=optimizer, scheduler=scheduler,
                                   state=state, iterator=self.iterator, checkpointer=self.checkpointer,
                                   reporting=self.reporting, timing=timing, preemption=self.preemption,
                                   callbacks=callbacks, hooks=hooks, reseed=self.reseed, log=log)
        self.events = []  # periodic events of one's own (add_event)
        # what can be due after an update, each asking its own due(update): the one list anything_due asks
        self.due_after_update = [self.reporting, self.preemption, self.callbacks, self.feed, self.checkpointer,
                                 self.validation]

    def add_event(self, event):
        """A periodic event (a due.EveryUpdates): asked after every update
        taken, and counted in anything_due."""
        self.events.append(event)
        self.due_after_update.append(event)

    def use_model(self, model):
        """The model every component holds, replaced (--compile's fallback to eager)."""
        self.model = model
        for holder in (self.forward_backward, self.step, self.validation, self.lifecycle):
            holder.model = model

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        """Restore, start, epochs of updates until stop_reason() names one, finish: the exit code."""
        self.restore()
        self.start()
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
        self.step.settle()
        return self.lifecycle.finish(self.stop_reason() or "completed", self.global_batch.total())

    def after_update(self) -> bool:
        """Whatever is due after an update that moved the weights, each
        component asked once by its own check; True where the epoch's loop
        ends here: at the end of the epoch, or of the run."""
        state = self.state
        if self.reporting.due(state.num_updates):
            self.step.settle()
            self.reporting.log_train()
        self.global_batch.rebalance()  # every update (the balancer's marks); its exchanges read no count
        self.preemption.poll(state.num_updates)
        self.hooks.limit_memory(state.num_updates)
        for event in self.events:
            if event.due(state.num_updates):
                event.run(self)
        self.callbacks.update_end()
        if self.feed.due(state.num_updates):
            return True
        stopping = self.stop_reason() is not None
        saving = self.checkpointer.due(state.num_updates)
        # HetSeq validates at every interval save; a run that ends
        # validates its final weights (unless preempted: leave fast)
        improved = self.validate() if (self.validation.due(state.num_updates) or saving or (
            stopping and not self.preemption.agreed)) else False
        stopping = stopping or self.stop_reason() is not None  # a callback (--patience) asked at this validation
        if saving or improved or stopping:
            self.save(end_of_epoch=False, is_best=improved, final=stopping)
        return stopping

    def anything_due(self) -> bool:
        """Whether after_update will act after this update beyond the next
        one: the same components asked (due_after_update), and the run's end
        (the trainer then settles an update a fused optimizer left unsettled,
        so that every decision sees the settled count)."""
        update = self.state.num_updates
        return self.stop_reason() is not None or any(component.due(update) for component in self.due_after_update)

    def end_epoch(self):
        """The epoch's record, its validation (every --validate-interval epochs), its save, the next epoch."""
        self.step.settle()
        self.reporting.log_epoch()
        final = self.stop_reason(next_epoch=True) is not None
        due = self.validation.should_validate_epoch(self.state.epoch, self.state.num_updates,
                                                    final and not self.preemption.agreed)
        improved = self.validate() if due else False
        self.save(end_of_epoch=True, is_best=improved, final=final)
        if not self.preemption.agreed:
            self.feed.next_epoch()

    def validate(self) -> bool:
        """Validation.validate, the last update settled first."""
        self.step.settle()
        return self.validation.validate()

    def save(self, end_of_epoch, is_best, final):
        """Checkpointer.save, the last update settled first."""
        snapshot = self.checkpointer.snapshot  # as the update left it (a taken-back update crossed none)
        self.step.settle()
        self.checkpointer.save(end_of_epoch=end_of_epoch, is_best=is_best, final=final, snapshot=snapshot)

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
        """One update (UpdateStep.update); False when it was skipped. An
        update a fused optimizer left unsettled (UpdateStep.step_on_device)
        is settled at once where anything is due after it."""
        if self.in_flight.compile_pending:
            return self.first_compiled_step(micro_batches, totals)
        stepped = self.step.update(micro_batches, totals)
        if self.in_flight.unsettled is not None and self.anything_due():
            return self.step.settle()
        return stepped

    def updates_of_this_epoch(self):
        """The rest of this epoch, update by update (Feed.updates)."""
        return self.feed.updates()

    # ------------------------------------------------------------- start
    def restore(self):
        """Lifecycle.restore, then what the restored position means for the split and the epoch."""
        restored = self.lifecycle.restore()
        if restored is None:
            return
        path, self.feed.previous_data_failure = restored
        if self.global_batch.balancer is not None:  # the saved split, or an even one on another world size
            self.global_batch.apply_split()
        if self.feed.end_of_epoch():
            self.feed.next_epoch()
        self.log.info(f"resumed from {path}: epoch {self.state.epoch}, update {self.state.num_updates}")

    def start(self):
        """The checks and the start line before the first update, each component's start."""
        self.lifecycle.start()
        self.global_batch.start(self.state.num_updates)
        self.log.info(self.reporting.start_line(self.global_batch.describe(), self.scheduler.describe()))
        self.reporting.start()
        self.step.decide_device_skips()
        self.lifecycle.into_training()

    def first_compiled_step(self, micro_batches, totals) -> bool:
        """The first update under --compile includes compiling: timed and
        reported apart, and left out of the throughput. A model that cannot
        compile trains eager after one line (every component given the
        eager model: use_model)."""
        import copy

        from textbox_like.core.internals import compile_errors
        started = time.perf_counter()
        self.in_flight.compile_pending = False
        window = copy.deepcopy(self.record.window)
        try:
            stepped = self.train_step(micro_batches, totals)
        except compile_errors() as e:
            from textbox_like.parallel.accelerator import uncompile, warn
            cause = getattr(e, "inner_exception", None) or e  # the backend's own error
            reason = f"{type(cause).__name__}: " + first_line(cause, 200, empty="")
            name = type(self.accelerator.unwrap_model(self.model, keep_torch_compile=False)).__name__
            warn(f"--compile: {name} did not compile ({reason}); training eager")
            self.use_model(uncompile(self.model, self.compiled_regions))
            self.sources["compile"] = "default"
            self.optimizer.zero_grad(set_to_none=True)
            self.record.window = window
            return self.train_step(micro_batches, totals)
        took = time.perf_counter() - started
        self.state.clock.paused += took
        self.log.info(f"compiled: the first update took {took:.1f}s (compilation; not counted in throughput)")
        return stepped
