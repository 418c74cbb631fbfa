#!/usr/bin/env python
"""Hyperparameter search: `python run_hyper.py --space=FILE --algo=exhaustive|random|tpe|anneal --max_evals=N
[--metric NAME] [--maximize|--minimize] [--seed S] [--output DIR] [run_hetseq.py options...]`
(see textbox_like/search/ and docs/search.md)."""
import sys

from textbox_like.search import hyper_main

if __name__ == "__main__":
    sys.exit(hyper_main())
