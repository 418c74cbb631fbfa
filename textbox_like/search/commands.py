"""The two command lines: run_hyper.py and run_multi_seed.py."""
from __future__ import annotations

import argparse
import sys

from .. import config as C
from ..errors import UserError

BACKENDS = ("local", "ray")
SCHEDULERS = ("none", "asha")


def _parser(prog, description, epilog):
    parser = argparse.ArgumentParser(prog=C.program_name(prog), description=description, epilog=epilog, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(message):
        raise UserError(message)

    parser.error = error
    return parser


def _both(flag):
    body = flag[2:]
    return sorted({"--" + body, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")}, key=flag.__ne__)


# the trainer's own value types (config.py), not copies
_positive = C.positive_int
_nonneg = C.nonneg_int


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = -1
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expects a number > 0, got {text!r}")
    return value


def _seed_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v < 2 ** 32 for v in values):
        raise argparse.ArgumentTypeError(f"expects integers from 0 to 2**32 - 1 like 3,7,11, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists a seed twice: {text!r}")
    return values


def _common(p, what):
    p.add_argument(*_both("--metric"), dest="metric", default=None,
                   help="validation metric (default: --best-checkpoint-metric or the task's)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--maximize", dest="maximize", action="store_const", const=True, default=None,
                       help="higher METRIC is better (default: the configured or the task's direction)")
    group.add_argument("--minimize", dest="maximize", action="store_const", const=False,
                       help="lower METRIC is better")
    p.add_argument(*_both("--parallel"), dest="parallel", type=_positive, default=1, metavar="N",
                   help=f"{what} at once (default 1); on CPU the cores are split between them")
    p.add_argument(*_both("--gpus-per-trial"), dest="gpus_per_trial", type=_nonneg, default=0, metavar="K",
                   help="GPUs of each trial (K > 1: K processes of the trainer's multi-process mode)")
    p.add_argument(*_both("--cpus-per-trial"), dest="cpus_per_trial", type=_positive_float, default=None,
                   metavar="C", help="CPUs of each trial (ray; default: the cores divided by --parallel)")
    p.add_argument(*_both("--backend"), dest="backend", default="local", metavar="NAME",
                   help="local (default): this machine; ray: Ray Tune, this machine or a cluster")
    p.add_argument(*_both("--ray-address"), dest="ray_address", default=None, metavar="ADDR",
                   help="ray: join a running cluster (auto or HOST:PORT); default a local Ray instance")
    p.add_argument(*_both("--max-failures"), dest="max_failures", type=_nonneg, default=2, metavar="N",
                   help="ray: retries of a trial whose process or node dies (default 2); it resumes from "
                        "its checkpoint_last.pt")


def _check_backend(args):
    if args.backend not in BACKENDS:
        from ..errors import closest
        raise UserError(f"unknown --backend {args.backend!r}{closest(args.backend, BACKENDS)}; "
                        f"choose from: {', '.join(BACKENDS)}")
    if args.backend == "local":
        for name in ("ray_address", "cpus_per_trial"):
            if getattr(args, name) is not None:
                raise UserError(f"--{name.replace('_', '-')} belongs to --backend ray")
        if getattr(args, "scheduler", "none") != "none":
            raise UserError("--scheduler asha needs --backend ray (Tune's ASHA)")


def _entry(fn, argv):
    try:
        return fn(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:
        return 1


# ====================================================================== run_hyper.py
def hyper_main(argv=None):
    return _entry(_hyper, sys.argv[1:] if argv is None else list(argv))


def _hyper(argv):
    p = _parser("run_hyper.py", "Hyperparameter search over a space file, one run_hetseq.py run per trial.",
                "Any other option goes to every trial's run_hetseq.py run (e.g. --task mnist --max-update 100).\n"
                "Space files (TextBox's 'label kind space' lines or YAML) and outputs: docs/search.md.")
    p.add_argument(*_both("--space"), dest="space", required=True, metavar="FILE",
                   help="space file: TextBox lines ('learning_rate loguniform (-8, 0)') or YAML")
    p.add_argument(*_both("--algo"), dest="algo", default="random", metavar="ALGO",
                   help="exhaustive, random (rand), bayes (tpe), anneal, atpe, or tpe.suggest etc. (default random)")
    p.add_argument(*_both("--max_evals"), dest="max_evals", type=_positive, default=None, metavar="N",
                   help="number of trials (default 10; exhaustive: the whole grid)")
    p.add_argument(*_both("--seed"), dest="seed", type=C.seed_int, default=1, help="seed of the sampler (default 1)")
    p.add_argument(*_both("--train_seed"), dest="train_seed", type=C.seed_int, default=None,
                   help="--seed of every trial's training run (default: the configured one)")
    p.add_argument(*_both("--output"), dest="output", default="checkpoints/hyper", metavar="DIR",
                   help="where trial_<k>/ and the reports go (default checkpoints/hyper)")
    p.add_argument("--resume", action="store_true",
                   help="continue the search in --output: finished trials are kept, a running one continues")
    p.add_argument(*_both("--scheduler"), dest="scheduler", default="none", metavar="NAME",
                   help="ray: asha stops hopeless trials early (default none)")
    p.add_argument(*_both("--grace-updates"), dest="grace_updates", type=_positive, default=None, metavar="N",
                   help="ray/asha: updates every trial runs before it may be stopped (default: the first "
                        "validation's)")
    _common(p, "trials")
    args, rest = p.parse_known_args(argv)
    from .algos import canonical_algo
    canonical_algo(args.algo)
    if args.scheduler not in SCHEDULERS:
        from ..errors import closest
        raise UserError(f"unknown --scheduler {args.scheduler!r}{closest(args.scheduler, SCHEDULERS)}; "
                        f"choose from: {', '.join(SCHEDULERS)}")
    _check_backend(args)
    if args.train_seed is not None:
        rest = rest + [f"--seed={args.train_seed}"]
    from .. import cli
    from .space import load_space
    space = load_space(args.space, cli.build_options())
    if args.backend == "ray":
        from .ray_backend import ray_search
        code, _ = ray_search(space, args, rest)
        return code
    from .hyper import run_search
    code, _ = run_search(space, args.algo, args.max_evals, args.seed, rest, args.output, args.metric,
                         args.maximize, parallel=args.parallel, gpus_per_trial=args.gpus_per_trial,
                         resume=args.resume)
    return code


# ====================================================================== run_multi_seed.py
def multi_seed_main(argv=None):
    return _entry(_multi_seed, sys.argv[1:] if argv is None else list(argv))


def _multi_seed(argv):
    p = _parser("run_multi_seed.py", "Run one configuration with several seeds and summarize the metrics.",
                "Any other option goes to every run_hetseq.py run. Output: OUTPUT/seed_<s>/,\n"
                "multi_seed_summary.json/.csv (n, mean, std, min, max, median, 95% t-interval per metric)\n"
                "and multi_seed_curves.png.")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument(*_both("--multi_seed"), dest="multi_seed", type=_positive, default=None, metavar="N",
                       help="run N seeds drawn from a generator seeded with --seed (as TextBox)")
    seeds.add_argument(*_both("--seeds"), dest="seeds", type=_seed_list, default=None, metavar="LIST",
                       help="run these seeds, e.g. 3,7,11")
    p.add_argument(*_both("--seed"), dest="seed", type=C.seed_int, default=None,
                   help="with --multi_seed: seeds the generator of the N seeds (default: the configured --seed)")
    p.add_argument(*_both("--output"), dest="output", default="checkpoints/multi_seed", metavar="DIR",
                   help="where seed_<s>/ and the summaries go (default checkpoints/multi_seed)")
    _common(p, "seeds")
    args, rest = p.parse_known_args(argv)
    _check_backend(args)
    if args.multi_seed is None and args.seeds is None:
        raise UserError("say which seeds: --multi_seed N (drawn from --seed) or --seeds 3,7,11")
    if args.seeds is not None and args.seed is not None:
        raise UserError("--seed seeds the generator of --multi_seed; with --seeds list the seeds themselves")
    from .multi_seed import configured_seed, draw_seeds, run_multi_seed
    if args.seeds is not None:
        chosen = args.seeds
    else:
        base = args.seed if args.seed is not None else configured_seed(rest)
        chosen = draw_seeds(args.multi_seed, base)
        print(f"seeds: {', '.join(map(str, chosen))} ({args.multi_seed} drawn from seed {base})", flush=True)
    if args.backend == "ray":
        from .ray_backend import ray_multi_seed
        code, _ = ray_multi_seed(chosen, args, rest)
        return code
    code, _ = run_multi_seed(chosen, rest, args.output, args.metric, args.maximize, parallel=args.parallel,
                             gpus_per_trial=args.gpus_per_trial)
    return code
