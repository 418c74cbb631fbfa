"""Users arriving from other tools: each tool's documented options go through
--print_config and a short run (a few updates on the tiny MNIST of conftest).

ESPnet2, kanachan, HetSeq and TextBox option names; the Accelerate launcher
and the trainer-side behaviours are tested elsewhere."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import read_jsonl, run_main
from textbox_like.resolve.resolution import parse


def printed(capsys, *args):
    from textbox_like.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in args] + ["--print_config"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return yaml.safe_load(out.out), out.err


def short_run(data, save_dir, *extra):
    args = ["--task", "mnist", "--data", str(data), "--log-format", "none", "--save-dir", str(save_dir),
            "--max-update", "3", "--log-interval", "1"]
    return run_main(args + [str(a) for a in extra])


def train_records(save_dir):
    return [r for r in read_jsonl(Path(save_dir) / "metrics.jsonl") if r["kind"] == "train"]

# ------------------------------------------------------------------ ESPnet2
ESPNET = ["--optim", "adadelta", "--optim_conf", "{rho: 0.8}", "--scheduler", "ReduceLROnPlateau",
          "--scheduler_conf", "{patience: 0, factor: 0.5}", "--ngpu", "1", "--valid_batch_size", "16",
          "--resume", "true", "--cudnn_deterministic", "true", "--find_unused_parameters=True",
          "--max-sentences", "32", "--accum_grad", "1", "--seed", "3"]


def test_espnet2_print_config(capsys, small_mnist_dir, tmp_path):
    data, _ = printed(capsys, "--data", small_mnist_dir, "--save-dir", tmp_path / "o", *ESPNET)
    assert data["optimizer"] == "adadelta" and data["lr_scheduler"] == "ReduceLROnPlateau"
    assert data["resume"] is True and data["cudnn_deterministic"] is True
    assert data["find_unused_parameters"] is True
    assert data["distributed_world_size"] == 1 and data["ngpu"] == 1
    assert data["max_sentences_valid"] == 16
    conf = data["optim_conf"]
    assert conf["rho"] == 0.8 and {"lr", "eps", "weight_decay", "maximize"} <= set(conf)
    assert data["scheduler_conf"]["patience"] == 0 and data["scheduler_conf"]["factor"] == 0.5
    assert data["scheduler_conf"]["mode"] == "max"  # mnist's best metric is accuracy
    assert {"threshold", "cooldown", "min_lr"} <= set(data["scheduler_conf"])


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_espnet2_train_dtype(capsys, dtype):
    data, _ = printed(capsys, "--train_dtype", dtype)
    assert data["train_dtype"] == dtype


def test_espnet2_short_run(small_mnist_dir, tmp_path):
    out = tmp_path / "run"
    assert short_run(small_mnist_dir, out, "--optim", "sgd", "--scheduler", "steplr",
                     "--scheduler_conf", "step_size=1", "--resume", "false", "--ngpu", "1",
                     "--valid_batch_size", "25", "--cudnn_deterministic", "true", "--max-sentences", "32") == 0
    records = train_records(out)
    assert len(records) == 3
    # StepLR steps per epoch: one epoch here, so the LR stays sgd's default 0.1
    assert all(r["lr"] == pytest.approx(0.1) for r in records), records
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optimizer"] == "sgd" and saved["scheduler_conf"]["step_size"] == 1


# ------------------------------------------------------------------ kanachan
def kanachan_args(data, prefix):
    return ["--training-data", data, "--validation-data", data, "--learning-rate", "0.002",
            "--epsilon", "1e-7", "--gradient-accumulation-steps", "2", "--max-gradient-norm", "1.0",
            "--num-epochs", "1", "--training-batch-size", "16", "--validation-batch-size", "25",
            "--device", "cpu", "--output-prefix", prefix, "--experiment-name", "exp1",
            "--num-epoch-digits", "3", "--snapshot-interval", "0", "--amp-optimization-level", "O0",
            "--optimizer", "lamb"]


def test_kanachan_print_config(capsys, small_mnist_dir, tmp_path):
    data, err = printed(capsys, *kanachan_args(small_mnist_dir, tmp_path), "--checkpointing",
                        "--dim-final-feedforward", "64")
    assert data["data"] == str(small_mnist_dir)
    assert data["lr"] == [0.002] and data["optim_conf"]["lr"] == 0.002
    assert data["epsilon"] == 1e-7 and data["optim_conf"]["eps"] == 1e-7 and data["lamb_eps"] == 1e-7
    assert data["update_freq"] == [2] and data["clip_norm"] == 1.0 and data["max_epoch"] == 1
    assert data["max_sentences"] == 16 and data["max_sentences_valid"] == 25
    assert data["device"] == "cpu" and data["cpu"] is True
    assert data["save_dir"] == str(tmp_path / "exp1")
    assert data["num_epoch_digits"] == 3 and data["snapshot_interval"] == 0
    assert data["checkpointing"] is True and data["train_dtype"] == "float32"
    assert "--dim-final-feedforward" in err and len(err.strip().splitlines()) == 1


def test_kanachan_optimizer_dependent_defaults(capsys):
    assert printed(capsys, "--optimizer", "lamb")[0]["optim_conf"]["eps"] == 1e-6
    assert printed(capsys, "--optimizer", "sgd")[0]["lr"] == [0.1]
    for name in ("radam", "lamb"):
        assert printed(capsys, "--optimizer", name)[0]["lr"] == [0.001]
    assert printed(capsys, "--task", "bert", "--optimizer", "adamw")[0]["lr"] == [0.001]
    # mnist's recipe keeps its lr with its own optimizer, and a given lr always wins
    assert printed(capsys, "--task", "mnist")[0]["lr"] == [0.003]
    assert printed(capsys, "--task", "mnist", "--optimizer", "adam")[0]["lr"] == [0.003]
    assert printed(capsys, "--optimizer", "sgd", "--lr", "0.5")[0]["lr"] == [0.5]


def test_kanachan_optimizer_default_lr_not_when_a_config_file_gives_it(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.02\n")
    assert printed(capsys, "--config", path, "--optimizer", "sgd")[0]["lr"] == [0.02]


def test_kanachan_experiment_name_defaults_to_a_timestamp(capsys, tmp_path, monkeypatch):
    import re
    monkeypatch.delenv("TEXTBOX_LIKE_EXPERIMENT_NAME", raising=False)
    data, _ = printed(capsys, "--output-prefix", tmp_path)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-\d\d-\d\d-\d\d", data["experiment_name"])
    assert data["save_dir"] == str(tmp_path / data["experiment_name"])


def test_kanachan_amp_level_says_what_it_does(capsys):
    data, err = printed(capsys, "--amp-optimization-level", "O2")
    assert data["train_dtype"] == "float16"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "O2" in lines[0] and "float16" in lines[0]


def test_kanachan_short_run(small_mnist_dir, tmp_path):
    assert short_run(small_mnist_dir, tmp_path / "ignored", *kanachan_args(small_mnist_dir, tmp_path)) == 0
    out = tmp_path / "exp1"
    assert (out / "config.yaml").is_file()
    records = train_records(out)
    assert len(records) == 3
    assert all(r["lr"] <= 0.002 for r in records)


# ------------------------------------------------------------------ HetSeq
def hetseq_args(data, save_dir):
    return ["--task", "mnist", "--optimizer", "adadelta", "--lr-scheduler", "PolynomialDecayScheduler",
            "--data", data, "--clip-norm", "100", "--max-sentences", "30", "--fast-stat-sync",
            "--max-epoch", "1", "--update-freq", "1", "--valid-subset", "test", "--num-workers", "2",
            "--warmup-updates", "0", "--total-num-update", "50000", "--lr", "1.01", "--save-dir", save_dir,
            "--dadelta_weight_decay", "0.001", "--required-batch-size-multiple", "8"]


def test_hetseq_print_config(capsys, small_mnist_dir, tmp_path):
    data, err = printed(capsys, *hetseq_args(small_mnist_dir, tmp_path))
    assert data["adadelta_weight_decay"] == 0.001 and data["optim_conf"]["weight_decay"] == 0.001
    assert data["fast_stat_sync"] is True
    assert data["max_sentences"] == 24 and "rounded" in err
    assert data["lr"] == [1.01]
    data, _ = printed(capsys, *hetseq_args(small_mnist_dir, tmp_path), "--adadelta_weight_decay", "0.5")
    assert data["optim_conf"]["weight_decay"] == 0.5


def test_hetseq_short_run_from_torchvision_processed_files(small_mnist_dir, tmp_path):
    import torch
    from textbox_like.data.mnist import load_split
    root = tmp_path / "tv"
    (root / "MNIST" / "processed").mkdir(parents=True)
    for split, name in (("train", "training.pt"), ("test", "test.pt")):
        images, labels = load_split(small_mnist_dir, split)
        torch.save((torch.from_numpy(images.copy()), torch.from_numpy(labels.astype("int64"))),
                   root / "MNIST" / "processed" / name)
    out = tmp_path / "run"
    args = hetseq_args(root, out)
    args[args.index("--max-epoch") + 1] = "1"
    assert run_main(args + ["--max-update", "3", "--log-format", "none", "--log-interval", "1"]) == 0
    assert len(train_records(out)) == 3


# ------------------------------------------------------------------ TextBox
def test_textbox_print_config(capsys, tmp_path):
    data, _ = printed(capsys, "--gpu_id", "0,1", "--epochs", "2", "--learning_rate", "0.01",
                      "--train_batch_size", "16", "--eval_batch_size", "32", "--accumulation_steps", "2",
                      "--grad_clip", "0.5", "--saved_dir", tmp_path, "--seed", "5")
    assert data["gpu_id"] == "0,1" and data["max_epoch"] == 2 and data["lr"] == [0.01]
    assert data["max_sentences"] == 16 and data["max_sentences_valid"] == 32
    assert data["update_freq"] == [2] and data["clip_norm"] == 0.5 and data["save_dir"] == str(tmp_path)


def test_textbox_short_run(small_mnist_dir, tmp_path):
    out = tmp_path / "run"
    assert short_run(small_mnist_dir, out, "--gpu_id", "0", "--cpu", "--learning_rate", "0.001",
                     "--train_batch_size", "16", "--eval_batch_size", "25", "--saved_dir", out) == 0
    assert len(train_records(out)) == 3


# ------------------------------------------------------------------ rewrites onto ours
def tiny_bert_dir(path):
    """A save_pretrained directory as far as sizing goes: its config.json."""
    import json
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 2,
                                                  "num_hidden_layers": 2, "intermediate_size": 512,
                                                  "vocab_size": 100}))
    return path


@pytest.mark.parametrize("flag", ["--init-checkpoint", "--model_path", "--initial-encoder"])
def test_every_spelling_of_initial_weights_sizes_the_model_from_its_config_json(capsys, tmp_path, flag):
    weights = tiny_bert_dir(tmp_path / "exported")
    data, _ = printed(capsys, "--task", "bert", flag, weights)
    assert data["init_checkpoint"] == str(weights)
    assert (data["dimension"], data["num_heads"], data["num_layers"], data["dim_feedforward"]) == (128, 2, 2, 512)


def test_rewritten_values_name_the_other_tools_option(small_mnist_dir, tmp_path):
    from textbox_like.resolve.resolution import parse
    cfg = parse(["--task", "mnist", "--training-data", str(small_mnist_dir), "--ngpu", "0"])
    assert cfg.data.data == str(small_mnist_dir) and cfg.runtime.cpu is True
    assert cfg.source("data") == "command line (kanachan --training-data)"
    assert cfg.source("cpu") == "command line (ESPnet2 --ngpu)"
    assert cfg.source("ngpu") == "command line"
    cfg = parse(["--task", "mnist", "--device", "cpu", "--amp-optimization-level", "O1",
                 "--output-prefix", str(tmp_path), "--experiment-name", "e"])
    assert cfg.source("cpu") == "command line (kanachan --device)"
    assert cfg.source("train_dtype") == "command line (kanachan --amp-optimization-level)"
    assert cfg.source("save_dir") == "command line (kanachan --output-prefix)"
    weights = tiny_bert_dir(tmp_path / "exported")
    path = tmp_path / "c.yaml"
    path.write_text(f"model_path: {weights}\n")
    cfg = parse(["--task", "bert", "--config", str(path)])
    assert cfg.source("init_checkpoint") == f"--config {path} (TextBox --model_path)"
    cfg = parse(["--task", "bert", "--init-checkpoint", str(weights), "--initial-encoder", str(weights)])
    assert cfg.source("init_checkpoint") == "command line"   # given itself: the alias changes nothing


def test_a_derived_configuration_says_where_its_changes_came_from():
    from textbox_like.resolve.resolution import parse
    cfg = parse(["--task", "mnist", "--max-update", "4"])
    changed = cfg.replace("the search", max_update=5, lr=[0.5])
    assert changed.source("max_update") == "the search" and changed.source("lr") == "the search"
    assert cfg.source("max_update") == "command line" and changed.source("task") == cfg.source("task")
    assert cfg.replace(max_update=6).source("max_update") == "RunConfig.replace()"


def test_an_alias_names_its_tool_as_the_source():
    from textbox_like.resolve.resolution import parse
    cfg = parse(["--task", "mnist", "--learning-rate", "0.01", "--accum_grad", "2", "--update-freq", "3"])
    assert cfg.source("lr") == "command line (kanachan --learning-rate)"
    assert cfg.source("update_freq") == "command line" and cfg.schedule.update_freq == [3]  # the last one given


def test_other_tools_users_hear_where_our_defaults_differ(small_mnist_dir, tmp_path):
    import contextlib
    import io
    from textbox_like import cli
    from textbox_like.config.compat import default_notes
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert short_run(small_mnist_dir, tmp_path / "run", "--learning-rate", "0.01", "--disable-validation",
                         "--log-format", "simple") == 0
    start = [line for line in err.getvalue().splitlines() if line.startswith("task mnist |")]
    assert len(start) == 1 and start[0].endswith(
        " | kanachan's defaults differ from ours here: --optimizer adam (kanachan: lamb), --clip-norm 0 "
        "(kanachan: 1), --num-workers 0 (kanachan: 2); give them to train with kanachan's"), err.getvalue()[-2000:]
    # given values need no word, nor do our own spellings
    assert default_notes(parse(["--learning-rate", "0.01", "--optimizer", "lamb", "--max-gradient-norm", "1",
                                    "--num-workers", "2"])) == []
    assert default_notes(parse(["--task", "mnist", "--lr", "0.01", "--max-update", "1"])) == []
    textbox = default_notes(parse(["--task", "mnist", "--epochs", "2"]))
    assert len(textbox) == 1 and "--seed 1 (TextBox: 2020)" in textbox[0] and "--max-epoch" not in textbox[0]
    espnet = default_notes(parse(["--task", "mnist", "--ngpu", "0"]))
    assert len(espnet) == 1 and "--cudnn-deterministic false (ESPnet2: true)" in espnet[0]
    hetseq = default_notes(parse(["--task", "mnist", "--fast-stat-sync", "--seed", "19940802"]))
    assert len(hetseq) == 1 and "--clip-norm 0 (HetSeq: 25)" in hetseq[0] and "--seed" not in hetseq[0]


# ------------------------------------------------------------------ issue 29, item 9: ESPnet2's users
def test_espnet2_optim_conf_key_of_another_optimizer_names_it(capsys):
    """ESPnet2's documented --optim_conf rho=0.8 is adadelta's: the line says so."""
    from textbox_like.cli import main
    capsys.readouterr()
    assert main(["--task", "mnist", "--optim_conf", "rho=0.8", "--print_config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'rho' in --optim_conf for optimizer adam" in err[0]
    assert "'rho' is an option of adadelta: add --optim adadelta" in err[0], err


def test_espnet2_batch_size_that_does_not_divide_becomes_the_global_batch(capsys):
    data, err = printed(capsys, "--task", "mnist", "--batch_size", "9", "--ngpu", "2")
    assert data["global_batch_size"] == 9 and "--global-batch-size 9, split over them" in err
    data, _ = printed(capsys, "--task", "mnist", "--batch_size", "9", "--ngpu", "1")
    assert data["global_batch_size"] is None and data["max_sentences"] == 9    # one process: nothing to split
    data, _ = printed(capsys, "--task", "mnist", "--max-sentences", "10", "--ngpu", "2")
    assert data["global_batch_size"] is None and data["max_sentences"] == 10   # ours is per process


@pytest.mark.parametrize("option", ["--encoder_conf", "--decoder_conf"])
def test_espnet2_encoder_and_decoder_conf_say_our_models_have_no_such_parts(capsys, tmp_path, option):
    from textbox_like.cli import main
    capsys.readouterr()
    assert main(["--task", "mnist", option, "hidden=3", "--print_config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "have no separate encoder/decoder parts" in err[0] and "--model_conf" in err[0], err
    path = tmp_path / "c.yaml"
    path.write_text(f"{option[2:]}: {{hidden: 3}}\n")
    assert main(["--task", "mnist", "--config", str(path), "--print_config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "--model_conf" in err[0], err


# ------------------------------------------------------------------ issue 29, item 10: HetSeq's and kanachan's users
def test_kanachan_users_hear_every_default_of_theirs_left_unset():
    """kanachan's sgd has momentum 0.9 and lr 0.1, its adam/radam/lamb lr
    0.001, its loader 2 workers: each unset one that differs is named."""
    from textbox_like import cli
    from textbox_like.config.compat import default_notes
    sgd = default_notes(parse(["--task", "mnist", "--training-batch-size", "8", "--optimizer", "sgd"]))
    assert len(sgd) == 1 and "--momentum 0 (kanachan: 0.9)" in sgd[0] and "--num-workers 0 (kanachan: 2)" in sgd[0]
    assert "--lr" not in sgd[0]                     # sgd's 0.1 is kanachan's too
    adam = default_notes(parse(["--task", "bert", "--training-batch-size", "8", "--optimizer", "adam"]))
    assert len(adam) == 1 and "--lr 0.0001 (kanachan: 0.001)" in adam[0] and "--momentum" not in adam[0]
    mnist = default_notes(parse(["--task", "mnist", "--training-batch-size", "8"]))
    assert "--lr 0.003 (kanachan: 0.001)" in mnist[0]
    given = default_notes(parse(["--task", "mnist", "--training-batch-size", "8", "--optimizer", "sgd",
                                     "--momentum", "0.9", "--num-workers", "2", "--max-gradient-norm", "1"]))
    assert given == []

HETSEQ_ONE_NODE = ["--task", "mnist", "--optimizer", "adadelta", "--max-sentences", "64", "--fast-stat-sync",
                   "--max-epoch", "1"]


def test_hetseq_command_without_a_world_size_uses_every_visible_gpu(capsys):
    """HetSeq's several-GPUs-on-one-node commands give no world size: every
    visible GPU (here 4, faked: this machine has none) gets a process."""
    from textbox_like import cli
    from textbox_like.launch import apply_hetseq_gpus
    cfg = parse(HETSEQ_ONE_NODE)
    capsys.readouterr()
    four = apply_hetseq_gpus(cfg, device_count=4)
    assert four.distributed.distributed_world_size == 4
    assert four.source("distributed_world_size") == "HetSeq's default (every visible GPU)"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training on all 4 visible GPUs" in err[0] and "--distributed-world-size 1" in err[0]
    # one GPU or none, a world size, --cpu, a launcher's placement, our own spellings: unchanged
    assert apply_hetseq_gpus(cfg, device_count=1).distributed.distributed_world_size == 1
    assert apply_hetseq_gpus(cfg, device_count=0).distributed.distributed_world_size == 1
    for extra in (["--distributed-world-size", "1"], ["--cpu"], ["--device-id", "0"]):
        assert apply_hetseq_gpus(parse(HETSEQ_ONE_NODE + extra), device_count=4) \
            .distributed.distributed_world_size == 1, extra
    ours = parse(["--task", "mnist", "--max-sentences", "64"])
    assert apply_hetseq_gpus(ours, device_count=4).distributed.distributed_world_size == 1
    import os
    os.environ.update(RANK="0", WORLD_SIZE="1")   # torchrun/accelerate placed this process
    assert apply_hetseq_gpus(cfg, device_count=4).distributed.distributed_world_size == 1
    assert "visible GPUs" not in capsys.readouterr().err
