"""The few places where we reach into another library's private parts.

Each is version-dependent, so each lives here as one small function with a
test of its own (tests/unit/test_internals.py): an upgrade of torch, hyperopt or
Python that moves one fails there, by name, not deep inside a run.
"""
from __future__ import annotations

import argparse
import contextlib


# ---------------------------------------------------------------- torch.optim
DYNAMO_DISABLE = "__dynamo_disable"   # where torch._compile._disable_dynamo caches its wrapped function


@contextlib.contextmanager
def optimizers_built_without_dynamo():
    """While it lasts, building a torch optimizer does not import torch._dynamo.

    ``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``, which
    imports torch._dynamo (about 1 s) on its first call only to mark the method
    as not to be traced. A launcher that builds an optimizer on a dummy
    parameter to check its values, and trains nothing itself, need not pay
    that before its ranks start: the cache is filled with the plain method
    (nothing is compiled here, so not tracing it changes nothing) and emptied
    again on the way out, so a later call wraps it as torch does."""
    import sys

    import torch
    plain = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if plain is None or "torch._dynamo" in sys.modules or hasattr(plain, DYNAMO_DISABLE):
        yield
        return
    setattr(plain, DYNAMO_DISABLE, plain)
    try:
        yield
    finally:
        if getattr(plain, DYNAMO_DISABLE, None) is plain:
            delattr(plain, DYNAMO_DISABLE)


# ---------------------------------------------------------------- torch.compile
def compile_errors() -> tuple:
    """The exception types torch.compile raises when a model does not
    compile: dynamo's (unsupported code) and inductor's (code generation).
    Empty where torch has neither: nothing is taken for a compile error."""
    found = []
    try:
        from torch._dynamo.exc import TorchDynamoException
        found.append(TorchDynamoException)
    except ImportError:
        pass
    try:
        from torch._inductor.exc import InductorError
        found.append(InductorError)
    except ImportError:
        pass
    return tuple(found)


def compiled_original(model):
    """The module under torch.compile's wrapper (OptimizedModule), or ``model``."""
    return getattr(model, "_orig_mod", model)


def drop_module_compilation(module):
    """Undo ``nn.Module.compile()`` on ``module``: its forward runs eager again."""
    module._compiled_call_impl = None


# ---------------------------------------------------------------- hyperopt
def hyperopt_trial_documents(trials):
    """All trial documents of a ``hyperopt.Trials``, the unfinished ones too
    (``trials.trials`` lists only those seen by the last ``refresh()``): the
    search marks a trial done in its document, then refreshes."""
    return trials._dynamic_trials


# ---------------------------------------------------------------- argparse
def parser_actions(parser: argparse.ArgumentParser):
    """Every option of a parser, as argparse.Action objects."""
    return parser._actions


def appends(action) -> bool:
    """Whether an option collects its values in a list (``action='append'``)."""
    return isinstance(action, argparse._AppendAction)


# ---------------------------------------------------------------- ray
def ray_init_local(ray, temp_dir, **kwargs):
    """``ray.init`` of a new local instance (even where `ray start` runs one
    on this machine) whose sockets, logs and object spill go under
    ``temp_dir`` rather than the machine-wide /tmp/ray: ``_temp_dir`` is
    private in Ray 2.x, and the only way to say so from Python."""
    return ray.init(address="local", _temp_dir=str(temp_dir), **kwargs)
