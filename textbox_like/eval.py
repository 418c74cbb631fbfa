"""Evaluate a checkpoint: ``python -m textbox_like.eval --model_ckpt PATH``.

Loss and metrics are averaged over all samples (HetSeq's eval averaged batch
means over the wrong count and under-reported the loss about 64x).
"""
from __future__ import annotations

import argparse
import json
import sys

from .config import positive_int, switch


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m textbox_like.eval", allow_abbrev=False,
                                     description="Evaluate a textbox_like checkpoint on a data split.")
    parser.add_argument("--model_ckpt", "--model-ckpt", required=True, help="checkpoint file (any kind we save)")
    parser.add_argument("--data", "--mnist_dir", "--mnist-dir", default=None,
                        help="data directory (default: the one the run trained on); --mnist_dir is "
                             "HetSeq's eval_mnist.py name for it")
    parser.add_argument("--subset", default=None, help="split to evaluate (default: the run's first valid subset)")
    parser.add_argument("--batch-size", "--batch_size", type=positive_int, default=None, help="batch size")
    parser.add_argument("--json", type=switch, nargs="?", const=True, default=False, metavar="BOOL",
                        help="print one JSON object")
    parser.add_argument("--cpu", type=switch, nargs="?", const=True, default=False, metavar="BOOL",
                        help="evaluate on CPU even when CUDA is present")

    def one_line_error(message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error
    args = parser.parse_args(argv)

    from .errors import UserError
    try:
        import yaml

        from .checkpoint import load_checkpoint
        from .cli import parse
        state = load_checkpoint(args.model_ckpt)
        _, cfg, _ = parse(["--task", state["task"]])
        for key, value in yaml.safe_load(state["config"]).items():
            setattr(cfg, key, value)
        if args.data:
            cfg.data = args.data
        if hasattr(cfg, "init_checkpoint"):
            cfg.init_checkpoint = None  # the checkpoint's own weights replace it anyway
        subset = args.subset or cfg.valid_subset[0]

        import torch
        from accelerate import Accelerator

        from .tasks import TASKS
        from .validate import evaluate
        task = TASKS.get(cfg.task)(cfg)
        task.check_config(cfg)
        task.prepare_data()
        data = task.build_dataset(subset)
        model = task.build_model()
        model.load_state_dict(state["model"])
        accelerator = Accelerator(cpu=args.cpu or not torch.cuda.is_available())
        model = accelerator.prepare(model)
        metrics = evaluate(task, model, data, args.batch_size or cfg.max_sentences_valid or cfg.max_sentences or 64,
                           accelerator)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record = {"checkpoint": args.model_ckpt, "subset": subset, "samples": len(data),
              "num_updates": state["train"]["num_updates"], **metrics}
    if args.json:
        print(json.dumps(record))
    else:
        print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
