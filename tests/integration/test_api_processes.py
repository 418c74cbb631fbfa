"""The tests of test_api.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, clean_env


def python(code, timeout=240):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def api_runs(small_mnist_dir, tmp_path_factory):
    """One fresh Python process for the six tests below (a process each before), Accelerate's process-wide
    state never reset by the caller (no conftest there), the parts one after another: 1. train + evaluate;
    2. train, train again into the same save_dir (refused), resume=True; 3. train, then two processes into
    that save_dir (refused by the children); 4. three runs, the second failing; 5. a float64 deterministic
    run, then a float32 one; 6. train, evaluate, bf16, a caller's own PartialState, bf16, float32 (last: the
    caller's PartialState stays). Each part prints one JSON line and its stderr follows a marker line, so
    each test reads its own: {part: (its JSON, its stderr)}, "dirs": {part: its folder}."""
    tmp = tmp_path_factory.mktemp("api_runs")
    out1, out2, out3 = tmp / "one" / "run", tmp / "two" / "run", tmp / "three" / "run"
    four, five, six = tmp / "four", tmp / "five", tmp / "six"
    proc = python(f"""
        import json, sys, textbox_like
        from textbox_like.core.errors import UserError
        print("=== part 1", file=sys.stderr, flush=True)
        results = textbox_like.train({{"task": "mnist", "data": {str(small_mnist_dir)!r}, "max_update": 6,
                                       "batch_size": 16, "valid_subset": "test", "save_dir": {str(out1)!r},
                                       "threads": 1, "report_to": "none", "log_format": "none"}})
        metrics = textbox_like.evaluate({str(out1 / "checkpoint_last.pt")!r}, subset="test")
        print(json.dumps({{"results": results, "metrics": metrics}}), flush=True)

        print("=== part 2", file=sys.stderr, flush=True)
        base = {{"task": "mnist", "data": {str(small_mnist_dir)!r}, "batch_size": 16, "save_dir": {str(out2)!r},
                "threads": 1, "report_to": "none", "log_format": "none", "disable_validation": True}}
        first = textbox_like.train(base, max_update=2)
        try:
            textbox_like.train(base, max_update=4)
            refused = None
        except UserError as exc:
            refused = str(exc)
        resumed = textbox_like.train(base, max_update=4, resume=True)
        print(json.dumps({{"first": first["num_updates"], "refused": refused, "resumed": resumed["num_updates"]}}),
              flush=True)

        print("=== part 3", file=sys.stderr, flush=True)
        base = {{"task": "mnist", "data": {str(small_mnist_dir)!r}, "batch_size": 16, "save_dir": {str(out3)!r},
                "threads": 1, "report_to": "none", "log_format": "none", "disable_validation": True}}
        first = textbox_like.train(base, max_update=2)
        again = textbox_like.train(base, max_update=4, distributed_world_size=2)
        print(json.dumps({{"first": first, "again": again}}), flush=True)

        print("=== part 4", file=sys.stderr, flush=True)
        from textbox_like.optim import lr_scheduler
        base = {{"task": "mnist", "data": {str(small_mnist_dir)!r}, "batch_size": 16, "threads": 1, "cpu": True,
                "report_to": "none", "disable_validation": True, "max_update": 2}}
        first = textbox_like.train(base, save_dir={str(four / "a")!r})
        def fails(*args, **kwargs):
            raise RuntimeError("a fault of the model's own code")
        kept, lr_scheduler.build_scheduler = lr_scheduler.build_scheduler, fails  # after the Accelerator is built
        try:
            textbox_like.train(base, save_dir={str(four / "b")!r}, bf16=True)
            second = None
        except RuntimeError as exc:
            second = str(exc)
        lr_scheduler.build_scheduler = kept
        third = textbox_like.train(base, save_dir={str(four / "c")!r})
        print(json.dumps({{"first": first["exit_code"], "second": second, "third": third["exit_code"],
                          "updates": third.get("num_updates")}}), flush=True)

        print("=== part 5", file=sys.stderr, flush=True)
        import torch
        base = {{"task": "mnist", "data": {str(small_mnist_dir)!r}, "batch_size": 16, "threads": 1, "cpu": True,
                "report_to": "none", "disable_validation": True, "max_update": 1}}
        before = [str(torch.get_default_dtype()), torch.are_deterministic_algorithms_enabled()]
        first = textbox_like.train(base, save_dir={str(five / "a")!r}, train_dtype="float64",
                                   cudnn_deterministic=True)
        second = textbox_like.train(base, save_dir={str(five / "b")!r})
        after = [str(torch.get_default_dtype()), torch.are_deterministic_algorithms_enabled()]
        def dtypes(name):
            state = torch.load({str(five)!r} + "/" + name + "/checkpoint_last.pt", weights_only=False)
            return sorted({{str(v.dtype) for v in state["model"].values() if v.is_floating_point()}})
        print(json.dumps({{"codes": [first["exit_code"], second["exit_code"]], "before": before, "after": after,
                          "first": dtypes("a"), "second": dtypes("b")}}), flush=True)

        print("=== part 6", file=sys.stderr, flush=True)
        from accelerate.state import AcceleratorState, PartialState
        codes = [textbox_like.train(base, save_dir={str(six / "a")!r})["exit_code"]]
        metrics = textbox_like.evaluate({str(six / "a" / "checkpoint_last.pt")!r}, cpu=True)
        codes.append(textbox_like.train(base, save_dir={str(six / "b")!r}, bf16=True)["exit_code"])
        caller = PartialState(cpu=True)
        codes.append(textbox_like.train(base, save_dir={str(six / "c")!r}, bf16=True)["exit_code"])
        kept = bool(PartialState._shared_state) and PartialState().device == caller.device
        codes.append(textbox_like.train(base, save_dir={str(six / "d")!r})["exit_code"])
        print(json.dumps({{"codes": codes, "loss": "loss" in metrics, "kept": kept,
                          "accelerator_state": bool(AcceleratorState._shared_state)}}), flush=True)
    """, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-6:]
    stderr = proc.stderr.split("=== part ")
    return {k: (json.loads(lines[k - 1]), stderr[k]) for k in range(1, 7)} | {"dirs": (out1, out2, out3)}


@pytest.mark.slow
@pytest.mark.timeout(600)   # the first to run starts api_runs
def test_train_and_evaluate_from_python(small_mnist_dir, api_runs):
    out = api_runs["dirs"][0]
    got, _ = api_runs[1]
    results, metrics = got["results"], got["metrics"]
    assert results["exit_code"] == 0 and results["num_updates"] == 6
    assert results == json.loads((out / "results.json").read_text()) | {"exit_code": 0}
    # the mapping was the configuration trained with: its values, and its aliases (batch_size)
    import yaml
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["max_sentences"] == 16 and saved["max_update"] == 6 and saved["data"] == str(small_mnist_dir)
    # evaluate() scores the checkpoint on the split it names, over all its samples
    assert metrics["subset"] == "test" and metrics["samples"] == 50 and metrics["num_updates"] == 6
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["loss"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)   # the first to run starts api_runs
def test_training_twice_into_one_save_dir_raises_and_resume_true_continues(api_runs):
    got, _ = api_runs[2]
    assert got["first"] == 2 and got["resumed"] == 4
    assert "already holds a run (checkpoint_last.pt at update 2" in got["refused"], got
    assert "--resume" in got["refused"]


@pytest.mark.slow
@pytest.mark.timeout(600)   # the first to run starts api_runs
def test_a_refused_run_of_two_processes_returns_its_exit_code_not_the_earlier_runs_results(api_runs):
    """Two local processes: the refusal is the children's exit 2, and the
    results.json in the directory is the earlier run's, not this one's."""
    got, stderr = api_runs[3]
    assert got["first"]["num_updates"] == 2
    assert got["again"] == {"exit_code": 2}, got
    assert "already holds a run" in stderr


@pytest.mark.slow
@pytest.mark.timeout(600)   # the first to run starts api_runs
def test_runs_one_after_another_in_one_process_each_get_their_own_accelerate_state(api_runs):
    """api.train three times in one process, Accelerate's process-wide state
    not reset by the caller (no conftest here): a float32 run that ends, a
    bf16 run that fails with an exception that is not the user's (re-raised
    by cli.run), then float32 again. Each run sets up Accelerate anew, with
    its own precision, instead of "AcceleratorState has already been
    initialized and cannot be changed"."""
    got, stderr = api_runs[4]
    assert got == {"first": 0, "second": "a fault of the model's own code", "third": 0, "updates": 2}, got
    precisions = [line.split("| precision ")[1].split(" ")[0] for line in stderr.splitlines()
                  if "| precision " in line]
    assert precisions == ["float32", "float32"], stderr[-3000:]  # the bf16 run failed before its start line


