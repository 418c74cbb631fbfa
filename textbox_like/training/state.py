"""Where the run is (:class:`TrainState`), the small objects two components
share (:class:`Ranks`, :class:`StepRecord`, :class:`SamplesTrained`: built
once by the trainer and given to each component that uses them), and the
objects a checkpoint is made of: each stateful part of the run as a
``state_dict`` / ``load_state_dict`` pair for
:class:`~textbox_like.storage.checkpoint.CheckpointManager`."""
from __future__ import annotations

from textbox_like.core import collectives
from textbox_like.storage.checkpoint import rng_state, set_rng_state
from textbox_like.core.errors import UserError
from textbox_like.metrics.meters import StatSums, TrainClock
from textbox_like.models import adapters
from textbox_like.training.due import crosses


class Ranks:
    """This process among the run's: its rank, the world size, the host
    group of host collectives, whether it is the main one. One object every
    component reads, so that all see the same world."""

    def __init__(self, rank: int, world: int, group, is_main: bool):
        self.rank, self.world, self.group, self.is_main = rank, world, group, is_main


class Reseeding:
    """A fresh RNG stream for this rank at the current update, where a
    checkpoint brings none for it (another world size, one survivor's
    emergency save) or --reset-dataloader starts a new pass."""

    def __init__(self, seed: int, state, ranks, log):
        self.seed, self.state, self.ranks, self.log = seed, state, ranks, log

    def __call__(self, why: str):
        import torch
        torch.manual_seed(self.seed + 7919 * self.state.num_updates + self.ranks.rank)
        self.log.info(f"{why}: reseeding")


class StepRecord:
    """What the update step leaves for the log: the open log window's stats
    (this rank only, summed over its updates), the last gradient norm and
    the learning rate. Written by :class:`~.step.UpdateStep`, read and
    folded by :class:`~.reporting.Reporting`."""

    def __init__(self, lr):
        self.window = StatSums()
        self.gnorm = None
        self.lr = lr


class SamplesTrained:
    """The samples of the updates taken (``TrainState.samples_trained``), and
    kanachan's --snapshot-interval: whether the last update taken crossed a
    multiple of N training samples. Counted by the update step, read by the
    checkpointer's schedule."""

    def __init__(self, state, snapshot_interval: int):
        self.state, self.snapshot_interval = state, snapshot_interval
        self.crossed_snapshot = False

    def count(self, samples_in_update: int):
        """An update taken: its samples, and whether they crossed a snapshot."""
        before = self.state.samples_trained
        self.state.samples_trained += samples_in_update
        self.crossed_snapshot = crosses(before, self.state.samples_trained, self.snapshot_interval)

    def take_back(self, samples_in_update: int):
        """The last update turned out skipped (UpdateStep.settle, one update
        late): its samples are not trained. It crossed no snapshot (an update
        that crosses one is due, so settled at once); an earlier crossing was
        saved when it happened."""
        self.state.samples_trained -= samples_in_update
        self.crossed_snapshot = False

    def new_epoch(self):
        self.crossed_snapshot = False


class TrainState:
    """Where the run is; a checkpoint part like any other."""

    def __init__(self, best_metric: str, maximize: bool):
        self.epoch = 1
        self.num_updates = 0
        self.updates_in_epoch = 0
        self.samples_seen = 0       # summed at log time, for throughput
        self.samples_trained = 0    # counted per update from the batch plan
        self.skipped_updates = 0    # non-finite updates and loss-scaler overflows, skipped
        self.best_metric, self.maximize = best_metric, maximize
        self.best = None            # best value of best_metric so far
        self.last_valid, self.best_valid = {}, {}
        self.validations_since_best = 0   # validations in a row without improvement (--patience)
        self.epoch_sums = StatSums()  # this epoch's training stats, summed over ranks
        self.clock = TrainClock()

    def reset_meters(self):
        self.best, self.last_valid, self.best_valid = None, {}, {}
        self.validations_since_best = 0
        self.epoch_sums.reset()
        self.clock = TrainClock()

    def state_dict(self):
        return {"epoch": self.epoch, "num_updates": self.num_updates, "updates_in_epoch": self.updates_in_epoch,
                "samples_seen": self.samples_seen, "samples_trained": self.samples_trained, "skipped_updates": self.skipped_updates, "best": self.best, "best_metric": self.best_metric,
                "maximize": self.maximize, "last_valid": self.last_valid, "best_valid": self.best_valid,
                "validations_since_best": self.validations_since_best,
                "epoch_sums": self.epoch_sums.state_dict(), "clock": self.clock.state_dict()}

    def load_state_dict(self, state):
        self.epoch, self.num_updates = int(state["epoch"]), int(state["num_updates"])
        self.updates_in_epoch, self.samples_seen = int(state["updates_in_epoch"]), int(state["samples_seen"])
        self.skipped_updates, self.samples_trained = int(state["skipped_updates"]), int(state["samples_trained"])
        self.last_valid = dict(state["last_valid"])
        self.epoch_sums.load_state_dict(state["epoch_sums"])
        self.clock.load_state_dict(state["clock"])
        # the best so far only means something for the same metric and direction
        if (state["best_metric"], state["maximize"]) == (self.best_metric, self.maximize):
            self.best, self.best_valid = state["best"], dict(state["best_valid"])
            self.validations_since_best = int(state.get("validations_since_best", 0))  # older checkpoints: 0


