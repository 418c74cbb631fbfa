"""Accelerate's settings honoured (issue 10 item 1) and HetSeq's validation at
interval saves, ESPnet2's ReduceLROnPlateau (issue 10 items 3 and 5).

``accelerate launch`` flags and an ``accelerate config`` file reach the
trainer as ACCELERATE_* variables: mixed precision and gradient accumulation
come from them unless our own options say otherwise, and the start line names
the source that won."""
from __future__ import annotations

import json

import pytest

from conftest import N_SMALL_TEST, N_SMALL_TRAIN, read_jsonl, run_main, write_mnist


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_accel")
    write_mnist(directory, n_train=N_SMALL_TRAIN, n_test=N_SMALL_TEST, seed=10)
    return directory


@pytest.fixture(scope="module")
def data64(tmp_path_factory):
    """64 training samples: 8 batches of 8 per epoch."""
    directory = tmp_path_factory.mktemp("mnist_accel64")
    write_mnist(directory, n_train=64, n_test=20, seed=4)
    return directory


def ours(data, out, *extra, max_update=3):
    return ["--task", "mnist", "--data", str(data), "--max-sentences", "8", "--max-update", str(max_update),
            "--save-dir", str(out), "--threads", "1", "--log-format", "simple", "--report_to", "none",
            *map(str, extra)]


def start_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("task mnist |")]


def launched_start_line(data, out, monkeypatch, steps, *extra):
    """The one start line of a run that Accelerate's launcher handed
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS=steps."""
    import contextlib
    import io
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", str(steps))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(ours(data, out, "--max-epoch", "1", *extra, max_update=0))
    assert rc == 0, err.getvalue()[-3000:]
    lines = start_lines(err.getvalue())
    assert len(lines) == 1, err.getvalue()[-3000:]
    return lines[0]


def test_gradient_accumulation_from_accelerate_environment(data64, tmp_path, monkeypatch):
    """What the launcher hands over (ACCELERATE_GRADIENT_ACCUMULATION_STEPS; accelerate 1.15 exports it
    from its DeepSpeed launcher) sets update_freq when ours is the default."""
    import yaml
    out = tmp_path / "out"
    line = launched_start_line(data64, out, monkeypatch, 2, "--log-interval", "1")
    assert "update-freq from accelerate launch" in line, line
    assert yaml.safe_load((out / "config.yaml").read_text())["update_freq"] == [2]
    assert json.loads((out / "results.json").read_text())["num_updates"] == 4


def test_our_update_freq_wins_over_launch(data64, tmp_path, monkeypatch):
    out = tmp_path / "out"
    line = launched_start_line(data64, out, monkeypatch, 2, "--update-freq", "4")
    assert "update-freq from command line" in line, line
    assert json.loads((out / "results.json").read_text())["num_updates"] == 2


def test_an_explicit_update_freq_of_1_wins_over_launch(data64, tmp_path, monkeypatch):
    """--update-freq 1 given is not "not given" (issue 20): it keeps 1 and the
    start line says it came from the command line."""
    import yaml
    out = tmp_path / "out"
    line = launched_start_line(data64, out, monkeypatch, 4, "--update-freq", "1")
    assert "update-freq from command line" in line, line
    assert yaml.safe_load((out / "config.yaml").read_text())["update_freq"] == [1]
    assert json.loads((out / "results.json").read_text())["num_updates"] == 8  # 64 samples, batch 8, no accumulation


# ------------------------------------------------- ReduceLROnPlateau, plateau
def test_reduce_lr_on_plateau_lowers_lr_after_a_validation_without_improvement(data, tmp_path, monkeypatch):
    import textbox_like.training.validate as validate
    # a forced plateau: every validation reports the same loss
    monkeypatch.setattr(validate, "evaluate", lambda *a, **k: {"loss": 1.0, "accuracy": 0.5})
    out = tmp_path / "out"
    rc = run_main(ours(data, out, "--scheduler", "ReduceLROnPlateau", "--scheduler_conf",
                       "{patience: 0, factor: 0.5}", "--optimizer", "adam", "--lr", "0.001",
                       "--validate-interval-updates", "2", "--log-interval", "1", "--log-format", "none",
                       max_update=8))
    assert rc == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["update"] for r in rows if r["kind"] == "valid"] == [2, 4, 6, 8]
    lr = {r["update"]: r["lr"] for r in rows if r["kind"] == "train"}
    # validation 2 sets the best (no change); 4 and 6 do not improve: halved after each
    assert lr[1] == pytest.approx(0.001) and lr[2] == pytest.approx(0.001)
    assert lr[3] == pytest.approx(0.001) and lr[4] == pytest.approx(0.001)
    assert lr[5] == pytest.approx(0.0005) and lr[6] == pytest.approx(0.0005)
    assert lr[7] == pytest.approx(0.00025) and lr[8] == pytest.approx(0.00025)


def test_reduce_lr_on_plateau_keeps_lr_while_improving(data, tmp_path, monkeypatch):
    import textbox_like.training.validate as validate
    values = iter([0.5, 0.6, 0.7, 0.8])  # MNIST's best-checkpoint metric is accuracy (maximized)
    monkeypatch.setattr(validate, "evaluate", lambda *a, **k: {"loss": 1.0, "accuracy": next(values)})
    out = tmp_path / "out"
    assert run_main(ours(data, out, "--scheduler", "ReduceLROnPlateau", "--scheduler_conf",
                         "{patience: 0, factor: 0.5}", "--optimizer", "adam", "--lr", "0.001",
                         "--validate-interval-updates", "2", "--log-interval", "1", "--log-format", "none",
                         max_update=8)) == 0
    lrs = [r["lr"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert lrs == pytest.approx([0.001] * 8)


# ------------------------------------------- HetSeq: validate at interval saves
def test_save_interval_updates_validates_at_each_save(data, tmp_path):
    out = tmp_path / "out"
    assert run_main(ours(data, out, "--save-interval-updates", "5", "--log-format", "none", max_update=12)) == 0
    valid = [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "valid"]
    assert [u for u in valid if u < 12] == [5, 10], valid
    assert (out / "checkpoint_1_5.pt").is_file() and (out / "checkpoint_1_10.pt").is_file()
