"""Helpers of the "runs" group of process tests (test_resume_processes,
test_elastic_processes, test_distributed, test_faults_processes,
test_faults_two_ranks, test_os_faults_processes, test_ctrl_c_processes):
the runs around a fault whose process is not what is tested (a reference,
the run before a fault, the resume after it) train in the pytest worker,
whose torch is imported already, instead of in a process of their own
(~3 CPU-s of imports each)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conftest import RANK_LEAVES, REPO, TESTS, clean_env, refusal_in_process, run_main

#: the signals a launcher (distributed._supervise) forwards to its ranks, then ignores
_LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def argv_of(cmd):
    """The trainer's arguments of a ``[python, run_hetseq.py, *args]`` command."""
    cmd = [str(a) for a in cmd]
    assert cmd[0] == sys.executable and cmd[1].endswith("run_hetseq.py"), cmd[:2]
    return cmd[2:]


def in_process(args, capfd):
    """main() in this process, its output (fd 1 and 2, a spawned rank's
    too) captured, as a CompletedProcess (returncode, stdout, stderr)."""
    saved = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        return refusal_in_process([str(a) for a in args], capfd)
    finally:
        # a run of several local ranks: this process is their launcher, which forwards these signals to
        # them while they run and ignores SIGTERM and SIGUSR1 after: the worker's own handlers back
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def ok_in_process(args, capfd):
    """in_process(), asserted to end with 0."""
    done = in_process(args, capfd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def train_in_process(args):
    """main() in this process, its output left to pytest; asserted to end with 0."""
    saved = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        code = run_main([str(a) for a in args])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code in (0, None), code
    return code


# ------------------------------------------------------------ runs of several ranks in one set of rank processes
#: one rank process of a plan (argv[1] the plan, JSON; argv[2] this process's rank): main() for each run of the
#: plan that has arguments for this rank, in turn, with the run's rank variables; each run's output between its
#: marks, which carry the monotonic clock (a run's seconds)
RANK_SCRIPT = f'''
import json, os, sys, time
sys.path.insert(0, {str(TESTS)!r})
from conftest import _RANK_VARS, run_main
plan, me = json.load(open(sys.argv[1])), sys.argv[2]
for i, step in enumerate(plan):
    argv = step["argv"].get(me)
    if argv is None:
        continue   # a run of the other ranks only
    before = dict(os.environ)
    for key in _RANK_VARS:
        os.environ.pop(key, None)
    os.environ.update(step["env"].get(me, {{}}))
    print(f"--- run {{i}} {{time.monotonic()}}", file=sys.stderr, flush=True)
    try:
        code = run_main(argv)
    except BaseException:   # what main() let through: said, and the next run goes on
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    print(f"--- exit {{i}} {{0 if code is None else code}} {{time.monotonic()}}", file=sys.stderr, flush=True)
    os.environ.clear()
    os.environ.update(before)
''' + RANK_LEAVES


@dataclass
class Ranks:
    """One run of a plan: ``argv[rank]`` the trainer's arguments of each of its ranks, ``env[rank]`` the
    variables it runs with. Filled in by the plan's processes, rank by rank: ``codes`` (main()'s exit
    codes), ``errs`` (what the rank printed during the run) and ``seconds`` (how long it ran)."""
    argv: dict
    env: dict = field(default_factory=dict)
    codes: dict = field(default_factory=dict)
    errs: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    @property
    def stderr(self) -> str:
        """Every rank's output, rank 0's first: what a launcher's stderr (its children's) holds."""
        return "".join(self.errs[rank] for rank in sorted(self.errs))

    def check(self, expect=0) -> str:
        assert self.codes and all(code == expect for code in self.codes.values()), \
            (self.codes, self.stderr[-6000:])
        return self.stderr


def nodes(argvs):
    """A run given node by node, one rank each (``--distributed-rank R --distributed-no-spawn`` in each
    node's own arguments ``argvs[R]``), as started by hand."""
    return Ranks({rank: [str(a) for a in argv] for rank, argv in enumerate(argvs)})


def spawned(args, world, rendezvous, ranks=None):
    """A run as ``run_hetseq.py ARGS --distributed-world-size WORLD`` (or --distributed-gpus WORLD) starts
    it on one node: each rank with the variables distributed.run_local_ranks gives its children (the
    launcher itself only starts them and waits); ``ranks``: those of them this plan runs (others missing)."""
    ranks = range(world) if ranks is None else ranks
    env = {rank: {"TEXTBOX_LIKE_SPAWNED": "1", "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                  "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                  "TEXTBOX_LIKE_INIT_METHOD": f"file://{rendezvous}"} for rank in ranks}
    return Ranks({rank: [str(a) for a in args] for rank in ranks}, env)


def run_plan(runs, root, processes=2, timeout=900):
    """``processes`` rank processes that run ``runs`` (Ranks) in turn, each the runs it has arguments for;
    waited for; each run's codes, output and seconds filled in. The processes must exit 0 (each run ended,
    whatever its code). Returns ``runs``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    plan = root / "plan.json"
    plan.write_text(json.dumps([{"argv": {str(r): a for r, a in run.argv.items()},
                                 "env": {str(r): e for r, e in run.env.items()}} for run in runs]))
    logs = [root / f"rank{rank}.log" for rank in range(processes)]
    procs = []
    try:
        for rank in range(processes):
            with open(logs[rank], "w") as log:
                procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(plan), str(rank)], cwd=REPO,
                                              env={**clean_env(), "PYTHONUNBUFFERED": "1"}, stdout=log,
                                              stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    assert [proc.returncode for proc in procs] == [0] * processes, [text[-4000:] for text in texts]
    for rank, text in enumerate(texts):
        for i, run in enumerate(runs):
            if rank not in run.argv:
                continue
            assert f"--- run {i} " in text and f"--- exit {i} " in text, (i, rank, text[-4000:])
            start, rest = text.split(f"--- run {i} ", 1)[1].split("\n", 1)
            err, end = rest.split(f"--- exit {i} ", 1)
            code, stop = end.split("\n", 1)[0].split()
            run.codes[rank], run.errs[rank], run.seconds[rank] = int(code), err, float(stop) - float(start)
    return runs


# ------------------------------------------------------------ rank processes that run what they are sent
#: a rank process that runs main() for each run it reads from stdin (a JSON line: {"id", "argv", "env"}; null
#: ends it), with the run's variables (undone after it), each run's output between its marks
SERVE_SCRIPT = f'''
import json, os, sys, time, traceback
sys.path.insert(0, {str(TESTS)!r})
from conftest import _RANK_VARS, run_main
for line in sys.stdin:
    step = json.loads(line)
    if step is None:
        break
    before = dict(os.environ)
    for key in _RANK_VARS:
        os.environ.pop(key, None)
    os.environ.update(step["env"])
    print(f"--- run {{step['id']}} {{time.monotonic()}}", file=sys.stderr, flush=True)
    try:
        code = run_main(step["argv"])
    except BaseException:   # what main() let through: said, and the next run goes on
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    print(f"--- exit {{step['id']}} {{0 if code is None else code}} {{time.monotonic()}}", file=sys.stderr,
          flush=True)
    os.environ.clear()
    os.environ.update(before)
''' + RANK_LEAVES


class RankServer:
    """A rank process, imported once, that trains the runs it is sent one after another (main() in it, as
    conftest's RUNS_IN_ONE_PROCESS does): a rank of several tests' runs, each test sending its own run when
    it needs it. A run that goes wrong (the process gone, or a run that never ends) ends the process; the
    next run starts a new one."""

    def __init__(self, log: Path, env: dict):
        self.log, self.env = Path(log), env
        self.proc = None
        self.count = 0
        self.current = None
        self.offsets = {}   # run id: where its output starts in the log

    def _start(self):
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, text=True,
                                         env={**self.env, "PYTHONUNBUFFERED": "1"})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def begin(self, argv, env=None, idle_timeout=300):
        """Send a run (the trainer's arguments, its extra variables); its id. The run before must have
        ended (waited for up to ``idle_timeout`` s, else the process is ended and a new one started)."""
        if self.current is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self.wait(self.current, idle_timeout)
            except AssertionError:
                self.close(kill=True)
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.count += 1
        self.current = f"{self.count}"
        self.offsets[self.current] = self.log.stat().st_size   # the runs before have ended: theirs is all there
        self.proc.stdin.write(json.dumps({"id": self.current, "argv": [str(a) for a in argv],
                                          "env": {k: str(v) for k, v in (env or {}).items()}}) + "\n")
        self.proc.stdin.flush()
        return self.current

    def _read(self, run_id) -> str:
        with open(self.log, "rb") as log:
            log.seek(self.offsets[run_id])
            return log.read().decode(errors="replace")

    def text(self, run_id) -> str:
        """What the process printed during run ``run_id`` (so far)."""
        text = self._read(run_id)
        mark = f"--- run {run_id} "
        if mark not in text:
            return ""
        text = text.split(mark, 1)[1].split("\n", 1)[-1]
        return text.split(f"--- exit {run_id} ", 1)[0]

    def poll(self, run_id):
        """The exit code of run ``run_id``, None while it runs; an AssertionError if the process is gone."""
        text = self._read(run_id)
        mark = f"--- exit {run_id} "
        if mark in text:
            return int(text.split(mark, 1)[1].split()[0])
        assert self.proc.poll() is None, f"the rank process ended ({self.proc.returncode}): {text[-3000:]}"
        return None

    def wait(self, run_id, timeout):
        """Run ``run_id``'s exit code, once it has ended (an AssertionError after ``timeout`` s)."""
        import time
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll(run_id)
            if code is not None:
                return code
            assert time.monotonic() < deadline, f"run {run_id} still running {timeout}s later: " \
                                                f"{self.text(run_id)[-3000:]}"
            time.sleep(0.05)

    def close(self, kill=False):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                try:
                    self.proc.stdin.write("null\n")
                    self.proc.stdin.flush()
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.current = None


class ServedRank:
    """Run ``run_id`` of a RankServer, as a rank's process is seen by a test: pid (the server's), poll,
    wait, text; kill ends the server (a new one serves the next run)."""

    def __init__(self, server: RankServer, run_id):
        self.server, self.run_id = server, run_id

    @property
    def pid(self):
        return self.server.pid

    def poll(self):
        return self.server.poll(self.run_id)

    def wait(self, timeout=300):
        return self.server.wait(self.run_id, timeout)

    def text(self):
        return self.server.text(self.run_id)

    def kill(self):
        self.server.close(kill=True)
