"""The tests of test_cli_errors.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, refusal_in_process, run_cli


def assert_one_line_error(proc, *needles):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "malformed.yaml").write_text("lr: [0.1\nmax_update: 3\n")
    (root / "unknown_key.yaml").write_text("max_updat: 3\n")
    (root / "empty_data").mkdir()
    (root / "lr_abc.yaml").write_text("lr: abc\n")
    (root / "batch_0.yaml").write_text("max_sentences: 0\n")
    (root / "list.yaml").write_text("- lr\n- 0.1\n")
    (root / "null.yaml").write_text("log_interval: null\n")
    (root / "inf.yaml").write_text("max_epoch: .inf\n")
    (root / "task_list.yaml").write_text("task: [mnist]\n")
    (root / "a_file").write_text("x")
    return root


def _cases(mnist_dir, bad):
    good = ["--data", str(mnist_dir), "--max-update", "1", "--log-format", "none", "--no-save"]
    return {
        "missing data dir": (["--data", str(bad / "nope"), "--max-update", "1"], [str(bad / "nope")]),
        "data dir without idx files": (["--data", str(bad / "empty_data"), "--max-update", "1",
                                        "--no-save", "--log-format", "none"], []),
        "unknown task": (good + ["--task", "mnsit"], ["mnsit", "mnist"]),
        "unknown optimizer": (good + ["--optimizer", "adamx"], ["adamx"]),
        "unknown lr scheduler": (good + ["--lr-scheduler", "cosinus"], ["cosinus", "cosine"]),
        "lr abc": (good + ["--lr", "abc"], ["abc"]),
        "malformed yaml": (good + ["--config", str(bad / "malformed.yaml")], ["malformed.yaml"]),
        "missing config": (good + ["--config", str(bad / "missing.yaml")], ["missing.yaml"]),
        "max-sentences 0": (good + ["--max-sentences", "0"], ["max-sentences"]),
        "unknown key in config file": (good + ["--config", str(bad / "unknown_key.yaml")],
                                       ["max_updat", "max_update"]),
        "unknown option": (good + ["--max-updat", "5"], ["--max-updat", "--max-update"]),
        "unknown option 2": (good + ["--lr-schedular", "cosine"], ["--lr-schedular", "--lr-scheduler"]),
        "unknown optim_conf key": (good + ["--optimizer", "adadelta", "--optim_conf", "rhoo=0.8"],
                                   ["rhoo", "rho"]),
        "unknown scheduler_conf key": (good + ["--scheduler_conf", "powr=2"], ["powr", "power"]),
        "unknown model_conf key": (good + ["--model_conf", "dropout3=0.1"], ["dropout3"]),
        "bad update-freq": (good + ["--update-freq", "2,0"], []),
        "bad train_dtype": (good + ["--train_dtype", "float8"], ["float8"]),
        "malformed optim_conf": (good + ["--optim_conf", "{lr: [0.1"], []),
        "lr abc in config file": (good + ["--config", str(bad / "lr_abc.yaml")], ["abc"]),
        "max_sentences 0 in config file": (good + ["--config", str(bad / "batch_0.yaml")], []),
        "config file not a mapping": (good + ["--config", str(bad / "list.yaml")], ["list.yaml"]),
        "malformed adam-betas": (good + ["--optimizer", "adam", "--adam-betas", "(0.9,"], []),
        "adam-betas not numbers": (good + ["--optimizer", "adam", "--adam-betas", "__import__('os')"], []),
        "unknown valid subset": (good + ["--valid-subset", "valid"], ["valid"]),
        "negative seed": (good + ["--seed", "-1"], ["--seed"]),
        "negative lr": (good + ["--lr", "-1"], ["learning rate"]),
        "adadelta rho 2": (good + ["--optimizer", "adadelta", "--adadelta_rho", "2"], ["rho"]),
        "short adam-betas": (good + ["--optimizer", "adam", "--adam-betas", "(0.9,)"], ["betas"]),
        "bad optim_conf value": (good + ["--optim_conf", "lr=abc"], ["lr"]),
        "bad optimizer-overrides value": (good + ["--optimizer-overrides", "{'betas': 'x'}"], ["betas"]),
        "bad model_conf value": (good + ["--model_conf", "dropout1=2"], ["dropout1"]),
        "null in config file": (good + ["--config", str(bad / "null.yaml")], ["log_interval"]),
        "infinity in config file": (good + ["--config", str(bad / "inf.yaml")], ["max_epoch"]),
        "task as a list": (good + ["--config", str(bad / "task_list.yaml")], ["task"]),
        "save-dir is a file": (good[:-1] + ["--save-dir", str(bad / "a_file")], ["a_file"]),
        "tcp port not a number": (good + ["--distributed-init-method", "tcp://localhost:abc",
                                          "--distributed-world-size", "2"], ["port"]),
        "unknown best metric": (good + ["--best-checkpoint-metric", "acc"], ["acc", "accuracy"]),
    }

CASE_NAMES = ["missing data dir", "data dir without idx files", "unknown task", "unknown optimizer",
              "unknown lr scheduler", "lr abc", "malformed yaml", "missing config", "max-sentences 0",
              "unknown key in config file", "unknown option", "unknown option 2", "unknown optim_conf key",
              "unknown scheduler_conf key", "unknown model_conf key", "bad update-freq", "bad train_dtype",
              "malformed optim_conf", "lr abc in config file", "max_sentences 0 in config file",
              "config file not a mapping", "malformed adam-betas", "adam-betas not numbers",
              "unknown valid subset", "negative seed", "negative lr", "adadelta rho 2", "short adam-betas",
              "bad optim_conf value", "bad optimizer-overrides value", "bad model_conf value",
              "null in config file", "infinity in config file", "task as a list", "save-dir is a file",
              "tcp port not a number", "unknown best metric"]

# Run as a whole process: what run_hetseq.py adds to main() (the exit code, no
# traceback from the interpreter) for a refusal at parsing, one after torch is
# imported, and one from the file system. The rest run main() in-process: a
# process costs ~3.5 s of imports and would test the same code again.
IN_A_PROCESS = {"unknown option", "negative lr", "save-dir is a file"}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_one_line_exit_2(case, mnist_dir, bad_files, capfd):
    args, needles = _cases(mnist_dir, bad_files)[case]
    if case in IN_A_PROCESS:
        proc = run_cli(args, timeout=100)
    else:
        proc = refusal_in_process(args, capfd)
    assert_one_line_error(proc, *needles)
    assert proc.stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_help_is_fast():
    best = None
    for _ in range(2):  # best of two: the machine may be busy with another job
        start = time.perf_counter()
        proc = run_cli(["--help"], timeout=60)
        elapsed = time.perf_counter() - start
        assert proc.returncode == 0, proc.stderr
        best = elapsed if best is None else min(best, elapsed)
        if best < 2.0:
            break
    assert best < 2.0, f"--help took {best:.2f}s"
    for flag in ("--max-update", "--update-freq", "--optim_conf", "--print_config", "--lr-scheduler",
                 "--adadelta_rho", "--momentum", "--warmup-updates", "--fp16", "--bf16", "--train_dtype"):
        assert flag in proc.stdout, flag


@pytest.mark.fresh_interpreter
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_help_print_config_and_a_refusal_import_no_torch():
    """The options, --print_config (which reads the optimizer's constructor
    defaults: optim/signatures.py's table where torch is its version) and a
    command refused by the checks answer without importing torch (1.7 s)."""
    script = ("import sys\n"
              "from textbox_like.resolve.options import build_options\n"
              "from textbox_like.cli import main\n"
              "build_options()\n"
              "print_config = main(['--task', 'mnist', '--print_config'])\n"
              "refused = main(['--task', 'mnist', '--data', '/nonexistent-mnist-dir'])\n"
              "print(print_config, refused, 'torch' in sys.modules, 'accelerate' in sys.modules, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "optim_conf:" in proc.stdout and "--data /nonexistent-mnist-dir: no such directory" in proc.stderr
    assert proc.stderr.splitlines()[-1].split() == ["0", "2", "False", "False"], proc.stderr
