"""Hyperparameter search (``run_hyper.py``) and repeated runs over seeds
(``run_multi_seed.py``) on top of the ordinary trainer, at TextBox's interface.

Modules: ``space`` (space files, both formats), ``algos`` (hyperopt's
algorithms, ask/tell), ``trials`` (trainer runs as child processes, a pool),
``hyper`` (the search), ``multi_seed`` (seeds), ``report`` (statistics,
tables, CSV, PNG), ``commands`` (the two command lines, parsed into
config.schema.SearchConfig), ``ray_backend`` (the same on Ray Tune). See docs/search.md.
"""
from textbox_like.search.algos import ALGO_NAMES, Sampler, canonical_algo
from textbox_like.search.commands import hyper_main, multi_seed_main
from textbox_like.search.hyper import (
    INTERRUPTED,
    Search,
    Setup,
    check_space,
    resolve_metric,
    run_search,
    search_locally)
from textbox_like.search.multi_seed import draw_seeds, plan_seeds, run_multi_seed, seeds_locally
from textbox_like.search.report import describe, summarize_runs
from textbox_like.search.space import (
    KINDS,
    Param,
    detect_format,
    grid,
    load_space,
    parse_space,
    parse_textbox,
    parse_yaml)
from textbox_like.search.trials import Outcome, SubprocessRunner, TrialConfigs, TrialRecord

__all__ = ["ALGO_NAMES", "INTERRUPTED", "KINDS", "Outcome", "Param", "Sampler", "Search", "Setup",
           "SubprocessRunner", "canonical_algo", "check_space", "describe", "detect_format", "draw_seeds", "grid",
           "hyper_main", "load_space", "multi_seed_main", "parse_space", "parse_textbox", "parse_yaml", "plan_seeds",
           "TrialConfigs", "TrialRecord", "resolve_metric", "run_multi_seed", "run_search", "search_locally",
           "seeds_locally", "summarize_runs"]
