"""The tests of test_compile.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import pytest
import torch

from conftest import base_args, run_cli, run_main
from test_bert_train import bert_data, train_args  # noqa: F401 (fixture)
from test_compile import FakeAccelerator, NO_DROPOUT, losses


def run_ok(args, timeout=300):
    out = run_cli(args, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def eager_in_process(args):
    """The eager reference run in this process (a process's ~3 s of imports saved); torch's thread
    count (--threads) restored after it."""
    threads = torch.get_num_threads()
    try:
        assert run_main(args) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_mnist_losses_equal_eager_over_20_updates(small_mnist_dir, tmp_path):
    common = ["--log-interval", "1", "--threads", "1", "--disable-validation", "--max-epoch", "0", *NO_DROPOUT]
    eager_in_process(base_args(small_mnist_dir, tmp_path / "eager", *common, max_update=20))
    err = run_ok(base_args(small_mnist_dir, tmp_path / "compiled", *common, "--log-format", "simple", "--compile",
                           max_update=20))
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 20
    assert compiled == pytest.approx(eager, rel=1e-4)
    # the start line says what compiles where; compiling is timed apart from the first update
    assert "compile from --compile (mode default), regions head on cpu" in err
    assert err.count("compiled: the first update took") == 1
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_bert_losses_equal_eager(bert_data, tmp_path):  # noqa: F811
    common = ["--max-sentences", "8", "--max-update", "5", "--disable-validation"]
    eager_in_process(train_args(bert_data, tmp_path / "eager", *common))
    err = run_ok(train_args(bert_data, tmp_path / "compiled", *common, "--compile"))
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 5
    assert compiled == pytest.approx(eager, rel=1e-4)
    # BERT names no regions: Accelerate compiles the whole model
    assert "compile from --compile (mode default)" in err and "regions" not in err
    assert err.count("compiled: the first update took") == 1


@pytest.mark.slow
def test_mnist_compiles_its_head_on_cpu_and_everything_on_cuda():
    from accelerate.utils import DynamoBackend

    from textbox_like.parallel.accelerator import compile_regions, uncompile
    from textbox_like.models.mnist_cnn import MNISTNet
    model, acc = MNISTNet(), FakeAccelerator("cpu")
    keys = list(model.state_dict())
    assert compile_regions(acc, model) == ["head"]
    assert "head" in vars(model) and "features" not in vars(model)  # the head replaced on the instance
    assert acc.state.dynamo_plugin.backend == DynamoBackend.NO  # prepare() compiles nothing more
    assert list(model.state_dict()) == keys  # checkpoints are the same compiled or not
    x = torch.randn(4, 1, 28, 28)
    model.eval()
    eager = MNISTNet.head(model, MNISTNet.features(model, x))
    torch.testing.assert_close(model(x), eager, rtol=1e-5, atol=1e-6)
    assert uncompile(model, ["head"]) is model and "head" not in vars(model)

    cuda = FakeAccelerator("cuda")
    assert compile_regions(cuda, MNISTNet()) is None  # Accelerate compiles the whole net
    assert cuda.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR
