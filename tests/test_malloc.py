"""glibc malloc kept from giving each update's freed heap back to the OS
(textbox_like/malloc.py; issue 12: no cost a plain loop does not pay)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from textbox_like.malloc import user_chose_malloc

# Three 12 MB buffers allocated, touched and freed per "update", as a training
# step does with its activations. Prints the page faults of 20 steady updates.
LOOP = """
import resource, sys, torch
from textbox_like.malloc import keep_freed_heap
applied = keep_freed_heap() if sys.argv[1] == "keep" else None
def update():
    bufs = [torch.empty(3 << 20).fill_(1.0) for _ in range(3)]
    del bufs
for _ in range(5):
    update()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    update()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode, **env):
    import os
    done = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    applied, count = done.stdout.split()
    return applied, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_updates_reuse_the_heap_instead_of_faulting_pages_in():
    applied, kept = faults("keep")
    _, default = faults("default")
    assert applied == "True"
    # 20 updates of 36 MB: glibc's default trims and re-faults ~9,000 pages each
    assert default > 20 * 1000, default
    assert kept < 20 * 50, kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_users_malloc_setting_is_left_alone():
    applied, count = faults("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False"
    assert count > 20 * 1000, count  # the user's small threshold still trims


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
