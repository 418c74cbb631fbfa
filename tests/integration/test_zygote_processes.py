"""The suite's zygote (tests/_zygote.py) serves a child as an exec'd interpreter would start it: the flavour
its command line asks for (a Hugging Face child from the zygote that imported transformers), and the thread
count of its OMP_NUM_THREADS as torch would have read it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

#: (the name split: a command line that names it goes to the hf zygote)
PROBE = ("import json, os, sys, torch\n"
         "print(json.dumps({'parent': os.getppid(), 'threads': torch.get_num_threads(),\n"
         "                  'preloaded': 'transfor' 'mers.modeling_utils' in sys.modules, 'flavour': sys.argv[1]}))\n")


def probe(flavour, threads):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", PROBE, flavour], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_child_gets_its_flavours_imports_and_its_thread_count(threads, monkeypatch):
    _zygote = pytest.importorskip("_zygote")
    # what an in-process prepare_bert leaves behind: read when used, so every hf child is still served
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert subprocess.Popen is _zygote.ZygotePopen
    torch_side, hf_side = probe("torch", threads), probe("transformers", threads)
    zygotes = {name: server.proc.pid for name, server in _zygote._ZYGOTES.items()}
    assert torch_side["parent"] == zygotes["torch"] and hf_side["parent"] == zygotes["hf"], (zygotes, torch_side,
                                                                                            hf_side)
    assert not torch_side["preloaded"] and hf_side["preloaded"]
    assert torch_side["threads"] == hf_side["threads"] == threads
