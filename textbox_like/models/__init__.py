"""Models built by tasks. This package module stays import-light (no torch):
the helpers here run while the command line is checked."""
from __future__ import annotations

import json
from pathlib import Path

from textbox_like.core.errors import UserError

#: the published BERT sizes; their values live in properties/model/<name>.yaml
PRESETS = ("tiny", "mini", "small", "medium", "base", "large")


def read_vocab(path, flag="--dict") -> list:
    """The tokens of a WordPiece vocab.txt (one token a line)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"vocabulary file {str(path)!r} does not exist; check {flag}")
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise UserError(f"vocabulary file {str(path)!r} is empty; give a vocab.txt with one token a line")
    return lines


def read_vocab_size(path) -> int:
    return len(read_vocab(path))


def read_bert_json(path) -> dict:
    """A Google/NVIDIA bert_config.json as a dict."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"BERT config file {str(path)!r} does not exist; check --config_file")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"BERT config file {str(path)!r} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"BERT config file {str(path)!r} must hold a JSON object")
    return data


def checked_vocab_size(vocab_file, declared=None, source="the model configuration") -> int:
    """The model's vocabulary size given ``--dict`` and a declared
    ``vocab_size``: they must agree, except NVIDIA's padding of the
    vocabulary to a multiple of 8 (then the declared, padded size)."""
    size = read_vocab_size(vocab_file)
    if declared is None:
        return size
    padded = size + (-size) % 8
    if declared not in (size, padded):
        raise UserError(f"vocabulary {str(vocab_file)!r} has {size} tokens but {source} says "
                        f"vocab_size {declared}; give the vocab.txt the model was configured for")
    return int(declared)


def check_init_checkpoint(init):
    """--init-checkpoint names a local file or transformers save directory
    (checked without importing torch): nothing is downloaded here, so a hub
    name is one line saying what to pass instead."""
    path = Path(init)
    if not path.exists():
        raise UserError(f"--init-checkpoint {init!r} is no file or directory here, and no model can be downloaded "
                        f"here: pass a local transformers save_pretrained directory (textbox-like export writes "
                        f"one) or one of our checkpoints (.pt); check the path")
    if path.is_dir() and not (path / "config.json").is_file():
        inside = path / "checkpoint_last.pt"
        hint = f" (did you mean {str(inside)!r}?)" if inside.is_file() else ""
        raise UserError(f"--init-checkpoint {init!r} is a directory without config.json, so not a transformers "
                        f"save_pretrained directory{hint}; pass such a directory or one of our checkpoints (.pt)")


def saved_model_sizes(init):
    """The BERT sizes in a transformers save directory's config.json, or None
    when ``init`` is not such a directory or its config.json holds no sizes."""
    config = Path(init) / "config.json"
    if not config.is_file():
        return None
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
    if not isinstance(values, dict) or not all(isinstance(values.get(k), int) for k in keys):
        return None
    return {k: values[k] for k in keys}
