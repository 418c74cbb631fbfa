"""The trainer's old home: it lives in :mod:`textbox_like.train` now (read
:mod:`textbox_like.train.trainer` first). These names stay importable from here."""
from .train.due import crosses
from .train.outcome import batch_size_option, build_trainer, run, train, train_or_stop, trainer_stopped
from .train.reporting import LOG_EVERY_S
from .train.state import LossScalerPart, TrainState
from .train.trainer import Trainer
from .train.validation import valid_batch_size

__all__ = ["LOG_EVERY_S", "LossScalerPart", "TrainState", "Trainer", "batch_size_option", "build_trainer", "crosses",
           "run", "train", "train_or_stop", "trainer_stopped", "valid_batch_size"]
