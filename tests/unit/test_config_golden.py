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

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "print_config"
CASES = yaml.safe_load((GOLDEN / "cases.yaml").read_text())

#: settings declared after the files were saved, with the value each prints
#: when not given: the rest of the output must not move
ADDED = {"initial_decoder": None, "model_path": None, "metrics": None, "patience": -1, "user_dir": None,
         "task_class": None, "callbacks": []}


def printed(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*argv, "--print_config"]) == 0
    return out.getvalue()


def without_added(text):
    """The printed configuration less the ADDED settings' lines (a dict's
    indented lines go with its key)."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        if not line.startswith(" "):
            dropping = line.split(":", 1)[0] in ADDED
        if not dropping:
            kept.append(line)
    return "".join(kept)


@pytest.mark.parametrize("name", sorted(CASES))
def test_print_config_is_unchanged(name):
    text = printed(CASES[name])
    assert without_added(text) == (GOLDEN / f"{name}.yaml").read_text()
    assert {k: v for k, v in yaml.safe_load(text).items() if k in ADDED} == ADDED


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_old_config_yaml_loads_and_reproduces_itself(name):
    saved = GOLDEN / f"{name}.yaml"
    assert without_added(printed(["--config", str(saved)])) == saved.read_text()