@pytest.mark.slow
@pytest.mark.timeout(600)   # the first to run starts api_runs
def test_a_float64_deterministic_run_leaves_torch_as_it_found_it_for_the_next_run(api_runs):
    """api.train with --train_dtype float64 and --cudnn_deterministic, then
    a plain float32 run in the same process: the second run builds a float32
    model (its checkpoint holds float32 weights) and torch's default dtype
    and determinism flag are back to what they were before the first run."""
    got, _ = api_runs[5]
    assert got["codes"] == [0, 0], got
    assert got["first"] == ["torch.float64"], got  # the first run did change the default
    assert got["second"] == ["torch.float32"], got
    assert got["after"] == got["before"] == ["torch.float32", False], got


@pytest.mark.slow
@pytest.mark.timeout(600)   # the first to run starts api_runs
def test_evaluate_and_a_callers_partial_state_leave_a_later_run_its_own_precision(api_runs):
    """In one process: train, evaluate() its checkpoint, then train in bf16:
    evaluate's Accelerator state is reset, so the bf16 run is not refused
    ("AcceleratorState has already been initialized"). Then a caller's own
    PartialState(): a run keeps it (the same object, still set up) and
    resets the AcceleratorState it made, so one more bf16 run goes too."""
    got, stderr = api_runs[6]
    assert got == {"codes": [0, 0, 0, 0], "loss": True, "kept": True, "accelerator_state": False}, got
    precisions = [line.split("| precision ")[1].split(" ")[0] for line in stderr.splitlines()
                  if "| precision " in line]
    assert precisions == ["float32", "bf16", "bf16", "float32"], stderr[-3000:]
