"""What a task is: the one place that knows its model, its data and its metrics.

The trainer never looks inside a batch. It asks the task for a model, for a
dataset per split, and for a loss over a batch; everything it logs comes from
the sums a task returns. Adding a task is one new module in this package that
subclasses :class:`Task` and decorates it with ``@register_task("name")``.

Task modules are imported to build the command line (``--help`` must stay
fast), so they import torch and friends inside methods, not at module top.
"""
from __future__ import annotations

from textbox_like.config.schema import NoOptions
from textbox_like.data.base import map_tensors

#: words of a metric's name that mean lower is better (loss, mlm_loss, ppl, error rates);
#: any other metric (accuracy, F1, ROUGE*, BLEU, ...) is better higher. Whole words:
#: 'answer_f1' holds 'wer' but is an F1
LOWER_IS_BETTER = frozenset({"loss", "nll", "ppl", "perplexity", "error", "err", "wer", "cer", "mse", "mae", "rmse"})


def higher_is_better(metric: str) -> bool:
    """The direction of a metric, by its name: the one place that decides it."""
    import re
    return not LOWER_IS_BETTER.intersection(re.split(r"[^a-z0-9]+", metric.lower()))


def best_metric_direction(validation, task) -> tuple:
    """(the metric of checkpoint_best.pt, whether higher is better): the
    user's --maximize-best-checkpoint-metric where given, else the metric's
    own direction."""
    metric = validation.best_checkpoint_metric or task.default_best_metric
    given = validation.maximize_best_checkpoint_metric
    return metric, (bool(given) if given is not None else higher_is_better(metric))


