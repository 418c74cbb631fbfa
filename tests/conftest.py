"""Shared fixtures: tiny learnable MNIST idx files, a private cache, helpers to
run the trainer in-process and as a subprocess.

The suite needs neither the internet nor /work/shared.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

# before torch (and numpy) first load OpenMP: its threads sleep when they wait instead of spinning. Two xdist
# workers each start processes sized for the whole machine (a run's threads are the cores divided among its own
# ranks), so the cores are oversubscribed and a spinning thread burns the time slice its peer needs: two
# 2-thread MNIST loops side by side took 16.6 s each spinning, 6.0 s passive (docs/testing.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
# the two tiers' folders: a test module imports the helpers of another (test_fsdp's, test_hf_task's fixtures)
# whichever folder it is in and whichever files pytest was given
for _tier in ("unit", "integration"):
    if str(TESTS / _tier) not in sys.path:
        sys.path.insert(0, str(TESTS / _tier))
N_TRAIN, N_TEST = 512, 200
N_SMALL_TRAIN, N_SMALL_TEST = 256, 50

# keep the whole session away from ~/.cache (set before any test imports the package)
_CACHE = None


def pytest_configure(config):
    global _CACHE
    import tempfile
    _CACHE = tempfile.mkdtemp(prefix="textbox_like_cache_")
    os.environ["TEXTBOX_LIKE_CACHE"] = _CACHE
    # the Hugging Face datasets cache (the tokenised data's default place): the session's, not ~/.cache
    os.environ["HF_DATASETS_CACHE"] = os.path.join(_CACHE, "hf_datasets")
    os.environ["TEXTBOX_LIKE_CURVES"] = "0"   # no curves.png per run (~1 s each); test_trackers draws one
    # every process a test starts prints its Python threads' stacks if it dies of SIGSEGV/SIGABRT: a rare
    # crash at a two-rank run's teardown (gloo; "terminate called without an active exception") left no stack
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    # the suite's processes (hundreds) share compiled bytecode: where PYTHONDONTWRITEBYTECODE is set, each would
    # compile textbox_like's modules again (0.3 s of CPU a process) and each pytest process rewrite every test
    # module (4 s); the files go to __pycache__ folders, which git ignores
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # torch's first import runs ldconfig (ctypes.util.find_library, for CUDA's libraries): done here, before any
    # test, so that a fast-tier test that is the first to import torch is not taken for one starting a process
    import torch  # noqa: F401
    # likewise platform.processor() runs `uname -p` once and caches it: h5py's first import asks it
    import platform
    platform.processor()
    # torch._dynamo's import (a run's, a launcher's prepare_forks) publishes TORCHINDUCTOR_CACHE_DIR in
    # os.environ; published mid-session it made every later child's environment differ from the zygote's, and
    # the zygote refused them all (a whole slow tier started its Python processes by exec): set once, here
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    # the Python processes tests start are forks of a process that imported torch once (tests/_zygote.py;
    # a suite copied without it, as test_tiers copies this file, starts them as before)
    try:
        import _zygote
    except ImportError:
        return
    _zygote.install()


def pytest_collection_modifyitems(config, items):
    """The tiers are the folders: every test of tests/integration is slow (a CUDA test starts the trainer
    as a user would: it is there too), and a test of tests/unit marked slow belongs in tests/integration."""
    misplaced = []
    for item in items:
        tier = Path(str(item.fspath)).resolve().parent.name
        if tier == "integration" and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        elif tier == "unit" and (item.get_closest_marker("slow") or item.get_closest_marker("cuda")):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("tests marked slow in tests/unit (the fast tier): move them to tests/integration: "
                                + ", ".join(misplaced))


@pytest.fixture(autouse=True)
def _fresh_interpreters(request, monkeypatch):
    """A test marked ``fresh_interpreter`` starts its Python processes by exec, not from the zygote
    (tests/_zygote.py): it tests what a fresh interpreter imports or how the OS sees it started."""
    if request.node.get_closest_marker("fresh_interpreter"):
        monkeypatch.setenv("TEXTBOX_LIKE_TEST_ZYGOTE", "0")


class StartsAProcess(AssertionError):
    """A test of the fast tier started a process."""


def _refuse_to_start(what, attempts):
    def refused(*args, **kwargs):
        attempts.append(what)
        raise StartsAProcess(f"this test starts a process ({what}): the fast tier (tests/unit) starts none; "
                             f"move the test to tests/integration")
    return refused


@contextlib.contextmanager
def no_process_started(item):
    """While a test without the ``slow`` marker (one of tests/unit) is set up,
    runs and is torn down, whatever would start a process (subprocess,
    multiprocessing spawn and fork, os.fork, os.posix_spawn) raises
    StartsAProcess instead, and the phase fails even where the code under
    test caught it: the marker, which tests/integration gives its tests, is
    what selects the tiers (-m "not slow"), and this keeps it true."""
    if item.get_closest_marker("slow"):
        yield []
        return
    import _posixsubprocess
    attempts = []
    saved = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "posix_spawn"),
             (os, "posix_spawnp")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, _refuse_to_start(f"{owner.__name__}.{name}", attempts))
    try:
        yield attempts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item):
    with no_process_started(item) as attempts:
        outcome = yield
    if attempts and outcome.excinfo is None:
        outcome.force_exception(StartsAProcess(f"this test tried to start a process ({attempts[0]}) and went on: "
                                               f"move it to tests/integration"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _guarded(item)


def pytest_unconfigure(config):
    import shutil
    if "_zygote" in sys.modules:
        sys.modules["_zygote"].uninstall()
    if _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


# ---------------------------------------------------------------- data
def write_idx(path: Path, array: np.ndarray, gz: bool = True):
    array = np.ascontiguousarray(array, dtype=np.uint8)
    magic = 0x00000800 | array.ndim  # 0x803 images (N,28,28), 0x801 labels (N,)
    header = struct.pack(">i", magic) + struct.pack(">" + "i" * array.ndim, *array.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as handle:
        handle.write(header + array.tobytes())


# 10 blob positions on a 28x28 canvas, one per class
_POSITIONS = [(r, c) for r in (2, 11, 20) for c in (2, 11, 20)] + [(11, 6)]


def make_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Class-dependent bright 6x6 blob on weak noise: easy to learn."""
    n = len(labels)
    images = rng.integers(0, 40, size=(n, 28, 28)).astype(np.uint8)
    for i, label in enumerate(labels):
        r, c = _POSITIONS[int(label)]
        r += int(rng.integers(-1, 2))
        c += int(rng.integers(-1, 2))
        images[i, r:r + 6, c:c + 6] = rng.integers(200, 256, size=(6, 6))
    return images


