"""--compile (issue 12): compiled training equals eager within float tolerance,
compile time is reported apart, a model names the parts worth compiling on a
device, and a model or platform that cannot compile trains eager after one line.
Exact resume of a compiled run: tests/integration/test_resume_processes.py."""
from __future__ import annotations

import types

import pytest
import torch

from conftest import base_args, read_jsonl, run_main


NO_DROPOUT = ["--model_conf", "dropout1=0", "--model_conf", "dropout2=0"]


def losses(save_dir):
    return [r["loss"] for r in read_jsonl(save_dir / "metrics.jsonl") if r["kind"] == "train"]


# ---------------------------------------------------------------- regions
class FakeAccelerator:
    def __init__(self, device_type, backend="inductor"):
        from accelerate.utils import TorchDynamoPlugin
        self.device = torch.device(device_type)
        self.state = types.SimpleNamespace(dynamo_plugin=TorchDynamoPlugin(backend=backend, mode="default"))


def test_regions_that_are_submodules_compile_in_place():
    from textbox_like.parallel.accelerator import compile_regions, uncompile

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.out(self.body(x))

        def compile_regions(self, device_type):
            return ["out"]

    net = Net()
    assert compile_regions(FakeAccelerator("cpu"), net) == ["out"]
    assert net.out._compiled_call_impl is not None and net.body._compiled_call_impl is None
    assert list(net.state_dict()) == ["body.weight", "body.bias", "out.weight", "out.bias"]
    uncompile(net, ["out"])
    assert net.out._compiled_call_impl is None
    # nothing to do without --compile, or for a model that names no regions
    assert compile_regions(FakeAccelerator("cpu", backend="no"), Net()) is None
    assert compile_regions(FakeAccelerator("cpu"), torch.nn.Linear(2, 2)) is None


# ---------------------------------------------------------------- falling back
@pytest.mark.parametrize("whole", [False, True], ids=["regions", "whole-model"])
def test_a_model_that_does_not_compile_trains_eager_after_one_line(small_mnist_dir, tmp_path, capsys, monkeypatch,
                                                                  whole):
    import torch._inductor.compile_fx as compile_fx

    from textbox_like.models.mnist_cnn import MNISTNet
    if whole:  # Accelerate wraps the whole model in torch.compile, and the fallback unwraps it
        monkeypatch.setattr(MNISTNet, "compile_regions", lambda self, device_type: None)

    def fail(*args, **kwargs):
        raise RuntimeError("inductor cannot lower this model\nsecond line")
    monkeypatch.setattr(compile_fx, "compile_fx", fail)
    common = ["--log-interval", "1", "--threads", "1", "--disable-validation", "--max-epoch", "0", *NO_DROPOUT]
    assert run_main(base_args(small_mnist_dir, tmp_path / "eager", *common, max_update=3)) == 0
    capsys.readouterr()
    assert run_main(base_args(small_mnist_dir, tmp_path / "fallback", *common, "--compile", max_update=3)) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "did not compile" in line]
    assert len(lines) == 1 and "MNISTNet" in lines[0] and "training eager" in lines[0], err
    assert "inductor cannot lower this model" in lines[0] and "second line" not in err
    assert "Traceback" not in err and "compiled: the first update" not in err
    assert losses(tmp_path / "fallback") == pytest.approx(losses(tmp_path / "eager"), rel=1e-6)


def test_no_compiler_means_eager_with_one_line(monkeypatch, capsys):
    import shutil

    from textbox_like.parallel.accelerator import compile_plugin
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    cfg = types.SimpleNamespace(compile=True, compile_mode="default")
    assert compile_plugin(cfg, cuda=False) == (None, "default")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "C++ compiler" in err[0] and "training eager" in err[0]
