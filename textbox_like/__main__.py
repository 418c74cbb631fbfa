"""``python -m textbox_like COMMAND ...``: the ``textbox-like`` command (see commands.py)."""
import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
