"""One update: forward and backward over the micro-batches, the gradient
norm, the optimizer step, the compile fallback, and the non-finite guard
(a skip decided on the host, or in a fused optimizer's kernel and read one
update late: :meth:`UpdateStep.settle`). What is true while an update is
under way is one object, :class:`InFlight`. The forward and backward over
micro-batches is :class:`ForwardBackward`, which the update step and the
global batch's memory-guarded share both run. The first update under
--compile, and its fallback to eager, is the trainer's
(Trainer.first_compiled_step): a fallback changes the model every
component holds."""
from __future__ import annotations

import contextlib
import math
import time

from textbox_like.parallel import sharding
from textbox_like.core.errors import UserError
from textbox_like.core.faults import Diverged, HostCopy


class InFlight:
    """The update under way, as the loop, the step, a fault and an emergency
    save see it, and the one before it while that one is unsettled (its
    gradient norm still on the device: a skip is known one update late).
    Every field is here from the start."""

    def __init__(self, compile_pending: bool):
        self.began = None          # perf_counter when the update began reading (RankTimer.update_took)
        self.offset = None         # where the update under way started reading, while it runs: redone from there
        self.start = None          # several ranks: position, update and RNG at its start (elastic.emergency_save)
        self.stepping = False      # in the optimizer's step: an allocation failing here leaves weights half-updated
        self.all_reducing = False  # in the backward that all-reduces (an out-of-memory there is not retried)
        self.unsettled = None      # the last update's gradient norm, not read on the host yet (HostCopy)
        self.unsettled_samples = 0  # its samples, taken back if it turns out skipped
        self.compile_pending = compile_pending  # the first update under --compile compiles: timed apart

    def update_over(self, timer):
        """The update is over (taken or skipped): no position to redo, its whole time to the timer."""
        self.offset = None
        if timer is not None:
            timer.update_took(time.perf_counter() - self.began)


class ToDevice:
    """A batch onto the device, in the dtype the model trains in (the
    task's own collate, then float64 where --train-dtype asks for it)."""

    def __init__(self, task, device, float64: bool):
        self.task, self.device, self.float64 = task, device, float64

    def __call__(self, batch):
        batch = self.task.collate_to_device(batch, self.device)
        if self.float64:
            from textbox_like.data.base import map_tensors
            batch = map_tensors(lambda v: v.double() if v.is_floating_point() else v, batch)
        return batch


class ForwardBackward:
    """Forward and backward over this rank's micro-batches of an update: what
    the update step runs, and what the global batch's memory-guarded share
    runs in its micro-batches (given to both)."""

    def __init__(self, accelerator, task, model, ranks, state, in_flight, timing, hooks, to_device):
        self.accelerator, self.task, self.model, self.ranks = accelerator, task, model, ranks
        self.state, self.in_flight, self.timing, self.hooks = state, in_flight, timing, hooks
        self.to_device = to_device

    def backward(self, batches, totals, sync=True) -> list:
        """Forward and backward over this rank's micro-batches of the update,
        all-reducing the gradients once, on the last (``sync=False``: none
        does; the caller all-reduces by hand); their stats."""
        acc, task, timer, flight, hooks, model = \
            self.accelerator, self.task, self.timing.timer, self.in_flight, self.hooks, self.model
        world = self.ranks.world
        out = []
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1 and sync
            with contextlib.nullcontext() if last else sharding.no_sync(acc, model):
                if timer is not None:
                    timer.forward_starts()
                terms, stats = task.loss(model, batch)
                if hooks.slow is not None:
                    hooks.slow_down(self.state.num_updates + 1, stats["nsamples"])
                if not isinstance(terms, dict):
                    terms = {"nsamples": terms}
                loss = sum(term * (world / totals[name]) for name, term in terms.items())
                if getattr(loss, "ndim", 0):
                    refuse_loss_shape(task, terms)
                flight.all_reducing = last
                acc.backward(loss)
                flight.all_reducing = False
                if timer is not None and sharding.is_sharded(model):
                    timer.backward_done()
            if last and timer is not None:
                timer.synced()
            out.append(stats)
        return out


