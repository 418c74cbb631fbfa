"""The tests of test_plot.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
import subprocess
import sys

import pytest

from test_plot import mnist_records, write_run


@pytest.mark.slow
def test_command_line(tmp_path):
    """python -m textbox_like.metrics.plot and textbox-like plot, as a user runs them."""
    run = write_run(tmp_path / "r", mnist_records())
    for argv in (["-m", "textbox_like.metrics.plot", str(run)], ["-m", "textbox_like", "plot", str(run), "-o", "c.png"]):
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert (run / "curves.png").is_file() and (tmp_path / "c.png").is_file()
    proc = subprocess.run([sys.executable, "-m", "textbox_like.metrics.plot", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
