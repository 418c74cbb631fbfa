"""The noisy-neighbour figures of issue 21: two ranks on a 2-core machine, one
of them sharing its core with someone else's busy loop.

    python scripts/noisy_neighbour.py --data /work/shared/data/mnist [--rounds 5] [--updates 300]

Two ranks over file://, rank 0 pinned to core 0 and rank 1 to core 1
(taskset), --threads 1 each, a busy loop pinned to core 1 throughout; MNIST,
SGD lr 0.05, dropout off. Per round, alternating:

- fixed: --max-sentences 32 on each rank;
- balanced: --global-batch-size 64 --max-sentences 64 --balance.

Reported: updates/s over updates 100..UPDATES of each (medians of the
rounds), their ratio, the update of the balanced run's first re-split, and
whether the two runs' parameters at update 20 agree within 1e-5 (relative to
each tensor's largest value). The ideal is each rank's speed measured alone
(one process with batch 64 on core 0; one on core 1 beside the busy loop),
summed: updates/s = (samples/s on core 0 + samples/s on core 1) / 64.

The machine must otherwise be idle for meaningful figures: say so when
reporting figures taken on a shared machine. One JSON object is the last line
of stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def common(data, save_dir, updates):
    return ["--task", "mnist", "--data", str(data), "--save-dir", str(save_dir), "--optimizer", "sgd",
            "--lr", "0.05", "--lr-scheduler", "constant", "--model_conf", "dropout1=0", "--model_conf", "dropout2=0",
            "--max-epoch", "0", "--max-update", str(updates), "--threads", "1", "--log-format", "none",
            "--report_to", "none", "--disable-validation", "--log-interval", "10", "--distributed-timeout", "120"]


def env():
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def two_ranks(data, save_dir, updates, extra):
    """Both ranks, each pinned to its core; waits for both."""
    rdzv = Path(tempfile.mkdtemp(prefix="noisy_rdzv_")) / "rdzv"
    procs = []
    for rank in (0, 1):
        cmd = ["taskset", "-c", str(rank), PY, "run_hetseq.py", *common(data, save_dir, updates), *extra,
               "--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", "2",
               "--distributed-gpus", "1", "--distributed-rank", str(rank), "--distributed-no-spawn"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    errs = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        sys.stderr.write("".join(e[-3000:] for e in errs))
        raise SystemExit(f"a run in {save_dir} failed")


def one_rank(data, save_dir, updates, core):
    cmd = ["taskset", "-c", str(core), PY, "run_hetseq.py", *common(data, save_dir, updates), "--max-sentences", "64"]
    done = subprocess.run(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"the single-process run on core {core} failed")


def records(save_dir, kind):
    return [json.loads(line) for line in open(Path(save_dir) / "metrics.jsonl") if f'"kind": "{kind}"' in line]


def rate(save_dir, first, last):
    """(updates/s, samples/s) between two logged updates, from the trainer's own wall clock."""
    train = {r["update"]: r for r in records(save_dir, "train")}
    seconds = train[last]["wall"] - train[first]["wall"]
    return (last - first) / seconds, (last - first) * 64 / seconds


def max_relative_difference(a_dir, b_dir, update):
    import torch

    def weights(d):
        path = next(Path(d).glob(f"checkpoint_*_{update}.pt"))
        return torch.load(path, map_location="cpu", weights_only=True)["model"]
    a, b = weights(a_dir), weights(b_dir)
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp(min=1e-12)).item()
               for k in a)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the MNIST idx files")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=300, help="updates per run; timed from update 100")
    parser.add_argument("--from-update", type=int, default=100)
    args = parser.parse_args(argv)
    fixed_args = ["--max-sentences", "32"]
    balanced_args = ["--global-batch-size", "64", "--max-sentences", "64", "--balance"]
    busy = subprocess.Popen(["taskset", "-c", "1", PY, "-c", "while True: pass"])
    report = {"rounds": args.rounds, "updates": args.updates, "timed_from": args.from_update}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            # the same 20 updates both ways, checkpointed at update 20
            for name, extra in (("fixed", fixed_args), ("balanced", balanced_args)):
                two_ranks(args.data, tmp / f"exact_{name}", 20, extra + ["--save-interval-updates", "20"])
            report["max_rel_diff_at_20"] = max_relative_difference(tmp / "exact_balanced", tmp / "exact_fixed", 20)
            resplits = records(tmp / "exact_balanced", "balance")
            report["first_resplit"] = resplits[0] if resplits else None
            fixed, balanced = [], []
            for r in range(args.rounds):
                for name, extra, out in (("fixed", fixed_args, fixed), ("balanced", balanced_args, balanced)):
                    save = tmp / f"{name}{r}"
                    two_ranks(args.data, save, args.updates, extra + ["--no-last-checkpoints"])
                    out.append(rate(save, args.from_update, args.updates)[0])
                print(f"round {r + 1}: updates/s fixed {fixed[-1]:.2f}, balanced {balanced[-1]:.2f} "
                      f"(x{balanced[-1] / fixed[-1]:.3f})", file=sys.stderr, flush=True)
            alone = []
            for core in (0, 1):
                one_rank(args.data, tmp / f"alone{core}", args.updates, core)
                alone.append(rate(tmp / f"alone{core}", args.from_update, args.updates)[1])
            last_split = records(tmp / f"balanced{args.rounds - 1}", "balance")
    finally:
        busy.kill()
        busy.wait()
    ratios = [b / f for f, b in zip(fixed, balanced)]
    ideal = sum(alone) / 64
    report.update({
        "fixed_updates_per_s": [round(x, 3) for x in fixed], "balanced_updates_per_s": [round(x, 3) for x in balanced],
        "ratios": [round(x, 3) for x in ratios], "ratio_median": round(statistics.median(ratios), 3),
        "fixed_median": round(statistics.median(fixed), 3), "balanced_median": round(statistics.median(balanced), 3),
        "alone_samples_per_s": [round(x, 1) for x in alone], "ideal_updates_per_s": round(ideal, 3),
        "ideal_ratio": round(ideal / statistics.median(fixed), 3),
        "last_split": last_split[-1]["batch_sizes"] if last_split else [32, 32]})
    print(f"median of {args.rounds} rounds, updates/s over {args.from_update}..{args.updates}: fixed "
          f"{report['fixed_median']}, balanced {report['balanced_median']}, ratio {report['ratio_median']} "
          f"(rounds {' '.join(map(str, report['ratios']))}); ideal {report['ideal_updates_per_s']} updates/s "
          f"(x{report['ideal_ratio']}: alone {report['alone_samples_per_s']} samples/s); first re-split "
          f"{report['first_resplit']}; parameters at update 20 differ by {report['max_rel_diff_at_20']:.2e}",
          file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
