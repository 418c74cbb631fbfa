"""The trainer's old home: it lives in :mod:`textbox_like.training` now (read
:mod:`textbox_like.training.trainer` first). These names stay importable from here."""
from .training.due import crosses
from .training.outcome import batch_size_option, build_trainer, run, train, train_or_stop, trainer_stopped
from .training.reporting import LOG_EVERY_S
from .training.state import LossScalerPart, TrainState
from .training.trainer import Trainer
from .training.validation import valid_batch_size

__all__ = ["LOG_EVERY_S", "LossScalerPart", "TrainState", "Trainer", "batch_size_option", "build_trainer", "crosses",
           "run", "train", "train_or_stop", "trainer_stopped", "valid_batch_size"]
