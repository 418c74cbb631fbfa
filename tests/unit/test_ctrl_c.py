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
