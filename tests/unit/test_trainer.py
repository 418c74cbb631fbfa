"""The training loop: stopping, accumulation, precision, clipping, validation,
logging, outputs in --save-dir, checkpoints, seeding."""
from __future__ import annotations

import argparse
import json
import socket

import numpy as np
import pytest
import torch

from conftest import N_SMALL_TRAIN as N_TRAIN, base_args, read_jsonl, run_main


TRAIN_FIELDS = ["epoch", "update", "loss", "accuracy", "lr", "gnorm", "samples_per_s", "updates_per_s", "wall"]


def train(data, out, *extra, max_update=4, rc=0):
    got = run_main(base_args(data, out, *extra, max_update=max_update))
    assert got == rc
    return out


def results(out):
    return json.loads((out / "results.json").read_text())


def records(out, kind=None):
    rows = read_jsonl(out / "metrics.jsonl")
    return [r for r in rows if kind is None or r["kind"] == kind]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def initial_model(seed=1, **conf):
    from accelerate.utils import set_seed

    from textbox_like.models.mnist_cnn import MNISTNet
    set_seed(seed)
    return MNISTNet(**conf)


def flat(state):
    return torch.cat([v.detach().float().reshape(-1) for k, v in sorted(state.items())])


# ---------------------------------------------------------------- logging and outputs
def test_metrics_jsonl_train_and_valid_records(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--log-interval", "2", "--validate-interval-updates", "2",
                "--clip-norm", "0")
    rows = records(out)
    assert all(r["kind"].startswith(("train", "valid")) for r in rows)
    train_rows = records(out, "train")
    assert [r["update"] for r in train_rows] == [2, 4]
    for r in train_rows:
        for field in TRAIN_FIELDS:
            assert field in r, (field, r)
            assert r[field] is not None, (field, r)  # gnorm logged although clipping is off
        assert r["epoch"] == 1
        assert r["gnorm"] > 0 and r["samples_per_s"] > 0 and r["updates_per_s"] > 0 and r["wall"] > 0
        assert 0.0 <= r["accuracy"] <= 1.0
    valid_rows = records(out, "valid")
    assert [r["update"] for r in valid_rows] == [2, 4]
    for r in valid_rows:
        for field in ("epoch", "update", "loss", "accuracy"):
            assert field in r


def test_peak_resident_set_per_rank_on_cpu(small_mnist_dir, tmp_path):
    """On CPU the log's peak memory is the process's peak resident set, under
    its own key (peak_mem_gib is the CUDA allocator's): at least what the
    process held before the run, at most its peak after it."""
    import resource
    held_before = next(int(line.split()[1]) for line in open("/proc/self/status")
                       if line.startswith("VmRSS:")) / 2 ** 20  # KiB
    out = train(small_mnist_dir, tmp_path / "o", "--log-interval", "2", max_update=4)
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
    rows = records(out, "train")
    assert len(rows) == 2
    for r in rows:
        (peak,) = r["peak_rss_gib"]  # one figure per rank, rounded to 3 decimals
        assert held_before - 0.001 <= peak <= peak_after + 0.001, (held_before, r, peak_after)
        assert "peak_mem_gib" not in r


def test_simple_log_lines(small_mnist_dir, tmp_path, capsys):
    train(small_mnist_dir, tmp_path / "o", "--log-format", "simple", "--log-interval", "1", max_update=2)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train |")]
    assert len(lines) == 2, err
    for line in lines:
        for field in TRAIN_FIELDS:
            assert f" {field} " in f" {line} ", (field, line)


def test_json_log_lines(small_mnist_dir, tmp_path, capsys):
    train(small_mnist_dir, tmp_path / "o", "--log-format", "json", "--log-interval", "1", max_update=2)
    err = capsys.readouterr().err
    rows = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    assert len(train_rows) == 2
    for r in train_rows:
        assert all(field in r for field in TRAIN_FIELDS)


@pytest.mark.parametrize("fmt", ["none", "tqdm"])
def test_other_log_formats_run(small_mnist_dir, tmp_path, capsys, fmt):
    out = train(small_mnist_dir, tmp_path / "o", "--log-format", fmt, "--log-interval", "1", max_update=2)
    err = capsys.readouterr().err
    assert "train |" not in err
    if fmt == "none":
        assert "loss" not in err
    assert len(records(out, "train")) == 2  # metrics.jsonl whatever the format


