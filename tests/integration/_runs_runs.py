"""Helpers of the "runs" group of process tests (test_resume_processes,
test_elastic_processes, test_distributed, test_faults_processes,
test_faults_two_ranks, test_os_faults_processes, test_ctrl_c_processes):
the runs around a fault whose process is not what is tested (a reference,
the run before a fault, the resume after it) train in the pytest worker,
whose torch is imported already, instead of in a process of their own
(~3 CPU-s of imports each)."""
from __future__ import annotations

import signal
import subprocess
import sys

from conftest import refusal_in_process, run_main

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


def completed(cmd, code, out="", err=""):
    return subprocess.CompletedProcess(cmd, code, out, err)
