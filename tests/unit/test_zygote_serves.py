"""The suite's zygote (tests/_zygote.py) keeps serving the Python processes tests start after what a run
imports in a pytest process: torch._dynamo published TORCHINDUCTOR_CACHE_DIR in os.environ, after which every
child's environment differed from the zygote's and the slow tier started them all by exec."""
import os
import subprocess
import sys

import pytest

_zygote = pytest.importorskip("_zygote")


def request(env=None, args=("-c", "pass")):
    return _zygote.request_for([sys.executable, *args], None, False, None, (), None, env, None, None, None, -1,
                               True, False, None)


def test_a_child_is_served_after_torch_dynamo_was_imported():
    import torch._dynamo  # noqa: F401  (what a run's launcher imports)
    assert subprocess.Popen is _zygote.ZygotePopen
    base = _zygote.zygote_env()
    changed = {key: (base.get(key), os.environ.get(key)) for key in set(base) | set(os.environ)
               if key.startswith(_zygote.UNSAFE_PREFIXES) and base.get(key) != os.environ.get(key)}
    assert request() is not None, f"the zygote would refuse this process's children: {changed}"


def test_a_child_whose_environment_changes_what_torch_read_at_import_is_started_by_exec():
    assert request({**os.environ, "MALLOC_ARENA_MAX": "7"}) is None
    assert request({**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1"}) is None


def test_a_thread_count_is_served_as_the_count_torch_set_num_threads_gives_the_child():
    assert request({**os.environ, "OMP_NUM_THREADS": "1"})["threads"] == 1
    assert request({**os.environ, "OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"})["threads"] == 3
    for unlike in ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "0"},
                   {"OMP_NUM_THREADS": "two"}):
        assert request({**os.environ, **unlike}) is None, unlike


def test_a_hugging_face_child_goes_to_the_hf_zygote_and_is_exec_d_where_it_changes_what_hf_read_at_import():
    hf = ("run_hetseq.py", "--task", "hf", "--model_name_or_path", "/m")
    assert request(args=hf)["flavour"] == "hf"
    assert request(args=("-m", "textbox_like", "train", "--peft", "lora"))["flavour"] == "hf"
    assert request(args=("run_hetseq.py", "--task", "mnist", "--save-dir", "/tmp/hf_home"))["flavour"] == "torch"
    cache = {**os.environ, "HF_HUB_CACHE": "/elsewhere"}
    assert request(cache, args=hf) is None
    assert request(cache, args=("run_hetseq.py", "--task", "mnist"))["flavour"] == "torch"
    read_when_used = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert request(read_when_used, args=hf)["flavour"] == "hf"
