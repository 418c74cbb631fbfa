"""Trackers, curves and throughput fields (issue 11, items 2-4).

A 30-update MNIST run writes TensorBoard events under SAVE_DIR/tensorboard that
TensorBoard's own reader finds (train loss at every log interval, validation
accuracy at every validation); a tracker whose package is missing, or an
unknown one, is one ``error:`` line and exit 2; ``--report_to none`` and
``--use_tensorboard false`` write no TensorBoard directory; every run ends
with SAVE_DIR/curves.png; log lines and metrics.jsonl carry the throughput
fields.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conftest import read_jsonl, refusal_in_process

THROUGHPUT = ("samples_per_s", "data_s_per_update", "compute_s_per_update", "eta_s")


def args(data, out, *extra, max_update=30):
    return ["--task", "mnist", "--data", str(data), "--max-sentences", "8", "--max-update", str(max_update),
            "--save-dir", str(out), "--threads", "1", "--log-format", "simple", *map(str, extra)]


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    """One 30-update run with the default trackers (TensorBoard), shared by
    the tests below; in-process (what they test is what the run wrote), its
    stderr kept as a process's would be."""
    import contextlib
    import io
    import subprocess

    from conftest import N_SMALL_TEST, N_SMALL_TRAIN, run_main, write_mnist
    root = tmp_path_factory.mktemp("trackers")
    write_mnist(root / "mnist", n_train=N_SMALL_TRAIN, n_test=N_SMALL_TEST, seed=10)
    out = root / "out"
    curves = os.environ.pop("TEXTBOX_LIKE_CURVES", None)   # a user's run: curves.png drawn
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = run_main(args(root / "mnist", out, "--log-interval", "5", "--validate-interval-updates", "10"))
    finally:
        if curves is not None:
            os.environ["TEXTBOX_LIKE_CURVES"] = curves
    assert code == 0, err.getvalue()[-3000:]
    return out, subprocess.CompletedProcess([], code, "", err.getvalue())


def scalar_series(logdir: Path) -> dict:
    """{tag: [(step, value)]} over every event file under ``logdir`` (Accelerate
    may write into a subdirectory)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    series = {}
    files = [p for p in logdir.rglob("*") if p.is_file() and "events.out.tfevents" in p.name]
    assert files, f"no TensorBoard event file under {logdir}"
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            series.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(points) for tag, points in series.items()}


def test_tensorboard_events_hold_train_loss_and_valid_accuracy(tb_run):
    out, _ = tb_run
    logdir = out / "tensorboard"
    assert logdir.is_dir()
    series = scalar_series(logdir)
    assert "train/loss" in series, sorted(series)
    assert "valid/accuracy" in series, sorted(series)
    assert [step for step, _ in series["train/loss"]] == [5, 10, 15, 20, 25, 30]
    assert [step for step, _ in series["valid/accuracy"]] == [10, 20, 30]
    # the same numbers as metrics.jsonl (float32 in the event file)
    rows = read_jsonl(out / "metrics.jsonl")
    train = {r["update"]: r["loss"] for r in rows if r["kind"] == "train"}
    valid = {r["update"]: r["accuracy"] for r in rows if r["kind"] == "valid"}
    for step, value in series["train/loss"]:
        assert value == pytest.approx(train[step], rel=1e-5, abs=1e-6)
    for step, value in series["valid/accuracy"]:
        assert value == pytest.approx(valid[step], rel=1e-5, abs=1e-6)
    # learning rate and gradient norm are logged too
    assert [s for s, _ in series["train/lr"]] == [5, 10, 15, 20, 25, 30]
    assert [s for s, _ in series["train/gnorm"]] == [5, 10, 15, 20, 25, 30]


def test_curves_png_written(tb_run):
    out, _ = tb_run
    png = out / "curves.png"
    assert png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_fields_in_log_lines_and_metrics(tb_run):
    out, proc = tb_run
    train_lines = [line for line in proc.stderr.splitlines() if line.startswith("train |")]
    assert len(train_lines) == 6, proc.stderr[-2000:]
    for line in train_lines:
        for field in THROUGHPUT:
            assert f"| {field} " in line, (field, line)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 6
    for record in train:
        for field in THROUGHPUT:
            assert isinstance(record.get(field), (int, float)), (field, record)
            assert record[field] >= 0, (field, record)
    assert train[-1]["eta_s"] == 0  # at --max-update nothing is left


def _one_error_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return errors[0]


def test_report_to_wandb_not_installed_is_one_line(small_mnist_dir, tmp_path, monkeypatch, capfd):
    """In-process: find_spec sees no wandb (whether or not this machine has it)."""
    import textbox_like.metrics.trackers as trackers
    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "wandb" else real(name, *a, **k))
    out = tmp_path / "out"
    proc = refusal_in_process(args(small_mnist_dir, out, "--report_to", "wandb", max_update=2), capfd)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_error_line(proc)
    assert "wandb" in line and "pip install wandb" in line, line
    assert not (out / "tensorboard").exists()


def test_use_wandb_true_not_installed_is_one_line(small_mnist_dir, tmp_path, monkeypatch):
    """ESPnet2's spelling, in-process: find_spec sees no wandb."""
    import contextlib
    import io

    import textbox_like.metrics.trackers as trackers
    from conftest import run_main
    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "wandb" else real(name, *a, **k))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(args(small_mnist_dir, tmp_path / "out", "--use_wandb", "true", max_update=2))
    assert rc == 2
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert "pip install wandb" in lines[0]


def test_report_to_bogus_is_one_line(small_mnist_dir, tmp_path, capfd):
    proc = refusal_in_process(args(small_mnist_dir, tmp_path / "out", "--report_to", "bogus", max_update=2), capfd)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_error_line(proc)
    assert "bogus" in line and "tensorboard" in line, line


@pytest.mark.parametrize("flags", [("--report_to", "none"), ("--use_tensorboard", "false")])
def test_no_tensorboard_dir_when_turned_off(small_mnist_dir, tmp_path, flags):
    from conftest import run_main
    out = tmp_path / "out"
    rc = run_main(args(small_mnist_dir, out, *flags, "--log-interval", "1", "--log-format", "none",
                       max_update=3))
    assert rc == 0
    assert (out / "metrics.jsonl").is_file() and (out / "checkpoint_last.pt").is_file()
    assert not (out / "tensorboard").exists()
    assert not list(out.rglob("events.out.tfevents*"))
