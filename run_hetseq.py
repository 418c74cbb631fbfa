#!/usr/bin/env python
"""Train with textbox_like: `python run_hetseq.py --task mnist ...` (see README.md and docs/)."""
from textbox_like.cli import leave, main

if __name__ == "__main__":
    leave(main())
