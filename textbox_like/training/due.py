"""When a periodic event is due: the schedule arithmetic every component's
own check uses, and :class:`EveryUpdates`, the shape of a periodic event
that needs nothing but a trainer (register one with
:meth:`~textbox_like.training.trainer.Trainer.add_event`)."""
from __future__ import annotations


def every(update: int, interval: int) -> bool:
    """True on every ``interval``-th update (0: never)."""
    return interval > 0 and update % interval == 0


def crosses(before: int, after: int, interval: int) -> bool:
    """A count going from ``before`` to ``after`` passes a multiple of ``interval`` (0: never)."""
    return interval > 0 and after // interval > before // interval


class EveryUpdates:
    """A periodic event every ``interval`` updates: :meth:`should_run` is
    its own check, asked after each update (and by the update step, which
    reads the gradient norm at once when anything is due), and ``run`` is
    what it does, given the trainer. Subclass and override ``run``."""

    def __init__(self, interval: int):
        self.interval = interval

    def should_run(self, update: int) -> bool:
        return every(update, self.interval)

    def due(self, update: int) -> bool:
        """The trainer's one question to everything that can be due after an
        update (Trainer.due_after_update): this event's own check."""
        return self.should_run(update)

    def run(self, trainer) -> None:
        raise NotImplementedError
