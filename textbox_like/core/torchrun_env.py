"""What torchrun (torch.distributed.elastic) tells a worker: its agent, and
the hand-off note an earlier worker group of the run left in the save
directory. A leaf module (nothing of ours imported): the save-dir lock
reads both, and :mod:`~textbox_like.processes.elastic`, which writes the note, uses
the lock."""
from __future__ import annotations

import json
import os
from pathlib import Path

HANDOFF_NAME = "elastic.json"


class Agent:
    """The torchrun (torch.distributed.elastic) agent this worker runs under."""

    def __init__(self, run_id: str, restart_count: int, max_restarts: int):
        self.run_id, self.restart_count, self.max_restarts = run_id, restart_count, max_restarts

    @classmethod
    def from_env(cls, environ=None):
        """The agent, or None when this process was not started by torchrun."""
        env = os.environ if environ is None else environ
        if "TORCHELASTIC_RUN_ID" not in env:
            return None

        def number(name):
            try:
                return int(env.get(name, "0"))
            except ValueError:
                return 0
        return cls(env["TORCHELASTIC_RUN_ID"], number("TORCHELASTIC_RESTART_COUNT"),
                   number("TORCHELASTIC_MAX_RESTARTS"))


def read_handoff(save_dir):
    """The hand-off note of ``save_dir`` (a dict), or None."""
    try:
        note = json.loads((Path(save_dir) / HANDOFF_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None
