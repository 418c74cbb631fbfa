"""Batch plans and the resumable epoch iterator (textbox_like/data/iterators.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from textbox_like.data.base import BatchDataset
from textbox_like.data.iterators import EpochBatchIterator, plan_fixed


class Toy(BatchDataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def get_batch(self, indices):
        return np.array(indices, dtype=np.int64)


def slices(bounds):
    """Per step, per rank: the (start, end) offsets."""
    return [[(int(row[r]), int(row[r + 1])) for r in range(bounds.shape[1] - 1)] for row in bounds]


# ---------------------------------------------------------------- plan_fixed
@pytest.mark.parametrize("n", [0, 1, 7, 63, 64, 65, 100, 512, 1001])
@pytest.mark.parametrize("sizes", [[32], [16, 16], [32, 8], [5, 13, 7], [64, 1, 3, 9]])
@pytest.mark.parametrize("multiple", [1, 4])
def test_plan_fixed_uses_every_sample_once(n, sizes, multiple):
    bounds = plan_fixed(n, sizes, multiple)
    assert bounds.shape[1] == len(sizes) + 1
    used = []
    for row in slices(bounds):
        for r, (a, b) in enumerate(row):
            assert 0 <= a <= b <= n
            assert b - a <= sizes[r], (row, sizes)
            used.extend(range(a, b))
    assert sorted(used) == list(range(n))
    assert len(used) == n  # no sample twice
    # contiguous: rank r+1 starts where rank r ended, step s+1 where step s ended
    flat = bounds.reshape(-1)
    if len(bounds):
        assert all(bounds[s + 1, 0] == bounds[s, -1] for s in range(len(bounds) - 1))
        assert bounds[0, 0] == 0 and bounds[-1, -1] == n
    # full steps are full
    for row in slices(bounds)[:-1]:
        assert [b - a for a, b in row] == list(sizes)
    assert len(flat) >= 0


def test_plan_fixed_partial_last_step_split():
    bounds = plan_fixed(100, [32, 16])  # 2 full steps of 48, then 4 left
    assert len(bounds) == 3
    last = [b - a for a, b in slices(bounds)[-1]]
    assert sum(last) == 4 and all(x >= 0 for x in last)


def test_plan_fixed_required_multiple_in_full_steps():
    bounds = plan_fixed(1000, [24, 16], multiple=8)
    for row in slices(bounds)[:-1]:
        assert all((b - a) % 8 == 0 for a, b in row)


# ---------------------------------------------------------------- iterator
def run_epoch(it, limit=None):
    out = []
    for batch, count in itertools.islice(iter(it), limit):
        out.append((batch.tolist(), count))
    return out


def all_ranks(n, seed, epoch, batch_sizes, shuffle=True, offset=0, num_workers=0):
    """Per step, the concatenation over ranks (rank order), and per-rank lists."""
    world = len(batch_sizes)
    per_rank = []
    for rank in range(world):
        it = EpochBatchIterator(Toy(n), seed, rank, world, batch_sizes, shuffle=shuffle,
                                num_workers=num_workers)
        it.set_epoch(epoch, offset)
        per_rank.append(run_epoch(it))
    steps = len(per_rank[0])
    assert all(len(p) == steps for p in per_rank)
    merged = []
    for s in range(steps):
        counts = {p[s][1] for p in per_rank}
        assert len(counts) == 1  # every rank knows the update's global sample count
        step = list(itertools.chain.from_iterable(p[s][0] for p in per_rank))
        assert counts.pop() == len(step)
        merged.append(step)
    return merged, per_rank


@pytest.mark.parametrize("batch_sizes", [[32], [16, 16], [20, 7], [5, 9, 3]])
def test_epoch_covers_order_exactly(batch_sizes):
    n = 203
    merged, _ = all_ranks(n, seed=3, epoch=2, batch_sizes=batch_sizes)
    flat = list(itertools.chain.from_iterable(merged))
    assert flat == Toy(n).epoch_order(3, 2).tolist()
    assert sorted(flat) == list(range(n))


def test_order_is_pure_function_of_seed_and_epoch():
    a = run_epoch(_it(seed=1, epoch=1))
    b = run_epoch(_it(seed=1, epoch=1))
    assert a == b
    assert a != run_epoch(_it(seed=1, epoch=2))
    assert a != run_epoch(_it(seed=2, epoch=1))
    # visiting other epochs first changes nothing
    it = _it(seed=1, epoch=3)
    run_epoch(it)
    it.set_epoch(1)
    assert run_epoch(it) == a


def test_order_independent_of_batch_size_and_world():
    one, _ = all_ranks(150, 4, 1, [32])
    two, _ = all_ranks(150, 4, 1, [10, 6])
    assert list(itertools.chain.from_iterable(one)) == list(itertools.chain.from_iterable(two))


def test_no_shuffle_is_data_order():
    merged, _ = all_ranks(70, 9, 5, [16], shuffle=False)
    assert list(itertools.chain.from_iterable(merged)) == list(range(70))


def _it(n=100, seed=1, epoch=1, rank=0, batch_sizes=(16,), num_workers=0, shuffle=True, multiple=1):
    it = EpochBatchIterator(Toy(n), seed, rank, len(batch_sizes), list(batch_sizes), shuffle=shuffle,
                            num_workers=num_workers, multiple=multiple)
    it.set_epoch(epoch)
    return it


def test_len_and_end_of_epoch():
    it = _it(n=100, batch_sizes=(16,))
    assert len(it) == 7 and it.steps_in_epoch() == 7
    assert not it.end_of_epoch
    consumed = run_epoch(it, 3)
    assert len(consumed) == 3
    assert len(it) == 4 and it.steps_in_epoch() == 7
    run_epoch(it)
    assert it.end_of_epoch


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k", [0, 1, 3, 6, 7])
def test_state_dict_resumes_with_exactly_the_rest(num_workers, k):
    n = 100
    full = run_epoch(_it(n=n, epoch=2))
    it = _it(n=n, epoch=2, num_workers=num_workers)
    head = run_epoch(it, k)
    state = it.state_dict()
    fresh = EpochBatchIterator(Toy(n), 1, 0, 1, [16], num_workers=num_workers)
    fresh.load_state_dict(state)
    tail = run_epoch(fresh)
    assert head + tail == full
    if k == len(full):
        assert fresh.end_of_epoch or tail == []


@pytest.mark.parametrize("new_sizes", [[16], [8, 8], [20, 3, 7], [50]])
def test_resume_with_other_world_size_or_batch_sizes(new_sizes):
    n, seed, epoch = 211, 5, 3
    old_sizes = [12, 20]
    order = Toy(n).epoch_order(seed, epoch).tolist()
    # two old ranks consume 3 steps in lock step
    its = [EpochBatchIterator(Toy(n), seed, r, 2, old_sizes) for r in range(2)]
    consumed = []
    for it in its:
        it.set_epoch(epoch)
        consumed.extend(itertools.chain.from_iterable(b for b, _ in run_epoch(it, 3)))
    states = [it.state_dict() for it in its]
    assert states[0]["offset"] == states[1]["offset"] == len(consumed)
    remaining_expected = [i for i in order if i not in set(consumed)]
    # reload on a new world
    world = len(new_sizes)
    remaining = []
    per_rank_steps = []
    for rank in range(world):
        it = EpochBatchIterator(Toy(n), seed, rank, world, new_sizes)
        it.load_state_dict(states[0])
        per_rank_steps.append([b for b, _ in run_epoch(it)])
    for s in range(len(per_rank_steps[0])):
        for rank in range(world):
            remaining.extend(per_rank_steps[rank][s])
    assert sorted(remaining) == sorted(remaining_expected)
    assert len(remaining) == len(remaining_expected)
    assert remaining == remaining_expected  # and in the epoch's order
    assert sorted(consumed + remaining) == list(range(n))


def test_load_state_rejects_other_dataset_or_seed():
    from textbox_like.core.errors import UserError
    it = _it(n=100)
    run_epoch(it, 2)
    state = it.state_dict()
    with pytest.raises(UserError):
        EpochBatchIterator(Toy(99), 1, 0, 1, [16]).load_state_dict(state)
    with pytest.raises(UserError):
        EpochBatchIterator(Toy(100), 2, 0, 1, [16]).load_state_dict(state)


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_prefetch_yields_the_same_batches(num_workers):
    for sizes, rank in (([16], 0), ([10, 6], 1)):
        a = run_epoch(_it(n=157, epoch=4, batch_sizes=sizes, rank=rank))
        b = run_epoch(_it(n=157, epoch=4, batch_sizes=sizes, rank=rank, num_workers=num_workers))
        assert a == b


def test_prefetch_offset_counts_only_handed_out_batches():
    it = _it(n=160, batch_sizes=(16,), num_workers=2)
    gen = iter(it)
    next(gen)
    next(gen)
    import time
    time.sleep(0.05)  # the reader thread runs ahead
    assert it.offset == 32
    gen.close()
    assert it.state_dict()["offset"] == 32


def test_required_batch_size_multiple_in_iterator():
    batches = [b for b, _ in run_epoch(_it(n=100, batch_sizes=(30,), multiple=8))]
    assert sum(len(b) for b in batches) == 100
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(100))


def test_mnist_batches_by_max_sentences(mnist_dir):
    """--max-sentences (alias --batch-size) sets the trainer's batches."""
    from textbox_like.data.mnist import MNISTDataset, load_split
    data = MNISTDataset(*load_split(mnist_dir, "train"))
    it = EpochBatchIterator(data, 1, 0, 1, [48])
    it.set_epoch(1)
    sizes = [len(batch["target"]) for batch, _ in it]
    assert sizes == [48] * (512 // 48) + [512 % 48]


class OnDisk(Toy):
    reads_from_disk = True


@pytest.mark.parametrize("dataset, pinned, expected", [
    (Toy(8), False, 0),      # in memory, CPU: nothing to overlap, the thread only takes cores
    (OnDisk(8), False, 2),   # reads from files as it goes
    (Toy(8), True, 2),       # pins each batch for a CUDA copy
])
def test_read_ahead_only_where_it_has_work_to_overlap(dataset, pinned, expected):
    from textbox_like.data.iterators import read_ahead_workers
    assert read_ahead_workers(2, dataset, pinned) == expected
    assert read_ahead_workers(0, dataset, pinned) == 0


def test_mnist_batches_are_a_gather_of_the_images(mnist_dir):
    """MNIST's get_batch (a numpy gather, so a read-ahead thread starts no
    OpenMP team of its own) returns exactly the indexed rows."""
    import torch

    from textbox_like.data.mnist import MNISTDataset, load_split
    data = MNISTDataset(*load_split(mnist_dir, "train"))
    indices = np.array([5, 0, 511, 5, 17], dtype=np.int64)
    batch = data.get_batch(indices)
    assert torch.equal(batch["image"], data.images[torch.from_numpy(indices)])
    assert torch.equal(batch["target"], data.labels[torch.from_numpy(indices)])
    assert batch["image"].is_contiguous() and batch["image"].shape == (5, 1, 28, 28)
    assert data.get_batch(np.zeros(0, dtype=np.int64))["image"].shape == (0, 1, 28, 28)
