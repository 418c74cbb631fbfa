"""A user task whose loss is never finite (issue 51, item 11): a run whose
epoch is shorter than --max-nonfinite-updates ended "done | updates 0", exit
0, and a run that reached the limit named the epoch checkpoint of update 0
as "the last finite checkpoint" (the untrained weights). Both stop as
diverged, exit 65, with one line saying that no update was made. The task is
found with --user-dir in a folder outside the repository; the trainer's main
runs in-process."""
from __future__ import annotations

import pytest

from conftest import refusal_in_process
from test_task_loss_shape import TASK as LOSS_SHAPE_TASK

# the loss-shape test's tiny task, its loss summed and made NaN
TASK = (LOSS_SHAPE_TASK.replace("reduction=REDUCTION)", 'reduction="sum") * float("nan")')
        .replace('"per_sample_loss"', '"never_finite"'))
assert 'float("nan")' in TASK and '"never_finite"' in TASK


@pytest.mark.parametrize("limit, said", [
    (10, "training diverged: none of the 3 updates tried had a finite loss and gradient norm"),   # one epoch: 3
    (2, "training diverged at update 1: 2 updates in a row had a non-finite loss or gradient norm")])
def test_a_loss_never_finite_stops_as_diverged_and_names_no_checkpoint(tmp_path, capfd, limit, said):
    package = tmp_path / f"never_finite_{limit}"   # a module name of its own: one process runs both cases
    package.mkdir()
    (package / "__init__.py").write_text(TASK.replace('"never_finite"', f'"never_finite_{limit}"'))
    out = refusal_in_process(["--user-dir", package, "--task", f"never_finite_{limit}", "--max-sentences", 8, "--max-epoch", 1,
                              "--max-nonfinite-updates", limit, "--save-dir", tmp_path / "run", "--log-format", "none",
                              "--cpu"], capfd)
    assert out.returncode == 65, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {said}; the learning rate is likely too high (or float16 overflows: try --bf16), or "
                      f"the task's loss is not finite on any batch; no update was made, so no checkpoint holds a "
                      f"trained one"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "done |" not in out.stderr
