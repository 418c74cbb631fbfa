"""glibc malloc kept from giving each update's freed heap back to the OS
(textbox_like/parallel/malloc.py; issue 12: no cost a plain loop does not pay)."""
from __future__ import annotations

import pytest

from textbox_like.parallel.malloc import user_chose_malloc


@pytest.mark.parametrize("env, chose", [
    ({}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, True),
    ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, False),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, True),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, True),
    ({"LD_PRELOAD": "/opt/libsomething.so"}, False),
])
def test_user_chose_malloc(env, chose):
    assert user_chose_malloc(env) is chose


@pytest.mark.parametrize("fsdp, world_size, cuda, sharded", [
    (True, 2, False, True), (True, 1, False, False), (True, 2, True, False), (False, 2, False, False)])
def test_freed_megabyte_chunks_are_unmapped_only_for_fsdp_on_cpu_ranks(fsdp, world_size, cuda, sharded):
    from textbox_like.parallel.malloc import MMAP_THRESHOLD, SHARDED_MMAP_THRESHOLD, mmap_threshold_for
    assert mmap_threshold_for(fsdp, world_size, cuda) == (SHARDED_MMAP_THRESHOLD if sharded else MMAP_THRESHOLD)
