"""A SIGTERM during start-up stops the run with 75 even where the code it
lands in cannot raise it: a real signal, sent to this process by the OS at
the moment a finalizer runs (tests/integration/test_os_faults_processes.py
holds the whole run's line and exit code)."""
from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

from textbox_like.core.faults import StoppedEarly
from textbox_like.processes import preemption


@pytest.fixture
def startup_guarded():
    handlers = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    hook = sys.unraisablehook
    sys.unraisablehook = sys.__unraisablehook__  # Python's, which prints (not pytest's, which warns)
    preemption.guard_startup()
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    sys.unraisablehook = hook


class SignalledWhileFinalized:
    """Its finalizer is where the signal lands: Python cannot raise there."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between these bytecodes
            pass


def test_a_stop_landing_in_a_finalizer_prints_nothing_and_the_next_phase_raises_it(startup_guarded, capfd):
    capfd.readouterr()
    SignalledWhileFinalized()
    gc.collect()
    with pytest.raises(StoppedEarly, match="stopped by SIGTERM during start-up, before training began"):
        preemption.raise_if_stopped()
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


def test_other_unraisable_errors_still_reach_the_hook_that_was_there(startup_guarded):
    seen = []
    sys.unraisablehook = seen.append
    preemption.guard_startup()   # a second command in this process: it wraps the hook it finds

    class Broken:
        def __del__(self):
            raise ValueError("a finalizer's own bug")
    Broken()
    assert len(seen) == 1 and isinstance(seen[0].exc_value, ValueError)
