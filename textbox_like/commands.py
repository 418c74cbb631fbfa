"""The ``textbox-like`` console command: one entry point for every tool.

    textbox-like train --task mnist ...        # = python run_hetseq.py ...
    textbox-like hyper --space FILE ...        # = python run_hyper.py ...
    textbox-like multi-seed --multi_seed 3 ... # = python run_multi_seed.py ...
    textbox-like prepare-bert --input ...      # = python -m textbox_like.tools.prepare_bert ...
    textbox-like eval CKPT ...                 # = python -m textbox_like.tools.eval ... (or --model_ckpt CKPT)
    textbox-like plot RUN_DIR ... [-o F.png]   # = python -m textbox_like.metrics.plot ...
    textbox-like bench mnist ...               # = python -m textbox_like.tools.bench ...
    textbox-like export CKPT --to DIR          # = python -m textbox_like.tools.export ...

Each subcommand hands the rest of the command line to that tool's own
``main(argv)`` (imported only when chosen, so ``--help`` answers at once) and
exits with its code. ``python -m textbox_like`` is the same command.
"""
from __future__ import annotations

import importlib
import sys

# subcommand: (module, function, what it does)
COMMANDS = {
    "train": ("textbox_like.cli", "main", "train a model (run_hetseq.py)"),
    "hyper": ("textbox_like.search", "hyper_main", "hyperparameter search over a space file (run_hyper.py)"),
    "multi-seed": ("textbox_like.search", "multi_seed_main",
                   "one configuration over several seeds (run_multi_seed.py)"),
    "prepare-bert": ("textbox_like.tools.prepare_bert", "main", "raw text to BERT pre-training HDF5 shards"),
    "eval": ("textbox_like.tools.eval", "main", "evaluate a checkpoint on a data split"),
    "plot": ("textbox_like.metrics.plot", "main", "training and validation curves of runs to a PNG"),
    "bench": ("textbox_like.tools.bench", "main", "trainer vs. a plain PyTorch loop, samples/s"),
    "export": ("textbox_like.tools.export", "main",
               "a BERT checkpoint to a transformers save_pretrained directory (from_pretrained loads it)"),
}
ALIASES = {"multi_seed": "multi-seed", "prepare_bert": "prepare-bert"}


def usage():
    from textbox_like import __version__
    width = max(map(len, COMMANDS))
    lines = [f"usage: textbox-like COMMAND [options]   (textbox_like {__version__})", "",
             "commands:"]
    lines += [f"  {name.ljust(width)}  {what}" for name, (_, _, what) in COMMANDS.items()]
    lines += ["", "textbox-like COMMAND --help shows a command's options."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from textbox_like import __version__
        print(f"textbox_like {__version__}")
        return 0
    name = ALIASES.get(argv[0], argv[0])
    if name not in COMMANDS:
        from textbox_like.core.errors import unknown
        print(f"error: {unknown('command', argv[0], COMMANDS)}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    sys.argv[0] = f"textbox-like {name}"   # what the tool's --help names as its usage (config.program_name)
    entry = getattr(importlib.import_module(module), function)
    return entry(argv[1:])


def console():
    """The installed ``textbox-like`` command (and ``python -m textbox_like``):
    main(), then the way out a training process needs (cli.leave)."""
    from textbox_like.cli import leave
    leave(main())


if __name__ == "__main__":
    console()