def make_split(n: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) % 10).astype(np.uint8)
    rng.shuffle(labels)
    return make_images(labels, rng), labels


NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def write_mnist(directory: Path, n_train=N_TRAIN, n_test=N_TEST, gz=True, seed=0):
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"train": make_split(n_train, seed), "test": make_split(n_test, seed + 1)}
    suffix = ".gz" if gz else ""
    for split, (images, labels) in arrays.items():
        write_idx(directory / (NAMES[split][0] + suffix), images, gz)
        write_idx(directory / (NAMES[split][1] + suffix), labels, gz)
    return arrays


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """512 train / 200 test samples, gzip idx files, flat."""
    directory = tmp_path_factory.mktemp("mnist")
    write_mnist(directory)
    return directory


@pytest.fixture(scope="session")
def small_mnist_dir(tmp_path_factory):
    """256 train / 50 test samples: for tests of the loop, not of learning."""
    directory = tmp_path_factory.mktemp("mnist_small")
    write_mnist(directory, n_train=N_SMALL_TRAIN, n_test=N_SMALL_TEST, seed=10)
    return directory


def small_mnist_fixture(name, seed):
    """A module-scoped fixture: a tiny MNIST of its own (``seed``) in a
    directory named ``name``, for a test module to bind as its ``data``."""
    @pytest.fixture(scope="module")
    def data(tmp_path_factory):
        directory = tmp_path_factory.mktemp(name)
        write_mnist(directory, n_train=N_SMALL_TRAIN, n_test=N_SMALL_TEST, seed=seed)
        return directory
    return data


@pytest.fixture(scope="session")
def mnist_arrays(mnist_dir):
    """The same arrays the mnist_dir fixture wrote (regenerated: deterministic)."""
    return {"train": make_split(N_TRAIN, 0), "test": make_split(N_TEST, 1)}


# ---------------------------------------------------------------- running
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TEXTBOX_LIKE_INIT_METHOD", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


#: what the trainer publishes, as the session found it (a test's own changes are undone at its end)
_SESSION_RANK_VARS = {key: os.environ.get(key) for key in _RANK_VARS}