def test_results_json(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--validate-interval-updates", "2", max_update=4)
    res = results(out)
    assert res["num_updates"] == 4
    assert res["wall_time"] > 0
    for key in ("final", "best"):
        assert set(res[key]) >= {"loss", "accuracy"}
    valid = records(out, "valid")
    assert res["final"]["accuracy"] == pytest.approx(valid[-1]["accuracy"])
    assert res["best"]["accuracy"] == pytest.approx(max(r["accuracy"] for r in valid))


# ---------------------------------------------------------------- checkpoints
def test_checkpoints_load_with_weights_only(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", max_update=2)
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        state = load(out / name)
        model = initial_model()
        model.load_state_dict(state["model"])
    last = load(out / "checkpoint_last.pt")
    assert last["train"]["num_updates"] == 2


def test_no_save_writes_nothing(small_mnist_dir, tmp_path):
    out = tmp_path / "o"
    train(small_mnist_dir, out, "--no-save", "--validate-interval-updates", "1", max_update=2)
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("metric,maximize", [("accuracy", None), ("loss", None), ("loss", "false"),
                                             ("loss", "true")])
def test_best_checkpoint_metric(small_mnist_dir, tmp_path, metric, maximize):
    extra = ["--best-checkpoint-metric", metric, "--validate-interval-updates", "1", "--max-sentences-valid", "100"]
    if maximize is not None:
        extra += ["--maximize-best-checkpoint-metric", maximize]
    out = train(small_mnist_dir, tmp_path / "o", *extra, max_update=4)
    valid = records(out, "valid")
    assert [r["update"] for r in valid] == [1, 2, 3, 4]
    values = [r[metric] for r in valid]
    higher = maximize == "true" or maximize is None and metric == "accuracy"  # loss: lower is better
    best_value = max(values) if higher else min(values)
    best_update = valid[values.index(best_value)]["update"]  # first reaching the best
    best = load(out / "checkpoint_best.pt")
    assert best["train"]["num_updates"] == best_update, (values, best["train"])
    assert results(out)["best"][metric] == pytest.approx(best_value)


def test_textbox_metrics_for_best_model_takes_the_direction_of_its_metric(small_mnist_dir, tmp_path, capsys):
    out = train(small_mnist_dir, tmp_path / "o", "--metrics_for_best_model", "['loss']", "--log-format", "simple",
                "--validate-interval-updates", "1", "--max-sentences-valid", "100", max_update=4)
    valid = records(out, "valid")
    values = [r["loss"] for r in valid]
    assert load(out / "checkpoint_best.pt")["train"]["num_updates"] == valid[values.index(min(values))]["update"]
    assert "best loss (lower is better)" in capsys.readouterr().err  # the start line says the direction used


def test_unknown_best_checkpoint_metric_is_a_user_error(small_mnist_dir, tmp_path, capsys):
    train(small_mnist_dir, tmp_path / "o", "--best-checkpoint-metric", "accuracyy", max_update=1, rc=2)
    err = capsys.readouterr().err
    assert "error:" in err and "accuracy" in err


# ---------------------------------------------------------------- stopping
@pytest.mark.parametrize("extra,updates,epochs", [
    (["--max-epoch", "1", "--max-sentences", "64"], N_TRAIN // 64, 1),    # epoch first (max-update 100)
    (["--max-epoch", "5", "--max-sentences", "64"], 3, 0),               # update first
    (["--max-epoch", "3", "--num_iters_per_epoch", "2"], 6, 3),          # capped epochs
])
def test_stop_at_max_epoch_or_max_update(small_mnist_dir, tmp_path, extra, updates, epochs):
    max_update = 100 if updates != 3 else 3
    out = train(small_mnist_dir, tmp_path / "o", "--disable-validation", "--log-interval", "1", *extra,
                max_update=max_update)
    res = results(out)
    assert res["num_updates"] == updates
    assert res["epochs_completed"] == epochs
    rows = records(out, "train")
    assert len(rows) == updates
    if "--num_iters_per_epoch" in extra:
        assert [r["epoch"] for r in rows] == [1, 1, 2, 2, 3, 3]


def test_max_epoch_without_max_update(small_mnist_dir, tmp_path):
    out = tmp_path / "o"
    assert run_main(["--task", "mnist", "--data", str(small_mnist_dir), "--max-sentences", "128", "--max-epoch", "2",
                     "--max-update", "0", "--log-format", "none", "--disable-validation",
                     "--save-dir", str(out)]) == 0
    assert results(out)["num_updates"] == 2 * N_TRAIN // 128


# ---------------------------------------------------------------- accumulation
@pytest.mark.parametrize("flag", ["--update-freq", "--accum_grad"])
def test_update_freq_counts_updates(small_mnist_dir, tmp_path, flag):
    out = train(small_mnist_dir, tmp_path / "o", flag, "2", "--max-sentences", "64", "--max-epoch", "1",
                "--disable-validation", max_update=100)
    assert results(out)["num_updates"] == N_TRAIN // 64 // 2


def test_update_freq_per_epoch(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--update-freq", "4,2,1", "--max-sentences", "32", "--max-epoch", "3",
                "--disable-validation", "--log-interval", "1", max_update=1000)
    per_epoch = [sum(1 for r in records(out, "train") if r["epoch"] == e) for e in (1, 2, 3)]
    assert per_epoch == [2, 4, 8]
    assert results(out)["num_updates"] == 14


def test_accumulation_plans_cover_the_same_samples():
    """Two batches of 16 per update are the one batch of 32, in the same order."""
    from textbox_like.data.iterators import plan_fixed
    small, large = plan_fixed(N_TRAIN, [16]), plan_fixed(N_TRAIN, [32])
    assert len(small) == 2 * len(large)
    for u, row in enumerate(large):
        assert (small[2 * u, 0], small[2 * u + 1, 1]) == (row[0], row[1])
        assert small[2 * u, 1] == small[2 * u + 1, 0]


@pytest.mark.parametrize("shuffle", [False, True])
def test_gradient_accumulation_equivalence(small_mnist_dir, tmp_path, shuffle):
    common = ["--optimizer", "sgd", "--lr", "0.05", "--lr-scheduler", "constant", "--warmup-updates", "0",
              "--clip-norm", "0",
              "--model_conf", "dropout1=0", "--model_conf", "dropout2=0", "--disable-validation"]
    if not shuffle:
        common.append("--no-shuffle")
    a = train(small_mnist_dir, tmp_path / "a", *common, "--update-freq", "2", "--max-sentences", "16", max_update=3)
    b = train(small_mnist_dir, tmp_path / "b", *common, "--update-freq", "1", "--max-sentences", "32", max_update=3)
    sa, sb = load(a / "checkpoint_last.pt")["model"], load(b / "checkpoint_last.pt")["model"]
    init = initial_model(hidden=128, dropout1=0, dropout2=0).state_dict()
    moved = (flat(sb) - flat(init)).abs().max().item()
    assert moved > 1e-4  # the runs did train
    for key in sb:
        assert torch.allclose(sa[key], sb[key], atol=1e-5, rtol=1e-5), key


# ---------------------------------------------------------------- clipping
def test_clip_norm_clips_and_logs_pre_clip_norm(small_mnist_dir, tmp_path):
    clip, lr = 1e-3, 1.0
    out = train(small_mnist_dir, tmp_path / "o", "--optimizer", "sgd", "--lr", lr, "--lr-scheduler", "constant",
                "--warmup-updates", "0",
                "--clip-norm", clip, "--log-interval", "1", "--disable-validation", max_update=1)
    gnorm = records(out, "train")[0]["gnorm"]
    assert gnorm > 10 * clip  # the norm before clipping
    step = flat(load(out / "checkpoint_last.pt")["model"]) - flat(initial_model().state_dict())
    assert step.norm().item() == pytest.approx(lr * clip, rel=1e-2)


def test_clip_norm_zero_disables_clipping(small_mnist_dir, tmp_path):
    lr = 0.01
    out = train(small_mnist_dir, tmp_path / "o", "--optimizer", "sgd", "--lr", lr, "--lr-scheduler", "constant",
                "--warmup-updates", "0",
                "--clip-norm", "0", "--log-interval", "1", "--disable-validation", max_update=1)
    gnorm = records(out, "train")[0]["gnorm"]
    step = flat(load(out / "checkpoint_last.pt")["model"]) - flat(initial_model().state_dict())
    assert step.norm().item() == pytest.approx(lr * gnorm, rel=1e-3)


# ---------------------------------------------------------------- validation
def test_validate_interval_updates(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--validate-interval-updates", "3", max_update=7)
    updates = [r["update"] for r in records(out, "valid")]
    assert 3 in updates and 6 in updates
    assert set(updates) <= {3, 6, 7}
    assert results(out)["final"]


def test_an_update_interval_alone_validates_by_updates_not_again_at_an_epochs_end(small_mnist_dir, tmp_path):
    """8 updates an epoch, every 5 updates: 5 and the last, 10; not 8 too (a
    seq2seq run validated, and generated, at its epoch's end 94 and again at
    100). With --validate-interval given as well, both schedules hold."""
    assert N_TRAIN // 32 == 8
    out = train(small_mnist_dir, tmp_path / "o", "--validate-interval-updates", "5", "--max-epoch", "2",
                max_update=10)
    assert [r["update"] for r in records(out, "valid")] == [5, 10]
    both = train(small_mnist_dir, tmp_path / "b", "--validate-interval-updates", "5", "--validate-interval", "1",
                 "--max-epoch", "2", max_update=10)
    assert [r["update"] for r in records(both, "valid")] == [5, 8, 10]


def test_an_update_interval_that_falls_on_an_epochs_end_validates_there(small_mnist_dir, tmp_path):
    """Update 8 ends epoch 1 and is due by --validate-interval-updates 4, though
    --validate-interval 2 does not make epoch 1 due; the last epoch validates too."""
    out = train(small_mnist_dir, tmp_path / "o", "--validate-interval-updates", "4", "--validate-interval", "2",
                "--max-epoch", "3", max_update=100)
    assert [r["update"] for r in records(out, "valid")] == [4, 8, 12, 16, 20, 24]
    out = train(small_mnist_dir, tmp_path / "e", "--validate-interval", "2", "--max-epoch", "3", max_update=100)
    assert [r["update"] for r in records(out, "valid")] == [16, 24]


def test_validate_interval_epochs(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--validate-interval", "2", "--num_iters_per_epoch", "2",
                "--max-epoch", "4", max_update=100)
    updates = [r["update"] for r in records(out, "valid")]
    assert updates == [4, 8]


def test_disable_validation(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--disable-validation", "--validate-interval-updates", "1",
                max_update=3)
    assert records(out, "valid") == []
    assert not any(r["kind"].startswith("valid") for r in records(out))


def test_several_valid_subsets(small_mnist_dir, tmp_path):
    out = train(small_mnist_dir, tmp_path / "o", "--valid-subset", "test,train", max_update=2)
    kinds = {r["kind"] for r in records(out)}
    assert {"valid_test", "valid_train"} <= kinds
    test_row = [r for r in records(out) if r["kind"] == "valid_test"][-1]
    assert results(out)["final"]["accuracy"] == pytest.approx(test_row["accuracy"])


# ---------------------------------------------------------------- precision
def test_mixed_precision_choice():
    from textbox_like.parallel.accelerator import mixed_precision

    def cfg(**kw):
        base = {"train_dtype": "float32", "fp16": False, "bf16": False}
        return argparse.Namespace(**{**base, **kw})

    assert mixed_precision(cfg(), cuda=False) == "no"
    assert mixed_precision(cfg(bf16=True), cuda=False) == "bf16"
    assert mixed_precision(cfg(train_dtype="bfloat16"), cuda=False) == "bf16"
    assert mixed_precision(cfg(fp16=True), cuda=True) == "fp16"
    assert mixed_precision(cfg(train_dtype="float16"), cuda=True) == "fp16"
    assert mixed_precision(cfg(fp16=True), cuda=False) == "bf16"


@pytest.mark.parametrize("extra,precision,warns", [
    (["--bf16"], "bf16", False),
    (["--train_dtype", "bfloat16"], "bf16", False),
    (["--fp16"], "bf16", True),
    (["--train_dtype", "float16"], "bf16", True),
    (["--train_dtype", "float32"], "float32", False),
])
def test_precision_runs_on_cpu(small_mnist_dir, tmp_path, capsys, extra, precision, warns):
    out = train(small_mnist_dir, tmp_path / "o", *extra, "--log-format", "simple", "--log-interval", "1",
                "--disable-validation", max_update=2)
    err = capsys.readouterr().err
    assert f"precision {precision}" in err, err
    assert ("warning" in err.lower() and "bfloat16" in err) == warns, err
    assert all(np.isfinite(r["loss"]) for r in records(out, "train"))


# ---------------------------------------------------------------- seeding
def test_seed_makes_runs_repeatable(small_mnist_dir, tmp_path):
    a = train(small_mnist_dir, tmp_path / "a", "--seed", "3", "--disable-validation", max_update=2)
    b = train(small_mnist_dir, tmp_path / "b", "--seed", "3", "--disable-validation", max_update=2)
    c = train(small_mnist_dir, tmp_path / "c", "--seed", "4", "--disable-validation", max_update=2)
    fa, fb, fc = (flat(load(d / "checkpoint_last.pt")["model"]) for d in (a, b, c))
    assert torch.equal(fa, fb)
    assert not torch.allclose(fa, fc)


def test_seed_seeds_python_numpy_torch(small_mnist_dir, tmp_path):
    import random

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    train(small_mnist_dir, tmp_path / "a", "--seed", "7", "--disable-validation", "--no-save", max_update=1)
    after_a = draws()
    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)
    train(small_mnist_dir, tmp_path / "b", "--seed", "7", "--disable-validation", "--no-save", max_update=1)
    after_b = draws()
    # the generators' states after the run depend on --seed only
    assert after_a == after_b


def test_num_workers_gives_same_training(small_mnist_dir, tmp_path):
    a = train(small_mnist_dir, tmp_path / "a", "--num-workers", "0", "--disable-validation", max_update=3)
    b = train(small_mnist_dir, tmp_path / "b", "--num-workers", "2", "--disable-validation", max_update=3)
    assert torch.equal(flat(load(a / "checkpoint_last.pt")["model"]), flat(load(b / "checkpoint_last.pt")["model"]))


# ---------------------------------------------------------------- one process, no network
def test_single_process_needs_no_port(small_mnist_dir, tmp_path, monkeypatch):
    """One process must not open a rendezvous port: with the default port
    (29500) taken by something else, a plain run still trains."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    holder = socket.socket()
    try:
        try:
            holder.bind(("0.0.0.0", 29500))
            holder.listen(1)
        except OSError:
            pass  # already taken by something else: the same situation
        train(small_mnist_dir, tmp_path / "o", "--disable-validation", max_update=1)
    finally:
        holder.close()


@pytest.mark.parametrize("metric,higher", [
    ("loss", False), ("mlm_loss", False), ("nsp_loss", False), ("ppl", False), ("perplexity", False),
    ("valid/nll", False), ("WER", False), ("accuracy", True), ("nsp_accuracy", True), ("f1", True),
    ("ROUGE-1", True), ("BLEU", True), ("answer_f1", True), ("lower_bound", True)])
def test_a_metric_takes_its_direction_from_its_name(metric, higher):
    from textbox_like.tasks.base import higher_is_better
    assert higher_is_better(metric) is higher


def test_a_periodic_event_of_ones_own_is_one_class_and_one_line(small_mnist_dir, tmp_path):
    """A new periodic event is one class (an EveryUpdates and what it does)
    and one line (Trainer.add_event): in a real run it fires after every
    third update, and sees that update counted."""
    from test_faults import build_trainer, mnist_args, run_trainer
    from textbox_like.training.due import EveryUpdates

    class RecordUpdates(EveryUpdates):
        def __init__(self, interval):
            super().__init__(interval)
            self.fired = []

        def run(self, trainer):
            self.fired.append((trainer.state.num_updates, trainer.state.samples_trained))

    trainer, _, _ = build_trainer(mnist_args(small_mnist_dir, tmp_path / "out", "--disable-validation",
                                             max_update=10))
    every_third = RecordUpdates(3)
    trainer.add_event(every_third)
    assert run_trainer(trainer) == 0
    assert trainer.state.num_updates == 10
    assert every_third.fired == [(3, 24), (6, 48), (9, 72)]  # 8 samples an update (mnist_args)


def test_an_error_without_a_message_is_named_by_its_type(small_mnist_dir, tmp_path, monkeypatch, capfd):
    """--initial-optimizer whose read fails with an empty message (EOFError()):
    one line naming the error's type, exit 2 (the first line of an empty
    message was an IndexError)."""
    from textbox_like.core.errors import first_line
    assert first_line(KeyError()) == "KeyError" and first_line(ValueError("\n  two\nlines"), 3) == "two"
    path = tmp_path / "optimizer.pt"
    path.write_bytes(b"x")

    def unreadable(*args, **kwargs):
        raise EOFError()
    monkeypatch.setattr(torch, "load", unreadable)
    assert run_main(base_args(small_mnist_dir, tmp_path / "out", "--initial-optimizer", path, max_update=1)) == 2
    err = capfd.readouterr().err
    assert f"--initial-optimizer {path} cannot be read (EOFError)" in err and "Traceback" not in err
