"""Ctrl-C (issue 51, item 9): a first Ctrl-C in training saves the update
under way and stops as SIGTERM does, with Ctrl-C's exit code (130) and the
line that says how to resume; a second one aborts at once. The signal is
delivered as a terminal delivers it: SIGINT to the run's whole process group
(the launcher and its ranks each get it, and the launcher forwards it too).
A run in this process hands SIGINT back when it ends."""
from __future__ import annotations

import signal

from conftest import run_main


def test_a_run_in_this_process_hands_ctrl_c_back_and_leaves_an_ignored_one_ignored(small_mnist_dir, tmp_path):
    """textbox_like.train() in a notebook: after the run, Ctrl-C (the
    kernel's interrupt) is Python's KeyboardInterrupt again; where SIGINT
    was ignored, the run does not take it."""
    args = ["--task", "mnist", "--data", small_mnist_dir, "--max-sentences", "32", "--max-update", "2",
            "--log-format", "none", "--no-save"]
    # Python's own handler, as a prompt or a notebook has it (an xdist worker has another)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_main(args) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)

    from textbox_like.processes.preemption import Preemption
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        taken = Preemption()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        taken.hand_back_interrupt()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


class _StderrThatIsInterrupted:
    """stderr whose first write of a progress line is followed by a real SIGINT, as a Ctrl-C that
    arrives while the line is being written."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        if text.startswith("train |") and len(self.writes) == 1:
            signal.raise_signal(signal.SIGINT)
        return len(text)

    def flush(self):
        pass


def test_the_ctrl_c_announcement_lands_between_progress_lines_never_inside_one(monkeypatch):
    """A CI run found ``... wall 0.9285interrupted (Ctrl-C): ...``: print() writes a line and its newline
    apart, and the handler's own line ran between them."""
    from types import SimpleNamespace

    from textbox_like.metrics.meters import Logger
    from textbox_like.processes.preemption import SIGNALS, Preemption
    before = {sig: signal.getsignal(sig) for sig in (*SIGNALS, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stderr = _StderrThatIsInterrupted()
    monkeypatch.setattr("sys.stderr", stderr)
    try:
        preemption = Preemption()
        preemption.started = True
        Logger(SimpleNamespace(logging=SimpleNamespace(log_format="simple")), is_main=True).info(
            "train | epoch 1 | update 6 | wall 0.9285")
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert preemption.requested and preemption.signal == "SIGINT"
    lines = "".join(stderr.writes).splitlines()
    assert lines[0] == "train | epoch 1 | update 6 | wall 0.9285", lines
    assert lines[1].startswith("interrupted (Ctrl-C): finishing this update"), lines
