"""One update: forward and backward over the micro-batches, the gradient
norm, the optimizer step, the compile fallback, and the non-finite guard
(a skip decided on the host, or in a fused optimizer's kernel and read one
update late: :meth:`UpdateStep.settle`). What is true while an update is
under way is one object, :class:`InFlight`."""
from __future__ import annotations

import contextlib
import math
import time

from textbox_like.parallel import sharding
from textbox_like.core.errors import UserError, first_line
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


class UpdateStep:
    """The update of the weights, and its guard against non-finite values."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.lr = trainer.scheduler.get_lr()
        self.gnorm = None
        self.nonfinite_in_a_row = 0
        self.skips_on_device = False  # decided in start(), after a checkpoint's optimizer groups are loaded

    def decide_device_skips(self):
        """Fused optimizers take a found_inf flag and skip a non-finite step in
        their kernel, so the host need not wait for the gradient norm before
        stepping (the default on CUDA, see optim.build_optimizer). Decided
        from the groups in use: a resumed checkpoint brings its own (a CPU
        one is not fused); the loss scaler, when there is one, skips itself."""
        groups = self.trainer.optimizer.optimizer.param_groups
        self.skips_on_device = self.trainer.accelerator.scaler is None and all(g.get("fused") for g in groups)

    def update(self, micro_batches, totals) -> bool:
        """One update: forward and backward over the micro-batches, then one
        optimizer step; False when the update was skipped. ``totals``: each
        loss term's denominator over the whole update (all micro-batches and
        ranks). Each rank scales its summed loss so that DDP's average of
        gradients equals the gradient of the mean over the union of the
        update's samples."""
        t = self.trainer
        acc, state, flight, timer = t.accelerator, t.state, t.in_flight, t.timing.timer
        if flight.compile_pending:
            return self.first_compiled_step(micro_batches, totals)
        units = None  # what the timer counts: samples, or tokens of a global batch in tokens
        if t.global_batch.balancer is not None:
            stats, units = t.global_batch.backward_share(micro_batches[0][0], totals)
        else:
            stats = self.backward([t.to_device(batch) for batch, _ in micro_batches], totals)
        for one in stats:
            t.reporting.window.add(one)
        if timer is not None:
            timer.count(sum(one["nsamples"] for one in stats) if units is None else units)
            if t.global_batch.balancer is not None:
                t.timing.mark_once("balance")  # the first update warms up: not measured
        self.gnorm = self.gradient_norm()
        # an optimizer's first step creates its state: checked on the host,
        # since a kernel that skips it may leave that state uninitialised
        # (fused SGD's momentum buffers are torch.empty_like)
        if self.skips_on_device and t.optimizer.optimizer.state:
            return self.step_on_device(totals)
        self.settle()
        if acc.scaler is None and not bool(self.gnorm.isfinite()):
            t.optimizer.zero_grad(set_to_none=True)
            self.skip_nonfinite(float(self.gnorm))
            return False
        flight.stepping = True  # an allocation failing in here leaves the weights half-updated
        t.optimizer.step()
        flight.stepping = False
        t.optimizer.zero_grad(set_to_none=True)
        if acc.scaler is not None and acc.optimizer_step_was_skipped:
            state.skipped_updates += 1  # float16 overflow: the scaler lowered its scale and skipped
            return False
        self.nonfinite_in_a_row = 0
        self.count_update(totals["nsamples"])
        self.lr = t.scheduler.step_update(state.num_updates)
        return True

    def count_update(self, samples: int):
        """One more update taken (maybe taken back by settle): the counts, the log's bar, the snapshot count."""
        t = self.trainer
        t.state.num_updates += 1
        t.state.updates_in_epoch += 1
        t.log.advance()
        t.checkpointer.count_samples(samples)

    def backward(self, batches, totals, sync=True) -> list:
        """Forward and backward over this rank's micro-batches of the update,
        all-reducing the gradients once, on the last (``sync=False``: none
        does; the caller all-reduces by hand); their stats."""
        t = self.trainer
        acc, task, timer, flight, hooks = t.accelerator, t.task, t.timing.timer, t.in_flight, t.hooks
        out = []
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1 and sync
            with contextlib.nullcontext() if last else sharding.no_sync(acc, t.model):
                if timer is not None:
                    timer.forward_starts()
                terms, stats = task.loss(t.model, batch)
                if hooks.slow is not None:
                    hooks.slow_down(t.state.num_updates + 1, stats["nsamples"])
                if not isinstance(terms, dict):
                    terms = {"nsamples": terms}
                loss = sum(term * (t.world / totals[name]) for name, term in terms.items())
                if getattr(loss, "ndim", 0):
                    refuse_loss_shape(task, terms)
                flight.all_reducing = last
                acc.backward(loss)
                flight.all_reducing = False
                if timer is not None and sharding.is_sharded(t.model):
                    timer.backward_done()
            if last and timer is not None:
                timer.synced()
            out.append(stats)
        return out

    def first_compiled_step(self, micro_batches, totals) -> bool:
        """The first update under --compile includes compiling: timed and
        reported apart, and left out of the throughput. A model that cannot
        compile trains eager after one line."""
        import copy

        from textbox_like.core.internals import compile_errors
        t = self.trainer
        started = time.perf_counter()
        t.in_flight.compile_pending = False
        window = copy.deepcopy(t.reporting.window)
        try:
            stepped = t.train_step(micro_batches, totals)
        except compile_errors() as e:
            from textbox_like.parallel.accelerator import uncompile, warn
            cause = getattr(e, "inner_exception", None) or e  # the backend's own error
            reason = f"{type(cause).__name__}: " + first_line(cause, 200, empty="")
            name = type(t.accelerator.unwrap_model(t.model, keep_torch_compile=False)).__name__
            warn(f"--compile: {name} did not compile ({reason}); training eager")
            t.model = uncompile(t.model, t.compiled_regions)
            t.sources["compile"] = "default"
            t.optimizer.zero_grad(set_to_none=True)
            t.reporting.window = window
            return t.train_step(micro_batches, totals)
        took = time.perf_counter() - started
        t.state.clock.paused += took
        t.log.info(f"compiled: the first update took {took:.1f}s (compilation; not counted in throughput)")
        return stepped

    def gradient_norm(self):
        """The norm of the gradients (after DDP's all-reduce: the same on every
        rank, so every rank skips the same updates), clipped to --clip-norm."""
        import torch
        t = self.trainer
        acc, params, clip = t.accelerator, t.grad_params, t.cfg.schedule.clip_norm
        if sharding.is_sharded(t.model) and acc.scaler is None:
            # sharded gradients (DTensors): the norm over all shards, then each shard clipped by it
            norm = sharding.full_value(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
            return norm
        if clip > 0:
            return sharding.full_value(acc.clip_grad_norm_(params, clip))
        if acc.scaler is not None:  # the scaler guards: the norm only for the log
            return sharding.full_value(acc.clip_grad_norm_(params, float("inf"))) \
                if t.reporting.should_log(ahead=1) else None
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: no clipping pass
            return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return acc.clip_grad_norm_(params, float("inf"))

    def step_on_device(self, totals) -> bool:
        """The step of an optimizer that skips a non-finite update in its own
        kernel: no host sync per update. The host reads the gradient norm one
        update later (settle), or at once when anything is due after this
        update (Trainer.anything_due: a log line, a save, a validation, the
        end), so every decision sees the settled count; the LR schedule steps
        when the update is known to have been taken."""
        import torch
        t = self.trainer
        flight = t.in_flight
        self.settle()  # the previous update: long computed, so this does not stall the device
        inner = t.optimizer.optimizer
        inner.found_inf = (~self.gnorm.isfinite()).to(torch.float32)
        flight.stepping = True
        try:
            t.optimizer.step()
        finally:
            del inner.found_inf
        flight.stepping = False
        t.optimizer.zero_grad(set_to_none=True)
        flight.unsettled = HostCopy(self.gnorm)
        self.count_update(totals["nsamples"])
        flight.unsettled_samples = totals["nsamples"]
        if t.anything_due():
            return self.settle()
        return True

    def settle(self) -> bool:
        """Account for the last device-skipped update (see step_on_device):
        True if it was taken; if not, its count is taken back and it is
        counted as skipped."""
        t = self.trainer
        flight = t.in_flight
        if flight.unsettled is None:
            return True
        gnorm, flight.unsettled = flight.unsettled.value(), None
        state = t.state
        if math.isfinite(gnorm):
            self.nonfinite_in_a_row = 0
            self.lr = t.scheduler.step_update(state.num_updates)
            return True
        state.num_updates -= 1
        state.updates_in_epoch -= 1
        t.checkpointer.take_back_samples(flight.unsettled_samples)
        t.log.advance(-1)
        self.skip_nonfinite(gnorm)
        return False

    def skip_nonfinite(self, gnorm: float):
        """Count a skipped update; stop after --max-nonfinite-updates in a row."""
        t = self.trainer
        t.state.skipped_updates += 1
        self.nonfinite_in_a_row += 1
        update = t.state.num_updates + 1
        t.log.info(f"update {update}: gradient norm {gnorm} is not finite; update skipped "
                   f"({self.nonfinite_in_a_row} in a row)")
        if self.nonfinite_in_a_row >= t.cfg.runtime.max_nonfinite_updates:
            raise self.diverged(f"training diverged at update {update}: {self.nonfinite_in_a_row} updates in a row "
                                f"had a non-finite loss or gradient norm")

    def refuse_a_run_of_skips(self):
        """At the end of the run: a run whose every update was skipped (a
        loss that is never finite) trained nothing, however few it tried
        (an epoch shorter than --max-nonfinite-updates ended it "done", its
        epoch checkpoint holding the untrained weights of update 0)."""
        t = self.trainer
        if t.state.num_updates == 0 and t.state.skipped_updates:
            raise self.diverged(f"training diverged: none of the {t.state.skipped_updates} updates tried had a finite "
                                f"loss and gradient norm")

    def diverged(self, what: str) -> Diverged:
        t = self.trainer
        last = t.checkpointer.checkpoints.newest_good() if t.state.num_updates else None
        where = (f"the last finite checkpoint is {last}" if last else "no checkpoint was saved" if t.state.num_updates
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