class UpdateStep:
    """The update of the weights, and its guard against non-finite values."""

    def __init__(self, cfg, accelerator, model, optimizer, scheduler, grad_params, *, state, in_flight, timing,
                 forward_backward, global_batch, record, samples, logs_at, checkpoints, log):
        self.cfg, self.accelerator, self.model = cfg, accelerator, model
        self.optimizer, self.scheduler, self.grad_params = optimizer, scheduler, grad_params
        self.state, self.in_flight, self.timing = state, in_flight, timing
        self.forward_backward, self.global_batch = forward_backward, global_batch
        self.record = record        # state.StepRecord: the log window's stats, the gradient norm, the lr
        self.samples = samples      # state.SamplesTrained: the samples counter the checkpointer's schedule reads
        self.logs_at = logs_at      # Reporting.due: whether an update logs (the norm is read for it)
        self.checkpoints = checkpoints  # the run's checkpoints: the last finite one, in a divergence's line
        self.log = log
        self.nonfinite_in_a_row = 0
        self.skips_on_device = False  # decided in start(), after a checkpoint's optimizer groups are loaded

    @property
    def lr(self):
        return self.record.lr

    @property
    def gnorm(self):
        return self.record.gnorm

    def decide_device_skips(self):
        """Fused optimizers take a found_inf flag and skip a non-finite step in
        their kernel, so the host need not wait for the gradient norm before
        stepping (the default on CUDA, see optim.build_optimizer). Decided
        from the groups in use: a resumed checkpoint brings its own (a CPU
        one is not fused); the loss scaler, when there is one, skips itself."""
        groups = self.optimizer.optimizer.param_groups
        self.skips_on_device = self.accelerator.scaler is None and all(g.get("fused") for g in groups)

    def update(self, micro_batches, totals) -> bool:
        """One update: forward and backward over the micro-batches, then one
        optimizer step; False when the update was skipped. ``totals``: each
        loss term's denominator over the whole update (all micro-batches and
        ranks). Each rank scales its summed loss so that DDP's average of
        gradients equals the gradient of the mean over the union of the
        update's samples. Under a fused optimizer the update may be left
        unsettled (step_on_device): the trainer settles it when anything is due."""
        acc, state, flight, timer, batches = \
            self.accelerator, self.state, self.in_flight, self.timing.timer, self.global_batch
        units = None  # what the timer counts: samples, or tokens of a global batch in tokens
        if batches.balancer is not None:
            stats, units = batches.backward_share(micro_batches[0][0], totals, self.forward_backward)
        else:
            to_device = self.forward_backward.to_device
            stats = self.forward_backward.backward([to_device(batch) for batch, _ in micro_batches], totals)
        window = self.record.window
        for one in stats:
            window.add(one)
        if timer is not None:
            timer.count(sum(one["nsamples"] for one in stats) if units is None else units)
            if batches.balancer is not None:
                self.timing.mark_once("balance")  # the first update warms up: not measured
        self.record.gnorm = self.gradient_norm()
        # an optimizer's first step creates its state: checked on the host,
        # since a kernel that skips it may leave that state uninitialised
        # (fused SGD's momentum buffers are torch.empty_like)
        if self.skips_on_device and self.optimizer.optimizer.state:
            return self.step_on_device(totals)
        self.settle()
        if acc.scaler is None and not bool(self.record.gnorm.isfinite()):
            self.optimizer.zero_grad(set_to_none=True)
            self.skip_nonfinite(float(self.record.gnorm))
            return False
        flight.stepping = True  # an allocation failing in here leaves the weights half-updated
        self.optimizer.step()
        flight.stepping = False
        self.optimizer.zero_grad(set_to_none=True)
        if acc.scaler is not None and acc.optimizer_step_was_skipped:
            state.skipped_updates += 1  # float16 overflow: the scaler lowered its scale and skipped
            return False
        self.nonfinite_in_a_row = 0
        self.count_update(totals["nsamples"])
        self.record.lr = self.scheduler.step_update(state.num_updates)
        return True

    def count_update(self, samples: int):
        """One more update taken (maybe taken back by settle): the counts, the log's bar, the samples."""
        self.state.num_updates += 1
        self.state.updates_in_epoch += 1
        self.log.advance()
        self.samples.count(samples)

    def gradient_norm(self):
        """The norm of the gradients (after DDP's all-reduce: the same on every
        rank, so every rank skips the same updates), clipped to --clip-norm."""
        import torch
        acc, params, clip, model = self.accelerator, self.grad_params, self.cfg.schedule.clip_norm, self.model
        if sharding.is_sharded(model) and acc.scaler is None:
            # sharded gradients (DTensors): the norm over all shards, then each shard clipped by it
            norm = sharding.full_value(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
            return norm
        if clip > 0:
            return sharding.full_value(acc.clip_grad_norm_(params, clip))
        if acc.scaler is not None:  # the scaler guards: the norm only for the log
            return sharding.full_value(acc.clip_grad_norm_(params, float("inf"))) \
                if self.logs_at(self.state.num_updates + 1) else None
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: no clipping pass
            return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return acc.clip_grad_norm_(params, float("inf"))

    def step_on_device(self, totals) -> bool:
        """The step of an optimizer that skips a non-finite update in its own
        kernel: no host sync per update. The host reads the gradient norm one
        update later (settle), or at once when anything is due after this
        update (Trainer.train_step asks Trainer.anything_due: a log line, a
        save, a validation, the end), so every decision sees the settled
        count; the LR schedule steps when the update is known to have been taken."""
        import torch
        flight = self.in_flight
        self.settle()  # the previous update: long computed, so this does not stall the device
        inner = self.optimizer.optimizer
        inner.found_inf = (~self.record.gnorm.isfinite()).to(torch.float32)
        flight.stepping = True
        try:
            self.optimizer.step()
        finally:
            del inner.found_inf
        flight.stepping = False
        self.optimizer.zero_grad(set_to_none=True)
        flight.unsettled = HostCopy(self.record.gnorm)
        self.count_update(totals["nsamples"])
        flight.unsettled_samples = totals["nsamples"]
        return True

    def settle(self) -> bool:
        """Account for the last device-skipped update (see step_on_device):
        True if it was taken; if not, its count is taken back and it is
        counted as skipped."""
        flight = self.in_flight
        if flight.unsettled is None:
            return True
        gnorm, flight.unsettled = flight.unsettled.value(), None
        state = self.state
        if math.isfinite(gnorm):
            self.nonfinite_in_a_row = 0
            self.record.lr = self.scheduler.step_update(state.num_updates)
            return True
        state.num_updates -= 1
        state.updates_in_epoch -= 1
        self.samples.take_back(flight.unsettled_samples)
        self.log.advance(-1)
        self.skip_nonfinite(gnorm)
        return False

    def skip_nonfinite(self, gnorm: float):
        """Count a skipped update; stop after --max-nonfinite-updates in a row."""
        self.state.skipped_updates += 1
        self.nonfinite_in_a_row += 1
        update = self.state.num_updates + 1
        self.log.info(f"update {update}: gradient norm {gnorm} is not finite; update skipped "
                      f"({self.nonfinite_in_a_row} in a row)")
        if self.nonfinite_in_a_row >= self.cfg.runtime.max_nonfinite_updates:
            raise self.diverged(f"training diverged at update {update}: {self.nonfinite_in_a_row} updates in a row "
                                f"had a non-finite loss or gradient norm")

    def refuse_a_run_of_skips(self):
        """At the end of the run: a run whose every update was skipped (a
        loss that is never finite) trained nothing, however few it tried
        (an epoch shorter than --max-nonfinite-updates ended it "done", its
        epoch checkpoint holding the untrained weights of update 0)."""
        state = self.state
        if state.num_updates == 0 and state.skipped_updates:
            raise self.diverged(f"training diverged: none of the {state.skipped_updates} updates tried had a finite "
                                f"loss and gradient norm")

    def diverged(self, what: str) -> Diverged:
        updates = self.state.num_updates
        last = self.checkpoints.newest_good() if updates else None
        where = (f"the last finite checkpoint is {last}" if last else "no checkpoint was saved" if updates
                 else "no update was made, so no checkpoint holds a trained one")
        return Diverged(f"{what}; the learning rate is likely too high (or float16 overflows: try --bf16), or the "
                        f"task's loss is not finite on any batch; {where}")


def refuse_loss_shape(task, terms):
    """A task's loss() must return one number per term (a sum over its
    batch): a tensor of another shape (``reduction="none"``, a loss per
    sample or token) would end in autograd's traceback. One line naming the
    task's loss() and the shape it returned."""
    shapes = ", ".join(f"{list(getattr(term, 'shape', ()))}" + (f" (term {name!r})" if len(terms) > 1 else "")
                       for name, term in terms.items() if getattr(term, "ndim", 0))
    cls = type(task)
    raise UserError(f"{cls.__module__}.{cls.__qualname__}.loss() returned a loss of shape {shapes}, not one number: "
                    f"return the sum over the batch (e.g. reduction='sum', or .sum() of a per-sample loss) and the "
                    f"samples or tokens it covers in its stats, which the trainer divides by")
