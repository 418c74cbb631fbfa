"""glibc malloc settings for a training process (its host memory).

Each update allocates and frees the same activation buffers. With glibc's
defaults, the freed top of the heap is given back to the OS after an update
when it exceeds the trim threshold (twice the largest chunk freed so far), and
the next update faults the same pages back in, zeroed by the kernel. MNIST at
one thread took ~9,500 page faults per update that way (37 MB of fresh pages)
and trained ~15% slower than with the heap kept. Keeping up to 256 MB of freed
heap (per malloc arena), and serving chunks up to 32 MB from the heap, makes
the steady state fault-free. Only the limits move: memory is still reused, and
larger chunks are still mapped and unmapped one by one.

Under ``--fsdp`` chunks from 1 MB up are mapped and unmapped one by one
instead: every forward and backward gathers a unit's whole parameters and
makes its unsharded gradients (megabytes each), frees them a unit later, and
allocates this rank's new shards among them. Served from the kept heap, those
freed chunks fragment it, and the process held about 1 GiB more than it used
(BERT-large, 2 ranks: 4.97 GiB peak resident per rank, 4.02 with mapped
chunks; DDP's 7.61 moved to 7.43), which is what sharding is chosen to save.
Only where that happens: ``--fsdp`` on CPU with more than one rank. On CUDA
the gathered parameters and gradients live in GPU memory, and one rank shards
nothing; there mapped chunks would only bring the page faults back.

A user's own choice wins: ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``, a ``glibc.malloc`` tunable in
``GLIBC_TUNABLES``, or another allocator in ``LD_PRELOAD`` (jemalloc, tcmalloc,
mimalloc) leaves malloc as it is. Not glibc (macOS, musl): nothing to do.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 256 << 20
# glibc's largest allowed (DEFAULT_MMAP_THRESHOLD_MAX): 32 MB on 64-bit, 16 MB on 32-bit
MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
SHARDED_MMAP_THRESHOLD = 1 << 20  # under --fsdp (the module docstring says why)

_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_chose_malloc(environ=os.environ) -> bool:
    """Whether the environment already says how malloc should behave."""
    if any(name in environ for name in _USER_SETTINGS):
        return True
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(name in environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS)


def mmap_threshold_for(fsdp: bool, world_size: int, cuda: bool) -> int:
    """The mmap threshold for a training process: ``SHARDED_MMAP_THRESHOLD``
    only under --fsdp on CPU with more than one rank (the module docstring
    says why), else ``MMAP_THRESHOLD``."""
    return SHARDED_MMAP_THRESHOLD if fsdp and world_size > 1 and not cuda else MMAP_THRESHOLD


def keep_freed_heap(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Set glibc's trim and mmap thresholds for this process (see the module
    docstring; mmap_threshold_for() chooses the mmap threshold). True when set; False
    where not glibc or the user chose."""
    if not sys.platform.startswith("linux") or user_chose_malloc():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl has no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success. Setting either threshold turns off glibc's
    # own adjustment of both, so the trim threshold is set only when the mmap
    # threshold was accepted
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def give_back_freed_heap() -> bool:
    """Return the heap's free pages to the OS now (glibc's malloc_trim):
    once, after a large one-off structure is freed (the whole model that
    --fsdp builds before keeping only this rank's shard), since the trim
    threshold above keeps up to 256 MB per arena, and chunks of a freed
    model stay scattered below the top of the heap. True where done."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    malloc_trim(0)
    return True
