#!/usr/bin/env python
"""One configuration over several seeds: `python run_multi_seed.py --multi_seed=N | --seeds 3,7,11
[--metric NAME] [--output DIR] [run_hetseq.py options...]` (see textbox_like/search/ and docs/search.md)."""
import sys

from textbox_like.search import multi_seed_main

if __name__ == "__main__":
    sys.exit(multi_seed_main())
