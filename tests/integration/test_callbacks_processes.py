"""Callbacks on two ranks (issue 48, item 3): a callback from a --user-dir
package, run in a folder outside the repository, sees every update once per
rank, and a stop that rank 1 alone asks for ends both ranks at that update as
a normal end would (exit 0, the same files, the weights of one process over the
same global batches); its on_log gets metrics.jsonl's records on both ranks. In-process behaviour: tests/unit/test_callbacks.py."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import REPO, clean_env, run_main

pytestmark = pytest.mark.slow

CALLBACK = textwrap.dedent("""
    import json, os
    from textbox_like import Callback, register_callback

    @register_callback("stop_when_rank1_says")
    class StopWhenRank1Says(Callback):
        def on_train_start(self, run):
            self.path = os.path.join(run.config.checkpoint.save_dir, f"seen_rank{run.rank}.jsonl")
            self.write({"event": "start", "update": run.update, "world": run.world_size})

        def write(self, record):
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\\n")

        def on_update_end(self, run):
            self.write({"event": "update", "update": run.update})
            if run.rank == 1 and run.update == 5:
                run.request_stop("rank 1 has seen enough")

        def on_checkpoint(self, run, path):
            self.write({"event": "checkpoint", "update": run.update, "name": path.name})

        def on_log(self, run, kind, record):
            self.write({"event": "log", "record": {"kind": kind, **record}})

        def on_train_end(self, run, results):
            self.write({"event": "end", "update": run.update, "reason": results["stop_reason"]})
""")

SETTINGS = ["--task", "mnist", "--optimizer", "sgd", "--lr", "0.05", "--lr-scheduler", "constant",
            "--warmup-updates", "0", "--model_conf", "dropout1=0.0", "--model_conf", "dropout2=0.0",
            "--save-interval-updates", "3", "--max-epoch", "20"]


def test_a_user_dirs_callback_on_two_ranks_sees_every_update_and_one_ranks_stop_ends_both_as_a_normal_end(
        small_mnist_dir, tmp_path):
    import subprocess
    import sys
    package = tmp_path / "outside" / "my_callbacks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(CALLBACK)
    save = tmp_path / "two"
    proc = subprocess.run([sys.executable, str(REPO / "run_hetseq.py"), *SETTINGS, "--data", str(small_mnist_dir),
                           "--max-sentences", "32", "--log-format", "simple", "--distributed-world-size", "2", "--max-update", "40",
                           "--user-dir", "my_callbacks", "--callbacks", "stop_when_rank1_says", "--save-dir", str(save)],
                          cwd=package.parent, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: stopped by a callback on rank 1: rank 1 has seen enough at update 5" in proc.stderr
    for rank in (0, 1):
        seen = [json.loads(line) for line in (save / f"seen_rank{rank}.jsonl").read_text().splitlines()]
        assert seen[0] == {"event": "start", "update": 0, "world": 2}
        assert [r["update"] for r in seen if r["event"] == "update"] == [1, 2, 3, 4, 5]
        assert [(r["update"], r["name"]) for r in seen if r["event"] == "checkpoint"] == \
            [(3, "checkpoint_1_3.pt"), (4, "checkpoint1.pt"), (5, "checkpoint_last.pt")]   # 4: epoch 1's end
        assert seen[-1] == {"event": "end", "update": 5, "reason": "callback on rank 1: rank 1 has seen enough"}
        # every record of metrics.jsonl once: rank 0's as written, rank 1's with the same figures (its clocks
        # and throughput its own)
        logged = [r["record"] for r in seen if r["event"] == "log"]
        written = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        assert [r["update"] for r in logged if r["kind"] == "train"], logged

        def figures(records):
            return [(r["kind"], r["update"], r.get("loss"), r.get("accuracy"), r.get("lr")) for r in records]
        assert (logged if rank == 0 else figures(logged)) == (written if rank == 0 else figures(written)), rank
    results = json.loads((save / "results.json").read_text())
    assert (results["num_updates"], results["stopped"], results["world_size"]) == (5, "completed", 2)

    # a normal end at update 5: one process over the same global batches of 64
    one = tmp_path / "one"
    assert run_main([*SETTINGS, "--data", small_mnist_dir, "--max-sentences", "64", "--log-format", "none", "--max-update", "5",
                     "--save-dir", one]) == 0
    assert sorted(p.name for p in save.glob("checkpoint*")) == sorted(p.name for p in one.glob("checkpoint*"))
    a = torch.load(save / "checkpoint_last.pt", weights_only=True)
    b = torch.load(one / "checkpoint_last.pt", weights_only=True)
    assert a["train"]["num_updates"] == b["train"]["num_updates"] == 5
    for key in b["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], atol=1e-5), key
