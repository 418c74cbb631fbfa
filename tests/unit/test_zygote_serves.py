"""The suite's zygote (tests/_zygote.py) keeps serving the Python processes tests start after what a run
imports in a pytest process: torch._dynamo published TORCHINDUCTOR_CACHE_DIR in os.environ, after which every
child's environment differed from the zygote's and the slow tier started them all by exec."""
import os
import subprocess
import sys

import pytest

_zygote = pytest.importorskip("_zygote")


def request(env=None):
    return _zygote.request_for([sys.executable, "-c", "pass"], None, False, None, (), None, env, None, None, None, -1,
                               True, False, None)


def test_a_child_is_served_after_torch_dynamo_was_imported():
    import torch._dynamo  # noqa: F401  (what a run's launcher imports)
    assert subprocess.Popen is _zygote.ZygotePopen
    base = _zygote.zygote_env()
    changed = {key: (base.get(key), os.environ.get(key)) for key in set(base) | set(os.environ)
               if key.startswith(_zygote.UNSAFE_PREFIXES) and base.get(key) != os.environ.get(key)}
    assert request() is not None, f"the zygote would refuse this process's children: {changed}"


def test_a_child_whose_environment_changes_what_torch_read_at_import_is_started_by_exec():
    assert request({**os.environ, "OMP_NUM_THREADS": "7"}) is None
