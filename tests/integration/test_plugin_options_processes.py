"""The tests of test_plugin_options.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, clean_env


USER_TASK = textwrap.dedent("""
    import sys
    from dataclasses import dataclass

    from textbox_like.cli import main
    from textbox_like.config.schema import Section, setting
    from textbox_like.config.value_types import positive_int
    from textbox_like.tasks import register_task
    from textbox_like.tasks.mnist import MNISTTask


    @dataclass(frozen=True)
    class ToyOptions(Section):
        toy_width: int = setting(16, "width of the toy model", type=positive_int)
        toy_head: str = setting("linear", "the toy model's head", choices=["linear", "mlp"])


    @register_task("toy", dataclass=ToyOptions)
    class ToyTask(MNISTTask):
        pass


    sys.exit(main(sys.argv[1:]))
""")


def run_user_task(tmp_path, *args):
    script = tmp_path / "toy_task.py"
    script.write_text(USER_TASK)
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_task_declares_typed_options(tmp_path):
    shown = run_user_task(tmp_path, "--help")
    assert shown.returncode == 0, shown.stderr
    assert "task toy:" in shown.stdout and "--toy-width TOY_WIDTH, --toy_width TOY_WIDTH" in shown.stdout
    assert "width of the toy model (default: 16)" in shown.stdout

    printed = run_user_task(tmp_path, "--task", "toy", "--toy_width", "32", "--print_config")
    assert printed.returncode == 0, printed.stderr
    assert "toy_width: 32\ntoy_head: linear\n" in printed.stdout

    bad = run_user_task(tmp_path, "--task", "toy", "--toy-width", "0", "--print_config")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: argument --toy-width/--toy_width: expects a positive "
                                               "integer, got '0'"]
    config = tmp_path / "toy.yaml"
    config.write_text("task: toy\ntoy_head: tree\n")
    bad = run_user_task(tmp_path, "--config", str(config), "--print_config")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: option toy_head: 'tree' is not one of linear, mlp"]
