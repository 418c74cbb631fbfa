"""The hot loop on CPU, as CUDA would see it (issue 14, items 2 and 3).

1. A fake loss scaler that skips every third optimizer step: skipped steps move
   neither the update count, ``--max-update`` nor the LR schedule, and are
   counted (``state.skipped_updates``).
2. Per update, the trainer's own code (``textbox_like.*`` frames: the trainer,
   the task's loss and collate, the meters, the batch generator) calls no
   ``Tensor.item()`` and creates no tensor from a Python value (``torch.tensor``,
   ``as_tensor``, ``zeros``, ``ones``, ``full``, ``empty``, ``Tensor.new_*``):
   on CUDA each would be a host sync or a blocking host-to-device copy.
   Calls made by torch itself (e.g. Adam reading its CPU step counter) are not
   the trainer's and are counted apart.
"""
from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch

from conftest import _reset_accelerate, write_mnist


@pytest.fixture(scope="module")
def data30(tmp_path_factory):
    """240 training samples: exactly 30 batches of 8."""
    directory = tmp_path_factory.mktemp("mnist_hot")
    write_mnist(directory, n_train=240, n_test=20, seed=3)
    return directory


def build_trainer(argv):
    from textbox_like.processes import distributed
    from textbox_like.resolve.checks import check
    from textbox_like.resolve.resolution import parse
    from textbox_like.training.trainer import Trainer
    _reset_accelerate()
    ns = parse([str(a) for a in argv])
    check(ns)
    assert distributed.placement_from_env(ns) is None and distributed.local_plan(ns) is None
    return Trainer(ns)


def args(data, out, *extra):
    return ["--task", "mnist", "--data", str(data), "--max-sentences", "8", "--save-dir", str(out),
            "--threads", "1", "--log-format", "none", "--report_to", "none", "--no-save", "--disable-validation",
            "--num-workers", "0", *map(str, extra)]


def run(trainer):
    """trainer.train(), which must succeed; returns what it wrote to stderr."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = trainer.train()
    finally:
        _reset_accelerate()
    assert rc == 0, err.getvalue()[-3000:]
    return err.getvalue()


# ------------------------------------------------------------ fake scaler
class FakeScaler:
    """Stands for torch's GradScaler at scale 1 (what Accelerate calls on it)."""

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def state_dict(self):
        return {"scale": 1.0}

    def load_state_dict(self, state):
        pass


def test_scaler_skips_move_neither_updates_nor_schedule(data30, tmp_path, monkeypatch):
    # --max-epoch 1 over 30 batches: the run sees exactly 30 iterations
    trainer = build_trainer(args(data30, tmp_path / "out", "--max-epoch", "1", "--max-update", "0",
                                 "--log-interval", "5", "--lr", "0.003", "--warmup-updates", "100",
                                 "--clip-norm", "0"))
    acc = trainer.accelerator
    assert trainer.iterator.steps_in_epoch() == 30
    acc.scaler = FakeScaler()
    optimizer = trainer.optimizer
    real_step = optimizer.step
    calls = {"n": 0, "skipped": False}

    def step(*a, **k):  # as GradScaler.step does on overflow: no optimizer step at all
        calls["n"] += 1
        calls["skipped"] = calls["n"] % 3 == 0
        if not calls["skipped"]:
            return real_step(*a, **k)

    optimizer.step = step
    monkeypatch.setattr(type(acc), "optimizer_step_was_skipped", property(lambda self: calls["skipped"]))
    lrs_seen = []
    real_train_step = trainer.train_step

    def train_step(micro_batches, totals):
        stepped = real_train_step(micro_batches, totals)
        lrs_seen.append((stepped, trainer.state.num_updates, trainer.scheduler.num_updates,
                         optimizer.param_groups[0]["lr"]))
        return stepped

    trainer.train_step = train_step
    run(trainer)
    assert calls["n"] == 30 and len(lrs_seen) == 30
    state = trainer.state
    assert state.num_updates == 20
    assert state.skipped_updates == 10
    assert trainer.scheduler.num_updates == 20
    assert trainer.scheduler.get_lr() == pytest.approx(trainer.scheduler.lr_at(20))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.003 * 20 / 100)  # warm-up: lr * 20 / 100
    # a skipped step leaves the count and the LR where they were
    for i, (stepped, updates, sched_updates, lr) in enumerate(lrs_seen):
        assert stepped == ((i + 1) % 3 != 0), i
        assert updates == sched_updates == (i + 1) - (i + 1) // 3
        assert lr == pytest.approx(0.003 * updates / 100)


def test_scaler_skips_do_not_count_toward_max_update(data30, tmp_path, monkeypatch):
    """--max-update 12 with every third step skipped: 18 iterations, 12 updates."""
    trainer = build_trainer(args(data30, tmp_path / "out", "--max-update", "12", "--log-interval", "0"))
    acc = trainer.accelerator
    acc.scaler = FakeScaler()
    real_step = trainer.optimizer.step
    calls = {"n": 0, "skipped": False}

    def step(*a, **k):
        calls["n"] += 1
        calls["skipped"] = calls["n"] % 3 == 0
        if not calls["skipped"]:
            return real_step(*a, **k)

    trainer.optimizer.step = step
    monkeypatch.setattr(type(acc), "optimizer_step_was_skipped", property(lambda self: calls["skipped"]))
    run(trainer)
    assert trainer.state.num_updates == 12
    assert calls["n"] == 17  # updates 1..12 need 17 calls (3, 6, ..., 15 skipped)
    assert trainer.state.skipped_updates == 5
    assert trainer.scheduler.num_updates == 12


