"""The first hour of users from other tools (issue 23): their documented
commands run, or stop with one line naming our counterpart."""
from __future__ import annotations

import pytest
import torch
import yaml

from textbox_like import search as S
from textbox_like.resolve.options import build_options
from textbox_like.cli import main
from textbox_like.resolve.resolution import parse
from textbox_like.core.errors import UserError


NO_CUDA = not torch.cuda.is_available()


def one_error_line(capsys, *args):
    """Run the command line; its exit code and its one stderr line."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return code, err[0]


def notes(capsys, *args):
    capsys.readouterr()
    assert main([str(a) for a in args] + ["--print_config"]) == 0
    out = capsys.readouterr()
    return yaml.safe_load(out.out), [line for line in out.err.splitlines() if line.startswith("note:")]

MNIST = ["--task", "mnist", "--max-update", "1", "--max-sentences", "8"]

# ------------------------------------------------------------------ TextBox
TEXTBOX_SPACE = "learning_rate loguniform (-8, 0)\nembedding_size choice [64, 96, 128]\n" \
                "train_batch_size choice [512, 1024, 2048]\n"


class RecordingRunner:
    """A trial runner that records each trial's resolved configuration and
    writes the results a finished trial would."""

    def __init__(self):
        self.configs = []

    def start(self, cfg, save_dir, env=None):
        import json
        self.configs.append(cfg)
        (save_dir / "results.json").write_text(json.dumps({"best": {"loss": 1.0}, "final": {"loss": 1.0},
                                                           "num_updates": 1}))
        return self

    def poll(self):
        return S.Outcome(0)


def test_textbox_example_space_searches_the_bert_width(tmp_path):
    (tmp_path / "hyperopt_example.test").write_text(TEXTBOX_SPACE)
    space = S.load_space(tmp_path / "hyperopt_example.test", build_options())
    runner = RecordingRunner()
    base = ["--task", "bert", "--model-preset", "tiny", "--data", str(tmp_path), "--max-update", "1",
            "--metrics", "['mlm_accuracy']",
            "--metrics_for_best_model", "['loss']"]
    code, summary = S.run_search(space, "exhaustive", 3, 1, base, tmp_path / "out", runner=runner,
                                 out=lambda *a: None)
    assert code == 0 and summary["n_trials"] == 3
    from textbox_like.tasks import TASKS
    for cfg, record in zip(runner.configs, S.hyper.read_jsonl(tmp_path / "out" / "hyper_results.jsonl")):
        width = record["params"]["model_conf.hidden_size"]
        assert width in (64, 96, 128)
        assert TASKS.get("bert")(cfg).model_config().hidden_size == width      # the model built is that wide
        assert cfg.validation.best_checkpoint_metric == "loss" and cfg.validation.metrics == ["mlm_accuracy"]


def test_textbox_embedding_size_for_mnist_is_one_line(tmp_path):
    (tmp_path / "s.test").write_text(TEXTBOX_SPACE)
    space = S.load_space(tmp_path / "s.test", build_options())
    with pytest.raises(UserError, match=r"s.test line 2: embedding_size: the mnist model has no embedding"):
        S.run_search(space, "exhaustive", 1, 1, MNIST, tmp_path / "out", runner=RecordingRunner(),
                     out=lambda *a: None)


def test_textbox_metrics_we_do_not_report_are_one_line(capsys):
    code, line = one_error_line(capsys, *MNIST, "--metrics=['rouge']")
    assert code == 2 and "--metrics rouge: not reported by task mnist; it reports loss, accuracy" in line
    code, line = one_error_line(capsys, *MNIST, "--metrics_for_best_model=['ROUGE-1']")
    assert code == 2 and "'ROUGE-1' is not a metric of task mnist" in line and "accuracy" in line
    cfg = parse(MNIST + ["--metrics_for_best_model=['accuracy']", "--metrics", "['accuracy', 'loss']"])
    assert cfg.validation.best_checkpoint_metric == "accuracy" and cfg.validation.metrics == ["accuracy", "loss"]


def test_textbox_model_path(capsys, tmp_path):
    code, line = one_error_line(capsys, "--task", "bert", "--max-update", "1", "--model_path", "bert-base-uncased")
    assert code == 2 and "nothing can be downloaded here" in line and "save_pretrained" in line
    code, line = one_error_line(capsys, *MNIST, "--model_path", tmp_path)
    assert code == 2 and "the mnist model starts from random weights only" in line
    weights = tmp_path / "exported"
    weights.mkdir()
    cfg = parse(["--task", "bert", "--max-update", "1", "--model_path", str(weights)])
    assert cfg.task_options.init_checkpoint == str(weights)
    # TextBox's commands give no task: its --model_path names a Hugging Face model, trained by the hf task
    capsys.readouterr()
    assert main(["--max-update", "1", "--model_path=facebook/bart-base"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("note: --model_path facebook/bart-base and no --task: trained by --task hf (any Hugging Face "
                      "model); give --task to choose another")
    assert err[1].startswith("error: --model_path facebook/bart-base: no such directory, and no model") and len(err) == 2


# ------------------------------------------------------------------ kanachan
@pytest.mark.skipif(not NO_CUDA, reason="the machine has a GPU: --device cuda is valid there")
@pytest.mark.parametrize("device", ["cuda", "cuda1", "cuda:0"])
def test_kanachan_device_cuda_without_cuda_is_refused(capsys, device):
    code, line = one_error_line(capsys, *MNIST, "--device", device)
    assert code == 2 and f"--device {device}: this machine has no CUDA GPU; pass --device cpu" in line


@pytest.mark.parametrize("flag", ["--initial-encoder", "--initial-optimizer"])
def test_kanachan_initial_weights_and_resume_exclude_each_other(capsys, tmp_path, flag):
    path = tmp_path / "w.pt"
    path.write_bytes(b"x")
    task = ["--task", "bert", "--max-update", "1"] if flag == "--initial-encoder" else MNIST
    code, line = one_error_line(capsys, *task, flag, path, "--resume")
    assert code == 2 and f"{flag} and --resume exclude each other" in line


def test_kanachan_initial_decoder(capsys, tmp_path):
    path = tmp_path / "w.pt"
    path.write_bytes(b"x")
    bert = ["--task", "bert", "--max-update", "1"]
    cfg = parse(bert + ["--initial-encoder", str(path), "--initial-decoder", str(path)])
    assert cfg.task_options.init_checkpoint == str(path)
    code, line = one_error_line(capsys, *bert, "--initial-decoder", path)
    assert code == 2 and "hold the heads with the encoder; pass that file as --initial-encoder" in line


# ------------------------------------------------------------------ ESPnet2
@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_espnet2_ngpu_without_gpus_says_so(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    data, lines = notes(capsys, *MNIST, "--ngpu", "2")
    assert data["distributed_world_size"] == 2
    assert lines == ["note: --ngpu 2: this machine has no CUDA GPU (CUDA_VISIBLE_DEVICES=2,3); running 2 "
                     "process(es) on CPU"]


def test_espnet2_apex_level_as_train_dtype_names_the_option(capsys):
    code, line = one_error_line(capsys, *MNIST, "--train_dtype", "O1")
    assert code == 2 and "pass --amp-optimization-level O1 (it means --train_dtype float16)" in line


# ------------------------------------------------------------------ HetSeq
def test_hetseq_fast_stat_sync_says_it_changes_nothing(capsys):
    data, lines = notes(capsys, *MNIST, "--fast-stat-sync")
    assert data["fast_stat_sync"] is True and len(lines) == 1 and "--fast-stat-sync changes nothing" in lines[0]


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_hetseq_device_id_on_cpu_says_so(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    data, lines = notes(capsys, *MNIST, "--device-id", "1")
    assert lines == ["note: --device-id 1: this machine has no CUDA GPU; training on CPU"]


def test_hetseq_scheduler_given_as_optimizer_points_at_lr_scheduler(capsys):
    code, line = one_error_line(capsys, *MNIST, "--optimizer", "PolynomialDecayScheduler")
    assert code == 2 and "is a learning-rate scheduler: pass --lr-scheduler PolynomialDecayScheduler" in line


def test_usable_cpus_is_the_affinity(monkeypatch):
    import os

    from textbox_like.processes import distributed
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3})
    assert distributed.usable_cpus() in (1, 2)      # 1 only where a cgroup quota allows less


def test_accelerate_launch_without_multi_gpu_says_it_started_one_process(capsys):
    from textbox_like.launch import launcher_note
    one = {"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert launcher_note(one) is True
    assert "accelerate launch started one process" in capsys.readouterr().err
    assert launcher_note({**one, "RANK": "0", "WORLD_SIZE": "2"}) is False      # --multi_gpu: ranks are set
    assert launcher_note({"ACCELERATE_MIXED_PRECISION": "no"}) is False          # --num_processes 1


def test_patience_stops_after_n_validations_without_improvement(small_mnist_dir, tmp_path, capfd):
    import json

    from conftest import base_args, read_jsonl, run_main
    out = tmp_path / "o"
    # lr 0: nothing moves, so only the first validation improves on "none yet"
    code = run_main(base_args(small_mnist_dir, out, "--lr", "0", "--validate-interval-updates", "1",
                              "--patience", "2", "--log-format", "simple", max_update=20))
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["stop_reason"] == "patience" and results["num_updates"] == 3
    assert len([r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "valid"]) == 3
    captured = capfd.readouterr()
    last = [line for line in (captured.out + captured.err).splitlines() if line.startswith(("done", "stopped"))][-1]
    assert last.startswith("done: no better accuracy in 2 validations (--patience) at update 3 | last validation:")


def test_the_last_line_of_a_stopped_run_says_stopped_and_whose_figures():
    from types import SimpleNamespace

    from textbox_like.training.reporting import Reporting
    fake = SimpleNamespace(state=SimpleNamespace(num_updates=15, last_valid={"loss": 0.5, "accuracy": 0.9},
                                                 best_metric="accuracy",
                                                 clock=SimpleNamespace(elapsed=lambda: 12.0)),
                           cfg=SimpleNamespace(validation=SimpleNamespace(patience=-1)),
                           saved_where=lambda: "saved in /runs/a")
    line = Reporting.last_line(fake, "preempted")
    assert line == ("stopped by a signal at update 15 | last validation: loss 0.5000 | accuracy 0.9000 | wall 12.0s"
                    " | saved in /runs/a")
    assert Reporting.last_line(fake, "max_update").startswith("done | updates 15 | last validation: loss 0.5000")


def test_console_command_help_names_itself(capsys, monkeypatch):
    """The console command's dispatch in-process (test_package runs the installed command)."""
    import sys

    from textbox_like.commands import main
    for command, usage in (("train", "usage: textbox-like train "), ("hyper", "usage: textbox-like hyper ")):
        monkeypatch.setattr(sys, "argv", ["python -m textbox_like"])   # the dispatch renames argv[0]
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and out.startswith(usage), out[:200]


