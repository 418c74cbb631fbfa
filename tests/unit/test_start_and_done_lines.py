"""What the start and done lines say (issue 29, item 11): the lr given by
--optim_conf lr= is the command line's, the precision without mixed
precision is float32, both lines say where the run is saved; evaluating a
checkpoint does not repeat the training run's notes. In-process: what is
tested is what the lines say (a process's exit and lines: test_cli_errors)."""
from __future__ import annotations

import subprocess

from conftest import refusal_in_process
from textbox_like.tools.eval import main as eval_main


def eval_in_process(args, capfd):
    capfd.readouterr()
    code = eval_main([str(a) for a in args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_start_and_done_lines_name_lr_source_precision_and_save_dir(small_mnist_dir, tmp_path, capfd):
    save = tmp_path / "run"
    out = refusal_in_process(["--task", "mnist", "--data", small_mnist_dir, "--max-sentences", "16",
                              "--max-update", "2", "--optim_conf", "lr=0.01", "--fast-stat-sync", "--log-format",
                              "simple", "--threads", "1", "--save-dir", save], capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    start = [line for line in lines if line.startswith("task mnist |")]
    assert len(start) == 1, out.stderr[-3000:]
    assert "| adam lr 0.01 (command line (--optim_conf lr)) |" in start[0], start[0]
    assert "| precision float32 " in start[0] and "precision no" not in start[0], start[0]
    assert f"| saved in {save} " in start[0] + " ", start[0]
    done = [line for line in lines if line.startswith("done |")]
    assert len(done) == 1 and done[0].endswith(f"| saved in {save}"), out.stderr[-3000:]
    assert (save / "checkpoint_last.pt").is_file()

    # the checkpoint's evaluation: its result, not the training run's notes again
    assert "note: --fast-stat-sync" in out.stderr
    ev = eval_in_process(["--model_ckpt", save / "checkpoint_last.pt", "--subset", "test"], capfd)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "note:" not in ev.stderr, ev.stderr
    assert len(ev.stdout.strip().splitlines()) == 1 and "num_updates 2" in ev.stdout, ev.stdout


def test_no_save_says_so_on_both_lines(small_mnist_dir, tmp_path, capfd):
    out = refusal_in_process(["--task", "mnist", "--data", small_mnist_dir, "--max-sentences", "16", "--max-update",
                              "1", "--no-save", "--log-format", "simple", "--threads", "1", "--save-dir",
                              tmp_path / "run"], capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith(("task mnist |", "done |"))]
    assert len(said) == 2 and all("| not saved (--no-save)" in line for line in said), said


def test_the_start_line_says_how_the_lr_moves(small_mnist_dir, tmp_path, capfd):
    """mnist's properties decay the LR linearly to 0 by default: the start line says so (issue 51, item 11)."""
    def start_line(*extra):
        out = refusal_in_process(["--task", "mnist", "--data", small_mnist_dir, "--max-sentences", "16",
                                  "--max-update", "3", "--no-save", "--log-format", "simple", *extra], capfd)
        assert out.returncode == 0, out.stderr[-3000:]
        return next(line for line in out.stderr.splitlines() if line.startswith("task mnist |"))

    assert ("| adam lr 0.003 (properties/task/mnist.yaml) | lr schedule: warm-up 100 updates, then linear decay to 0 "
            "at update 3 (--end-learning-rate) |") in start_line()
    assert "| lr schedule: constant |" in start_line("--lr-scheduler", "constant", "--warmup-updates", "0")
    assert "| lr schedule: warm-up 2 updates, then cosine decay to 0.001 at update 3 (--min-lr) |" in start_line(
        "--lr-scheduler", "cosine", "--warmup-updates", "2", "--min-lr", "0.001")


def test_a_setting_from_config_is_named_beside_its_own_name_not_the_precisions(small_mnist_dir, tmp_path, capfd):
    config = tmp_path / "run.yaml"
    config.write_text("update_freq: 2\n")
    out = refusal_in_process(["--config", config, "--task", "mnist", "--data", small_mnist_dir, "--max-sentences",
                              "16", "--max-update", "1", "--no-save", "--log-format", "simple"], capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    start = next(line for line in out.stderr.splitlines() if line.startswith("task mnist |"))
    assert "| precision float32 | update-freq from " in start and str(config) in start, start
    assert "precision float32 (" not in start, start
