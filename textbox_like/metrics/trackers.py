"""Experiment trackers through Accelerate: TensorBoard by default, W&B, MLflow,
Aim, Comet, ClearML, DVCLive on request (``--report_to``, or ESPnet2's
``--use_tensorboard``/``--use_wandb``). Only the main process writes.

Every train and validation log event becomes scalars (``train/loss``,
``valid/accuracy``, ``train/lr``, ``train/gnorm``, ``train/samples_per_s``...)
at the update count; the resolved configuration is stored as hyperparameters.
"""
from __future__ import annotations

import importlib.util

from textbox_like.core.errors import UserError

# name -> (module that must import, pip package)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "aim": ("aim", "aim"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
}


def requested(cfg) -> list:
    """The tracker names this run asks for, checked."""
    text = cfg.report_to if isinstance(cfg.report_to, str) else ",".join(cfg.report_to or [])
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if "all" in names:
        names = [n for n in TRACKERS if importlib.util.find_spec(TRACKERS[n][0]) is not None]
    names = [n for n in names if n != "none"]
    for flag, name in ((cfg.use_tensorboard, "tensorboard"), (cfg.use_wandb, "wandb")):
        if flag is True and name not in names:
            names.append(name)
        if flag is False and name in names:
            names.remove(name)
    for name in names:
        if name not in TRACKERS:
            from textbox_like.core.errors import closest
            raise UserError(f"--report_to {name}: unknown tracker{closest(name, TRACKERS)}; "
                            f"choose from {', '.join(TRACKERS)}, all or none")
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"--report_to {name}: the {package} package is not installed; "
                            f"pip install {package} (or pass --report_to none)")
    return names


def log_with(names, save_dir):
    """Accelerate's ``log_with``: TensorBoard as an instance writing to
    SAVE_DIR/tensorboard, the others by name."""
    out = []
    for name in names:
        if name == "tensorboard":
            from accelerate.tracking import TensorBoardTracker
            out.append(TensorBoardTracker("tensorboard", save_dir))
        else:
            out.append(name)
    return out


def hyperparameters(config: dict) -> dict:
    """The resolved configuration as flat scalars (trackers take no lists or dicts)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for sub, inner in value.items():
                flat[f"{key}.{sub}"] = inner
        else:
            flat[key] = value
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flat.items()}


def scalars(kind: str, record: dict) -> dict:
    """One log record as tracker scalars: numbers only, prefixed by the event
    kind; a list of numbers (one per rank) as one scalar per rank, ``kind/key/rankN``; a mapping
    of numbers as one scalar per name, ``kind/key/name``."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out = {}
    for k, v in record.items():
        if k in ("epoch", "update"):
            continue
        if number(v):
            out[f"{kind}/{k}"] = float(v)
        elif isinstance(v, list):
            out.update((f"{kind}/{k}/rank{r}", float(x)) for r, x in enumerate(v) if number(x))
        elif isinstance(v, dict):  # named figures (a split's measured seconds per update: "44+20")
            out.update((f"{kind}/{k}/{name}", float(x)) for name, x in v.items() if number(x))
    return out
