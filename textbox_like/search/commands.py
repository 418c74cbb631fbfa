"""The two command lines: run_hyper.py and run_multi_seed.py."""
from __future__ import annotations

import argparse
import sys

from textbox_like.resolve.options import Options, program_name, raise_user_errors
from textbox_like.core.errors import UserError, closest


def search_options(command, description, epilog):
    """The parser of ``command`` (run_hyper.py or run_multi_seed.py), from
    the declarations of config.schema.SearchConfig, as the trainer's parser is
    built from its sections (each flag in both spellings)."""
    from textbox_like.config.schema import SearchConfig
    own, differs = SearchConfig.COMMANDS[command]
    o = Options(program_name(command), description)
    o.parser.epilog, o.parser.formatter_class = epilog, argparse.RawDescriptionHelpFormatter
    raise_user_errors(o.parser)
    o.group("search", "options of " + command)
    fields = {f.name: f for f in SearchConfig.settings()}
    for name in own:
        meta = fields[name].metadata
        default, help = differs.get(name, (meta["cli_default"], meta["help"]))
        if name == "maximize":          # the one setting with two flags
            both = o.parser.add_argument_group("direction of METRIC").add_mutually_exclusive_group()
            both.add_argument("--maximize", dest="maximize", action="store_const", const=True, default=None,
                              help=help)
            both.add_argument("--minimize", dest="maximize", action="store_const", const=False,
                              help="lower METRIC is better")
            continue
        kwargs = {"default": default, "help": help}
        if meta["switch"]:
            kwargs["action"] = "store_true"
        for key in ("type", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        o.add(meta["flag"] or "--" + name.replace("_", "-"), **kwargs)
    return o


#: each command's --help: what it does, and what its other options are
HELP = {
    "run_hyper.py": (
        "Hyperparameter search over a space file, one run_hetseq.py run per trial.",
        "Any other option goes to every trial's run_hetseq.py run (e.g. --task mnist --max-update 100).\n"
        "Space files (TextBox's 'label kind space' lines or YAML) and outputs: docs/search.md."),
    "run_multi_seed.py": (
        "Run one configuration with several seeds and summarize the metrics.",
        "Any other option goes to every run_hetseq.py run. Output: OUTPUT/seed_<s>/,\n"
        "multi_seed_summary.json/.csv (n, mean, std, min, max, median, 95% t-interval per metric)\n"
        "and multi_seed_curves.png."),
}


def parse_search(command, argv):
    """(the typed SearchConfig, the rest of argv: the trainer's options),
    checked: names of choices, and the options that go together."""
    from textbox_like.config.schema import SearchConfig
    o = search_options(command, *HELP[command])
    ns, rest = o.parser.parse_known_args(argv)
    own = SearchConfig.COMMANDS[command][0]
    search = SearchConfig.for_command(command, **{name: getattr(ns, name) for name in own})
    check_search(search, command)
    return search, rest


def check_search(search, command):
    """What argparse cannot see: a choice's name (with the closest), and the options that go together."""
    from textbox_like.config.schema import SearchConfig
    for f in SearchConfig.settings():
        choices, value = f.metadata["choices"], getattr(search, f.name)
        if choices and value not in choices:
            raise UserError(f"unknown --{f.name} {value!r}{closest(value, choices)}; choose from: "
                            f"{', '.join(choices)}")
    if command == "run_hyper.py":
        from textbox_like.search.algos import canonical_algo
        canonical_algo(search.algo)
    if search.backend == "local":
        for name in ("ray_address", "cpus_per_trial"):
            if getattr(search, name) is not None:
                raise UserError(f"--{name.replace('_', '-')} belongs to --backend ray")
        if search.scheduler != "none":
            raise UserError("--scheduler asha needs --backend ray (Tune's ASHA)")
    if command == "run_multi_seed.py":
        if search.multi_seed is not None and search.seeds is not None:
            raise UserError("--multi_seed N draws the seeds, --seeds lists them; give one of them")
        if search.multi_seed is None and search.seeds is None:
            raise UserError("say which seeds: --multi_seed N (drawn from --seed) or --seeds 3,7,11")
        if search.seeds is not None and search.seed is not None:
            raise UserError("--seed seeds the generator of --multi_seed; with --seeds list the seeds themselves")


def _entry(fn, argv):
    try:
        return fn(sys.argv[1:] if argv is None else list(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:
        return 1


# ====================================================================== run_hyper.py
def hyper_main(argv=None):
    return _entry(_hyper, argv)


def _hyper(argv):
    search, rest = parse_search("run_hyper.py", argv)
    if search.space is None:
        raise UserError("name the space file: --space FILE (TextBox lines like 'learning_rate loguniform (-8, 0)' "
                        "or YAML)")
    if search.train_seed is not None:
        rest = rest + [f"--seed={search.train_seed}"]
    from textbox_like.resolve.options import build_options
    from textbox_like.resolve.resolution import import_plugins
    from textbox_like.search.space import load_space
    import_plugins(rest)      # the trainer's options of a --user-dir's components are in the space's reach
    space = load_space(search.space, build_options())
    from textbox_like.search.trials import output_locked
    with output_locked(search.output):
        if search.backend == "ray":
            from textbox_like.search.ray_backend import ray_search
            code, _ = ray_search(space, search, rest)
            return code
        from textbox_like.search.hyper import search_locally
        code, _ = search_locally(space, search, rest)
        return code


# ====================================================================== run_multi_seed.py
def multi_seed_main(argv=None):
    return _entry(_multi_seed, argv)


def _multi_seed(argv):
    search, rest = parse_search("run_multi_seed.py", argv)
    from textbox_like.search.trials import output_locked
    with output_locked(search.output):
        if search.backend == "ray":
            from textbox_like.search.ray_backend import ray_multi_seed
            code, _ = ray_multi_seed(search, rest)
            return code
        from textbox_like.search.multi_seed import seeds_locally
        code, _ = seeds_locally(search, rest)
        return code