@pytest.fixture(autouse=True)
def _restore_environ():
    """The trainer publishes RANK/WORLD_SIZE etc. in os.environ; undo that per test. A module fixture's run
    published them before this test began (so not undone at its end): put back as the session began, or its
    OMP_NUM_THREADS would make the zygote start every later child by exec."""
    for key, value in _SESSION_RANK_VARS.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    before = dict(os.environ)
    yield
    for key in list(os.environ):
        if key not in before:
            del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def free_port():
    """A port no one listens on, chosen BELOW the kernel's ephemeral range. A port the kernel hands out
    for bind(0) is one it hands out again as the local end of any outgoing connection, and a gloo
    mesh of a run beside makes hundreds: a CI run lost that race (EADDRINUSE at the rendezvous)."""
    import random
    import socket
    try:
        lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lowest_ephemeral = 32768
    choose = random.SystemRandom()
    for _ in range(200):
        port = choose.randrange(max(1024, lowest_ephemeral - 2700), lowest_ephemeral)  # above torch's 29400, 29500
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {lowest_ephemeral}")


def _reset_accelerate():
    try:
        from accelerate.state import AcceleratorState, GradientState, PartialState
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()
    except Exception:
        pass


def base_args(data, save_dir, *extra, max_update=4):
    args = ["--task", "mnist", "--data", str(data), "--max-sentences", "32",
            "--log-format", "none", "--max-update", str(max_update), "--save-dir", str(save_dir)]
    return args + [str(a) for a in extra]


def run_main(args):
    """Run the CLI in-process; returns the exit code."""
    import torch

    from textbox_like.cli import main
    _reset_accelerate()
    threads = torch.get_num_threads()   # --threads (or its default) is the run's, not the session's
    try:
        return main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
        _reset_accelerate()


def refusal_in_process(args, capfd):
    """main() in-process with its output captured, as a CompletedProcess
    (returncode, stdout, stderr) like run_cli's: for a refusal, which a whole
    process would reach only after ~3.5 s of imports."""
    capfd.readouterr()
    code = run_main(args)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([str(a) for a in args], code, out, err)


#: the end of a script that ran as a rank of a process group: it leaves as the trainer's ranks do
#: (textbox_like.cli.leave), output flushed, without the interpreter's teardown, which now and then
#: aborts (SIGABRT, exit -6) while it destroys gloo's threads: the project's CI saw it on a script
#: that had printed every verdict
RANK_LEAVES = """
import os as _os, sys as _sys
_sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)
"""


#: a script that runs the trainer's main() for each argv of the JSON list in argv[1] in turn, in one process
#: (one process's imports instead of one per run), each run's stderr between its own marks: split_runs
RUNS_IN_ONE_PROCESS = f'''
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from conftest import run_main   # main() with Accelerate's state reset before and after
for i, args in enumerate(json.loads(sys.argv[1])):
    print(f"--- run {{i}}", file=sys.stderr, flush=True)
    code = run_main(args)
    print(f"--- exit {{i}} {{0 if code is None else code}}", file=sys.stderr, flush=True)
'''


def split_runs(stderr, count):
    """[(exit code, its own stderr)] of each of the ``count`` runs of a RUNS_IN_ONE_PROCESS script."""
    results = []
    for i in range(count):
        err, rest = stderr.split(f"--- run {i}\n", 1)[1].split(f"--- exit {i} ", 1)
        results.append((int(rest.split("\n", 1)[0]), err))
    return results


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(args, timeout=300, module=None, cwd=None, env=None):
    """Run run_hetseq.py (or ``python -m module``) in a subprocess from the repo root."""
    cmd = [sys.executable] + (["-m", module] if module else ["run_hetseq.py"]) + [str(a) for a in args]
    return subprocess.run(cmd, cwd=cwd or REPO, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def copy_of(run_dir, tmp_path):
    """A copy of a finished run to resume or rerun (the run itself stays as it
    ended, for the next test that starts from it)."""
    import shutil
    return Path(shutil.copytree(run_dir, tmp_path / Path(run_dir).name))


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture
def run():
    return run_main


@pytest.fixture
def cli():
    return run_cli


def assert_bitwise_equal(a, b, where="state"):
    """Nested dicts/lists/tensors equal bit for bit, naming the first difference."""
    import torch
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
