"""Validation: metrics over every sample of each validation split, each rank
taking its share, and the best value of the checkpoint metric so far."""
from __future__ import annotations

from textbox_like.core.errors import UserError
from textbox_like.metrics.meters import StatSums
from textbox_like.parallel.sharding import is_sharded


def evaluate(task, model, data, batch_sizes, accelerator, to_device=None):
    """Metrics over every sample of ``data``, each rank taking its share
    (``batch_sizes``: one per rank, or one for all; ``to_device``: how a
    batch reaches the model, the task's own by default)."""
    import numpy as np
    import torch

    from textbox_like.data.iterators import plan_fixed

    rank, world = accelerator.process_index, accelerator.num_processes
    sums = StatSums()
    was_training = model.training
    model.eval()
    # inference_mode, not no_grad: no version counters or view tracking
    # either; nothing made here is kept for training (metrics leave as floats).
    # Except under --fsdp: FSDP2 makes its unsharded parameters at the first
    # forward and reuses them after; made under inference_mode they are
    # inference tensors, which training's forward and backward cannot update
    with torch.no_grad() if is_sharded(model) else torch.inference_mode():
        sizes = list(batch_sizes) if isinstance(batch_sizes, (list, tuple)) else [batch_sizes] * world
        for row in plan_fixed(len(data), sizes):
            batch = data.get_batch(np.arange(row[rank], row[rank + 1]))
            batch = to_device(batch) if to_device else task.collate_to_device(batch, accelerator.device)
            with accelerator.autocast():
                _, stats = task.loss(model, batch)
                extra = task.validation_stats(model, batch)
            sums.add(stats)
            if extra:
                sums.add(extra)
    model.train(was_training)
    return task.metrics(sums.reduce(accelerator))


class Validator:
    """Runs :func:`evaluate` on each ``--valid-subset`` and judges the first
    subset's ``metric`` against the best so far (kept in the train state)."""

    def __init__(self, task, datasets: dict, batch_sizes, accelerator, metric: str, maximize: bool,
                 to_device=None):
        self.to_device = to_device
        self.task = task
        self.datasets = datasets
        self.batch_sizes = batch_sizes
        self.accelerator = accelerator
        self.metric = metric
        self.maximize = maximize

    def __bool__(self):
        return bool(self.datasets)

    def validate(self, model) -> dict:
        """{subset: metrics} for every validation subset."""
        return {subset: evaluate(self.task, model, data, self.batch_sizes, self.accelerator, self.to_device)
                for subset, data in self.datasets.items()}

    def value(self, metrics: dict) -> float:
        if self.metric not in metrics:
            raise UserError(f"--best-checkpoint-metric {self.metric!r} is not a metric of task "
                            f"{self.task.name}; choose from: {', '.join(metrics)}")
        return metrics[self.metric]

    def is_better(self, value, best) -> bool:
        return best is None or (value > best if self.maximize else value < best)
