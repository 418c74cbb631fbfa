"""``python -m textbox_like COMMAND ...``: the ``textbox-like`` command (see commands.py)."""
from textbox_like.commands import console

if __name__ == "__main__":
    console()
