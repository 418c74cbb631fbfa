"""Each use of another library's private parts (textbox_like/core/internals.py)
still does what we rely on, with the installed versions."""
from __future__ import annotations

import argparse

import pytest
import torch

from textbox_like.core import internals


def test_compile_errors_catch_a_model_that_does_not_compile():
    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    compiled = torch.compile(breaks, backend="eager", fullgraph=True)
    kinds = internals.compile_errors()
    assert len(kinds) == 2 and all(issubclass(k, Exception) for k in kinds)
    with pytest.raises(kinds):
        compiled(torch.ones(2))
    torch._dynamo.reset()


def test_torchs_wrappers_that_import_dynamo_are_the_ones_import_dynamo_only_when_compiling_knows():
    """On a torch upgrade that changes them this fails by name, and the run
    is only slower (they are left as torch made them), never different."""
    import inspect
    step = inspect.unwrap(torch.optim.Adam.step, stop=lambda f: f.__code__.co_qualname == internals.STEP_WRAPPER)
    assert step.__code__.co_qualname == internals.STEP_WRAPPER
    # torch's, or already ours where an in-process run came first (a torch that changed it is left alone)
    assert internals.is_torchs_step_wrapper(step.__code__) or internals.is_step_wrapper_without_dynamo(step.__code__)
    zero_grad = torch.optim.Optimizer.zero_grad
    assert zero_grad.__code__.co_qualname == internals.DISABLE_DYNAMO_WRAPPER
    assert {"fn", "recursive"} <= set(zero_grad.__code__.co_freevars)


def test_compiled_original_is_the_module_under_the_wrapper():
    model = torch.nn.Linear(2, 2)
    assert internals.compiled_original(torch.compile(model, backend="eager")) is model
    assert internals.compiled_original(model) is model


def test_drop_module_compilation_makes_forward_eager_again():
    model = torch.nn.Linear(2, 2)
    calls = []

    def counting_backend(graph, example_inputs):
        calls.append(1)
        return graph.forward

    model.compile(backend=counting_backend)
    model(torch.ones(1, 2))
    assert calls                                    # compiled
    internals.drop_module_compilation(model)
    torch._dynamo.reset()
    calls.clear()
    model(torch.ones(1, 2))
    assert not calls                                # eager: the backend is not called again


def test_hyperopt_trial_documents_include_unfinished_trials():
    from hyperopt import JOB_STATE_DONE, STATUS_OK, Trials
    trials = Trials()
    spec = {"tid": 7, "spec": None, "result": {"status": "new"}, "misc": {"tid": 7, "cmd": None, "idxs": {},
                                                                          "vals": {}, "workdir": None},
            "state": 0, "owner": None, "book_time": None, "refresh_time": None, "exp_key": None}
    trials.insert_trial_docs([spec])
    docs = internals.hyperopt_trial_documents(trials)
    assert [d["tid"] for d in docs] == [7]
    docs[0]["state"], docs[0]["result"] = JOB_STATE_DONE, {"status": STATUS_OK, "loss": 0.25}
    trials.refresh()
    assert trials.losses() == [0.25]                # marking the document is what hyperopt reads


def test_parser_actions_and_appends():
    parser = argparse.ArgumentParser()
    parser.add_argument("--one")
    parser.add_argument("--many", action="append")
    actions = {a.dest: a for a in internals.parser_actions(parser)}
    assert {"help", "one", "many"} <= set(actions)
    assert internals.appends(actions["many"]) and not internals.appends(actions["one"])