# ------------------------------------------------------------------ kanachan's data files
def test_kanachan_training_and_validation_data_files_are_those_files(tmp_path):
    """--training-data FILE trains on that shard only (not its directory's
    other shards); --validation-data FILE validates on that file."""
    import shutil

    from test_prepare_bert import write_corpus, write_vocab
    from textbox_like.tools.prepare_bert import main as prepare

    from textbox_like.tasks import TASKS
    vocab = tmp_path / "vocab.txt"
    write_vocab(vocab)
    write_corpus(tmp_path / "corpus.txt", n_docs=20)
    assert prepare(["--input", str(tmp_path / "corpus.txt"), "--vocab", str(vocab), "--output",
                    str(tmp_path / "shards"), "--max-seq-length", "32", "--max-predictions-per-seq", "5",
                    "--valid-fraction", "0.2", "--no-progress-bar", "--num-proc", "1"]) == 0
    shards = tmp_path / "shards"
    train = next(shards.glob("*_train_0.hdf5"))
    shutil.copy(train, shards / "more_train_1.hdf5")                 # the directory holds twice the rows
    held_out = tmp_path / "held_out.hdf5"
    shutil.copy(next(shards.glob("*_test_0.hdf5")), held_out)
    base = ["--task", "bert", "--model-preset", "tiny", "--dict", str(vocab), "--max-update", "1",
            "--max-sentences", "8"]
    cfg = parse(base + ["--training-data", str(train), "--validation-data", str(held_out)])
    task = TASKS.get("bert")(cfg)
    assert cfg.data.data == str(shards) and cfg.data.training_data == str(train)
    assert task.build_dataset("train").files == [str(train)]
    assert task.build_dataset(cfg.data.valid_subset[0]).files == [str(held_out)]
    whole = TASKS.get("bert")(parse(base + ["--training-data", str(shards)]))
    assert len(whole.build_dataset("train")) == 2 * len(task.build_dataset("train"))


