"""Validating: when it is due (every --validate-interval-updates, every
--validate-interval epochs) and what a validation changes: the best so far,
--patience's count, a plateau scheduler."""
from __future__ import annotations

import time

from textbox_like.core import collectives
from textbox_like.training.validate import Validator
from textbox_like.training.due import every
from textbox_like.training.global_batch import clamped_batch_size


def valid_batch_size(data) -> int:
    """--max-sentences-valid, else 4x the training batch: forward-only work
    keeps no activations for a backward pass, and larger batches make it
    ~2.3x faster per sample (MNIST on CPU: 1,650 vs 700 samples/s at 256 vs 64)."""
    return data.max_sentences_valid or 4 * (data.max_sentences or 16)


class Validation:
    """The validator over the validation subsets, and its schedule."""

    def __init__(self, cfg, ranks, valid_data, *, task, accelerator, model, to_device, state, scheduler, callbacks,
                 log):
        self.cfg, self.model, self.state, self.scheduler = cfg, model, state, scheduler
        self.callbacks, self.log = callbacks, log
        largest = max(valid_data.values(), key=len, default=None)
        size = valid_batch_size(cfg.data)
        if not cfg.data.max_sentences_valid and largest is not None and len(largest):
            size = min(size, len(largest))   # our default, not the user's: no note
        valid_batch_sizes = collectives.one_per_rank(
            clamped_batch_size(size, largest, "the validation batch size"), ranks.world, ranks.group)
        self.validator = Validator(task, valid_data, valid_batch_sizes, accelerator, state.best_metric,
                                   state.maximize, to_device)

    def due(self, update: int) -> bool:
        """Every --validate-interval-updates (a save validates too: Trainer.after_update)."""
        return every(update, self.cfg.validation.validate_interval_updates)

    def should_validate_epoch(self, epoch: int, update: int, final: bool) -> bool:
        """At an epoch's end: where it ends the run (its final weights), where
        --validate-interval-updates falls on it, and every --validate-interval-th
        epoch, unless the schedule is by updates alone (--validate-interval-updates
        given, --validate-interval not): a seq2seq run that ended its epoch at
        update 94 validated, and generated, again at 100."""
        cfg = self.cfg
        if final or self.due(update):
            return True
        if cfg.validation.validate_interval_updates and not cfg.given("validate_interval"):
            return False
        return epoch % cfg.validation.validate_interval == 0

    def validate(self) -> bool:
        """Validate every subset; True if the first one's metric improved.
        The last update is settled by then (the trainer settles it first)."""
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
        improved = self.validator.is_better(value, state.best)
        if improved:
            state.best, state.best_valid = value, dict(first)
            state.validations_since_best = 0
        else:
            state.validations_since_best += 1
        self.callbacks.validation_end(dict(first))
        return improved
