"""Callbacks: the public way to hook into a run (as transformers'
``TrainerCallback`` and Lightning's ``Callback``), and the trainer's own
early stopping through the same mechanism.

A callback is a :class:`Callback` subclass whose methods are called on every
rank with a :class:`Run` (what the run is at: update, epoch, rank, world size,
the last validation's metrics) and may ask the run to stop with
:meth:`Run.request_stop`. The ranks agree after each call point (one small
all-reduce, only where callbacks are given), so a stop asked on any rank ends
every rank at that same update, with the normal end's validation, checkpoint,
results.json and exit code; a callback that raises ends the run on every rank
with one line naming it, after saving the last completed update (exit 70).

Given by name with ``--callbacks NAME[,NAME]`` (classes registered with
``@register_callback("name")`` in a ``--user-dir`` package or an entry point;
the names go into config.yaml) or, from Python, as instances:
``textbox_like.train(config, callbacks=[MyCallback()])``.
"""
from __future__ import annotations

from textbox_like.core import collectives
from textbox_like.callbacks import CALLBACKS, Callback
from textbox_like.core.errors import UserError
from textbox_like.core.faults import RunStopped


class CallbackFailed(RunStopped):
    """A callback raised: every rank saves the last completed update and stops."""
    exit_code = 70  # EX_SOFTWARE
    saves_state = True

    def __init__(self, message, update):
        super().__init__(message)
        self.after_save = f"; saved update {update}: fix the callback and rerun with --resume"


class Run:
    """What a callback sees of the run, read live, and the one thing it may do: ask it to stop."""

    def __init__(self, state, rank: int, world_size: int, cfg):
        self._state = state
        self.rank, self.world_size, self.config = rank, world_size, cfg
        self._requested = None

    @property
    def update(self) -> int:
        return self._state.num_updates

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def metrics(self) -> dict | None:
        """The last validation's metrics (of the first --valid-subset), or None before one."""
        return self._state.last_valid

    @property
    def best(self) -> dict | None:
        """The best validation's metrics so far (by --best-checkpoint-metric)."""
        return self._state.best_valid

    @property
    def validations_since_best(self) -> int:
        return self._state.validations_since_best

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """End the run at this update on every rank, as a normal end: validated, saved, exit 0."""
        if self._requested is None:
            self._requested = str(reason)


class EarlyStopping(Callback):
    """fairseq's --patience: stop after N validations in a row without a better
    --best-checkpoint-metric. Added by the trainer where --patience > 0."""
    builtin_reason = "patience"

    def __init__(self, patience: int):
        self.patience = patience

    def exhausted(self, run) -> bool:
        return run.validations_since_best >= self.patience

    def on_train_start(self, run):
        if self.exhausted(run):  # a resumed run whose patience had already run out
            run.request_stop(self.builtin_reason)

    def on_validation_end(self, run, metrics):
        if self.exhausted(run):
            run.request_stop(self.builtin_reason)


def callback_name(callback) -> str:
    return type(callback).__name__


def from_names(names) -> list:
    """Instances of the registered callback classes ``names`` (--callbacks)."""
    return [CALLBACKS.get(name)() for name in names]


class Callbacks:
    """The run's callbacks, called at their points, and the ranks' agreement
    after each call: whether any asked to stop (``stop_reason``) or raised.
    ``records``: the trainer's own record callbacks (callbacks/records.py:
    metrics.jsonl, the trackers, the progress), called first, on rank 0,
    without agreement: a fault of theirs is the run's own."""

    def __init__(self, callbacks, state, rank: int, world: int, group, cfg, records=()):
        self.callbacks = list(callbacks)
        self.records = list(records)
        self.run = Run(state, rank, world, cfg)
        self.world, self.group, self.rank = world, group, rank
        self.stop_reason = None   # agreed by every rank: the run ends at this update
        self._failure = None
        self.failed = False       # one raised: none is called again (not by the save on the way out)

    def overriding(self, hook) -> list:
        """The callbacks whose class overrides ``hook``: only they are called, and
        where none does, the ranks need not agree there."""
        return [c for c in self.callbacks if getattr(type(c), hook) is not getattr(Callback, hook)]

    @property
    def every_update(self) -> bool:
        """Whether a callback acts after every update (the update step then settles its count at once)."""
        return bool(self.overriding("on_update_end"))

    def due(self, update: int) -> bool:
        """After an update: where a callback acts after every update (its count is settled first)."""
        return self.every_update

    def _call(self, hook, *args):
        called = self.overriding(hook)
        if not called or self.failed:
            return
        for callback in called:
            try:
                getattr(callback, hook)(self.run, *args)
            except Exception as exc:
                if self._failure is None:
                    detail = str(exc).splitlines()[0] if str(exc) else ""
                    self._failure = (f"callback {callback_name(callback)}.{hook} raised {type(exc).__name__}"
                                     f"{': ' + detail if detail else ''} on rank {self.rank} at update "
                                     f"{self.run.update}")
                break
        self._agree()

    def _agree(self):
        """One all-reduce of (stop asked, raised) over the ranks; the reasons
        only where one is set (a second, rare collective)."""
        if not self.callbacks:
            return
        asked, failure = self.run._requested, self._failure
        flagged, _ = collectives.any_rank_failed(asked is not None or failure is not None, self.world, self.group)
        if not flagged:
            return
        reports = collectives.one_per_rank((asked, failure), self.world, self.group)
        failures = [f for _, f in reports if f is not None]
        if failures:
            self.failed = True
            raise CallbackFailed(failures[0], self.run.update)
        if self.stop_reason is None:
            rank, reason = next((r, a) for r, (a, _) in enumerate(reports) if a is not None)
            self.stop_reason = reason if reason == EarlyStopping.builtin_reason else f"callback on rank {rank}: {reason}"

    def train_start(self):
        for callback in self.records:
            callback.on_train_start(self.run)
        self._call("on_train_start")

    def log(self, kind, record):
        """A record of the run, on every rank at the same point (metrics.meters.Logger's log and event)."""
        for callback in self.records:
            callback.on_log(self.run, kind, record)
        self._call("on_log", kind, record)

    def close(self):
        for callback in self.records:
            callback.close()

    def update_end(self):
        self._call("on_update_end")

    def validation_end(self, metrics):
        self._call("on_validation_end", metrics)

    def checkpoint_saved(self, path):
        self._call("on_checkpoint", path)

    def train_end(self, results):
        self._call("on_train_end", results)


def run_callbacks(cfg, given=()) -> list:
    """The run's callbacks: --patience's early stopping, then --callbacks' by
    name, then instances given from Python; a name not registered is one line."""
    built = [EarlyStopping(cfg.validation.patience)] if cfg.validation.patience > 0 else []
    built += from_names(cfg.callbacks.callbacks)
    for callback in given:
        if not isinstance(callback, Callback):
            raise UserError(f"callbacks=[...]: {callback!r} is not a textbox_like.Callback; subclass it")
        built.append(callback)
    return built