class Task:
    #: registry name, set by ``register_task``
    name: str = ""

    #: Names of the counts, besides ``nsamples``, that normalise loss terms
    #: (e.g. ``("masked_tokens",)`` for BERT's MLM). The trainer sums each
    #: over the whole update, over all micro-batches and ranks, before
    #: backward, so an update equals the one-process update over the union of
    #: its samples, whatever the ranks' batch sizes. ``nsamples`` needs no
    #: communication: every rank knows it from the batch plan.
    denominators: tuple = ()

    #: the task's own setting for initial weights, which kanachan's
    #: --initial-encoder and TextBox's --model_path set (None: the model
    #: starts from random weights only)
    initial_weights_setting: str | None = None

    #: whether one split can be read from one named file (kanachan's
    #: --training-data FILE / --validation-data FILE: that file is the split)
    split_files: bool = False

    #: the --model_conf key of the model's width, which TextBox's
    #: ``embedding_size`` stands for in a search space (None: no such width)
    width_key: str | None = None

    #: names of the metrics ``metrics()`` returns (checked against
    #: --best-checkpoint-metric before training starts)
    metric_names: tuple = ("loss",)

    #: names that --metrics may give for a family of the metrics above, lowercase
    #: (TextBox's ``rouge`` for ROUGE-1, ROUGE-2 and ROUGE-L)
    metric_families: dict = {}

    #: metric used by default for ``checkpoint_best.pt`` (its direction: :func:`higher_is_better`)
    default_best_metric: str = "loss"

    #: the task's own options: a frozen dataclass of ``setting`` fields
    #: (config/schema.py), shown by --help and --print_config and typed like
    #: the core sections; a run's values are ``cfg.task_options``
    options: type = NoOptions

    @classmethod
    def resolve_config(cls, ns) -> None:
        """Fill options whose values follow from others (a preset's sizes), so
        that --print_config and config.yaml show what the run will use."""

    def start_notes(self) -> list:
        """Short notes for the run's start line (e.g. a classification head
        trained anew); none by default."""
        return []

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
        """The dataset of ``split``, one of:

        - a ``textbox_like.BatchDataset`` (data/base.py): read a batch at a
          time by an array of indices, its epoch order its own;
        - a map-style ``torch.utils.data.Dataset`` (``__len__`` and
          ``__getitem__``: a ``TensorDataset``, a class of your own returning
          tuples, dicts or tensors): a batch is ``collate`` (below) of its
          samples, in the structure it returns, as a ``DataLoader`` would
          give it (a ``TensorDataset``'s batch is ``[x, y]``);
        - a Hugging Face ``datasets.Dataset``: a batch is one ``ds[indices]``
          read in torch format, a dict of column tensors (with ``collate``,
          that function of the batch's rows, each a dict).

        - for the training split, an iterable dataset (torch's
          ``IterableDataset``, a ``datasets.IterableDataset``): streamed
          (data/streams.py), its own order on every rank, each update's
          samples cut over the ranks, a resume reading the epoch again up to
          its position.

        The map-style ones are wrapped by data/plain.py (:meth:`batch_dataset`):
        their epoch order is a uniform permutation, a pure function of
        (seed, epoch), the same on every rank, resumed exactly mid-epoch.
        Raise ``UserError`` for a split that does not exist."""
        raise NotImplementedError

    #: for a map-style dataset or a ``datasets.Dataset``: None (torch's
    #: ``default_collate``; a datasets.Dataset's columns as they are), or a
    #: method ``collate(self, samples)`` turning a list of samples into a batch
    collate = None

    def batch_dataset(self, split: str):
        """``build_dataset(split)`` as a BatchDataset: what the trainer,
        validation and ``textbox_like.evaluate`` read."""
        from textbox_like.core.errors import UserError
        from textbox_like.data.plain import as_batch_dataset
        source = f"{type(self).__name__}.build_dataset({split!r})"
        data = as_batch_dataset(self.build_dataset(split), self.collate, source=source)
        if getattr(data, "streaming", False) and split != self.cfg.data.train_subset:
            raise UserError(f"{source} returned an iterable dataset: a stream trains (the training split), "
                            f"validation reads its split whole; return a map-style dataset for {split!r}")
        return data

    def collate_to_device(self, batch, device):
        """Move one batch (tensors in a dict, list or tuple, nested) to ``device``."""
        return map_tensors(lambda v: v.to(device, non_blocking=True), batch)

    # -- model ------------------------------------------------------------
    def build_model(self):
        raise NotImplementedError

    def model_conf_defaults(self) -> dict:
        """The values the model takes for the --model_conf keys left out, so
        that a resume compares what the models are, not what was typed."""
        return {}

    def count(self, batch) -> dict:
        """This batch's count for each name in ``denominators``, read from the
        host batch before it moves to the device (no forward), as Python ints:
        summing them over ranks then never waits on the device."""
        return {}

    def loss(self, model, batch):
        """Forward one batch.

        Returns ``(loss_terms, stats)``. ``loss_terms`` is a scalar tensor, the
        SUM over the batch's samples of the per-sample loss, or a dict mapping
        a denominator name (``"nsamples"`` or one of ``denominators``) to the
        SUM of a loss term; the trainer divides each by its total over the
        update. ``stats`` is a dict of scalar tensors that are sums too, so they
        add up across batches and ranks, and holds ``nsamples`` (a Python int:
        the batch's size is known on the host; ``ntokens``, where the task has
        tokens, gives tokens/s in the log)."""
        raise NotImplementedError

    def validation_stats(self, model, batch) -> dict:
        """Sums measured at validation only, besides ``loss``'s stats (e.g.
        ROUGE/BLEU of generated text); they reach ``metrics`` with the others
        and must have the same keys on every rank, for an empty batch too."""
        return {}

    def export_at_end(self, model, save_dir):
        """At the end of a completed run (main process, the trained model
        unwrapped): write it where other tools load it from, and return that
        path; None (the default): the checkpoints are the output."""
        return None

    def metrics(self, sums: dict) -> dict:
        """Turn summed ``stats`` (floats) into the metrics people read."""
        n = max(sums.get("nsamples", 0.0), 1.0)
        return {"loss": sums.get("loss_sum", 0.0) / n}

    def param_groups(self, model, weight_decay: float):
        """Parameter groups for the optimizer; override to exempt parameters
        from weight decay by marking their group ``"no_decay": True``."""
        return [{"params": [p for p in model.parameters() if p.requires_grad],
                 "weight_decay": weight_decay}]
