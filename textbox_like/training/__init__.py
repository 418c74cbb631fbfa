"""The trainer as components: trainer.py holds the loop and the build order
and delegates to the others (its docstring lists them)."""
