"""The training loop, top to bottom: read :meth:`Trainer.train` first.

Accelerate places the model, wraps it in DDP and runs mixed precision; the
trainer decides what is trained on, when to validate, log and save, and how an
update over unequal ranks is weighted (:meth:`Trainer.train_step`). The other
jobs are components with one job each:

- :class:`TrainState`: where the run is (epoch, updates, best, meters);
- :class:`~textbox_like.validate.Validator`: metrics and best-metric judgement;
- :class:`~textbox_like.checkpoint.CheckpointManager`: saving and restoring a
  dict of stateful parts under the ``--reset-*`` policy;
- :class:`~textbox_like.preemption.Preemption`: stopping on SIGTERM/SIGUSR1;
- :mod:`~textbox_like.distributed`: process groups and the ranks' agreement;
- :mod:`~textbox_like.balance`: the split of ``--global-batch-size`` over the
  ranks, its re-splits by measured speed (``--balance``), per-rank timing and
  the micro-batch cap under a device's memory;
- :mod:`~textbox_like.accelerator`, :mod:`~textbox_like.trackers`,
  :class:`~textbox_like.meters.Logger`: Accelerate, trackers and logs.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

from . import distributed
from .checkpoint import CheckpointManager, changes_numbers, refuse_rerun, rng_state, set_rng_state
from .compat import default_notes
from .config import to_yaml
from .errors import UserError
from .faults import (DataCorrupt, DataUnavailable, Diverged, HostCopy, OutOfMemory, RunStopped, SaveFailed,
                     Superseded,
                     allocation_failed, allocation_reason, check_writable, failed_writing, memory_limit_hook,
                     os_reason, test_delay)
from .fileio import atomic_write_text, remove
from .meters import Logger, StatSums, TrainClock
from .preemption import PREEMPTED_EXIT_CODE, Preemption
from .tasks import TASKS
from .tasks.base import best_metric_direction
from .validate import Validator

#: the longest a run goes without a progress record, in seconds of rank 0's
#: wall clock (as near as a schedule decided at log time can keep it)
LOG_EVERY_S = 5.0
#: rank 0's seconds since its last log decision, shared in the log window's sum
_CLOCK_KEY = "log_clock_s_rank0"


class TrainState:
    """Where the run is; a checkpoint part like any other."""

    def __init__(self, best_metric: str, maximize: bool):
        self.epoch = 1
        self.num_updates = 0
        self.updates_in_epoch = 0
        self.samples_seen = 0       # summed at log time, for throughput
        self.samples_trained = 0    # counted per update from the batch plan
        self.skipped_updates = 0    # non-finite updates and loss-scaler overflows, skipped
        self.best_metric, self.maximize = best_metric, maximize
        self.best = None            # best value of best_metric so far
        self.last_valid, self.best_valid = {}, {}
        self.validations_since_best = 0   # validations in a row without improvement (--patience)
        self.epoch_sums = StatSums()  # this epoch's training stats, summed over ranks
        self.clock = TrainClock()

    def reset_meters(self):
        self.best, self.last_valid, self.best_valid = None, {}, {}
        self.validations_since_best = 0
        self.epoch_sums.reset()
        self.clock = TrainClock()

    def state_dict(self):
        return {"epoch": self.epoch, "num_updates": self.num_updates, "updates_in_epoch": self.updates_in_epoch,
                "samples_seen": self.samples_seen, "samples_trained": self.samples_trained, "skipped_updates": self.skipped_updates, "best": self.best, "best_metric": self.best_metric,
                "maximize": self.maximize, "last_valid": self.last_valid, "best_valid": self.best_valid,
                "validations_since_best": self.validations_since_best,
                "epoch_sums": self.epoch_sums.state_dict(), "clock": self.clock.state_dict()}

    def load_state_dict(self, state):
        self.epoch, self.num_updates = int(state["epoch"]), int(state["num_updates"])
        self.updates_in_epoch, self.samples_seen = int(state["updates_in_epoch"]), int(state["samples_seen"])
        self.skipped_updates, self.samples_trained = int(state["skipped_updates"]), int(state["samples_trained"])
        self.last_valid = dict(state["last_valid"])
        self.epoch_sums.load_state_dict(state["epoch_sums"])
        self.clock.load_state_dict(state["clock"])
        # the best so far only means something for the same metric and direction
        if (state["best_metric"], state["maximize"]) == (self.best_metric, self.maximize):
            self.best, self.best_valid = state["best"], dict(state["best_valid"])
            self.validations_since_best = int(state.get("validations_since_best", 0))  # older checkpoints: 0


class _Model:
    """The model as a checkpoint part: its unwrapped weights."""

    def __init__(self, accelerator, model):
        self.accelerator, self.model = accelerator, model

    def module(self):  # without DDP and torch.compile wrappers: the same keys compiled or not
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def state_dict(self):
        return self.module().state_dict()

    def load_state_dict(self, state):
        self.module().load_state_dict(state)


class _Optimizer:
    """The optimizer as a checkpoint part, named so that another optimizer's
    state is refused rather than misread."""

    def __init__(self, optimizer, name: str, saved: bool):
        self.optimizer, self.name, self.saved = optimizer, name, saved

    def state_dict(self):
        return {**self.optimizer.state_dict(), "name": self.name} if self.saved else None

    def load_state_dict(self, state):
        state = dict(state)
        name = state.pop("name")
        if name != self.name:
            raise UserError(f"the checkpoint holds {name} state, this run uses {self.name}; "
                            f"pass --reset-optimizer to start {self.name} afresh")
        self.optimizer.load_state_dict(state)


class LossScalerPart:
    """The loss scaler (fp16 on CUDA) as a checkpoint part; None where there is none."""
    def __init__(self, accelerator):
        self.scaler = accelerator.scaler

    def state_dict(self):
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state):
        # None: saved without a scaler (a CPU leg of a GPU's --fp16 run runs
        # bf16); this scaler then starts from its initial scale
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


class _RNG:
    """Every rank's RNG streams (python, numpy, torch, CUDA); gathers over ranks."""

    def __init__(self, accelerator, reseed):
        self.accelerator, self.reseed = accelerator, reseed

    def state_dict(self):
        return distributed.gather_per_rank(self.accelerator, rng_state())

    def load_state_dict(self, states):
        if len(states) == self.accelerator.num_processes and all(s is not None for s in states):
            set_rng_state(states[self.accelerator.process_index])
        elif len(states) == self.accelerator.num_processes:  # an emergency checkpoint: its writer's stream only
            self.reseed("the checkpoint was saved by one survivor of a lost peer and holds its RNG state only")
        else:
            self.reseed(f"the checkpoint has RNG states for {len(states)} rank(s), this run has "
                        f"{self.accelerator.num_processes}")


