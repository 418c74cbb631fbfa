"""The tests of test_export.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import pytest

from test_export import assert_one_line_error, exported, run  # noqa: F401 (fixtures)


@pytest.mark.slow  # real processes: the console command, and a mistake's exit code and one line from a process
@pytest.mark.timeout(300)
def test_console_command_exports(exported, tmp_path):
    _, checkpoint, target = exported
    (tmp_path / "empty").mkdir()  # an empty directory is filled
    out = run(["-m", "textbox_like", "export", checkpoint, "--to", tmp_path / "empty"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "empty" / "model.safetensors").read_bytes() == (target / "model.safetensors").read_bytes()
    out = run(["-m", "textbox_like", "--help"])
    assert "\n  export " in out.stdout
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    assert_one_line_error(run(["-m", "textbox_like.tools.export", junk, "--to", tmp_path / "a"]), "junk.pt")
