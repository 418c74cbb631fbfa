"""The ranks' host-side agreements, one helper per idiom: "did any rank
fail", "one value per rank" and "rank 0's value", over the host (CPU) group
so that no device stream waits for them. Imports nothing of ours: any module
may use it."""
from __future__ import annotations


def host_sum(numbers, group=None) -> list:
    """``numbers`` summed over the ranks, in float64 on the host (one
    all-reduce over ``group``, the default group when None)."""
    import torch
    import torch.distributed as dist
    values = torch.tensor(numbers, dtype=torch.float64)  # host memory, on purpose
    dist.all_reduce(values, group=group)
    return values.tolist()


def any_rank_failed(failed: bool, world: int, group=None, sums=()) -> tuple[bool, list]:
    """Whether any rank failed, and ``sums`` (numbers) summed over the ranks
    in the same all-reduce; on one rank, this rank's own answer and numbers."""
    if world == 1:
        return bool(failed), list(sums)
    *summed, failures = host_sum(list(sums) + [float(bool(failed))], group)
    return bool(failures), summed


def one_per_rank(value, world: int, group=None) -> list:
    """``value`` (any picklable) of every rank, in rank order: one
    all_gather over ``group`` (the host group: no device copy)."""
    if world == 1:
        return [value]
    import torch.distributed as dist
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def from_rank0(value, world: int, group=None):
    """Rank 0's (of ``group``) ``value`` (any picklable) on every rank: one
    broadcast over ``group``."""
    if world == 1:
        return value
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