class Trainer:
    """Built in the order a run needs: processes and Accelerate, data, model
    and optimizer, batch plan, then the components that watch over them."""

    def __init__(self, cfg):
        self.cfg = cfg  # a settings.RunConfig
        placement = distributed.placement_from_env(cfg)
        if not cfg.checkpoint.no_save:
            # before minutes of data loading, not at the first save; only the writer
            # creates the directory (on another node it would stay empty)
            check_writable(cfg.checkpoint.save_dir, create=placement is None or placement.rank == 0)
        from .elastic import Agent
        self.agent = Agent.from_env()  # torchrun's, if it started this worker
        self.setup_processes()
        try:
            self.claim_save_dir()  # inside: a signal during it ends here, where the lock is released
            from accelerate.utils import set_seed
            set_seed(cfg.numerics.seed)
            self.task = TASKS.get(cfg.data.task)(cfg)
            self.build_data()
            self.build_model()
            self.build_iterator()
            self.build_components()
        except BaseException:
            self.release_save_dir()
            raise

    def claim_save_dir(self):
        """One run per save directory: the main process takes its lock
        (savelock.py) before any data is read; every rank learns whether it
        got it, so a refusal ends all of them alike, and the lock's token,
        which each rank's writes into the directory check from then on
        (savelock.check_owner)."""
        from . import savelock
        save_dir = self.cfg.checkpoint.save_dir
        self.save_lock, refusal = None, None
        if self.is_main and not self.cfg.checkpoint.no_save:
            # held before its file exists: a signal at any moment of take()
            # (SIGTERM during start-up) finds it here, and release_save_dir removes the file
            self.save_lock = savelock.SaveDirLock(save_dir)
            try:
                self.save_lock.take()
                refuse_rerun(self.cfg.checkpoint)
            except UserError as exc:
                refusal = exc
                self.release_save_dir()
        token = self.save_lock.token if self.save_lock is not None else None
        if self.world > 1:
            per_rank = distributed.gather_per_rank(self.accelerator, [refusal is not None, token])
            if any(refused for refused, _ in per_rank) and refusal is None:
                refusal = UserError("rank 0 could not take the save directory (see its message)")
            token = per_rank[0][1]
        if refusal is not None:
            raise refusal
        # a rank that does not see rank 0's lock (a save directory not shared
        # by its node) cannot prove anything, and writes nothing there in a normal run
        if token is not None and savelock.not_owner(Path(save_dir) / savelock.LOCK_NAME, token, False) is None:
            savelock.own(save_dir, token, holds_lock=self.save_lock is not None, who=f"rank {self.rank}")

    def release_save_dir(self):
        from .savelock import disown
        disown()
        lock, self.save_lock = getattr(self, "save_lock", None), None
        if lock is not None:
            lock.release()

    def setup_processes(self):
        from .accelerator import build_accelerator
        from .malloc import keep_freed_heap
        from .trackers import log_with, requested
        cfg = self.cfg
        trackers = requested(cfg.logging)  # before any process group: a missing package is one line
        placement = distributed.placement_from_env(cfg) or distributed.Placement()
        # processes sharing a node share its cores; Accelerate would otherwise
        # set 2 threads each, whatever the machine
        threads = cfg.runtime.threads or max(1, distributed.usable_cpus() // max(placement.local_world_size, 1))
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("MKL_NUM_THREADS", str(threads))
        # before any data or model is allocated: updates reuse freed heap
        # instead of faulting fresh pages in (malloc.py says why)
        keep_freed_heap()
        import torch
        distributed.init_process_group(placement, cfg)
        self.accelerator, self.sources = build_accelerator(
            cfg, placement, log_with(trackers, cfg.checkpoint.save_dir) if trackers and not cfg.checkpoint.no_save else None)
        acc = self.accelerator
        self.rank, self.world, self.is_main = acc.process_index, acc.num_processes, acc.is_main_process
        self.host_group = distributed.host_group()
        self.preemption = Preemption(self.host_group, self.world)
        self.log = Logger(cfg, self.is_main, acc)
        torch.set_num_threads(threads)
        self.threads = threads

    def build_data(self):
        cfg, task = self.cfg, self.task
        # once per run, then once per node (nodes may not share a file system),
        # on a long-timeout group: preparing data can take long
        time.sleep(test_delay("start"))  # test-only: slow data
        with distributed.main_then_local_main_first(self.accelerator):
            task.prepare_data()
        self.train_data = task.build_dataset(cfg.data.train_subset)
        if len(self.train_data) == 0:
            raise UserError(f"the {cfg.data.train_subset!r} split of --data {cfg.data.data} holds no samples")
        self.valid_data = {} if cfg.validation.disable_validation else {s: task.build_dataset(s) for s in cfg.data.valid_subset}
        # a dataset read from disk as it goes can fail mid-run: ranks agree on every update's data
        self.data_can_fail = self.world > 1 and getattr(self.train_data, "reads_from_disk", False)

    def build_model(self):
        import torch

        from .lr_scheduler import build_scheduler
        from .optim import build_optimizer
        cfg = self.cfg
        if cfg.numerics.train_dtype == "float64":
            torch.set_default_dtype(torch.float64)
        from .accelerator import compile_regions
        model = self.task.build_model()
        self.n_params = sum(p.numel() for p in model.parameters())
        acc = self.accelerator
        # before prepare(): a model may name the parts worth compiling here
        self.compiled_regions = compile_regions(acc, model)
        if self.compiled_regions is not None:
            self.sources["compile"] += f", regions {', '.join(self.compiled_regions)} on {acc.device.type}"
        optimizer = build_optimizer(cfg.optim, self.task.param_groups(model, cfg.optim.weight_decay),
                                    fused_default=acc.device.type == "cuda" and acc.scaler is None)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.grad_params = [p for p in self.model.parameters() if p.requires_grad]
        # each rank its own dropout stream; rank 0 keeps the seed's own stream
        if self.rank:
            torch.manual_seed(cfg.numerics.seed + self.rank)

    def build_iterator(self):
        from .balance import Balancer
        from .data.iterators import EpochBatchIterator, pin_for, read_ahead_workers
        cfg, acc = self.cfg, self.accelerator
        self.batch_sizes = distributed.gather_per_rank(acc, self.clamped_batch_size(cfg.data.max_sentences, self.train_data, "--max-sentences"))
        max_tokens = distributed.gather_per_rank(acc, cfg.data.max_tokens or 0)
        # --global-batch-size: a step is one update's N samples (tokens where
        # a rank gives --max-tokens), split over the ranks; --max-sentences
        # (--max-tokens) caps this rank's micro-batches
        self.balancer, self.by_tokens = None, bool(cfg.data.global_batch_size and any(max_tokens))
        if cfg.data.global_batch_size:
            caps = max_tokens if self.by_tokens else self.batch_sizes
            self.balancer = Balancer(cfg.data.global_batch_size, self.world,
                                     1 if self.by_tokens else cfg.data.required_batch_size_multiple,
                                     cfg.distributed.balance_interval, enabled=cfg.distributed.balance,
                                     unit="tokens" if self.by_tokens else "samples")
            self.micro_caps = [c or cfg.data.global_batch_size for c in caps]
            self.micro_cap = self.micro_caps[self.rank]
        elif not any(max_tokens) and not all(self.batch_sizes):
            raise UserError("every rank needs --max-sentences (batch size) or --max-tokens")
        pin_memory = pin_for(acc.device)
        self.iterator = EpochBatchIterator(self.train_data, cfg.numerics.seed, self.rank, self.world, self.batch_sizes,
                                           max_tokens, shuffle=not cfg.data.no_shuffle,
                                           multiple=cfg.data.required_batch_size_multiple,
                                           num_workers=read_ahead_workers(cfg.data.num_workers, self.train_data, pin_memory),
                                           pin_memory=pin_memory)
        if self.balancer is not None:
            self.check_token_caps(max_tokens)
            self.apply_split()
        self.planned_updates = self.scheduler.planned_updates = self.updates_of_epochs(cfg.schedule.max_epoch or 0)

    @property
    def tokens_word(self) -> str:
        """' tokens' after a figure of a global batch counted in tokens, else nothing."""
        return " tokens" if self.by_tokens else ""

    @property
    def split_name(self) -> str:
        """What the split of the global batch gives each rank, in log lines."""
        return "tokens per rank" if self.by_tokens else "batch sizes per rank"

    def apply_split(self):
        """The balancer's split of the global batch to the batch plan, from the current position."""
        self.iterator.set_split(self.balancer.split, by_tokens=self.by_tokens)

    def check_token_caps(self, max_tokens):
        """--global-batch-size in tokens: a sample must fit in every rank's micro-batch cap."""
        tokens = self.train_data.num_tokens() if self.by_tokens else None
        longest = int(tokens.max()) if tokens is not None and len(tokens) else 0
        for rank, cap in enumerate(max_tokens):
            if cap and longest > cap:
                raise UserError(f"a sample has {longest} tokens, more than --max-tokens {cap} of rank {rank} "
                                f"(its micro-batch cap under --global-batch-size); raise --max-tokens")

    def clamped_batch_size(self, size, dataset, what) -> int:
        """A batch larger than the dataset holds nothing more, but its
        buffers are allocated in full: clamped, with a note."""
        if size and dataset is not None and 0 < len(dataset) < size:
            from .errors import note
            note(f"{what} {size} is larger than the {len(dataset):,} samples of the data: using {len(dataset)}")
            return len(dataset)
        return size or 0

    def build_components(self):
        cfg, acc, task = self.cfg, self.accelerator, self.task
        best_metric, maximize = best_metric_direction(cfg.validation, task)
        self.state = TrainState(best_metric, maximize)
        largest = max(self.valid_data.values(), key=len, default=None)
        size = valid_batch_size(cfg.data)
        if not cfg.data.max_sentences_valid and largest is not None and len(largest):
            size = min(size, len(largest))   # our default, not the user's: no note
        valid_batch_sizes = distributed.gather_per_rank(acc, self.clamped_batch_size(
            size, largest, "the validation batch size"))
        self.validator = Validator(task, self.valid_data, valid_batch_sizes, acc, best_metric, maximize,
                                   self.to_device)
        parts = {"model": _Model(acc, self.model), "optimizer": _Optimizer(self.optimizer, cfg.optim.optimizer,
                                                                          not cfg.checkpoint.no_save_optimizer_state),
                 "scheduler": self.scheduler, "iterator": self.iterator, "train": self.state,
                 "scaler": LossScalerPart(acc), "rng": _RNG(acc, self.reseed)}
        if self.balancer is not None:
            parts["balance"] = self.balancer
        self.checkpoints = CheckpointManager(
            cfg.checkpoint, metadata={"task": cfg.data.task, "world_size": self.world, "config": to_yaml(cfg),
                                  "precision": {"mixed": acc.mixed_precision, "source": self.sources["precision"]}},
            parts=parts, is_main=self.is_main)
        self.build_timing()
        self.window = StatSums()  # the open log window's stats, this rank only
        self.lr = self.scheduler.get_lr()
        self.gnorm = None
        self.nonfinite_in_a_row = 0
        self.skips_on_device = False  # decided in start(), after a checkpoint's optimizer groups are loaded
        self.unsettled = None  # the last update's gradient norm, not read on the host yet
        self.unsettled_samples = 0
        self.compile_pending = self.sources["compile"] != "default"
        self.previous_data_failure = None  # where the attempt resumed from failed to read data, if it did
        self.update_start = None  # where the update in flight started (several ranks: see emergency_save)

    def build_timing(self):
        """Who waits for whom: per-rank compute, all-reduce wait and data
        seconds where there are ranks to compare (balance.RankTimer), the
        memory cap of a share's micro-batches on CUDA, and the test-only
        slow-down (balance.slow_rank)."""
        from . import balance
        self.timer = balance.RankTimer(self.grad_params, self.accelerator.device) \
            if self.world > 1 or self.balancer is not None else None
        self.timer_marks = {}  # consumer -> RankTimer.totals() when it last looked
        probe = balance.memory_probe(self.accelerator.device) if self.balancer is not None else None
        # the out-of-memory protocol has collectives: with unlike devices (CUDA
        # beside CPU), every rank takes part if any rank's memory is guarded
        if self.balancer is not None and self.world > 1 and \
                any(distributed.gather_per_rank(self.accelerator, probe is not None)):
            probe = probe or balance.UnlimitedMemory()
        self.memory = balance.MemoryGuard(probe, self.micro_cap) if probe is not None else None
        self.slow = balance.slow_rank(self.rank)
        self.memory_hook = memory_limit_hook()  # test-only: allocations fail for real from an update on
        self.slow_save = test_delay("save")  # test-only: a slow file system
        self.stepping = False  # in the optimizer's step
        self.update_offset = None  # where the update under way started reading, while it runs
        self.all_reducing = False  # in the backward that all-reduces (an out-of-memory there is not retried)

    def timer_window(self, consumer) -> dict:
        """This rank's timer totals since ``consumer`` last asked."""
        from .balance import since
        now = self.timer.totals()
        window = since(now, self.timer_marks.get(consumer))
        self.timer_marks[consumer] = now
        return window

    def per_rank(self, values) -> list:
        """``values`` (numbers) of every rank, in rank order: one host all-reduce."""
        if self.world == 1:
            return [list(values)]
        flat = [0.0] * (self.world * len(values))
        flat[self.rank * len(values):(self.rank + 1) * len(values)] = values
        flat = self.sum_over_ranks(flat)
        return [flat[r * len(values):(r + 1) * len(values)] for r in range(self.world)]

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        cfg, state = self.cfg, self.state
        self.restore()
        self.start()
        self.apply_memory_hook()
        while self.stop_reason() is None:
            self.begin_epoch()
            snapshot = False
            for micro_batches, totals in self.updates_of_this_epoch():
                stepped, self.update_offset = self.train_step(micro_batches, totals), None  # the update is over
                if self.timer is not None:
                    self.timer.update_took(time.perf_counter() - self.update_began)
                if not stepped:
                    continue  # skipped (not finite, or the loss scaler's overflow): nothing moved
                snapshot = self.crossed_snapshot(totals["nsamples"])
                self.log_train()
                self.rebalance()
                self.preemption.poll(state.num_updates)
                self.apply_memory_hook()
                if self.end_of_epoch():
                    break  # the epoch's own validation and save follow
                stopping = self.stop_reason() is not None
                saving = self.every(cfg.checkpoint.save_interval_updates) or snapshot
                # HetSeq validates at every interval save; a run that ends
                # validates its final weights (unless preempted: leave fast)
                improved = self.validate() if (self.every(cfg.validation.validate_interval_updates) or saving or (
                    stopping and not self.preemption.agreed)) else False
                stopping = stopping or self.stop_reason() is not None  # --patience ran out at this validation
                if saving or improved or stopping:
                    self.save(end_of_epoch=False, is_best=improved, final=stopping, snapshot=snapshot)
                if stopping:
                    break
            self.log.end_epoch()
            if self.end_of_epoch():
                self.log_epoch()
                improved = self.validate() if state.epoch % cfg.validation.validate_interval == 0 else False
                self.save(end_of_epoch=True, is_best=improved, final=self.stop_reason(next_epoch=True) is not None,
                          snapshot=snapshot)
                if not self.preemption.agreed:
                    self.next_epoch()
        return self.finish()

    def stop_reason(self, next_epoch=False):
        """Why the run stops now, or None: the one place that knows."""
        cfg, state = self.cfg, self.state
        if self.preemption.agreed:
            return "preempted"
        if cfg.schedule.max_update and state.num_updates >= cfg.schedule.max_update:
            return "max_update"
        if cfg.schedule.max_epoch and state.epoch + int(next_epoch) > cfg.schedule.max_epoch:
            return "max_epoch"
        if cfg.validation.patience > 0 and state.validations_since_best >= cfg.validation.patience:
            return "patience"
        return None

    def train_step(self, micro_batches, totals) -> bool:
        """One update: forward and backward over the micro-batches, then one
        optimizer step; False when the update was skipped. ``totals``: each
        loss term's denominator over the whole update (all micro-batches and
        ranks). Each rank scales its summed loss so that DDP's average of
        gradients equals the gradient of the mean over the union of the
        update's samples."""
        acc, state = self.accelerator, self.state
        if self.compile_pending:
            return self.first_compiled_step(micro_batches, totals)
        units = None  # what the timer counts: samples, or tokens of a global batch in tokens
        if self.balancer is not None:
            stats, units = self.backward_share(micro_batches[0][0], totals)
        else:
            stats = self.backward([self.to_device(batch) for batch, _ in micro_batches], totals)
        for one in stats:
            self.window.add(one)
        if self.timer is not None:
            self.timer.count(sum(one["nsamples"] for one in stats) if units is None else units)
            if self.balancer is not None and "balance" not in self.timer_marks:
                self.timer_marks["balance"] = self.timer.totals()  # the first update warms up: not measured
        self.gnorm = self.gradient_norm()
        # an optimizer's first step creates its state: checked on the host,
        # since a kernel that skips it may leave that state uninitialised
        # (fused SGD's momentum buffers are torch.empty_like)
        if self.skips_on_device and self.optimizer.optimizer.state:
            return self.step_on_device(totals)
        self.settle()
        if acc.scaler is None and not bool(self.gnorm.isfinite()):
            self.optimizer.zero_grad(set_to_none=True)
            self.skip_nonfinite(float(self.gnorm))
            return False
        self.stepping = True  # an allocation failing in here leaves the weights half-updated
        self.optimizer.step()
        self.stepping = False
        self.optimizer.zero_grad(set_to_none=True)
        if acc.scaler is not None and acc.optimizer_step_was_skipped:
            state.skipped_updates += 1  # float16 overflow: the scaler lowered its scale and skipped
            return False
        self.nonfinite_in_a_row = 0
        state.num_updates += 1
        state.updates_in_epoch += 1
        self.lr = self.scheduler.step_update(state.num_updates)
        self.log.advance()
        return True

    def backward(self, batches, totals, sync=True) -> list:
        """Forward and backward over this rank's micro-batches of the update,
        all-reducing the gradients once, on the last (``sync=False``: none
        does; the caller all-reduces by hand); their stats."""
        acc, task, timer = self.accelerator, self.task, self.timer
        out = []
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1 and sync
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                if timer is not None:
                    timer.forward_starts()
                terms, stats = task.loss(self.model, batch)
                if self.slow is not None and self.state.num_updates + 1 >= self.slow[1]:
                    time.sleep(self.slow[0] * stats["nsamples"])  # TEXTBOX_LIKE_SLOW_RANK: a slower device
                if not isinstance(terms, dict):
                    terms = {"nsamples": terms}
                loss = sum(term * (self.world / totals[name]) for name, term in terms.items())
                self.all_reducing = last
                acc.backward(loss)
                self.all_reducing = False
            if last and timer is not None:
                timer.synced()
            out.append(stats)
        return out

    def backward_share(self, batch, totals):
        """--global-batch-size: this rank's share of the update, cut into
        micro-batches of at most its cap; (their stats, the share's samples
        or tokens). On CUDA a micro-batch that runs out of memory lowers this
        rank's cap, every rank learns of it in one host all-reduce, and the
        update is redone from its first micro-batch: nothing lost, nothing
        counted twice. While the cap is unproven (the first updates, until
        the memory is measured, and a redone update) every micro-batch runs
        under no_sync and the gradients are all-reduced by hand once every
        rank is through: an out-of-memory error in any backward is retried.
        After that DDP all-reduces in the last backward, overlapped with it,
        and an out-of-memory error there ends the run (the other ranks are
        inside that all-reduce); elsewhere it is retried, the failing rank
        joining the all-reduce with an empty micro-batch."""
        from .data.base import cut_batch
        update, redoing = self.state.num_updates + 1, False
        tokens = self.train_data.batch_num_tokens(batch) if self.by_tokens else None
        while True:
            sizes, units = self.micro_batch_plan(batch, tokens)
            if self.memory is None:
                return self.backward([self.to_device(b) for b in cut_batch(batch, sizes)], totals), sum(units)
            timed = self.timer.snapshot()
            self.memory.before(update)
            by_hand = redoing or update <= self.memory.measure_at  # the same on every rank
            stats, failed = self.try_share(batch, sizes, units, totals, update, by_hand)
            if not (self.sum_over_ranks([float(failed is not None)])[0] if self.world > 1 else failed):
                if by_hand:
                    self.all_reduce_gradients()
                return stats, sum(units)
            if failed is not None:
                self.micro_cap = self.memory.cap
                self.log.info(f"rank {self.rank}: out of memory on a micro-batch of {failed}{self.tokens_word} at "
                              f"update {update}; micro-batches of at most {self.micro_cap} from now on, the update "
                              f"redone", everywhere=True)
            self.optimizer.zero_grad(set_to_none=True)
            self.timer.restore(timed)
            redoing = True

    def try_share(self, batch, sizes, units, totals, update, by_hand):
        """One attempt at this rank's share under the memory guard: (stats,
        None), or (None, the units of the micro-batch that ran out of memory)."""
        from .balance import is_out_of_memory
        from .data.base import cut_batch
        try:
            stats = self.backward([self.to_device(b) for b in cut_batch(batch, sizes)], totals, sync=not by_hand)
        except Exception as exc:
            if not is_out_of_memory(exc) or self.all_reducing:
                raise  # out of memory in DDP's all-reducing backward: it cannot take part again
            self.optimizer.zero_grad(set_to_none=True)
            self.memory.out_of_memory(max(units))
            if not by_hand:  # the update's one all-reduce, with nothing of this rank in it
                self.backward([self.to_device(cut_batch(batch, [0])[0])], totals)
            return None, max(units)
        lowered = self.memory.after(update, units[0])
        if lowered is not None:
            self.micro_cap = lowered
            self.log.info(f"rank {self.rank}: micro-batches of at most {lowered}{self.tokens_word} fit in "
                          f"its memory (measured at update {update})", everywhere=True)
        return stats, None

    def all_reduce_gradients(self):
        """DDP's average of the gradients, by hand, after micro-batches that
        all ran under no_sync (a parameter without a gradient counts as zero,
        as in DDP); the wait in it is the rank's all-reduce wait."""
        import torch
        import torch.distributed as dist
        if self.world > 1:
            for p in self.grad_params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)
        if self.timer is not None:
            self.timer.synced()

    def micro_batch_plan(self, batch, tokens):
        """This rank's share cut under its cap: the micro-batches' sample
        counts and their units (samples, or tokens under --max-tokens)."""
        from .balance import micro_batch_sizes, micro_batches_by_tokens
        from .data.base import batch_samples
        if tokens is None:
            sizes = micro_batch_sizes(batch_samples(batch), self.micro_cap)
            return sizes, sizes
        sizes = micro_batches_by_tokens(tokens, self.micro_cap, self.batch_sizes[self.rank] or None)
        ends = itertools.accumulate(sizes)
        return sizes, [int(tokens[end - size:end].sum()) for size, end in zip(sizes, ends)]

    def first_compiled_step(self, micro_batches, totals) -> bool:
        """The first update under --compile includes compiling: timed and
        reported apart, and left out of the throughput. A model that cannot
        compile trains eager after one line."""
        import copy

        from .internals import compile_errors
        started = time.perf_counter()
        self.compile_pending = False
        window = copy.deepcopy(self.window)
        try:
            stepped = self.train_step(micro_batches, totals)
        except compile_errors() as e:
            from .accelerator import uncompile, warn
            cause = getattr(e, "inner_exception", None) or e  # the backend's own error
            reason = f"{type(cause).__name__}: " + (str(cause).strip().splitlines() or [""])[0][:200]
            name = type(self.accelerator.unwrap_model(self.model, keep_torch_compile=False)).__name__
            warn(f"--compile: {name} did not compile ({reason}); training eager")
            self.model = uncompile(self.model, self.compiled_regions)
            self.sources["compile"] = "default"
            self.optimizer.zero_grad(set_to_none=True)
            self.window = window
            return self.train_step(micro_batches, totals)
        took = time.perf_counter() - started
        self.state.clock.paused += took
        self.log.info(f"compiled: the first update took {took:.1f}s (compilation; not counted in throughput)")
        return stepped

    def gradient_norm(self):
        """The norm of the gradients (after DDP's all-reduce: the same on every
        rank, so every rank skips the same updates), clipped to --clip-norm."""
        import torch
        if self.cfg.schedule.clip_norm > 0:
            return self.accelerator.clip_grad_norm_(self.grad_params, self.cfg.schedule.clip_norm)
        if self.accelerator.scaler is not None:  # the scaler guards: the norm only for the log
            return self.accelerator.clip_grad_norm_(self.grad_params, float("inf")) \
                if self.log_due(ahead=1) else None
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: no clipping pass
            return torch.nn.utils.get_total_norm([p.grad for p in self.grad_params if p.grad is not None])
        return self.accelerator.clip_grad_norm_(self.grad_params, float("inf"))

    def step_on_device(self, totals) -> bool:
        """The step of an optimizer that skips a non-finite update in its own
        kernel: no host sync per update. The host reads the gradient norm one
        update later (settle), or at once when anything is due after this
        update (a log line, a save, a validation, the end), so every decision
        sees the settled count; the LR schedule steps when the update is
        known to have been taken."""
        import torch
        state = self.state
        self.settle()  # the previous update: long computed, so this does not stall the device
        inner = self.optimizer.optimizer
        inner.found_inf = (~self.gnorm.isfinite()).to(torch.float32)
        self.stepping = True
        try:
            self.optimizer.step()
        finally:
            del inner.found_inf
        self.stepping = False
        self.optimizer.zero_grad(set_to_none=True)
        self.unsettled, self.unsettled_samples = HostCopy(self.gnorm), 0
        state.num_updates += 1
        state.updates_in_epoch += 1
        self.log.advance()
        if self.due_after_update(totals["nsamples"]):
            return self.settle()
        return True

    def settle(self) -> bool:
        """Account for the last device-skipped update (see step_on_device):
        True if it was taken; if not, its count is taken back and it is
        counted as skipped."""
        if self.unsettled is None:
            return True
        gnorm, self.unsettled = self.unsettled.value(), None
        state = self.state
        if math.isfinite(gnorm):
            self.nonfinite_in_a_row = 0
            self.lr = self.scheduler.step_update(state.num_updates)
            return True
        state.num_updates -= 1
        state.updates_in_epoch -= 1
        state.samples_trained -= self.unsettled_samples  # what crossed_snapshot counted for it
        self.log.advance(-1)
        self.skip_nonfinite(gnorm)
        return False

    def due_after_update(self, samples_in_update) -> bool:
        """Whether the loop does anything after this update beyond the next one."""
        cfg, state = self.cfg, self.state
        n = cfg.checkpoint.snapshot_interval
        return (self.log_due() or any(self.every(i) for i in (cfg.checkpoint.save_interval_updates,
                                                              cfg.validation.validate_interval_updates))
                or self.preemption.due(state.num_updates) or self.end_of_epoch()
                or self.stop_reason() is not None
                or crosses(state.samples_trained, state.samples_trained + samples_in_update, n))

    def skip_nonfinite(self, gnorm: float):
        """Count a skipped update; stop after --max-nonfinite-updates in a row."""
        self.state.skipped_updates += 1
        self.nonfinite_in_a_row += 1
        update = self.state.num_updates + 1
        self.log.info(f"update {update}: gradient norm {gnorm} is not finite; update skipped "
                      f"({self.nonfinite_in_a_row} in a row)")
        if self.nonfinite_in_a_row >= self.cfg.runtime.max_nonfinite_updates:
            last = self.checkpoints.newest_good()
            raise Diverged(f"training diverged at update {update}: {self.nonfinite_in_a_row} updates in a row "
                           f"had a non-finite loss or gradient norm; the learning rate is likely too high (or "
                           f"float16 overflows: try --bf16); "
                           + (f"the last finite checkpoint is {last}" if last else "no checkpoint was saved"))

    # --------------------------------------------------------------- epochs
    def update_freq(self, epoch=None):
        freqs = self.cfg.schedule.update_freq
        return freqs[min((epoch or self.state.epoch) - 1, len(freqs) - 1)]

    def updates_of_epochs(self, epochs):
        """Updates in the first ``epochs`` epochs (what 'decay over the run' means under --max-epoch)."""
        steps = self.iterator.steps_in_epoch()
        cap = self.cfg.data.num_iters_per_epoch or steps
        return sum(min(math.ceil(steps / self.update_freq(e)), cap) for e in range(1, epochs + 1))

    def begin_epoch(self):
        cfg, state = self.cfg, self.state
        k = self.update_freq()
        self.scheduler.step_epoch(state.epoch)
        total = self.iterator.steps_in_epoch()
        done = math.ceil((total - len(self.iterator)) / k)
        bar = math.ceil(total / k)
        if cfg.data.num_iters_per_epoch:
            bar = min(bar, cfg.data.num_iters_per_epoch)
        if cfg.schedule.max_update:
            bar = min(bar, done + cfg.schedule.max_update - state.num_updates)
        self.log.start_epoch(state.epoch, bar, done)

    def updates_of_this_epoch(self):
        """The rest of this epoch as (``update_freq`` micro-batches, the
        update's denominators), timing the wait for data. A data file that
        fails mid-run rewinds the position to the update's start, so the
        checkpoint saved on the way out skips nothing."""
        k, clock, task = self.update_freq(), self.state.clock, self.task
        batches, plan = iter(self.iterator), self.iterator.plan_version
        while True:
            if self.iterator.plan_version != plan:  # re-split: read on from the new plan
                batches.close()
                batches, plan = iter(self.iterator), self.iterator.plan_version
            started, offset = time.perf_counter(), self.iterator.offset
            self.update_began = started  # a whole update's time runs from here (RankTimer.update_took)
            if self.world > 1:  # what an emergency save rewinds to if a peer is lost during this update
                self.update_start = {"offset": offset, "updates": self.state.num_updates, "rng": rng_state()}
            failure = None
            try:
                micro_batches = list(itertools.islice(batches, k))
            except DataUnavailable as exc:
                failure, micro_batches = exc, []
            waited = time.perf_counter() - started
            clock.data_wait += waited
            if self.timer is not None:
                self.timer.data += waited
            # every rank knows the update's sample count from the batch plan;
            # other denominators (BERT's masked tokens) are host numbers summed
            # over ranks, with the data's health, on the host group
            counts = [sum(task.count(batch)[name] for batch, _ in micro_batches) for name in task.denominators]
            if task.denominators or self.data_can_fail:
                if self.world > 1:
                    *counts, failed = self.sum_over_ranks(counts + [float(failure is not None)])
                    if failed and failure is None:
                        failure = DataUnavailable("another rank could not read its data (see its message)")
            if failure is not None:
                self.iterator.offset = offset
                if self.previous_data_failure == self.data_position():
                    failure = DataCorrupt(f"{failure}; the previous attempt failed at this same position "
                                          f"(update {self.state.num_updates + 1}): the data is damaged, not "
                                          f"unavailable, and a retry would fail again; repair or regenerate it")
                raise failure
            if not micro_batches:
                return
            self.update_offset = offset  # an update that fails (out of memory) is redone from here
            totals = {"nsamples": sum(count for _, count in micro_batches)}
            totals.update((name, max(count, 1)) for name, count in zip(task.denominators, counts))
            yield micro_batches, totals

    def data_position(self) -> dict:
        """Where the next update's data starts (the same on every rank)."""
        return {"epoch": int(self.iterator.epoch), "offset": int(self.iterator.offset),
                "update": int(self.state.num_updates)}

    def apply_memory_hook(self):
        """TEXTBOX_LIKE_TEST_MEMORY_LIMIT (tests only): from its update on,
        the process may grow by so many megabytes (faults.limit_address_space)."""
        if self.memory_hook is not None and self.state.num_updates == self.memory_hook[1]:
            from .faults import limit_address_space
            limit_address_space(self.memory_hook[0])

    def out_of_memory(self, exc) -> RunStopped | UserError:
        """What an allocation that failed in the loop means: before the first
        update of this run, a batch too large (2); later, a stop (71) that
        saves the last completed update's state, where one process holds it
        all and the optimizer's step was not interrupted."""
        reason = allocation_reason(exc)
        update = self.state.num_updates + 1
        batch = batch_size_option(self.cfg, self.batch_sizes[self.rank])
        if self.state.num_updates == getattr(self, "updates_at_start", self.state.num_updates):
            return UserError(f"out of memory at the first update ({reason}); lower {batch}")
        where = f"at update {update}" if self.update_offset is not None else f"after update {update - 1}"
        stop = OutOfMemory(f"out of memory {where} on rank {self.rank} ({reason})")
        stop.saves_state = self.world == 1 and not self.stepping
        if stop.saves_state:
            stop.after_save = f"; saved the state after update {update - 1}: rerun with --resume and a lower {batch}"
        else:
            last = self.checkpoints.newest_good()
            why = "the optimizer step was interrupted" if self.stepping else "the other ranks are mid-update"
            stop.after_save = (f"; not saved ({why}); lower {batch} and rerun"
                               + (f" with --resume from {last}" if last else ""))
        return stop

    def save_on_fault(self, exc):
        """The state before the update that failed, saved on the way out
        (a data file that failed, an allocation)."""
        if isinstance(exc, OutOfMemory):
            import gc
            gc.collect()  # the failed update's activations, held by reference cycles
            if self.update_offset is not None:  # failed within an update (not validating or saving after one)
                self.iterator.offset = self.update_offset  # redone from its start after --resume
            self.optimizer.zero_grad(set_to_none=True)
            if self.accelerator.device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
        else:
            # the position kept in the checkpoint: a retry failing at the same
            # place is known for damage at rest (DataCorrupt, exit 65)
            self.checkpoints.metadata["data_failure"] = self.data_position()
        self.save(end_of_epoch=False, is_best=False, final=True)

    def end_of_epoch(self) -> bool:
        cap = self.cfg.data.num_iters_per_epoch
        return self.iterator.end_of_epoch or bool(cap and self.state.updates_in_epoch >= cap)

    def next_epoch(self):
        self.state.epoch, self.state.updates_in_epoch = self.state.epoch + 1, 0
        self.iterator.set_epoch(self.state.epoch)

    def crossed_snapshot(self, samples_in_update) -> bool:
        """kanachan's --snapshot-interval: this update crossed a multiple of N training samples."""
        before = self.state.samples_trained
        self.state.samples_trained += samples_in_update
        if self.unsettled is not None:  # taken back if the update turns out skipped (settle)
            self.unsettled_samples = samples_in_update
        return crosses(before, self.state.samples_trained, self.cfg.checkpoint.snapshot_interval)

    def rebalance(self):
        """--balance: at each of the balancer's exchanges, the ranks' compute
        seconds and samples and their timed whole updates on the current
        split in one host all-reduce, and from them the same next split on
        every rank (checked: a rank that computed another stops the run).
        Timing a split starts after its first update (balance.Balancer.marks)."""
        balancer, state = self.balancer, self.state
        if balancer is None:
            return
        from .balance import since
        new, was = None, list(balancer.split)
        if balancer.due(state.num_updates):
            window = self.timer_window("balance")
            timed = since(self.timer.host_totals(), self.timer_marks.get("probe"))
            figures = self.per_rank([window["compute"], window["samples"], timed["wall"], timed["wall_sq"],
                                     timed["timed"]])
            new = balancer.decide([f[0] for f in figures], [f[1] for f in figures], state.num_updates,
                                  walls=[f[2:] for f in figures])
        if balancer.marks(state.num_updates):
            self.timer_marks["probe"] = self.timer.host_totals()
        if new is None:
            return
        splits = self.per_rank(new)
        if any(row != splits[0] for row in splits):
            raise RuntimeError(f"the ranks computed different splits of the global batch: {splits}")
        if new != was:
            self.apply_split()
        rates, unit, table = balancer.units_per_s(), balancer.unit, balancer.table()
        measured = ", ".join(f"{split} {seconds:.4f}" for split, seconds in table.items())
        self.log.event("balance", {"update": state.num_updates, "batch_sizes": new, "was": was,
                                   "reason": balancer.reason, "s_per_update": table, f"{unit}_per_s": rates,
                                   "unit": unit},
                       f"update {state.num_updates} | balance: {self.split_name} {new} "
                       f"({'kept' if new == was else f'was {was}'}): "
                       f"{balancer.reason} | s per update {measured} | {unit}/s per rank {rates}")

    def every(self, interval, ahead=0) -> bool:
        """True on every ``interval``-th update (``ahead``: for the update about to happen)."""
        return interval > 0 and (self.state.num_updates + ahead) % interval == 0

    # ---------------------------------------------------- validate and save
    def validate(self) -> bool:
        """Validate every subset; True if the first one's metric improved."""
        self.settle()
        if not self.validator:
            return False
        state = self.state
        started = time.perf_counter()
        results = self.validator.validate(self.model)
        for subset, metrics in results.items():
            self.log.log(f"valid_{subset}" if len(results) > 1 else "valid",
                         {"epoch": state.epoch, "update": state.num_updates, **metrics})
        state.clock.paused += time.perf_counter() - started  # not training time
        first = results[self.cfg.data.valid_subset[0]]
        value = self.validator.value(first)
        state.last_valid = first
        self.scheduler.step_valid(value)  # ReduceLROnPlateau and kin step here; the others ignore it
        if self.validator.is_better(value, state.best):
            state.best, state.best_valid = value, dict(first)
            state.validations_since_best = 0
            return True
        state.validations_since_best += 1
        return False

    def save(self, end_of_epoch, is_best, final=False, snapshot=False):
        self.settle()
        names = self.checkpoints.names(self.state.epoch, self.state.num_updates, end_of_epoch, is_best, final,
                                       snapshot)
        if not names:
            return
        started = time.perf_counter()
        self.fold_log_window()  # so the saved meters are already summed over ranks
        if not all(bool(p.isfinite().all()) for p in self.grad_params):
            raise Diverged(f"the weights are not finite at update {self.state.num_updates}; not saving them. "
                           f"The last finite checkpoint is {self.checkpoints.newest_good()}")
        failure = None
        time.sleep(self.slow_save)
        try:
            self.checkpoints.save(names)
        except SaveFailed as exc:
            failure = exc
        # instead of a barrier: every rank learns whether the main one could
        # write (on the long-timeout group: a large checkpoint takes a while)
        if self.world > 1 and self.sum_over_ranks([float(failure is not None)], distributed.long_group())[0] \
                and failure is None:
            failure = SaveFailed("rank 0 could not write a checkpoint (see its message); stopping")
        if failure is not None:
            raise failure
        self.state.clock.paused += time.perf_counter() - started

    # -------------------------------------------------------------- logging
    def fold_log_window(self, share_clock=False) -> dict:
        """Sum the open log window over ranks (one collective) into the
        epoch's meters; ``share_clock``: with rank 0's clock in the same sum,
        for the wall-clock log schedule."""
        self.settle()
        if share_clock:
            elapsed = time.perf_counter() - self.time_log_mark[0] if self.is_main else 0.0
            self.window.add({_CLOCK_KEY: elapsed})   # every rank the key: the same collective everywhere
        sums = self.window.reduce(self.accelerator)
        self.window.reset()
        if share_clock:
            self.schedule_time_log(sums.pop(_CLOCK_KEY))
        self.state.epoch_sums.add(sums)
        self.state.samples_seen += int(sums.get("nsamples", 0))
        return sums

    def target_updates(self) -> int:
        """The update the run will stop at (0: not known)."""
        known = [n for n in (self.cfg.schedule.max_update, self.planned_updates) if n]
        return min(known) if known else 0

    def log_interval(self) -> int:
        """--log-interval, shortened so that a short run still logs about ten
        times (a 20-update run with the default 100 would print nothing); a
        user's own --log-interval is kept. The longest spacing of records in
        updates; log_due adds records by wall time."""
        target = self.target_updates()
        if getattr(self, "_log_interval", (None,))[0] != target:   # asked every update: worked out once
            interval = self.cfg.logging.log_interval
            if not (self.cfg.given("log_interval") or not target or interval <= 0):
                interval = min(interval, max(1, target // 10))
            self._log_interval = (target, interval)
        return self._log_interval[1]

    def log_due(self, ahead=0) -> bool:
        """Whether the update ``num_updates + ahead`` logs: every --log-interval
        updates (log_interval), and sooner where the wall-clock schedule
        (schedule_time_log) says so; the same answer on every rank."""
        interval, update = self.log_interval(), self.state.num_updates + ahead
        return interval > 0 and (update % interval == 0 or update >= self.time_log_at)

    def schedule_time_log(self, rank0_seconds: float):
        """The next update to log so that records come at least every
        LOG_EVERY_S seconds: from rank 0's seconds per update since the last
        decision, which every rank received in the same sum, so all ranks
        pick the same update without a collective of their own."""
        updates = max(self.state.num_updates - self.time_log_mark[1], 1)
        spacing = max(1, int(LOG_EVERY_S * updates / max(rank0_seconds, 1e-9)))
        self.time_log_at = self.state.num_updates + spacing
        self.time_log_mark = (time.perf_counter(), self.state.num_updates)

    def log_train(self):
        if not self.log_due():
            return
        state = self.state
        sums = self.fold_log_window(share_clock=True)
        if self.first_log_probe:
            # the first update of a run is folded to learn its pace, not
            # printed (unless --log-interval asks for it)
            self.first_log_probe = False
            if not self.every(self.log_interval()):
                return
        rates = state.clock.window(state.samples_seen, state.num_updates)
        record = {"epoch": state.epoch, "update": state.num_updates, **self.task.metrics(sums), "lr": self.lr,
                  "gnorm": float(self.gnorm) if self.gnorm is not None else None, **rates}
        if "ntokens" in sums:
            record["tokens_per_s"] = rates["samples_per_s"] * sums["ntokens"] / max(sums.get("nsamples", 0), 1)
        target = self.target_updates()
        if target and rates["updates_per_s"] > 0:
            record["eta_s"] = max(target - state.num_updates, 0) / rates["updates_per_s"]
        if self.accelerator.device.type == "cuda":
            record["peak_mem_gib"] = self.peak_memory_per_rank()
        if self.world > 1:
            record.update(self.seconds_per_rank())
        record["wall"] = state.clock.elapsed()
        self.log.log("train", record)

    def seconds_per_rank(self) -> dict:
        """Each rank's compute, data and all-reduce wait seconds per update
        in this log window (one host all-reduce)."""
        window = self.timer_window("log")
        updates = max(window["updates"], 1)
        rows = self.per_rank([window["compute"] / updates, window["data"] / updates, window["wait"] / updates])
        return {f"{name}_s_per_rank": [round(row[i], 5) for row in rows]
                for i, name in enumerate(("compute", "data", "wait"))}

    def log_epoch(self):
        state = self.state
        self.fold_log_window()
        self.log.log("train_epoch", {"epoch": state.epoch, "update": state.num_updates,
                                     **self.task.metrics(state.epoch_sums.state_dict()),
                                     "wall": state.clock.elapsed()})
        state.epoch_sums.reset()

    def peak_memory_per_rank(self) -> list:
        import torch
        peak = torch.zeros(self.world, device=self.accelerator.device)
        peak[self.rank] = torch.cuda.max_memory_allocated() / 2 ** 30
        if self.world > 1:
            peak = self.accelerator.reduce(peak, reduction="sum")
        return [round(v, 3) for v in peak.tolist()]

    # ------------------------------------------------------------- helpers
    def to_device(self, batch):
        batch = self.task.collate_to_device(batch, self.accelerator.device)
        if self.cfg.numerics.train_dtype == "float64":
            import torch
            batch = {k: v.double() if torch.is_floating_point(v) else v for k, v in batch.items()}
        return batch

    def sum_over_ranks(self, numbers, group=None):
        import torch
        import torch.distributed as dist
        values = torch.tensor(numbers, dtype=torch.float64)  # host memory, on purpose
        dist.all_reduce(values, group=group or self.host_group)
        return values.tolist()

    def reseed(self, why):
        import torch
        torch.manual_seed(self.cfg.numerics.seed + 7919 * self.state.num_updates + self.rank)
        self.log.info(f"{why}: reseeding")

    # ------------------------------------------------------- start and end
    def restore(self):
        """Continue from --restore-file, or checkpoint_last.pt under --resume."""
        cfg, state = self.cfg, self.state
        path = self.checkpoints.resume_path()
        if path is None:
            if cfg.checkpoint.resume:
                self.log.info(f"no checkpoint_last.pt in {cfg.checkpoint.save_dir}: starting fresh")
            if cfg.checkpoint.initial_optimizer:
                self.load_initial_optimizer(cfg.checkpoint.initial_optimizer)
            self.iterator.set_epoch(state.epoch)
            return
        state_dict, path = self.checkpoints.load_newest(path, self.log.info)
        if cfg.checkpoint.resume:  # the same run, continued (--restore-file may start another)
            self.checkpoints.check_resumed_config(state_dict, path, changes_numbers(cfg),
                                                  defaults={"model_conf": self.task.model_conf_defaults()},
                                                  log=self.log.info)
        fresh = self.checkpoints.restore(state_dict, path)
        self.previous_data_failure = state_dict.get("data_failure")
        del state_dict
        if cfg.checkpoint.reset_meters:
            state.reset_meters()
        if "iterator" in fresh:  # --reset-dataloader: a new pass from the start, same update count
            state.epoch, state.updates_in_epoch = 1, 0
            self.iterator.set_epoch(1)
            if "rng" in fresh:
                self.reseed("--reset-dataloader")
        else:
            state.epoch = self.iterator.epoch
        overrides = cfg.checkpoint.optimizer_overrides or {}
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in overrides.items() if not (k == "weight_decay" and group.get("no_decay"))})
        if overrides.get("lr") is not None:
            self.scheduler.rebase(float(overrides["lr"]))
        if "scheduler" in fresh:
            self.scheduler.step_update(state.num_updates)  # the schedule at the restored update, not at 0
        if self.balancer is not None:  # the saved split, or an even one on another world size
            self.apply_split()
        if self.end_of_epoch():
            self.next_epoch()
        self.log.forget_after(state.num_updates)
        self.log.info(f"resumed from {path}: epoch {state.epoch}, update {state.num_updates}")

    def load_initial_optimizer(self, path):
        """kanachan's --initial-optimizer: the optimizer state of one of our
        checkpoints, or a file of ``optimizer.state_dict()``."""
        import torch
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UserError(f"--initial-optimizer {path} cannot be read ({str(exc).splitlines()[0][:150]})") \
                from None
        if isinstance(saved, dict) and "optimizer" in saved and "param_groups" not in saved:
            saved = saved["optimizer"]
        if not isinstance(saved, dict) or "param_groups" not in saved:
            raise UserError(f"--initial-optimizer {path} holds no optimizer state")
        saved = {k: v for k, v in saved.items() if k != "name"}
        try:
            self.optimizer.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UserError(f"--initial-optimizer {path} does not fit this model and optimizer "
                            f"({str(exc).splitlines()[0][:150]})") from None
        self.log.info(f"optimizer state from {path}")

    def agreed_settings(self) -> dict:
        """What every rank must have alike: the position, the data, the
        precision actually chosen, and every setting that is not per node."""
        import yaml
        state, cfg = self.state, self.cfg
        settings = {"position (update, epoch, offset)": (state.num_updates, self.iterator.epoch,
                                                         self.iterator.offset),
                    "training samples": len(self.train_data),
                    "precision": self.accelerator.mixed_precision}
        for key, value in yaml.safe_load(to_yaml(cfg)).items():
            if key not in distributed.PER_NODE_SETTINGS:
                settings[f"--{key.replace('_', '-')}"] = value
        return settings

    def start(self):
        cfg, acc = self.cfg, self.accelerator
        # every node has its own command line: settings that change the
        # numbers or the order of collectives must agree, or the replicas
        # drift apart or hang
        distributed.check_ranks_agree(acc, self.agreed_settings())
        if self.is_main and not cfg.checkpoint.no_save:
            from .config import write_config
            write_config(cfg, cfg.checkpoint.save_dir)
        if acc.log_with:
            import yaml

            from .trackers import hyperparameters
            acc.init_trackers("textbox_like", config=hyperparameters(yaml.safe_load(to_yaml(cfg))))
        if self.memory is not None:  # measured on the second update of this start (a resume too)
            self.memory.measure_at = self.state.num_updates + 2
        if self.balancer is not None:
            self.balancer.start(self.state.num_updates)
        self.log.info(self.start_line())
        state = self.state
        state.clock.mark_samples, state.clock.mark_updates = state.samples_seen, state.num_updates
        # the wall-clock log schedule (schedule_time_log) learns the pace at
        # this run's first update
        self.time_log_at, self.time_log_mark = state.num_updates + 1, (time.perf_counter(), state.num_updates)
        self.first_log_probe = True
        # fused optimizers take a found_inf flag and skip a non-finite step in
        # their kernel, so the host need not wait for the gradient norm before
        # stepping (the default on CUDA, see optim.build_optimizer). Decided
        # from the groups in use: a resumed checkpoint brings its own (a CPU
        # one is not fused); the loss scaler, when there is one, skips itself
        groups = self.optimizer.optimizer.param_groups
        self.skips_on_device = acc.scaler is None and all(g.get("fused") for g in groups)
        self.model.train()
        self.updates_at_start = state.num_updates  # an allocation failing before the next one fails the batch size
        self.preemption.started = True  # from here a signal saves and stops; before, it stops at once

    def start_line(self) -> str:
        """What the run is: task, size, devices, precision and where it was
        chosen, optimizer and lr (and why that lr), batches, data."""
        from .optim import lr_explained
        cfg, acc = self.cfg, self.accelerator
        sources = ", ".join(f"{k} from {v}" for k, v in self.sources.items() if v != "default")
        if self.balancer is not None:
            batches = (f"global batch {self.balancer.total}{self.tokens_word}"
                       f"{' (balanced)' if self.balancer.enabled else ''} | {self.split_name} {self.balancer.split} | "
                       f"micro-batch caps {self.micro_caps}{self.tokens_word}")
        else:
            batches = f"batch sizes per rank {self.batch_sizes}"
        return (f"task {cfg.data.task} | {self.n_params:,} parameters | world size {self.world} | "
                f"device {acc.device}" + (f" ({self.threads} thread{'s' if self.threads > 1 else ''})"
                                          if acc.device.type == "cpu" else "")
                + f" | precision {self.precision_name()}" + (f" ({sources})" if sources else "")
                + f" | {cfg.optim.optimizer} {lr_explained(cfg)}"
                + f" | {batches} | train {len(self.train_data):,} samples"
                + ("" if cfg.validation.disable_validation else
                   f" | best {self.state.best_metric} ({'higher' if self.state.maximize else 'lower'} is better)")
                + (" (in memory: read inline, --num-workers not needed)"
                   if cfg.data.num_workers and not self.iterator.num_workers else "")
                + f" | {self.saved_where()}"
                + "".join(f" | {line}" for line in default_notes(cfg)))

    def precision_name(self) -> str:
        """Accelerate's mixed precision (fp16, bf16), or where it has none
        ("no"), the dtype the model trains in: float32 (float64)."""
        chosen = self.accelerator.mixed_precision
        return self.cfg.numerics.train_dtype if chosen == "no" else chosen

    def saved_where(self) -> str:
        """Where the run is saved, for its start and done lines."""
        if self.cfg.checkpoint.no_save:
            return "not saved (--no-save)"
        return f"saved in {os.path.abspath(self.cfg.checkpoint.save_dir)}"

    def finish(self) -> int:
        self.settle()
        cfg, state, acc = self.cfg, self.state, self.accelerator
        reason = self.stop_reason() or "completed"
        results = {"task": cfg.data.task, "num_updates": state.num_updates, "epochs_completed": state.epoch - 1,
                   "wall_time": state.clock.elapsed(),
                   "best_metric": state.best_metric, "best": state.best_valid, "final": state.last_valid,
                   "stopped": "preempted" if reason == "preempted" else "completed", "stop_reason": reason,
                   "world_size": self.world, "samples_trained": state.samples_trained}
        if self.is_main and not cfg.checkpoint.no_save:
            self.write_results(results)
            from . import elastic
            if reason != "preempted":
                elastic.clear_handoff(cfg.checkpoint.save_dir)
            elif self.agent is not None:  # torchrun stops workers with SIGTERM when a node joins
                elastic.write_handoff(cfg.checkpoint.save_dir, self.agent, state.num_updates, self.global_batch(),
                                      "membership change or preemption")
        self.log.info(self.last_line(reason))
        if self.world > 1 and self.timer is not None:
            from .balance import slowest_rank_line
            totals = self.timer.totals()
            keys = ("compute", "data", "wait", "updates")
            rows = self.per_rank([totals[k] for k in keys])
            self.log.info(slowest_rank_line([dict(zip(keys, row)) for row in rows]))
        if self.timer is not None:
            self.timer.close()
        self.log.close()
        self.preemption.close()
        acc.wait_for_everyone()
        acc.end_training()
        if self.is_main and not cfg.checkpoint.no_save:
            self.plot_curves()
        self.release_save_dir()
        distributed.cleanup()
        if reason == "preempted":
            print(self.preemption.message(self.checkpoints.enabled and not cfg.checkpoint.no_last_checkpoints), file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        return 0

    def last_line(self, reason):
        """How the run ended, and whose the figures are (the last validation's)."""
        state, cfg = self.state, self.cfg
        head = {"preempted": f"stopped by a signal at update {state.num_updates}",
                "patience": f"done: no better {state.best_metric} in {cfg.validation.patience} validations "
                            f"(--patience) at update {state.num_updates}"}.get(reason, f"done | updates {state.num_updates}")
        figures = (" | last validation: " + " | ".join(f"{k} {v:.4f}" for k, v in state.last_valid.items())
                   if state.last_valid else " | not validated")
        return head + figures + f" | wall {state.clock.elapsed():.1f}s | {self.saved_where()}"

    # ------------------------------------------------------------- elastic
    def global_batch(self) -> int:
        """Samples of one update over all ranks (the first start's total,
        which an elastic restart keeps: elastic.kept_global_batch)."""
        if self.balancer is not None:
            return self.balancer.total
        return sum(self.batch_sizes) * self.update_freq() if not any(self.iterator.max_tokens or []) else 0

    def emergency_save(self):
        """A peer is lost: save the last completed update from this survivor
        alone (the process group is broken, so no part may gather over ranks),
        with the data position rewound to the start of the update in flight
        and this rank's RNG as of then. One writer among the survivors (a
        claim file); the path, or None where another survivor writes it."""
        from . import elastic
        from .checkpoint import FORMAT, atomic_save
        from .elastic import Claim
        ck, state, start = self.checkpoints, self.state, self.update_start
        self.settle()  # a host read of the last device-skipped update's norm, no collective
        if start is not None and start["updates"] == state.num_updates:
            self.iterator.offset = start["offset"]  # the update in flight is redone after the restart
        rng = [None] * self.world
        rng[self.rank] = start["rng"] if start is not None else rng_state()
        parts = {name: part.state_dict() for name, part in ck.parts.items() if name != "rng"}
        path = ck.dir / f"checkpoint_{state.epoch}_{state.num_updates}.pt"
        with Claim(ck.dir / f".emergency-{state.num_updates}.claim",
                   stale_after=self.cfg.distributed.distributed_timeout) as claim:
            if not claim.held:
                # every write of this run is the claim holder's, made before it lets go of
                # the claim; the lock holder leaves last: its release ends the run's writes
                claim.wait_for_writer()
                return None
            try:
                atomic_save({"format": FORMAT, **ck.metadata, **parts, "rng": rng}, path, make_parents=False)
            except Exception as exc:
                if not failed_writing(exc):
                    raise
                raise SaveFailed(f"rank {self.rank}: lost a peer, and could not write the emergency checkpoint "
                                 f"{path} ({os_reason(exc)}); the newest earlier checkpoint is kept") from None
            elastic.write_handoff(self.cfg.checkpoint.save_dir, self.agent, state.num_updates, self.global_batch(),
                                  "lost peer")
            init = os.environ.get("TEXTBOX_LIKE_INIT_METHOD") or self.cfg.distributed.distributed_init_method or ""
            if init.startswith("file://"):  # a rerun must not find this run's rendezvous file
                remove(init[len("file://"):])
        return path

    def peer_lost(self, exc) -> int:
        """Every survivor: the emergency checkpoint and the hand-off note for
        the restart (one survivor writes both), one line, and 75 (torchrun
        restarts on it)."""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        where = f"rank {self.rank}: lost a peer of this run at update {self.state.num_updates + 1} ({first})"
        if not self.checkpoints.enabled:
            print(f"error: {where}; nothing saved (--no-save)", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        path = self.emergency_save()
        saved = (f"saved update {self.state.num_updates} to {path}" if path is not None
                 else f"another survivor saved update {self.state.num_updates}")
        how = ("torchrun restarts the workers and they resume from it by themselves" if self.agent is not None
               else "rerun with --resume, on any number of ranks (--global-batch-size keeps the global batch)")
        self.release_save_dir()
        print(f"error: {where}; {saved}: {how}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE

    def write_results(self, results):
        path = Path(self.cfg.checkpoint.save_dir) / "results.json"
        try:
            atomic_write_text(path, json.dumps(results, indent=2), make_parents=False)
        except OSError as exc:
            raise SaveFailed(f"could not write {path} ({os_reason(exc)}); the checkpoints are kept") from None

    def plot_curves(self):
        try:
            from .plot import plot_runs
        except ImportError:  # matplotlib missing: curves are a convenience
            return
        plot_runs([self.cfg.checkpoint.save_dir], Path(self.cfg.checkpoint.save_dir) / "curves.png")


def valid_batch_size(data) -> int:
    """--max-sentences-valid, else 4x the training batch: forward-only work
    keeps no activations for a backward pass, and larger batches make it
    ~2.3x faster per sample (MNIST on CPU: 1,650 vs 700 samples/s at 256 vs 64)."""
    return data.max_sentences_valid or 4 * (data.max_sentences or 16)


def crosses(before: int, after: int, interval: int) -> bool:
    """A count going from ``before`` to ``after`` passes a multiple of ``interval`` (0: never)."""
    return interval > 0 and after // interval > before // interval


def batch_size_option(cfg, batch_size) -> str:
    """The option that sets the batch an allocation failed for, and its value."""
    data = cfg.data
    if data.global_batch_size:
        return f"--max-sentences (each micro-batch; now {data.max_sentences or data.global_batch_size}) " \
               f"or --global-batch-size (now {data.global_batch_size})"
    if data.max_tokens:
        return f"--max-tokens (now {data.max_tokens})"
    return f"--max-sentences (now {batch_size})"


def build_trainer(cfg):
    """A Trainer; an allocation failing while the data and the model are built is one line (2)."""
    try:
        return Trainer(cfg)
    except Exception as exc:
        if isinstance(exc, (UserError, RunStopped)) or not allocation_failed(exc):
            raise
        message = (f"out of memory while loading the data and building the model ({allocation_reason(exc)}); "
                   f"lower {batch_size_option(cfg, cfg.data.max_sentences)}, or use a smaller model")
    raise UserError(message)  # outside the handler: the failed allocation's frames are released


def train_or_stop(trainer) -> int:
    """trainer.train(); an allocation failing in it is a RunStopped (or, at the first update, a UserError)."""
    try:
        return trainer.train()
    except Exception as exc:
        if isinstance(exc, (UserError, RunStopped)) or not allocation_failed(exc):
            raise
        stop = trainer.out_of_memory(exc)
        exc.__traceback__ = None  # its frames hold the failed update's tensors
    raise stop


def train(cfg) -> int:
    return run(build_trainer(cfg))


def run(trainer) -> int:
    """Train; a fault ends as one line and its exit code, a lost peer as an
    emergency checkpoint and 75 (elastic.py)."""
    try:
        return train_or_stop(trainer)
    except Exception as exc:
        if isinstance(exc, RunStopped) or not (trainer.preemption.started and distributed.lost_peer(exc)):
            return trainer_stopped(trainer, exc)
        return trainer.peer_lost(exc)
    finally:
        trainer.release_save_dir()


def trainer_stopped(trainer, exc) -> int:
    """A fault the trainer knows (RunStopped): one line and its exit code;
    anything else is re-raised, and so is Superseded: a process that no
    longer owns its run does nothing more (cli.exit_code)."""
    if not isinstance(exc, RunStopped) or isinstance(exc, Superseded):
        raise exc
    message = str(exc)
    if getattr(exc, "saves_state", isinstance(exc, DataUnavailable)):
        # a data failure rewound the position to the failing update's
        # start: saved, a rerun with --resume (a requeue) continues
        # without skipping a sample
        try:
            trainer.save_on_fault(exc)
            message += getattr(exc, "after_save", "; saved the state before it: rerun with --resume once "
                                                  "the data is back")
        except RunStopped as stop:  # the save found divergence, or could not write
            exc, message = stop, str(stop)
        except Exception as again:
            if not allocation_failed(again):
                raise
            message += f"; saving failed too ({allocation_reason(again)})"
    else:
        message += getattr(exc, "after_save", "")
    # every rank stops together here, so leaving the group is safe (see cli.run)
    distributed.cleanup()
    print(f"error: {message}", file=sys.stderr)
    return exc.exit_code
