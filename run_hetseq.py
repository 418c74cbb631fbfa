#!/usr/bin/env python
"""Train with textbox_like: `python run_hetseq.py --task mnist ...` (see README)."""
import sys

from textbox_like.cli import main
from textbox_like.preemption import leaving

if __name__ == "__main__":
    sys.exit(leaving(main()))
