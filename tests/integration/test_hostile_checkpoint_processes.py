"""The tests of test_hostile_checkpoint.py (tests/unit) that start processes: the slow tier.

A checkpoint is data: a `.dcp` whose files were replaced by pickles that run
a shell command (its manifest's sizes and digests updated to match, since a
digest is not a signature) runs nothing through any entry point that reads a
checkpoint: `textbox-like export`, `textbox-like eval`, `--restore-file` (with
and without `--fsdp`) and `--resume`. Each is refused in one line, exit 2, and
the command's marker file is never created.

Two hostile files: `.metadata` replaced (torch's FileSystemReader unpickles it
without restriction), and a non-tensor item of the shards (the optimizer's
`lr`, which torch's DefaultLoadPlanner reads with `weights_only=False`).

Every case runs the entry point's main in-process (what its process runs);
two cases also run as real processes started from a directory outside the
repository, as a user would.
"""
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
