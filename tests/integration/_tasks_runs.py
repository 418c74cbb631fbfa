"""Helpers of the "tasks" group of the slow tier (test_hf_task_processes, test_balance_processes, ...):
ranks started directly, several runs of several ranks each in one set of rank processes.

A run of ``--distributed-world-size N`` is a parent (``run_hetseq.py``: its imports, torch's among them,
~3 CPU-s, to start N children and wait) and N ranks, each started with the variables the trainer's spawn
gives it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, TEXTBOX_LIKE_INIT_METHOD, a fresh
``file://`` rendezvous, TEXTBOX_LIKE_SPAWNED). :func:`rank_runs` starts the ranks that way, without the
parent, as torchrun or ``accelerate launch`` would, and one set of rank processes runs a whole list of such
runs in turn (the trainer's main() each time, with Accelerate's state reset before and after it, as
``textbox_like.train`` runs one after another): each rank process pays its imports once for all the runs
of a test file instead of once per run. Each run's output is told apart by marker lines, as conftest's
RUNS_IN_ONE_PROCESS does for runs of one process.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from conftest import REPO, TESTS, clean_env

#: one rank of every run of a list: argv[1] its rank, argv[2] the list (a JSON file). A step is a run
#: ({"argv", "env", "world"}: processes of a rank >= world sit it out) or a copy of a finished run's
#: folder ({"copy": [from, to]}: rank 0 copies it, the others wait until it is there)
RANK_RUNS = f'''
import json, os, shutil, sys, time, traceback
sys.path.insert(0, {str(TESTS)!r})
from conftest import run_main
rank = int(sys.argv[1])
for i, step in enumerate(json.load(open(sys.argv[2]))):
    if "copy" in step:
        source, target = step["copy"]
        if rank == 0:
            shutil.copytree(source, target + ".part")
            os.rename(target + ".part", target)
        else:
            deadline = time.monotonic() + 300
            while not os.path.exists(target):
                assert time.monotonic() < deadline, "rank 0 never copied " + source
                time.sleep(0.05)
        continue
    if rank >= step["world"]:
        continue
    env = {{**step["env"], "RANK": str(rank), "WORLD_SIZE": str(step["world"]), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(step["world"]), "MASTER_ADDR": "127.0.0.1", "TEXTBOX_LIKE_SPAWNED": "1",
           "TEXTBOX_LIKE_INIT_METHOD": "file://" + step["rendezvous"]}}
    before = dict(os.environ)   # the run's variables, and what the trainer publishes there, gone after it
    os.environ.update(env)
    print(f"--- run {{i}}", file=sys.stderr, flush=True)
    try:
        code = run_main(step["argv"])
    except BaseException:
        traceback.print_exc()   # what the process would have died of; the others would wait for it: end
        print(f"--- exit {{i}} 1", file=sys.stderr, flush=True)
        sys.stdout.flush(); sys.stderr.flush(); os._exit(1)
    print(f"--- exit {{i}} {{0 if code is None else code}}", file=sys.stderr, flush=True)
    os.environ.clear()
    os.environ.update(before)
# as a rank leaves (cli.leave): output flushed, without the interpreter's teardown of gloo's threads
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
'''


@dataclass
class Run:
    """A run of ``world`` ranks: the trainer's arguments and the variables it adds to the processes'."""
    argv: list
    env: dict = field(default_factory=dict)
    world: int = 2


@dataclass
class Copy:
    """A copy of a finished run's folder, made between two runs (rank 0 copies, the others wait)."""
    source: Path
    target: Path


@dataclass
class RankRun:
    """What a run of :func:`rank_runs` left: its exit code (the first rank's that failed, as the trainer's
    spawn reports it; else 0) and each rank's stderr; ``stderr`` is all of them, rank 0's last (the lines a
    run ends with are rank 0's, as in a parent's output, where rank 0 speaks last)."""
    returncode: int
    stderrs: list

    @property
    def stderr(self):
        return "".join(self.stderrs[1:] + self.stderrs[:1])


def _segments(stderr):
    """{run index: (exit code, its stderr)} of one rank process's stderr."""
    found = {}
    for part in stderr.split("--- run ")[1:]:
        head, rest = part.split("\n", 1)
        index = int(head)
        if f"--- exit {index} " in rest:
            err, tail = rest.split(f"--- exit {index} ", 1)
            found[index] = (int(tail.split("\n", 1)[0]), err)
        else:
            found[index] = (None, rest)   # the process ended during this run
    return found


def rank_runs(steps, env=None, cwd=REPO, timeout=600):
    """Run ``steps`` (:class:`Run` and :class:`Copy`) in turn in one set of rank processes (as many as the
    largest world); a :class:`RankRun` per Run, in order."""
    world = max(step.world for step in steps if isinstance(step, Run))
    workdir = Path(tempfile.mkdtemp(prefix="textbox_like_rank_runs_"))
    plan = []
    for i, step in enumerate(steps):
        if isinstance(step, Copy):
            plan.append({"copy": [str(step.source), str(step.target)]})
        else:
            plan.append({"argv": [str(a) for a in step.argv], "env": {k: str(v) for k, v in step.env.items()},
                         "world": step.world, "rendezvous": str(workdir / f"rendezvous_{i}")})
    (workdir / "plan.json").write_text(json.dumps(plan))
    (workdir / "rank_runs.py").write_text(RANK_RUNS)
    base = clean_env() if env is None else env
    procs = [subprocess.Popen([sys.executable, str(workdir / "rank_runs.py"), str(rank), str(workdir / "plan.json")],
                              cwd=cwd, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    errs = [err for _, err in outs]
    assert all(proc.returncode == 0 for proc in procs), \
        f"rank processes exited {[p.returncode for p in procs]}: " + "\n".join(err[-3000:] for err in errs)
    parts = [_segments(err) for err in errs]
    results = []
    for i, step in enumerate(steps):
        if isinstance(step, Run):
            ranked = [parts[rank].get(i, (None, "")) for rank in range(step.world)]
            codes = [code for code, _ in ranked]
            failed = [code for code in codes if code != 0]
            results.append(RankRun(failed[0] if failed else 0, [err for _, err in ranked]))
    return results
