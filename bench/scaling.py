"""Samples/s of MNIST training with 1 process vs N processes (one thread each).

    python bench/scaling.py --data ../shared/data/mnist [--processes 2] [--updates 300]

Each process keeps its batch (--max-sentences 64), so N processes train on N
times the samples per update; the ideal speed-up is N. Figures come from the
trainer's own metrics.jsonl, after its first log window (start-up excluded).
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def steady_samples_per_s(save_dir):
    records = [json.loads(line) for line in open(Path(save_dir) / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"][1:]
    seconds = sum(1 / r["updates_per_s"] for r in train)
    samples = sum(r["samples_per_s"] / r["updates_per_s"] for r in train)
    return samples / seconds


def run(processes, args):
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(REPO / "run_hetseq.py"), "--task", "mnist", "--max-sentences", "64",
               "--threads", "1", "--max-update", str(args.updates + args.window), "--max-epoch", "0",
               "--log-interval", str(args.window), "--log-format", "none", "--disable-validation",
               "--no-epoch-checkpoints", "--no-last-checkpoints", "--save-dir", out,
               "--distributed-world-size", str(processes)]
        if args.data:
            cmd += ["--data", args.data]
        subprocess.run(cmd, check=True)
        return steady_samples_per_s(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--window", type=int, default=30)
    args = parser.parse_args()
    one = run(1, args)
    many = run(args.processes, args)
    print(json.dumps({"processes": args.processes, "one_process_samples_per_s": round(one, 1),
                      f"{args.processes}_processes_samples_per_s": round(many, 1),
                      "speedup": round(many / one, 3), "ideal": args.processes}))


if __name__ == "__main__":
    main()
