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

With ``--acceptance`` it runs issue 33's protocol instead, in one command:
two cases, (a) the noisy neighbour above and (b) no busy loop but rank 1
slowed by ``TEXTBOX_LIKE_SLOW_RANK=1:SECONDS`` (``--slow-seconds`` per sample,
a sleep: balance.slow_rank); in each, per round, the fixed splits 32/32,
40/24, 44/20, 48/16, 52/12, 56/8 (per-rank ``--max-sentences``: the same
global batch of 64) and the balanced run, in alternating order (reversed
every other round). Reported per case: the medians of each over the rounds,
the balanced run's ratio to the best of the unequal fixed splits (the issue
asks >= 0.97) and to 32/32 (>= 1.40), the splits it chose, and its
parameters at update 20 against the fixed 32/32 run's (within 1e-5). About
7 runs of ``--updates`` per case and round: at ~20 s a run on the 2-core
development machine, ~5 minutes a round, ~25 minutes for 5 rounds.

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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def common(data, save_dir, updates):
    return ["--task", "mnist", "--data", str(data), "--save-dir", str(save_dir), "--optimizer", "sgd",
            "--lr", "0.05", "--lr-scheduler", "constant", "--model_conf", "dropout1=0", "--model_conf", "dropout2=0",
            "--max-epoch", "0", "--max-update", str(updates), "--threads", "1", "--log-format", "none",
            "--report_to", "none", "--disable-validation", "--log-interval", "10", "--distributed-timeout", "120"]


def env(extra=None):
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(extra or {})}


def two_ranks(data, save_dir, updates, extra, per_rank=((), ()), extra_env=None):
    """Both ranks, each pinned to its core (``per_rank``: each rank's own
    arguments, ``extra_env``: added to both's environment); waits for both."""
    rdzv = Path(tempfile.mkdtemp(prefix="noisy_rdzv_")) / "rdzv"
    procs = []
    for rank in (0, 1):
        cmd = ["taskset", "-c", str(rank), PY, "run_hetseq.py", *common(data, save_dir, updates), *extra,
               *per_rank[rank], "--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", "2",
               "--distributed-gpus", "1", "--distributed-rank", str(rank), "--distributed-no-spawn"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(extra_env), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
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


#: issue 33's fixed splits (rank 0 / rank 1) of the global batch of 64
FIXED_SPLITS = ((32, 32), (40, 24), (44, 20), (48, 16), (52, 12), (56, 8))
BALANCED = ["--global-batch-size", "64", "--max-sentences", "64", "--balance"]


def fixed(split):
    """Each rank's own --max-sentences: a fixed split of the same global batch."""
    return tuple(("--max-sentences", str(share)) for share in split)


def acceptance_case(args, tmp, name, extra_env):
    """One case of issue 33's protocol: the parameter check at update 20,
    then ``--rounds`` alternating rounds of every fixed split and the
    balanced run; the case's figures."""
    runs = {f"{a}/{b}": (["--max-sentences", "64"], fixed((a, b))) for a, b in FIXED_SPLITS}
    runs["balanced"] = (BALANCED, ((), ()))
    for label in ("32/32", "balanced"):  # the same 20 updates both ways, checkpointed at update 20
        base, per_rank = runs[label]
        two_ranks(args.data, tmp / f"{name}_exact_{label.replace('/', '_')}", 20,
                  base + ["--save-interval-updates", "20"], per_rank, extra_env)
    case = {"max_rel_diff_at_20": max_relative_difference(tmp / f"{name}_exact_balanced",
                                                          tmp / f"{name}_exact_32_32", 20)}
    rates, splits = {label: [] for label in runs}, []
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for label in order:
            base, per_rank = runs[label]
            save = tmp / f"{name}_{label.replace('/', '_')}_{r}"
            two_ranks(args.data, save, args.updates, base + ["--no-last-checkpoints"], per_rank, extra_env)
            rates[label].append(rate(save, args.from_update, args.updates)[0])
            if label == "balanced":
                splits.append([(b["update"], b["batch_sizes"]) for b in records(save, "balance")])
        print(f"{name} round {r + 1}: updates/s " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()),
              file=sys.stderr, flush=True)
    medians = {label: statistics.median(v) for label, v in rates.items()}
    best = max((label for label in runs if label not in ("32/32", "balanced")), key=medians.get)
    case.update({
        "updates_per_s": {k: [round(x, 3) for x in v] for k, v in rates.items()},
        "medians": {k: round(v, 3) for k, v in medians.items()}, "best_fixed": best,
        "balanced_vs_best_fixed": round(medians["balanced"] / medians[best], 3),
        "balanced_vs_32_32": round(medians["balanced"] / medians["32/32"], 3),
        "balanced_splits": splits})
    case["pass"] = (case["balanced_vs_best_fixed"] >= 0.97 and case["balanced_vs_32_32"] >= 1.40
                    and case["max_rel_diff_at_20"] <= 1e-5)
    print(f"{name}: medians of {args.rounds} rounds, updates/s over {args.from_update}..{args.updates}: "
          + ", ".join(f"{k} {v}" for k, v in case["medians"].items())
          + f"; balanced / best fixed ({best}) {case['balanced_vs_best_fixed']} (>= 0.97), balanced / 32/32 "
          f"{case['balanced_vs_32_32']} (>= 1.40); parameters at update 20 differ by "
          f"{case['max_rel_diff_at_20']:.2e} (<= 1e-5); {'PASS' if case['pass'] else 'FAIL'}",
          file=sys.stderr, flush=True)
    return case


def acceptance(args) -> dict:
    """Issue 33's protocol: (a) the noisy neighbour, (b) a slow rank."""
    started = time.perf_counter()
    report = {"protocol": "issue 33", "rounds": args.rounds, "updates": args.updates, "timed_from": args.from_update,
              "slow_seconds": args.slow_seconds}
    with tempfile.TemporaryDirectory() as tmp:
        busy = subprocess.Popen(["taskset", "-c", "1", PY, "-c", "while True: pass"])
        try:
            report["noisy_neighbour"] = acceptance_case(args, Path(tmp), "noisy_neighbour", None)
        finally:
            busy.kill()
            busy.wait()
        report["slow_rank"] = acceptance_case(args, Path(tmp), "slow_rank",
                                              {"TEXTBOX_LIKE_SLOW_RANK": f"1:{args.slow_seconds}"})
    report["pass"] = report["noisy_neighbour"]["pass"] and report["slow_rank"]["pass"]
    report["minutes"] = round((time.perf_counter() - started) / 60, 1)
    print(f"issue 33 acceptance: {'PASS' if report['pass'] else 'FAIL'} ({report['minutes']} minutes)",
          file=sys.stderr)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the MNIST idx files")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=300, help="updates per run; timed from update 100")
    parser.add_argument("--from-update", type=int, default=100)
    parser.add_argument("--acceptance", action="store_true",
                        help="issue 33's protocol: fixed splits 32/32..56/8 and balanced, noisy neighbour and slow rank")
    parser.add_argument("--slow-seconds", type=float, default=0.001,
                        help="--acceptance: rank 1's added sleep per sample in the slow-rank case")
    args = parser.parse_args(argv)
    if args.acceptance:
        print(json.dumps(acceptance(args)))
        return 0
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
