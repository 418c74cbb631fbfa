"""The process that started this one, read as early as anything of ours
runs (textbox_like/__init__.py imports this module first): a worker
compares it with getppid() to tell that its launcher (torchrun's agent)
died before the worker asked to die with it (cli.elastic_restart). A module
of its own, importing nothing of ours, so that the launch code reads it
without importing the package's __init__ (which imports api.py, which
imports cli.py: a cycle)."""
import os

STARTED_BY = os.getppid()
