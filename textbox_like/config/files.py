"""Reading and writing configuration files: the YAML files a user names
(``--config``, a search space's), and a resolved configuration written for
a process that runs it as it is (``config.yaml``, a spawned rank's, a
search trial's).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from textbox_like.core.errors import UserError


def read_text_file(path, what, kind) -> str:
    """A text file a user named, as a string; one line naming the file and
    what it is when it is empty, binary (a checkpoint, an archive) or not
    UTF-8, instead of a decoder's traceback."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{what} {str(path)!r} cannot be read ({exc.strerror or exc}); check the path") from None
    if not raw:
        raise UserError(f"{what} {str(path)!r} is empty (0 bytes); expected {kind} text")
    if raw.startswith(b"PK\x03\x04") or raw.startswith(b"\x80") or b"\0" in raw[:8192]:
        kind_of = "a zip archive (a torch checkpoint?)" if raw.startswith(b"PK\x03\x04") else \
            "a pickle (a checkpoint?)" if raw.startswith(b"\x80") else "binary data"
        raise UserError(f"{what} {str(path)!r} is {kind_of}, not {kind} text; pass the {kind} file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"{what} {str(path)!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
                        f"save it as UTF-8") from None


def load_yaml(path, what="config file"):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {str(path)!r} does not exist; check the path")
    try:
        data = yaml.safe_load(read_text_file(path, what, "YAML"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{what} {str(path)!r} is not valid YAML{where}: "
                        f"{getattr(exc, 'problem', None) or exc}; fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {str(path)!r} must hold a mapping of option: value, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def to_yaml(cfg) -> str:
    """The resolved configuration as YAML (a RunConfig): what
    --print_config prints and config.yaml holds; --config reads it back."""
    return yaml.safe_dump(_plain(cfg.as_dict()), sort_keys=False, default_flow_style=None)


def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def write_config(cfg, directory):
    from textbox_like.storage.fileio import atomic_write_text
    return atomic_write_text(Path(directory) / "config.yaml", to_yaml(cfg))


def write_resolved(cfg, path):
    """A resolved configuration for a process that runs it as it is (a spawned
    rank, a search trial): the values and where each came from. Read back by
    resolution.read_resolved, which finds the task's, optimizer's and
    scheduler's own sections from the values that choose them."""
    from textbox_like.storage.fileio import atomic_write_text
    data = {"config": _plain(cfg.as_dict()), "sources": dict(cfg.sources)}
    return atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))
