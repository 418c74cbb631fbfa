"""The tests of test_malloc.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest


# Three 12 MB buffers allocated, touched and freed per "update", as a training
# step does with its activations (torch's CPU allocator is malloc underneath).
# Raw malloc, so that no other allocation lands on top of the heap by chance
# and glibc's default trims on every update. Prints the page faults of 20
# steady updates.
LOOP = """
import ctypes, resource, sys
from textbox_like.parallel.malloc import keep_freed_heap
applied = keep_freed_heap() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = 12 << 20
def update():
    buffers = [libc.malloc(SIZE) for _ in range(3)]
    for b in buffers:
        ctypes.memset(b, 1, SIZE)
    for b in reversed(buffers):
        libc.free(b)
for _ in range(5):
    update()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    update()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode, **env):
    import os
    # the child starts with no malloc choice, even where the CI image preloads an allocator
    mine = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, timeout=120,
                          env={**mine, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    applied, count = done.stdout.split()
    return applied, int(count)

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_updates_reuse_the_heap_instead_of_faulting_pages_in():
    applied, kept = faults("keep")
    _, default = faults("default")
    assert applied == "True"
    # 20 updates of 36 MB: glibc's default trims and faults them back in each
    # time (~9,000 faults per update with 4 KB pages, far fewer with
    # transparent huge pages); kept, the steady state faults nothing
    assert kept < 20 * 50, kept
    assert default >= 10 * max(kept, 1), (default, kept)


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_a_users_malloc_setting_is_left_alone():
    applied, count = faults("keep", MALLOC_TRIM_THRESHOLD_="131072")
    _, kept = faults("keep")
    assert applied == "False"
    assert count >= 10 * max(kept, 1), (count, kept)  # the user's small threshold still trims

# 64 MB of 1 MB chunks freed under a small live chunk (as a model's weights
# freed under what was allocated after them): kept, the pages stay resident;
# give_back_freed_heap returns them. Prints resident MB after the free and after.
TRIM = """
import ctypes, os
from textbox_like.parallel.malloc import keep_freed_heap, give_back_freed_heap
assert keep_freed_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
chunks = [libc.malloc(1 << 20) for _ in range(64)]
for c in chunks:
    ctypes.memset(c, 1, 1 << 20)
pin = libc.malloc(4096)
for c in chunks:
    libc.free(c)
freed = resident_mb()
print(give_back_freed_heap(), freed, resident_mb())
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim")
def test_give_back_freed_heap_returns_a_freed_model_to_the_os():
    done = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in __import__("os").environ.items()
                               if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")})
    assert done.returncode == 0, done.stderr[-2000:]
    applied, freed, after = done.stdout.split()
    assert applied == "True"
    assert float(freed) - float(after) > 48, (freed, after)  # most of the 64 MB

# A training run in this process, then a 4 MB chunk allocated, touched and
# freed: prints how many MB of it went back to the OS on the free.
AFTER_A_RUN = """
import ctypes, os, sys
import textbox_like
textbox_like.train({"task": "mnist", "data": sys.argv[1], "save_dir": sys.argv[2], "max_update": 1,
                    "max_sentences": 16, "disable_validation": True, "fsdp": sys.argv[3] == "fsdp"})
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
chunk = libc.malloc(4 << 20)
ctypes.memset(chunk, 1, 4 << 20)
before = resident_mb()
libc.free(chunk)
print("returned", before - resident_mb())
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
@pytest.mark.timeout(300)
def test_under_fsdp_the_trainer_gives_freed_megabyte_chunks_back(tmp_path):
    """--fsdp's gathered parameters and unsharded gradients (MBs each, freed
    unit by unit) are unmapped when freed instead of fragmenting the kept
    heap: in each rank process of a 2-rank --fsdp run (started as torchrun
    would, the probe running in the rank). Where nothing is sharded (one
    process under --fsdp) and without --fsdp a freed 4 MB chunk stays for the
    next update."""
    from conftest import REPO, clean_env, free_port, write_mnist
    write_mnist(tmp_path / "mnist", n_train=64, n_test=16)
    env = {k: v for k, v in clean_env().items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    returned = {}
    for mode in ("fsdp", "ddp"):
        done = subprocess.run([sys.executable, "-c", AFTER_A_RUN, str(tmp_path / "mnist"), str(tmp_path / mode), mode],
                              cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        returned[mode] = float(done.stdout.split("returned")[-1])
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", AFTER_A_RUN, str(tmp_path / "mnist"), str(tmp_path / "two"),
                               "fsdp"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    returned["fsdp two ranks"] = [float(out.split("returned")[-1]) for out, _ in outputs]
    assert returned["fsdp"] < 0.5 and returned["ddp"] < 0.5, returned
    assert min(returned["fsdp two ranks"]) > 3.5, returned
