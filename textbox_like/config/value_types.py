"""Value types: the converters that turn a command-line or YAML value into
a setting's value, raising argparse's error (which names the option) with
what was expected. They include other tools' value types (TextBox's metric
lists and --gpu_id, kanachan's --device, Apex levels for --train_dtype).

This module imports nothing of ours, and no heavy library.
"""
from __future__ import annotations

import argparse
import ast
import re

import yaml


def _int(text, low, what):
    try:
        value = int(text)
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or value < low or isinstance(text, float) and text != value:
        raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}")
    return value


def absolute_path(text):
    """A path made absolute (and ``~`` expanded), for a setting that every
    process of a run, and a later ``--config SAVE_DIR/config.yaml`` from
    another directory, must read as the same file or folder."""
    import os
    return os.path.abspath(os.path.expanduser(str(text)))


def positive_int(text):
    return _int(text, 1, "a positive integer")


def nonneg_int(text):
    return _int(text, 0, "an integer >= 0")


def int_list(text):
    """'4,2,1' or [4, 2, 1] -> [4, 2, 1] (HetSeq's per-epoch --update-freq)."""
    if isinstance(text, (list, tuple)):
        values = [int(v) for v in text]
    elif isinstance(text, int):
        values = [text]
    else:
        values = [int(v) for v in str(text).strip("[]() ").split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expects positive integers like 4 or 4,2,1, got {text!r}")
    return values


def str_list(text):
    if isinstance(text, (list, tuple)):
        return [str(v) for v in text]
    return [v.strip() for v in str(text).split(",") if v.strip()]


def float_tuple(text):
    """'(0.9, 0.999)' -> [0.9, 0.999], read with ast.literal_eval, never eval."""
    if isinstance(text, (list, tuple)):
        value = text
    else:
        try:
            value = ast.literal_eval(str(text))
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise ValueError(f"expects a tuple of numbers like '(0.9, 0.999)', got {text!r}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"expects a tuple of numbers like '(0.9, 0.999)', got {text!r}")
    return [float(v) for v in value]


def str2bool(text):
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("true", "yes", "1", "on", "y", "t"):
        return True
    if lowered in ("false", "no", "0", "off", "none", "n", "f"):
        return False
    raise ValueError(f"expects true or false, got {text!r}")


def switch(text):
    """The value of a switch: true/false/yes/no/1/0 in any case."""
    try:
        return str2bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"is a switch: give it alone or with true/false/yes/no/1/0, got {text!r}") from None


def with_numbers(value):
    """YAML 1.1 reads '1e-7' as a string; people mean a number."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") or value.lower() in ("inf", "-inf") \
                else int(value)
        except ValueError:
            return value
    if isinstance(value, dict):
        return {k: with_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_numbers(v) for v in value]
    return value


def parse_dict(text):
    """'{lr: 0.1, rho: 0.8}' or 'lr=0.1' -> dict. YAML safe_load for values."""
    if isinstance(text, dict):
        return with_numbers(dict(text))
    text = str(text).strip()
    try:
        if text.startswith("{"):
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise ValueError(f"expects a mapping like '{{lr: 0.1}}', got {text!r}")
            return with_numbers(value)
        out = {}
        for part in text.split(","):
            if "=" not in part:
                raise ValueError(f"expects key=value or '{{key: value}}', got {text!r}")
            key, raw = part.split("=", 1)
            out[key.strip()] = with_numbers(yaml.safe_load(raw))
        return out
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{text!r} is not valid: {problem}") from None


def float_list(text):
    """--lr: one LR, or HetSeq's per-epoch list 'a,b,c'."""
    try:
        if isinstance(text, (int, float)):
            return [float(text)]
        if isinstance(text, (list, tuple)):
            return [float(v) for v in text]
        return [float(v) for v in str(text).strip("[] ").split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number (or numbers 'a,b,c'), got {text!r}") from None


def _described(fn, what):
    """``fn`` raising argparse's error, which names the option, with ``what`` it expects."""
    def convert(text):
        try:
            return fn(text)
        except (ValueError, TypeError, SyntaxError):
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None
    convert.__name__ = fn.__name__
    return convert


def _literal_dict(text):
    return text if isinstance(text, dict) else ast.literal_eval(str(text)) or {}


INT_LIST = _described(int_list, "positive integers like 4 or 4,2,1")
STR_LIST = _described(str_list, "a comma-separated list")
LITERAL_DICT = _described(_literal_dict, "a Python dict literal like \"{'lr': 0.5}\"")
BOOL = _described(str2bool, "true or false")


def seed_int(text):
    value = _int(text, 0, "an integer from 0 to 2**32 - 1")
    if value >= 2 ** 32:
        raise argparse.ArgumentTypeError(f"expects an integer from 0 to 2**32 - 1, got {text!r}")
    return value



def seed_list(text):
    """--seeds '3,7,11': distinct seeds, each checked as the trainer's --seed."""
    try:
        values = [seed_int(v.strip()) for v in str(text).split(",") if v.strip()]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (a list of seeds like 3,7,11)") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expects seeds like 3,7,11, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists a seed twice: {text!r}")
    return values


def probability(text):
    """A dropout probability: 0 <= p < 1."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expects a probability from 0 to below 1, got {text!r}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expects a number > 0, got {text!r}")
    return value


# ---------------------------------------------------------------- other tools' value types
#: kanachan's / Apex's --amp-optimization-level -> our --train_dtype
AMP_LEVELS = {"O0": "float32", "O1": "float16", "O2": "float16", "O3": "float16"}


def dtype_name(text):
    """--train_dtype's value; an Apex level (O1) names the option that takes it."""
    text = str(text).strip()
    if text in AMP_LEVELS:
        raise argparse.ArgumentTypeError(f"{text} is an Apex optimization level, not a dtype: pass "
                                         f"--amp-optimization-level {text} (it means --train_dtype "
                                         f"{AMP_LEVELS[text]})")
    return text


def names_list(text, example="a,b or ['a', 'b']"):
    """Names: 'a,b', or TextBox's list literal "['a', 'b']" (read by
    ast.literal_eval, never run)."""
    if isinstance(text, (list, tuple)):
        return [str(v) for v in text]
    text = str(text).strip()
    if text.startswith(("[", "(")):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"expects names like {example}, got {text!r}") from None
        return [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return [v.strip() for v in text.split(",") if v.strip()]


def metric_names(text):
    """Metric names: 'a,b', or TextBox's list literal "['a', 'b']"."""
    return names_list(text, "accuracy,loss or ['accuracy']")


def metric_name(text):
    """One metric name (TextBox's one-name list "['accuracy']" too)."""
    names = metric_names(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"expects one metric name, got {text!r}")
    return names[0]


def device_name(text):
    """cpu, cuda, cudaN or cuda:N (kanachan's --device)."""
    text = str(text).strip().lower()
    if not re.fullmatch(r"cpu|cuda(:?\d+)?", text):
        raise argparse.ArgumentTypeError(f"expects cpu, cuda or cudaN (e.g. cuda1), got {text!r}")
    return text


def gpu_ids(text):
    """TextBox's --gpu_id '0,1': device indices."""
    parts = [p.strip() for p in str(text).strip("[]() ").split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expects device indices like 0 or 0,1, got {text!r}")
    return ",".join(parts)

