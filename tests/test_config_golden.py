"""--print_config and config.yaml keep their shape (issue 20).

tests/data/print_config/ holds what --print_config printed for varied command
lines before the configuration became typed: each still prints the same, and
each saved file, fed back with --config as an old run's config.yaml, loads and
prints the same again.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from textbox_like import cli

GOLDEN = Path(__file__).resolve().parent / "data" / "print_config"
CASES = yaml.safe_load((GOLDEN / "cases.yaml").read_text())


def printed(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*argv, "--print_config"]) == 0
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(CASES))
def test_print_config_is_unchanged(name):
    assert printed(CASES[name]) == (GOLDEN / f"{name}.yaml").read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_old_config_yaml_loads_and_reproduces_itself(name):
    saved = GOLDEN / f"{name}.yaml"
    assert printed(["--config", str(saved)]) == saved.read_text()
