"""The tests of test_hostile_checkpoint.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env
from test_hostile_checkpoint import (  # noqa: F401 (fixtures)
    assert_refused_and_nothing_ran, entry_points, fsdp_run, hostile_item, hostile_metadata, poisoned_run)


PY = sys.executable


def as_process(argv, cwd):
    return subprocess.run([PY, *argv], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("poison, entry", [(hostile_metadata, "export"), (hostile_item, "resume --fsdp")],
                         ids=["metadata-export", "optimizer-item-resume-fsdp"])
def test_a_hostile_dcp_given_to_a_process_outside_the_repository_runs_nothing(fsdp_run, tmp_path, poison, entry):
    data, run, marker = poisoned_run(fsdp_run, tmp_path, poison)
    proc = as_process(entry_points(data, run, tmp_path)[entry], cwd=tmp_path)
    assert_refused_and_nothing_ran(proc, marker, poison, entry)
