"""What a task is: the one place that knows its model, its data and its metrics.

The trainer never looks inside a batch. It asks the task for a model, for a
dataset per split, and for a loss over a batch; everything it logs comes from
the sums a task returns. Adding a task is one new module in this package that
subclasses :class:`Task` and decorates it with ``@register_task("name")``.

Task modules are imported to build the command line (``--help`` must stay
fast), so they import torch and friends inside methods, not at module top.
"""
from __future__ import annotations


class Task:
    #: registry name, set by ``register_task``
    name: str = ""

    #: True when the loss is normalised by the number of samples in an update.
    #: The trainer then knows every update's denominator from the batch plan
    #: and scales the loss before backward, with no communication. When False
    #: (e.g. BERT normalises MLM by masked tokens) the trainer sums
    #: ``stats["sample_size"]`` over all ranks after backward and rescales the
    #: gradients, as fairseq does.
    sample_size_is_num_samples: bool = True

    #: names of the metrics ``metrics()`` returns (checked against
    #: --best-checkpoint-metric before training starts)
    metric_names: tuple = ("loss",)

    #: metric used by default for ``checkpoint_best.pt``
    default_best_metric: str = "loss"
    default_maximize_best_metric: bool = False

    @staticmethod
    def add_args(parser) -> None:
        """Register task options on an argparse (sub)parser. Keep it import-light."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """Cheap checks of the task's options before any process starts
        (e.g. that --data exists). Raise ``UserError``."""

    def __init__(self, cfg):
        self.cfg = cfg

    # -- data -------------------------------------------------------------
    def prepare_data(self) -> None:
        """Fetch or build what the datasets need. Called on one process per
        file system before any ``build_dataset``; the others wait."""

    def build_dataset(self, split: str):
        """Return a dataset for ``split`` following ``textbox_like.data.base.BatchDataset``.
        Raise ``UserError`` for a split that does not exist."""
        raise NotImplementedError

    def collate_to_device(self, batch, device):
        """Move one batch (a dict of tensors) to ``device``."""
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    # -- model ------------------------------------------------------------
    def build_model(self):
        raise NotImplementedError

    def loss(self, model, batch):
        """Forward one batch.

        Returns ``(loss_sum, stats)``: ``loss_sum`` is a scalar tensor that is
        the SUM of the per-unit losses over the batch (the trainer divides by
        the update's denominator), ``stats`` a dict of scalar tensors that are
        sums too, so that they add up across batches and ranks. ``stats`` must
        contain ``nsamples`` and ``sample_size`` (the denominator of
        ``loss_sum``).
        """
        raise NotImplementedError

    def metrics(self, sums: dict) -> dict:
        """Turn summed ``stats`` (floats) into the metrics people read."""
        n = max(sums.get("sample_size", 0.0), 1.0)
        return {"loss": sums.get("loss_sum", 0.0) / n}

    def param_groups(self, model, weight_decay: float):
        """Parameter groups for the optimizer; override to exempt parameters
        from weight decay."""
        return [{"params": [p for p in model.parameters() if p.requires_grad],
                 "weight_decay": weight_decay}]
