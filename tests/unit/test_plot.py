"""python -m textbox_like.metrics.plot: curves of runs from their metrics.jsonl."""
import json

import pytest

from textbox_like.metrics import plot  # noqa: E402


pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mnist_records(scale=1.0):
    """What the trainer writes: train every 5 updates, valid every 20, the end's valid repeated."""
    records = []
    for update in range(5, 65, 5):
        records.append({"kind": "train", "epoch": 1, "update": update, "loss": scale * 2.3 / update ** 0.5,
                        "accuracy": 1 - 1 / update, "lr": 1e-4 * update, "gnorm": 2.5,
                        "samples_per_s": 1500.0, "updates_per_s": 23.0, "wall": update / 20})
        if update % 20 == 0:
            records.append({"kind": "valid", "epoch": 1, "update": update, "loss": scale * 1.5 / update ** 0.5,
                            "accuracy": 1 - 2 / update})
    records.append({"kind": "train_epoch", "epoch": 1, "update": 60, "loss": 0.6, "accuracy": 0.8, "wall": 3.0})
    records.append(dict(records[-2]))
    return records


def run_main(argv, capsys):
    code = plot.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_runs_to_png(tmp_path, capsys):
    a = write_run(tmp_path / "lr_small", mnist_records())
    b = write_run(tmp_path / "lr_large", mnist_records(1.3))
    out_png = tmp_path / "both.png"
    code, out, err = run_main([a, b, "-o", out_png], capsys)
    assert code == 0, err
    assert out.strip() == str(out_png)
    data = out_png.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    assert not list(tmp_path.glob(".*.tmp*"))          # written atomically, no leftovers


def test_series_train_loss_and_every_valid_metric(tmp_path):
    series = plot.series(plot.read_metrics(write_run(tmp_path / "run", mnist_records())))
    assert set(series) == {("loss", "train"), ("loss", ""), ("accuracy", ""), ("accuracy", "train")}
    xs, ys = series[("loss", "train")]
    assert xs == list(range(5, 65, 5)) and len(ys) == 12       # train records, not the epoch summary
    assert series[("accuracy", "")][0] == [20, 40, 60]          # the repeated end-of-run record once


def test_one_run_default_output_and_subsets(tmp_path, capsys):
    records = [{"kind": "train", "update": u, "loss": 10.0 / u} for u in range(1, 30)]
    for u in (10, 20, 30):
        for subset in ("dev", "test"):
            records.append({"kind": f"valid_{subset}", "epoch": 1, "update": u, "loss": 5.0 / u,
                            "mlm_accuracy": u / 40, "ppl": 10 ** (6 - u / 10)})
    run = write_run(tmp_path / "bert", records)
    code, out, err = run_main([run], capsys)
    assert code == 0, err
    assert (run / "curves.png").read_bytes().startswith(PNG)
    series = plot.series(plot.read_metrics(run))
    assert ("ppl", "dev") in series and ("mlm_accuracy", "test") in series


def panels(fig):
    """{title: axes} of the figure's visible panels."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_training_accuracy_is_drawn_and_the_y_axis_fits_the_data(tmp_path):
    """MNIST's train records carry accuracy: its panel shows the training
    curve beside validation's. The loss starts at 40 and settles near 0.3:
    the y-axis fits the settled values and validation's, not the start."""
    records = []
    for update in range(1, 61):
        loss = 40.0 if update == 1 else 0.3 + 1.0 / update
        records.append({"kind": "train", "epoch": 1, "update": update, "loss": loss, "accuracy": 1 - loss / 41,
                        "lr": 1e-3, "gnorm": 1.0, "samples_per_s": 900.0,
                        "data_s_per_update": 1e-4, "compute_s_per_update": 0.03})  # timings: no panels
        if update % 20 == 0:
            records.append({"kind": "valid", "epoch": 1, "update": update, "loss": 0.35, "accuracy": 0.9})
    fig = plot.draw([write_run(tmp_path / "run", records)])
    axes = panels(fig)
    assert set(axes) == {"loss", "accuracy"}                                # both with training curves
    train_accuracy = [line for line in axes["accuracy"].get_lines() if line.get_linestyle() == "-"]
    assert len(train_accuracy) == 1 and list(train_accuracy[0].get_xdata()) == list(range(1, 61))
    assert list(train_accuracy[0].get_ydata()) == [r["accuracy"] for r in records if r["kind"] == "train"]
    low, high = axes["loss"].get_ylim()
    settled = [r["loss"] for r in records if r["kind"] == "train" and r["update"] > 6] + [0.35]
    assert low <= min(settled) and max(settled) <= high < 2.0, (low, high)  # not stretched up to 40
    assert axes["loss"].get_yscale() == "linear"
    low, high = axes["accuracy"].get_ylim()
    assert low > 0.5 and high >= 0.9


def test_names_are_directory_names_made_unique():
    assert plot.run_names(["/x/a/out", "/x/b/out", "/x/c/run"]) == ["a/out", "b/out", "c/run"]
    assert plot.run_names(["/x/p1", "/x/p2"]) == ["p1", "p2"]


@pytest.mark.parametrize("case", ["missing", "not_a_dir", "no_metrics", "empty", "corrupt", "not_a_record"])
def test_bad_input_one_line_exit_2(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case == "not_a_dir":
        run.write_text("x")
    elif case != "missing":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text("\n")
    elif case == "corrupt":
        (run / "metrics.jsonl").write_text(json.dumps(mnist_records()[0]) + "\n{\"kind\": \"tra\n")
    elif case == "not_a_record":
        (run / "metrics.jsonl").write_text("[1, 2]\n")
    code, out, err = run_main([run], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(run) in lines[0], err
    if case == "corrupt":
        assert "line 2" in lines[0]
    assert not list(tmp_path.rglob("*.png"))


def test_plot_runs_never_raises(tmp_path, capsys):
    good = write_run(tmp_path / "good", mnist_records())
    assert plot.plot_runs([good], good / "curves.png") is True
    assert plot.plot_runs(good, tmp_path / "single.png") is True          # one path, not a list
    assert plot.plot_runs([tmp_path / "missing"], tmp_path / "x.png") is False
    assert plot.plot_runs([good], tmp_path / "no" / "such" / "dir.png") is False
    capsys.readouterr()
