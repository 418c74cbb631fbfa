"""The tests of test_hf_cache.py (tests/unit) that start processes: the slow tier.

A run killed (SIGKILL) while it tokenised leaves datasets' partial file
(tmpXXXXXXXX, as large as what was written) in the cache: the next run that
tokenises there removes it, with a line, once it has not been written to for
an hour (a run tokenising now writes as it goes)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import REPO, clean_env, refusal_in_process
from test_hf_task import write_long_text_data, write_model


def test_a_partial_file_of_a_run_killed_while_tokenising_is_removed_by_the_next(tmp_path, capfd):
    model = write_model(tmp_path / "model", "sequence_classification")
    data = write_long_text_data(tmp_path / "data")
    args = ["--task", "hf", "--model_name_or_path", model, "--data", data, "--max-sentences", 4, "--max-update", 1,
            "--log-format", "none", "--cpu", "--cache-dir", data / ".hf_cache"]
    cache = data / ".hf_cache"
    # --num-workers 1: tokenised in the process itself (a pool's workers outlive a killed parent and finish)
    killed = subprocess.Popen([sys.executable, "run_hetseq.py", *map(str, args), "--num-workers", "1",
                               "--save-dir", str(tmp_path / "a")],
                              cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not [p for p in cache.glob("tmp*") if p.stat().st_size > 0] and killed.poll() is None:
        assert time.monotonic() < deadline, "no partial file appeared"
        time.sleep(0.05)
    assert killed.poll() is None, killed.communicate()[1][-3000:]   # still tokenising
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    left = list(cache.glob("tmp*"))
    assert left and not list(cache.glob("tokenized-*.arrow")), sorted(p.name for p in cache.iterdir())
    an_hour_ago = time.time() - 3700
    for path in left:
        os.utime(path, (an_hour_ago, an_hour_ago))
    size = sum(p.stat().st_size for p in left) / 2 ** 20
    out = refusal_in_process([*args, "--num-workers", 0, "--save-dir", tmp_path / "b", "--train-subset", "valid"],
                             capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "partial tokenised file" in line]
    assert said == [f"note: removed {len(left)} partial tokenised file(s) of a run killed while tokenising "
                    f"({size:.1f} MiB in {cache}: {', '.join(p.name for p in left)})"], out.stderr[-3000:]
    assert not list(cache.glob("tmp*"))
