"""Where a run's records go, as callbacks: the same ``on_log`` a user's
callback overrides (training/callbacks.py calls them).

Each record (the figures of ``--log-interval`` updates, an epoch, a
validation, an event such as a re-split) goes, on rank 0, to metrics.jsonl
(:class:`MetricsFile`, for programs), to Accelerate's trackers
(:class:`TrackerRecords`: TensorBoard, W&B...), and to people
(:class:`ProgressRecords`: a line, a JSON line or the progress bar's
figures). They are the trainer's own: a fault of theirs is the run's (a
full disk under metrics.jsonl stops it with 74, as a checkpoint's would), not
a callback's failure, and the ranks need not agree after them.
"""
from __future__ import annotations

import json
from pathlib import Path

from textbox_like.callbacks import Callback


class RecordCallback(Callback):
    """A trainer's own callback that takes the run's records on rank 0."""

    def close(self):
        """The run ends (or fails): what it holds open is closed."""


class MetricsFile(RecordCallback):
    """metrics.jsonl in the save directory: every record, one JSON line each,
    opened at the first record (a run refused before leaves none)."""

    def __init__(self, path):
        self.path = Path(path)
        self.handle = None

    def on_train_start(self, run):
        """Drop the records of updates after the one this run starts from
        (a resumed run logs them again)."""
        from textbox_like.storage.fileio import atomic_write_text
        if not self.path.exists():
            return
        self.close()
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("update", 0) <= run.update]
        try:
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        except OSError as exc:
            self.handle = open(self.path, "a", buffering=1)
            self.failed(exc)

    def on_log(self, run, kind, record):
        from textbox_like.storage.savelock import check_owner
        check_owner(self.path)  # a process woken after its run was taken over appends nothing
        try:
            if self.handle is None:
                self.handle = open(self.path, "a", buffering=1)
            self.handle.write(json.dumps({"kind": kind, **record}) + "\n")
        except OSError as exc:  # a full disk, a file size limit: a fault like a checkpoint's
            self.failed(exc)

    def failed(self, exc):
        """metrics.jsonl could not be written: one line (SaveFailed, exit 74);
        the file is closed here, so that nothing retries the failed write at exit."""
        from textbox_like.core.faults import SaveFailed, os_reason
        handle, self.handle = self.handle, None
        try:
            handle.close()  # closes the file even when flushing the failed line fails again
        except OSError:
            pass
        raise SaveFailed(f"could not write {self.path} ({os_reason(exc)}); stopping: the checkpoints saved so far "
                         f"are kept; free space, then rerun with --resume") from None

    def close(self):
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class TrackerRecords(RecordCallback):
    """Accelerate's trackers (``--tensorboard-logdir``, ``--wandb-project``...)
    get each record as scalars, at its update."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def on_log(self, run, kind, record):
        from textbox_like.metrics.trackers import scalars
        if self.accelerator.trackers:
            self.accelerator.log(scalars(kind, record), step=record.get("update"))


#: the records people see (an event's own line is printed where it happens)
PROGRESS_KINDS = ("train", "train_epoch", "valid")
#: the figures the progress bar shows beside it
BAR_FIGURES = ("loss", "accuracy", "lr", "gnorm", "samples_per_s")


class ProgressRecords(RecordCallback):
    """The records for people, in ``--log-format``: ``simple`` (a line of
    ``name value`` pairs), ``json`` (a JSON line), ``tqdm`` (the training
    figures beside the progress bar; the others as lines above it)."""

    def __init__(self, logger):
        self.logger = logger   # metrics.meters.Logger: its format, its lines and its bar

    def on_log(self, run, kind, record):
        import sys

        from textbox_like.metrics.meters import formatted
        logger = self.logger
        if not kind.startswith(PROGRESS_KINDS):
            return
        if logger.format == "json":
            print(json.dumps({"kind": kind, **record}), file=sys.stderr, flush=True)
        elif logger.format == "tqdm" and logger.bar is not None and kind == "train":
            logger.bar.set_postfix({k: formatted(v) for k, v in record.items() if k in BAR_FIGURES}, refresh=False)
        else:
            logger.info(f"{kind} | " + " | ".join(f"{k} {formatted(v)}" for k, v in record.items()))


def record_callbacks(logger, accelerator, save_dir) -> list:
    """The trainer's record callbacks on rank 0 (none on the others):
    metrics.jsonl where the run is saved, the trackers where any was asked
    for, the progress where --log-format is not none."""
    if not logger.is_main:
        return []
    built = [MetricsFile(Path(save_dir) / "metrics.jsonl")] if save_dir else []
    if accelerator is not None and accelerator.log_with:   # its trackers start with the run (Lifecycle.start)
        built.append(TrackerRecords(accelerator))
    if logger.format != "none":
        built.append(ProgressRecords(logger))
    return built
