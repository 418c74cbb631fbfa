"""The layers a setting's value comes from, lowest first, and where the
built-in ones (the properties files) live:

    built-in defaults < properties/overall.yaml < properties/task/<task>.yaml
    < --config FILE ... < environment (accelerate launch / accelerate config)
    < command line (or the mapping given to textbox_like.train)

This module imports nothing of ours.
"""
from __future__ import annotations

from pathlib import Path

# properties/: inside the package when installed from a wheel, else beside it (source tree, pip install -e)
_PACKAGE = Path(__file__).resolve().parent.parent
PROPERTIES = next((d for d in (_PACKAGE / "properties", _PACKAGE.parent / "properties") if d.is_dir()),
                  _PACKAGE.parent / "properties")

#: where a value came from, lowest first: the user gave it when >= CONFIG_FILE
BUILTIN, OVERALL, TASK_FILE, CONFIG_FILE, ENVIRONMENT, COMMAND_LINE = range(6)
LAYER_NAMES = {BUILTIN: "default", OVERALL: "properties/overall.yaml", TASK_FILE: "the task's properties file",
               CONFIG_FILE: "--config", ENVIRONMENT: "accelerate launch / accelerate config",
               COMMAND_LINE: "command line"}


def set_by_user(source: str) -> bool:
    """Whether a value whose source (in words, as RunConfig.sources holds it)
    is this one was set by the user (command line, --config, Python, the
    environment), not a built-in default or one of our properties files."""
    return source != LAYER_NAMES[BUILTIN] and source != LAYER_NAMES[OVERALL] \
        and not source.startswith(str(PROPERTIES))