class ModelPart:
    """The model as a checkpoint part: the weights of the module the task
    built, under DDP's and torch.compile's wrappers (the same keys compiled
    or not). That module itself, not ``accelerator.unwrap_model``: Accelerate
    asks ``hasattr(torch, "_dynamo")``, which imports torch._dynamo, 1 s of
    CPU at every process's first save where nothing was compiled."""

    def __init__(self, task_model, trained_only=False):
        self.task_model = task_model
        #: --peft: only the weights that train are saved and restored
        self.trained_only = trained_only

    def module(self):
        return self.task_model

    def state_dict(self):
        return adapters.trained_state(self.module()) if self.trained_only else self.module().state_dict()

    def load_state_dict(self, state):
        if self.trained_only:
            adapters.load_trained_state(self.module(), state, "the checkpoint")
        else:
            self.module().load_state_dict(state)


class BaseModelPart:
    """--peft: the base model the adapters belong to (its path and a digest
    of its frozen weights), checked on resume: adapters restored onto
    another base model would train on silently from nonsense."""

    def __init__(self, identity: dict):
        self.identity = identity

    def state_dict(self):
        return dict(self.identity)

    def load_state_dict(self, state):
        adapters.check_same_base(state, self.identity, "the checkpoint")


class OptimizerPart:
    """The optimizer as a checkpoint part, named so that another optimizer's
    state is refused rather than misread."""

    def __init__(self, optimizer, name: str, saved: bool):
        self.optimizer, self.name, self.saved = optimizer, name, saved

    def state_dict(self):
        return {**self.optimizer.state_dict(), "name": self.name} if self.saved else None

    def load_state_dict(self, state):
        state = dict(state)
        name = state.pop("name")
        if name != self.name:
            raise UserError(f"the checkpoint holds {name} state, this run uses {self.name}; "
                            f"pass --reset-optimizer to start {self.name} afresh")
        self.optimizer.load_state_dict(state)


class LossScalerPart:
    """The loss scaler (fp16 on CUDA) as a checkpoint part; None where there is none."""
    def __init__(self, accelerator):
        self.scaler = accelerator.scaler

    def state_dict(self):
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state):
        # None: saved without a scaler (a CPU leg of a GPU's --fp16 run runs
        # bf16); this scaler then starts from its initial scale
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


class RNGPart:
    """Every rank's RNG streams (python, numpy, torch, CUDA); gathers over ranks."""

    def __init__(self, accelerator, reseed, host_group):
        self.accelerator, self.reseed, self.host_group = accelerator, reseed, host_group

    def state_dict(self):
        return collectives.one_per_rank(rng_state(), self.accelerator.num_processes, self.host_group)

    def load_state_dict(self, states):
        if len(states) == self.accelerator.num_processes and all(s is not None for s in states):
            set_rng_state(states[self.accelerator.process_index])
        elif len(states) == self.accelerator.num_processes:  # an emergency checkpoint: its writer's stream only
            self.reseed("the checkpoint was saved by one survivor of a lost peer and holds its RNG state only")
        else:
            self.reseed(f"the checkpoint has RNG states for {len(states)} rank(s), this run has "
                        f"{self.accelerator.num_processes}")