def test_hetseq_data_file_for_mnist_means_its_directory(capsys, small_mnist_dir):
    data, lines = notes(capsys, *MNIST, "--data", next(small_mnist_dir.glob("train-images*")))
    assert data["data"] == str(small_mnist_dir)
    assert len(lines) == 1 and "MNIST reads its splits from its directory" in lines[0]


def test_a_short_run_logs_progress_about_ten_times(small_mnist_dir, tmp_path):
    from conftest import base_args, read_jsonl, run_main
    out = tmp_path / "o"
    assert run_main(base_args(small_mnist_dir, out, "--disable-validation", max_update=20)) == 0   # --log-interval 100
    updates = [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert len(updates) >= 5 and updates == sorted(set(updates)), updates


def test_validation_batches_default_to_four_times_the_training_batch():
    from textbox_like.training.validation import valid_batch_size
    assert valid_batch_size(parse(MNIST).data) == 32                               # --max-sentences 8
    assert valid_batch_size(parse(MNIST + ["--max-sentences-valid", "5"]).data) == 5


def test_another_optimizer_says_which_lr_it_uses_and_why(small_mnist_dir, tmp_path, capfd):
    """--optimizer adadelta without --lr: the task's 0.003 is Adam's; the start
    line says that adadelta's own default (1.0) is used instead."""
    from conftest import base_args, run_main
    capfd.readouterr()
    assert run_main(base_args(small_mnist_dir, tmp_path / "o", "--optimizer", "adadelta", "--disable-validation",
                              "--log-format", "simple", max_update=2)) == 0
    captured = capfd.readouterr()
    start = [line for line in (captured.out + captured.err).splitlines() if line.startswith("task mnist")]
    assert len(start) == 1, captured.err[-2000:]
    assert "| adadelta lr 1.0 (adadelta's default; the 0.003 of properties/task/mnist.yaml is for adam; " \
           "pass --lr to choose) |" in start[0]
    capfd.readouterr()
    assert run_main(base_args(small_mnist_dir, tmp_path / "p", "--optimizer", "adadelta", "--lr", "0.5",
                              "--disable-validation", "--log-format", "simple", max_update=1)) == 0
    captured = capfd.readouterr()
    assert "| adadelta lr 0.5 (command line) |" in captured.out + captured.err


def test_fast_updates_keep_the_count_schedule(small_mnist_dir, tmp_path):
    """Where updates are fast, no record is added: --log-interval 3 logs 3, 6."""
    from conftest import base_args, read_jsonl, run_main
    out = tmp_path / "o"
    assert run_main(base_args(small_mnist_dir, out, "--log-interval", "3", "--disable-validation", max_update=7)) == 0
    assert [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"] == [3, 6]
