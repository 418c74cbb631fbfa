"""Evaluate a checkpoint: ``python -m textbox_like.tools.eval --model_ckpt PATH``.

Loss and metrics are averaged over all samples (HetSeq's eval averaged batch
means over the wrong count and under-reported the loss about 64x).
"""
from __future__ import annotations

import argparse
import json
import sys

from textbox_like.config.value_types import positive_int, switch


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m textbox_like.tools.eval", allow_abbrev=False,
                                     description="Evaluate a textbox_like checkpoint on a data split.")
    parser.add_argument("checkpoint", nargs="?", default=None, metavar="CHECKPOINT",
                        help="checkpoint file or .dcp directory, as `textbox-like export` takes it (or --model_ckpt)")
    parser.add_argument("--model_ckpt", "--model-ckpt", default=None, help="checkpoint file (any kind we save)")
    parser.add_argument("--data", "--mnist_dir", "--mnist-dir", default=None,
                        help="data directory (default: the one the run trained on); --mnist_dir is "
                             "HetSeq's eval_mnist.py name for it")
    parser.add_argument("--subset", default=None, help="split to evaluate (default: the run's first valid subset)")
    parser.add_argument("--batch-size", "--batch_size", type=positive_int, default=None, help="batch size")
    parser.add_argument("--json", type=switch, nargs="?", const=True, default=False, metavar="BOOL",
                        help="print one JSON object")
    parser.add_argument("--user-dir", "--user_dir", default=None, metavar="DIR",
                        help="the folder of the run's own components (default: the one the run recorded)")
    parser.add_argument("--cpu", type=switch, nargs="?", const=True, default=False, metavar="BOOL",
                        help="evaluate on CPU even when CUDA is present")

    def one_line_error(message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error
    args = parser.parse_args(argv)
    if args.checkpoint and args.model_ckpt and args.checkpoint != args.model_ckpt:
        one_line_error(f"two checkpoints: {args.checkpoint} and --model_ckpt {args.model_ckpt}; give one")
    args.model_ckpt = args.model_ckpt or args.checkpoint
    if not args.model_ckpt:
        one_line_error("name the checkpoint to evaluate: textbox-like eval CHECKPOINT (or --model_ckpt CHECKPOINT)")

    from textbox_like.api import evaluate
    from textbox_like.core.errors import UserError
    try:
        record = evaluate(args.model_ckpt, subset=args.subset, data=args.data, batch_size=args.batch_size,
                          cpu=args.cpu, user_dir=args.user_dir)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(record))
    else:
        print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
