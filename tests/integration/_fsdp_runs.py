"""Runs of several ranks for the fsdp group's test files (test_fsdp_processes.py, test_fsdp_options_processes.py,
test_fsdp_balance_processes.py): a test file's two-rank runs that do not depend on each other run one after
another in ONE pair of rank processes (one process's imports per rank, ~3.5 CPU-s, instead of a launcher and
two ranks per run).

Each rank process runs the trainer's main() (conftest.run_main: Accelerate's state reset before and after; the
trainer's cleanup destroys the run's process group) for each run of a plan in turn, with the rank variables a
spawned rank gets from ``run_hetseq.py --distributed-world-size N`` (distributed.run_local_ranks: RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, TEXTBOX_LIKE_INIT_METHOD, TEXTBOX_LIKE_SPAWNED) and a
rendezvous file of the run's own, or, for a run given rank by rank (``--distributed-rank R
--distributed-no-spawn``: a "node" of one rank each), the arguments alone. A run of fewer ranks than the
processes (a leg on one rank) runs in the first ranks only; the others go on to the next run. Each run's
environment (what it publishes, what the plan gives it) is undone after it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import RANK_LEAVES, REPO, TESTS, clean_env, free_port

PY = sys.executable

#: one rank of a plan: argv[1] the plan (JSON), argv[2] this process's rank
RANK_SCRIPT = f'''
import json, os, sys
sys.path.insert(0, {str(TESTS)!r})
from conftest import _RANK_VARS, run_main
plan, me = json.load(open(sys.argv[1])), int(sys.argv[2])


class Left(BaseException):
    """A script's os._exit(code): a rank's leave without the interpreter's teardown ends the step here."""


def leave_step(code):
    sys.stdout.flush()
    sys.stderr.flush()
    raise Left(code)


def run_script(path, argv, out):
    """``python PATH ARGV`` in this process, its stdout to ``out``; its process group gone after it."""
    import contextlib
    import torch.distributed as dist
    init, saved_argv, real_exit = dist.init_process_group, sys.argv, os._exit
    sys.argv, os._exit = [path, *argv], leave_step
    try:
        with open(out, "w") as stdout, contextlib.redirect_stdout(stdout):
            try:
                exec(compile(open(path).read(), path, "exec"), {{"__name__": "__main__", "__file__": path}})
            except SystemExit as exc:
                return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Left as exc:
                return exc.args[0]
            finally:
                sys.stdout.flush()
        return 0
    finally:
        sys.argv, dist.init_process_group, os._exit = saved_argv, init, real_exit
        if dist.is_initialized():
            dist.destroy_process_group()


for i, step in enumerate(plan):
    argv = step["argv"].get(str(me))
    if argv is None:
        continue   # a run on fewer ranks: not this one's
    before = dict(os.environ)
    for key in _RANK_VARS:
        os.environ.pop(key, None)
    os.environ.update(step["env"].get(str(me), {{}}))
    home = os.getcwd()
    os.chdir(step["cwd"].get(str(me)) or home)   # a rank's own working directory, where the test gives one
    print(f"--- run {{i}}", file=sys.stderr, flush=True)
    try:
        if step.get("script"):
            code = run_script(step["script"], argv, f"{{step['out']}}.rank{{me}}")
        else:
            code = run_main(argv)
    except BaseException as exc:   # what main() or the script let through: said, and the next step goes on
        import traceback
        traceback.print_exc()
        code = 1
    print(f"--- exit {{i}} {{0 if code is None else code}}", file=sys.stderr, flush=True)
    os.chdir(home)
    os.environ.clear()
    os.environ.update(before)
