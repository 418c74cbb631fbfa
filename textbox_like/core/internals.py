"""The few places where we reach into another library's private parts.

Each is version-dependent, so each lives here as one small function with a
test of its own (tests/unit/test_internals.py): an upgrade of torch, hyperopt or
Python that moves one fails there, by name, not deep inside a run.
"""
from __future__ import annotations

import argparse


# ---------------------------------------------------------------- torch._dynamo
DYNAMO_DISABLE = "__dynamo_disable"   # where torch._compile._disable_dynamo caches its wrapped function
DISABLE_DYNAMO_WRAPPER = "_disable_dynamo.<locals>.inner"   # the function torch._disable_dynamo returns
STEP_WRAPPER = "_use_grad_for_differentiable.<locals>._use_grad"   # torch.optim's wrapper of every step()
#: the names torch's step wrapper uses (torch 2.x): where they differ, torch changed it, and it is left as it is
STEP_WRAPPER_NAMES = ("torch._dynamo", "cast", "Optimizer", "is_grad_enabled", "set_grad_enabled", "defaults",
                      "_dynamo", "graph_break")
_modules_seen = 0   # len(sys.modules) at the last look: new modules may hold new wrappers


def import_dynamo_only_when_compiling():
    """From now on, torch.optim and the methods torch marks "not to be traced
    by torch.compile" import torch._dynamo (about 1 s of CPU, in every process
    that trains) only once something has imported it, that is, only where a
    compile can be under way. Nothing else changes.

    Two kinds of torch wrappers import it on their first call:
    ``torch._disable_dynamo`` (``Optimizer.add_param_group``, ``zero_grad``,
    the optimizers' functional steps, DDP's forward helper...) to build
    ``torch._dynamo.disable(fn)``, which it caches on the function
    (``fn.__dynamo_disable``); and the wrapper of every optimizer's
    ``step()``, to call ``torch._dynamo.graph_break()``, which does nothing
    outside a compile. The first cache is filled, for every such wrapper
    loaded, with a function that calls ``fn`` while torch._dynamo is not
    imported (nothing can be tracing it then) and otherwise exactly what torch
    would have built; the step wrapper gets the same code with its two graph
    breaks made where torch._dynamo is imported. Safe to call again."""
    import gc
    import sys
    import types
    global _modules_seen
    if len(sys.modules) == _modules_seen or "torch._dynamo" in sys.modules:
        return
    _modules_seen = len(sys.modules)
    for obj in gc.get_objects():
        if type(obj) is not types.FunctionType:  # type(), not isinstance: no object is asked for its __class__
            continue
        name = obj.__code__.co_qualname
        if name == DISABLE_DYNAMO_WRAPPER:
            cells = dict(zip(obj.__code__.co_freevars, obj.__closure__ or ()))
            if "fn" in cells and "recursive" in cells and not hasattr(cells["fn"].cell_contents, DYNAMO_DISABLE):
                fn = cells["fn"].cell_contents
                setattr(fn, DYNAMO_DISABLE, _dynamo_disabled_when_imported(fn, cells["recursive"].cell_contents))
        elif name == STEP_WRAPPER and is_torchs_step_wrapper(obj.__code__):
            obj.__code__ = _step_with_graph_breaks_when_dynamo_is_imported(None).__code__.replace(
                co_name=obj.__code__.co_name, co_qualname=name, co_filename=obj.__code__.co_filename,
                co_firstlineno=obj.__code__.co_firstlineno)


def is_torchs_step_wrapper(code) -> bool:
    """Whether ``code`` is the step wrapper this module knows (the installed
    torch's; tests/unit/test_internals.py says so by name on an upgrade)."""
    return code.co_freevars == ("func",) and tuple(code.co_names) == STEP_WRAPPER_NAMES \
        and "differentiable" in code.co_consts


def is_step_wrapper_without_dynamo(code) -> bool:
    """Whether ``code`` is the step wrapper as import_dynamo_only_when_compiling leaves it."""
    return code.co_code == _step_with_graph_breaks_when_dynamo_is_imported(None).__code__.co_code


def _dynamo_disabled_when_imported(fn, recursive):
    import sys
    disabled = None

    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            import torch._dynamo
            disabled = torch._dynamo.disable(fn, recursive, wrapping=False)
        return disabled(*args, **kwargs)
    return call


def _step_with_graph_breaks_when_dynamo_is_imported(func):
    """torch.optim.optimizer's ``_use_grad`` (the code above ``func``, which
    runs in that module's globals), but for where its graph breaks run."""
    def _use_grad(*args, **kwargs):
        dynamo = torch.sys.modules.get("torch._dynamo")  # noqa: F821 (torch.optim.optimizer's global)
        self = args[0]
        prev_grad = torch.is_grad_enabled()  # noqa: F821
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])  # noqa: F821
            if dynamo is not None:
                dynamo.graph_break()
            ret = func(*args, **kwargs)
        finally:
            if dynamo is not None:
                dynamo.graph_break()
            torch.set_grad_enabled(prev_grad)  # noqa: F821
        return ret
    return _use_grad


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
