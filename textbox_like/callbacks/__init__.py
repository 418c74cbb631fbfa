"""The public callback contract: :class:`Callback`, what a user subclasses,
and the registry that ``--callbacks NAME`` reads (``@register_callback``).
How the trainer calls them, and what ``run`` is: training/callbacks.py."""
from __future__ import annotations

from textbox_like.config.registry import Registry


class Callback:
    """Subclass and override what you need; each method runs on every rank."""

    def on_train_start(self, run) -> None:
        """Once the run is built and restored, before its first update."""

    def on_update_end(self, run) -> None:
        """After each update that moved the weights (``run.update`` is its number)."""

    def on_validation_end(self, run, metrics: dict) -> None:
        """After each validation: ``metrics`` of the first --valid-subset, summed over every rank."""

    def on_log(self, run, kind: str, record: dict) -> None:
        """At each record the run writes to metrics.jsonl, on every rank: ``kind`` is ``train`` (every
        --log-interval updates), ``train_epoch``, ``valid`` (``valid_<subset>`` with several) or an event
        (``balance``: a re-split); ``record`` its figures (``update``, ``loss``, ``lr``...), summed over the
        ranks (clocks and throughput, ``wall``, ``samples_per_s``..., are each rank's own)."""

    def on_checkpoint(self, run, path) -> None:
        """After each checkpoint is written (``path``: its file, or a --fsdp run's .dcp directory)."""

    def on_train_end(self, run, results: dict) -> None:
        """At the run's end, with what results.json holds."""


CALLBACKS = Registry("callback", base=Callback, base_name="textbox_like.Callback")


def register_callback(name, *aliases):
    """``@register_callback("name")``: a Callback class that ``--callbacks name`` selects."""
    return CALLBACKS.register(name, *aliases)