''' + RANK_LEAVES


@dataclass
class Run:
    """One run of a plan: ``argv[rank]`` the arguments each rank runs (run_hetseq.py's, without the
    command), ``env[rank]`` the variables it runs with. Filled in by the plan's processes: ``codes`` and
    ``errs`` (each rank's output, stdout and stderr, between its marks), rank by rank."""
    argv: dict
    env: dict = field(default_factory=dict)
    codes: dict = field(default_factory=dict)
    errs: dict = field(default_factory=dict)
    script: str = ""
    outs: dict = field(default_factory=dict)   # a script's stdout, rank by rank
    cwd: dict = field(default_factory=dict)    # a rank's working directory, where not the repository's

    @property
    def stderr(self) -> str:
        """What the run's ranks printed, rank 0's first: a launcher's stderr (its children's, inherited)."""
        return "".join(self.errs[rank] for rank in sorted(self.errs))

    def check(self, expect=0):
        """Every rank exited ``expect``; returns the output, for the test's assertions."""
        assert self.codes and all(code == expect for code in self.codes.values()), \
            (self.codes, self.stderr[-6000:])
        return self.stderr


def spawned(args, world, rdzv, env=None):
    """A run of ``world`` ranks as ``run_hetseq.py ARGS --distributed-world-size WORLD`` starts them on one
    node: each rank with the variables distributed.run_local_ranks gives its children."""
    ranks = {}
    for rank in range(world):
        ranks[str(rank)] = {**(env or {}), "TEXTBOX_LIKE_SPAWNED": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
                            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                            "TEXTBOX_LIKE_INIT_METHOD": f"file://{rdzv}"}
    return Run({str(rank): [str(a) for a in args] for rank in range(world)}, ranks)


def one_rank(args, env=None):
    """A run of one process (no group), in the first rank's process."""
    return Run({"0": [str(a) for a in args]}, {"0": dict(env or {})})


def by_rank(argvs, env=None):
    """A run given rank by rank: ``argvs[rank]`` each rank's own arguments (its --distributed-rank, init
    method, batch size...)."""
    return Run({str(rank): [str(a) for a in argv] for rank, argv in enumerate(argvs)},
               {str(rank): dict(env or {}) for rank in range(len(argvs))})


def script(path, world, argv=(), on=None):
    """``python PATH ARGV`` on ``world`` ranks, each with the variables torchrun gives its workers and a store
    of the step's own (MASTER_PORT); ``on``: the plan's processes its ranks 0, 1... run in (default the
    first ``world``)."""
    port = str(free_port())
    on = list(range(world) if on is None else on)
    env = {str(process): {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                          "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
           for rank, process in enumerate(on)}
    return Run({str(process): [str(a) for a in argv] for process in on}, env, script=str(path))


class Plan:
    """``ranks`` processes that run ``runs`` (a list of Run) in turn, started at once, all in one process
    group of their own (rank 0's): while they run, a test may watch a step's output (wait_for) and kill
    them (kill: a real SIGKILL of a rank process, or of all of them at once), then finish() waits for them
    and fills in each run's exit codes and output. ``prefixes[rank]``: a command that rank's process starts
    under (one that execs its arguments: a mount namespace of its own). Use it as a context manager:
    whatever happens, no process outlives it."""

    def __init__(self, runs, root, ranks=2, prefixes=None):
        self.runs, self.root = runs, Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        plan = self.root / "plan.json"
        plan.write_text(json.dumps([{"argv": run.argv, "env": run.env, "script": run.script,
                                     "out": str(self.root / f"out{i}"),
                                     "cwd": {rank: str(path) for rank, path in run.cwd.items()}}
                                    for i, run in enumerate(runs)]))
        self.logs = [self.root / f"rank{rank}.log" for rank in range(ranks)]
        self.procs, self.killed = [], {}
        try:
            for rank in range(ranks):
                group = self.procs[0].pid if self.procs else 0   # rank 0's: a process group of its own
                with open(self.logs[rank], "w") as log:
                    command = [*(prefixes or {}).get(rank, []), PY, "-c", RANK_SCRIPT, str(plan), str(rank)]
                    self.procs.append(subprocess.Popen(command, cwd=REPO,
                                                       env={**clean_env(), "PYTHONUNBUFFERED": "1"}, stdout=log,
                                                       stderr=subprocess.STDOUT, process_group=group))
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def text(self, rank) -> str:
        return self.logs[rank].read_text(errors="replace")

    def output(self, index, rank):
        """What ``rank`` printed in step ``index`` so far; None before the step began."""
        text = self.text(rank)
        mark = f"--- run {index}\n"
        return text.split(mark, 1)[1].split(f"--- exit {index} ", 1)[0] if mark in text else None

    def wait_for(self, condition, timeout=300, poll=0.02, ranks=None):
        """Until ``condition()`` holds, the processes of ``ranks`` (default: all) still running."""
        deadline = time.monotonic() + timeout
        watched = [self.procs[rank] for rank in (range(len(self.procs)) if ranks is None else ranks)]
        while not condition():
            assert all(proc.poll() is None for proc in watched) and time.monotonic() < deadline, \
                [self.text(rank)[-3000:] for rank in range(len(self.procs))]
            time.sleep(poll)

    def kill(self, rank=None, sig=signal.SIGKILL):
        """``sig`` to rank ``rank``'s process, or to every process of the plan at once (their group)."""
        if rank is None:
            os.killpg(self.procs[0].pid, sig)
            self.killed.update({r: sig for r in range(len(self.procs))})
        else:
            self.procs[rank].send_signal(sig)
            self.killed[rank] = sig

    def finish(self, timeout=900, exits=None):
        """Wait for the processes: each exits 0 (every run it took part in ended, whatever the run's code),
        by the signal it was killed with, or with the code ``exits`` gives its rank (a run that ends its
        process itself: os._exit). Fills in every run's codes and output (a rank whose process ended in a
        run: the output it got to, and the process's code); returns the runs."""
        try:
            for proc in self.procs:
                proc.wait(timeout=timeout)
        finally:
            self.close()
        texts = [self.text(rank) for rank in range(len(self.procs))]
        ended = {**(exits or {}), **{rank: -sig for rank, sig in self.killed.items()}}
        expected = [ended.get(rank, 0) for rank in range(len(self.procs))]
        assert [proc.returncode for proc in self.procs] == expected, [text[-4000:] for text in texts]
        for rank, text in enumerate(texts):
            for i, run in enumerate(self.runs):
                if str(rank) not in run.argv:
                    continue
                if rank in ended and f"--- exit {i} " not in text:
                    if f"--- run {i}\n" in text:   # the run its process ended in: its output, the process's code
                        run.codes[rank], run.errs[rank] = ended[rank], text.split(f"--- run {i}\n", 1)[1]
                    continue
                assert f"--- run {i}\n" in text and f"--- exit {i} " in text, (i, rank, text[-4000:])
                err, rest = text.split(f"--- run {i}\n", 1)[1].split(f"--- exit {i} ", 1)
                run.codes[rank], run.errs[rank] = int(rest.split("\n", 1)[0]), err
                if run.script:
                    run.outs[rank] = (self.root / f"out{i}.rank{rank}").read_text(errors="replace")
        return self.runs


def run_plan(runs, root, ranks=2, timeout=900):
    """Start ``ranks`` processes that run ``runs`` (a list of Run) in turn; wait for them; fill in each
    run's exit codes and output. The processes themselves must exit 0 (every run ended, whatever its code)."""
    with Plan(runs, root, ranks) as plan:
        return plan.finish(timeout)