# --------------------------------------------------------- calls per update
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "full", "empty")
METHODS = ("item", "new_tensor", "new_zeros", "new_ones", "new_full", "new_empty")
SYNCS = ("__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")


class Counter:
    """Counts calls of patched torch functions while ``active``, split by
    whether the immediate caller is this project's code."""

    def __init__(self):
        self.active = False
        self.ours, self.theirs = {}, {}

    def wrap(self, name, real):
        counter = self

        def wrapper(*a, **k):
            if counter.active:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                where = counter.ours if caller.startswith("textbox_like") else counter.theirs
                key = name if not caller.startswith("textbox_like") else f"{name} ({caller}:{sys._getframe(1).f_lineno})"
                where[key] = where.get(key, 0) + 1
            return real(*a, **k)
        return wrapper

    def take(self):
        out = (dict(self.ours), dict(self.theirs))
        self.ours, self.theirs = {}, {}
        return out


def count_per_update(data, out, monkeypatch, names_on_tensor, updates=20):
    trainer = build_trainer(args(data, out, "--max-update", str(updates), "--log-interval", "0",
                                 "--validate-interval-updates", "0", "--save-interval-updates", "0"))
    counter = Counter()
    if names_on_tensor is METHODS:
        for name in FACTORIES:
            monkeypatch.setattr(torch, name, counter.wrap(f"torch.{name}", getattr(torch, name)))
    for name in names_on_tensor:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))

    per_update = []
    real_step = trainer.train_step

    def train_step(micro_batches, totals):
        counter.active = True
        try:
            return real_step(micro_batches, totals)
        finally:
            counter.active = False
            per_update.append(counter.take())  # this update: its batch's generator step + its train_step

    real_updates = trainer.updates_of_this_epoch

    def updates_of_this_epoch():
        it = real_updates()
        while True:
            counter.active = True
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                counter.active = False
            yield item

    trainer.train_step = train_step
    trainer.updates_of_this_epoch = updates_of_this_epoch
    run(trainer)
    monkeypatch.undo()
    assert trainer.state.num_updates == updates and len(per_update) == updates
    return per_update


def test_no_item_and_no_tensor_from_python_values_per_update(data30, tmp_path, monkeypatch):
    per_update = count_per_update(data30, tmp_path / "out", monkeypatch, METHODS)
    # the first updates may set up optimizer state; from the third on: the steady state
    steady = per_update[2:]
    # the counter sees calls: torch's Adam reads its CPU step counters with .item() every update
    assert all(t.get("Tensor.item", 0) > 0 for _, t in steady), steady[:2]
    ours = [o for o, _ in steady]
    assert all(not o for o in ours), [o for o in ours if o][:3]
    # torch's own factory calls (not .item() on Adam's CPU step counter) do not grow per update either
    theirs_factories = [{k: v for k, v in t.items() if k.startswith("torch.")} for _, t in steady]
    assert all(t == theirs_factories[0] for t in theirs_factories), theirs_factories[:3]




# ------------------------------------------------------------ read-ahead
@pytest.mark.parametrize("on_disk", [False, True])
def test_num_workers_reads_ahead_only_for_data_read_from_disk(data30, tmp_path, monkeypatch, on_disk):
    """On CPU, data already in memory (MNIST) is read inline whatever
    --num-workers says: a read-ahead thread has nothing to overlap and only
    competes with training's threads for the cores (issue 12: --num-workers 2
    must not be slower than 0). Data read from disk is read ahead."""
    from textbox_like.data.iterators import EpochBatchIterator
    from textbox_like.data.mnist import MNISTDataset
    monkeypatch.setattr(MNISTDataset, "reads_from_disk", on_disk)
    real = EpochBatchIterator._prefetched
    threads = []

    def prefetched(self, steps):
        threads.append(self.num_workers)
        return real(self, steps)

    monkeypatch.setattr(EpochBatchIterator, "_prefetched", prefetched)
    argv = args(data30, tmp_path, "--max-update", "3")
    argv[argv.index("--num-workers") + 1] = "2"
    argv[argv.index("--log-format") + 1] = "simple"
    trainer = build_trainer(argv)
    log = run(trainer)
    assert trainer.state.num_updates == 3
    assert trainer.iterator.num_workers == (2 if on_disk else 0)
    assert threads == ([2] if on_disk else [])
    assert ("in memory: read inline, --num-workers not needed" in log) == (not on_disk)


def test_the_trainer_keeps_freed_heap_before_loading_data(data30, tmp_path, monkeypatch):
    """The malloc setting (textbox_like/parallel/malloc.py) is made in every training
    process, before the data and the model are allocated."""
    from textbox_like.parallel import malloc
    from textbox_like.tasks import mnist as mnist_task
    order = []
    monkeypatch.setattr(malloc, "keep_freed_heap", lambda *threshold: order.append("malloc") or True)
    real_build = mnist_task.MNISTTask.build_dataset
    monkeypatch.setattr(mnist_task.MNISTTask, "build_dataset",
                        lambda self, split: order.append("data") or real_build(self, split))
    build_trainer(args(data30, tmp_path, "--max-update", "1"))
    _reset_accelerate()
    assert order[0] == "malloc" and order.count("malloc") == 1 and "data" in order
