"""How a run ends when it does not complete: one place that turns an
exception into (save or not, the one line, the exit code). Entry points:
:func:`train` (cli.py) and :func:`run`."""
from __future__ import annotations

import sys

from textbox_like.processes import distributed
from textbox_like.core.errors import UserError
from textbox_like.core.faults import (
    DataUnavailable,
    OutOfMemory,
    RunStopped,
    Superseded,
    allocation_failed,
    allocation_reason)
from textbox_like.training.elastic import peer_lost
from textbox_like.training.trainer import Trainer


def batch_size_option(cfg, batch_size) -> str:
    """The option that sets the batch an allocation failed for, and its value."""
    data = cfg.data
    if data.global_batch_size:
        return f"--max-sentences (each micro-batch; now {data.max_sentences or data.global_batch_size}) " \
               f"or --global-batch-size (now {data.global_batch_size})"
    if data.max_tokens:
        return f"--max-tokens (now {data.max_tokens})"
    return f"--max-sentences (now {batch_size})"


def build_trainer(cfg, callbacks=()):
    """A Trainer (``callbacks``: instances given from Python); an allocation
    failing while the data and the model are built is one line (2)."""
    try:
        return Trainer(cfg, callbacks)
    except Exception as exc:
        if isinstance(exc, (UserError, RunStopped)) or not allocation_failed(exc):
            raise
        message = (f"out of memory while loading the data and building the model ({allocation_reason(exc)}); "
                   f"lower {batch_size_option(cfg, cfg.data.max_sentences)}, or use a smaller model")
    raise UserError(message)  # outside the handler: the failed allocation's frames are released


def train(cfg, callbacks=()) -> int:
    return run(build_trainer(cfg, callbacks))


def run(trainer) -> int:
    """Train; a fault ends as one line and its exit code, a lost peer as an
    emergency checkpoint and 75 (elastic.py), or, once the run's end has
    begun, as one warning and the run's own exit code."""
    try:
        return train_or_stop(trainer)
    except Exception as exc:
        if isinstance(exc, RunStopped) or not (trainer.preemption.started and distributed.lost_peer(exc)):
            return trainer_stopped(trainer, exc)
        if trainer.lifecycle.finishing is not None:
            return trainer.lifecycle.lost_peer_at_end(exc)
        return peer_lost(trainer, exc)
    finally:
        trainer.preemption.hand_back_interrupt()
        trainer.hand_back_environment()
        trainer.lifecycle.release_save_dir()
        close = getattr(getattr(trainer, "train_data", None), "close", None)
        if close is not None:  # a stream's tokenising worker processes
            close()


def train_or_stop(trainer) -> int:
    """trainer.train(); an allocation failing in it is a RunStopped (or, at the first update, a UserError)."""
    try:
        return trainer.train()
    except Exception as exc:
        if isinstance(exc, (UserError, RunStopped)) or not allocation_failed(exc):
            raise
        stop = out_of_memory(trainer, exc)
        exc.__traceback__ = None  # its frames hold the failed update's tensors
    raise stop


def out_of_memory(trainer, exc) -> RunStopped | UserError:
    """What an allocation that failed in the loop means: before the first
    update of this run, a batch too large (2); later, a stop (71) that
    saves the last completed update's state, where one process holds it
    all and the optimizer's step was not interrupted."""
    state, flight = trainer.state, trainer.in_flight
    reason = allocation_reason(exc)
    update = state.num_updates + 1
    batch = batch_size_option(trainer.cfg, trainer.global_batch.batch_sizes[trainer.rank])
    if trainer.lifecycle.updates_at_start in (None, state.num_updates):
        return UserError(f"out of memory at the first update ({reason}); lower {batch}")
    where = f"at update {update}" if flight.offset is not None else f"after update {update - 1}"
    stop = OutOfMemory(f"out of memory {where} on rank {trainer.rank} ({reason})")
    stop.saves_state = trainer.world == 1 and not flight.stepping
    if stop.saves_state:
        stop.after_save = f"; saved the state after update {update - 1}: rerun with --resume and a lower {batch}"
    else:
        last = trainer.checkpointer.checkpoints.newest_good()
        why = "the optimizer step was interrupted" if flight.stepping else "the other ranks are mid-update"
        stop.after_save = (f"; not saved ({why}); lower {batch} and rerun"
                           + (f" with --resume from {last}" if last else ""))
    return stop


def save_on_fault(trainer, exc):
    """The state before the update that failed, saved on the way out
    (a data file that failed, an allocation)."""
    if isinstance(exc, OutOfMemory):
        import gc
        gc.collect()  # the failed update's activations, held by reference cycles
        if trainer.in_flight.offset is not None:  # failed within an update (not validating or saving after one)
            trainer.iterator.offset = trainer.in_flight.offset  # redone from its start after --resume
        trainer.optimizer.zero_grad(set_to_none=True)
        if trainer.accelerator.device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
    elif isinstance(exc, DataUnavailable):
        # the position kept in the checkpoint: a retry failing at the same
        # place is known for damage at rest (DataCorrupt, exit 65)
        trainer.checkpointer.checkpoints.metadata["data_failure"] = trainer.feed.data_position()
    trainer.save(end_of_epoch=False, is_best=False, final=True)  # the last update settled first


def trainer_stopped(trainer, exc) -> int:
    """A fault the trainer knows (RunStopped): one line and its exit code;
    anything else is re-raised, and so is Superseded: a process that no
    longer owns its run does nothing more (cli.exit_code)."""
    if not isinstance(exc, RunStopped) or isinstance(exc, Superseded):
        raise exc
    message = str(exc)
    if getattr(exc, "saves_state", isinstance(exc, DataUnavailable)):
        # a data failure rewound the position to the failing update's
        # start: saved, a rerun with --resume (a requeue) continues
        # without skipping a sample
        try:
            save_on_fault(trainer, exc)
            message += getattr(exc, "after_save", "; saved the state before it: rerun with --resume once "
                                                  "the data is back")
        except RunStopped as stop:  # the save found divergence, or could not write
            exc, message = stop, str(stop)
        except Exception as again:
            if not allocation_failed(again):
                raise
            message += f"; saving failed too ({allocation_reason(again)})"
    else:
        message += getattr(exc, "after_save", "")
    # every rank stops together here, so leaving the group is safe (see cli.run)
    distributed.cleanup()
    print(f"error: {message}", file=sys.stderr)
    return exc.exit_code
