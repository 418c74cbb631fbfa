"""python -m textbox_like.tools.eval: loss and accuracy averaged over ALL samples."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from textbox_like.data.mnist import MNISTDataset, load_split
from textbox_like.models.mnist_cnn import MNISTNet

from conftest import N_SMALL_TEST, N_TEST, N_TRAIN, base_args, run_main


@pytest.fixture(scope="module")
def trained(mnist_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_run")
    assert run_main(base_args(mnist_dir, out, "--disable-validation", max_update=3)) == 0
    return out


def manual(ckpt, data_dir, split):
    """Sum of per-sample NLL / N and correct / N, computed in one batch."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    conf = yaml.safe_load(state["config"]).get("model_conf") or {}
    model = MNISTNet(**conf)
    model.load_state_dict(state["model"])
    model.eval()
    data = MNISTDataset(*load_split(data_dir, split))
    batch = data.get_batch(np.arange(len(data)))
    with torch.no_grad():
        logp = model(batch["image"]).double()
    nll = F.nll_loss(logp, batch["target"], reduction="none")
    n = len(data)
    return {"loss": nll.sum().item() / n,
            "accuracy": (logp.argmax(1) == batch["target"]).sum().item() / n, "samples": n}


def eval_in_process(capsys, *args):
    from textbox_like.tools import eval as E
    capsys.readouterr()
    rc = E.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("batch_size", [7, 64, 199, 1000])
def test_eval_averages_over_all_samples(trained, mnist_dir, capsys, batch_size):
    ckpt = trained / "checkpoint_last.pt"
    rc, out, err = eval_in_process(capsys, "--model_ckpt", ckpt, "--data", mnist_dir, "--subset", "test",
                                   "--json", "--batch-size", batch_size)
    assert rc == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    expected = manual(ckpt, mnist_dir, "test")
    assert record["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-5)
    assert record["accuracy"] == pytest.approx(expected["accuracy"])


def test_eval_defaults_to_the_runs_data_and_valid_subset(trained, mnist_dir, capsys):
    ckpt = trained / "checkpoint_last.pt"
    rc, out, err = eval_in_process(capsys, "--model_ckpt", ckpt, "--json")
    assert rc == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["subset"] == "test" and record["samples"] == N_TEST
    expected = manual(ckpt, mnist_dir, "test")
    assert record["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-5)


def test_eval_hetseq_mnist_dir(trained, small_mnist_dir, capsys):
    ckpt = trained / "checkpoint_last.pt"
    rc, out, _ = eval_in_process(capsys, "--model_ckpt", ckpt, "--mnist_dir", small_mnist_dir, "--json", "true")
    assert rc == 0
    assert json.loads(out.strip().splitlines()[-1])["samples"] == N_SMALL_TEST


def test_eval_bad_switch_value_is_one_line(trained, capsys):
    with pytest.raises(SystemExit) as exc:
        eval_in_process(capsys, "--model_ckpt", trained / "checkpoint_last.pt", "--json", "maybe")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "maybe" in err[0]


def test_eval_other_subset_and_data(trained, mnist_dir, small_mnist_dir, capsys):
    ckpt = trained / "checkpoint_last.pt"
    rc, out, _ = eval_in_process(capsys, "--model_ckpt", ckpt, "--data", mnist_dir, "--subset", "train", "--json")
    assert rc == 0
    record = json.loads(out.strip().splitlines()[-1])
    assert record["samples"] == N_TRAIN
    assert record["loss"] == pytest.approx(manual(ckpt, mnist_dir, "train")["loss"], rel=1e-4, abs=1e-5)
    rc, out, _ = eval_in_process(capsys, "--model_ckpt", ckpt, "--data", small_mnist_dir, "--json")
    assert rc == 0
    record = json.loads(out.strip().splitlines()[-1])
    assert record["samples"] == N_SMALL_TEST
    assert record["accuracy"] == pytest.approx(manual(ckpt, small_mnist_dir, "test")["accuracy"])


def test_eval_text_output(trained, mnist_dir, capsys):
    rc, out, _ = eval_in_process(capsys, "--model_ckpt", trained / "checkpoint_last.pt", "--data", mnist_dir)
    assert rc == 0
    assert "loss" in out and "accuracy" in out


def test_eval_uses_the_runs_model_conf(mnist_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(base_args(mnist_dir, out, "--model_conf", "hidden=64", "--model_conf", "dropout1=0",
                              "--disable-validation", max_update=1)) == 0
    ckpt = out / "checkpoint_last.pt"
    rc, stdout, err = eval_in_process(capsys, "--model_ckpt", ckpt, "--json", "--batch-size", "33")
    assert rc == 0, err
    record = json.loads(stdout.strip().splitlines()[-1])
    assert record["loss"] == pytest.approx(manual(ckpt, mnist_dir, "test")["loss"], rel=1e-4, abs=1e-5)


@pytest.mark.timeout(120)
def test_eval_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    rc, _, err = eval_in_process(capsys, "--model_ckpt", tmp_path / "nope.pt", "--json")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error:"), err


def test_eval_garbage_checkpoint_is_an_error(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    rc, _, err = eval_in_process(capsys, "--model_ckpt", bad)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")


def test_eval_unknown_subset_is_an_error(trained, mnist_dir, capsys):
    rc, _, err = eval_in_process(capsys, "--model_ckpt", trained / "checkpoint_last.pt", "--data", mnist_dir,
                                 "--subset", "valid")
    assert rc == 2
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) == 1


def test_eval_takes_the_checkpoint_positionally_as_export_does(trained, mnist_dir, capsys):
    """``textbox-like eval CKPT`` (export's spelling) is ``--model_ckpt CKPT``;
    two different checkpoints, or none, is one line."""
    ckpt = trained / "checkpoint_last.pt"
    rc, named, _ = eval_in_process(capsys, "--model_ckpt", ckpt, "--data", mnist_dir, "--json")
    assert rc == 0
    rc, positional, _ = eval_in_process(capsys, ckpt, "--data", mnist_dir, "--json")
    assert rc == 0 and json.loads(positional) == json.loads(named)
    with pytest.raises(SystemExit) as refused:
        eval_in_process(capsys, ckpt, "--model_ckpt", trained / "checkpoint1.pt")
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == (f"error: two checkpoints: {ckpt} and --model_ckpt "
                                               f"{trained / 'checkpoint1.pt'}; give one")
    with pytest.raises(SystemExit) as refused:
        eval_in_process(capsys, "--json")
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: name the checkpoint to evaluate: textbox-like eval CHECKPOINT "
                                               "(or --model_ckpt CHECKPOINT)")
