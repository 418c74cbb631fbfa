"""The tests of test_user_dir.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, RUNS_IN_ONE_PROCESS, clean_env, read_jsonl, split_runs
from test_user_dir import USER_TASK


@pytest.fixture
def project(tmp_path):
    """The user's package (tmp_path/proj/toytask, its task in a module of
    its own) and the directory the runs start in (tmp_path/work)."""
    package = tmp_path / "proj" / "toytask"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import task  # noqa: F401\n")
    (package / "task.py").write_text(USER_TASK)
    work = tmp_path / "work"
    work.mkdir()
    return package, work


def trainer(*args, cwd, env=None):
    return subprocess.run([sys.executable, str(REPO / "run_hetseq.py"), *map(str, args)], cwd=cwd,
                          env=env or clean_env(), capture_output=True, text=True, timeout=300)

def runs_in_one_process(argvs, cwd):
    """[(exit code, stderr)] of main(argv) for each argv in turn in one fresh process (conftest's
    RUNS_IN_ONE_PROCESS) started in ``cwd``."""
    done = subprocess.run([sys.executable, "-c", RUNS_IN_ONE_PROCESS, json.dumps([[str(a) for a in argv]
                                                                                 for argv in argvs])],
                          cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return split_runs(done.stderr, len(argvs))


#: a toy run of 2 updates, its user dir given relative to tmp_path/work
TOY = ["--user-dir", "../proj/toytask", "--task", "toy", "--max-sentences", "8", "--max-update", "2", "--cpu",
       "--log-interval", "1"]


def toy_run(save_dir, *extra):
    return [*TOY, "--save-dir", save_dir, *extra]


def train_records(save_dir):
    return [r for r in read_jsonl(save_dir / "metrics.jsonl") if r.get("kind") == "train"]

#: the public names are the registries' and neither they nor a user dir's --help import torch (its task
#: imports it in its methods, as ours do); the --help it prints is the trainer's (cli.main, run_hetseq.py's)
NO_TORCH_PROBE = ("import sys, textbox_like\n"
                  "from textbox_like.optim.lr_scheduler import SCHEDULERS\n"
                  "from textbox_like.optim import OPTIMIZERS\n"
                  "from textbox_like.tasks import TASKS, base\n"
                  "assert textbox_like.Task is base.Task and textbox_like.register_task == TASKS.register\n"
                  "assert textbox_like.register_optimizer == OPTIMIZERS.register\n"
                  "assert textbox_like.register_scheduler == SCHEDULERS.register\n"
                  "from textbox_like.cli import main\n"
                  "try:\n    main(['--user-dir', '../proj/toytask', '--help'])\nexcept SystemExit:\n    pass\n"
                  "print('torch' in sys.modules, file=sys.stderr)\n")


@pytest.mark.fresh_interpreter
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_help_and_print_config_show_the_user_dirs_typed_options(project):
    """The --help of a user dir (printed by the process of
    test_the_public_names_are_the_registries_and_import_no_torch, now here:
    the same cli.main as run_hetseq.py's) and --print_config."""
    package, work = project
    shown = subprocess.run([sys.executable, "-c", NO_TORCH_PROBE], cwd=work, env=clean_env(), capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "task toy:" in shown.stdout and "--toy-width TOY_WIDTH, --toy_width TOY_WIDTH" in shown.stdout
    assert "hidden width of the toy model (default: 8)" in shown.stdout
    # textbox_like.Task and the decorators come on first use; neither they nor the --help imported torch
    assert shown.stderr.split() == ["False"]

    printed = trainer("--user-dir", "../proj/toytask", "--task", "toy", "--toy_width", "16", "--print_config",
                      cwd=work)
    assert printed.returncode == 0, printed.stderr
    config = yaml.safe_load(printed.stdout)
    assert config["user_dir"] == str(package) and (config["toy_width"], config["toy_samples"]) == (16, 64)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_process_trains_then_config_yaml_reruns_it_resume_continues_it_and_eval_reads_it(project, tmp_path):
    package, work = project
    first = tmp_path / "first"
    done = trainer(*toy_run(first), cwd=work)
    assert done.returncode == 0, done.stderr
    assert [r["update"] for r in train_records(first)] == [1, 2]
    saved = yaml.safe_load((first / "config.yaml").read_text())
    assert saved["user_dir"] == str(package) and saved["task"] == "toy"

    # from another directory, nothing on the command line but the saved file: the same run; then the saved
    # file resumes the first run. One fresh process for both (main() for each in turn, RUNS_IN_ONE_PROCESS):
    # the rerun is the first to read the saved file's user dir in it
    again = tmp_path / "again"
    first_losses = [r["loss"] for r in train_records(first)]   # before the resume adds its update
    (rerun_code, rerun_err), (resumed_code, resumed_err) = runs_in_one_process(
        [["--config", first / "config.yaml", "--save-dir", again],
         ["--config", first / "config.yaml", "--max-update", "3", "--resume"]], cwd=tmp_path)
    assert rerun_code == 0, rerun_err
    assert [r["loss"] for r in train_records(again)] == first_losses

    assert resumed_code == 0, resumed_err
    assert [r["update"] for r in train_records(first)] == [1, 2, 3]
    assert json.loads((first / "results.json").read_text())["num_updates"] == 3

    evaluated = subprocess.run([sys.executable, "-m", "textbox_like.tools.eval", "--model_ckpt",
                                str(first / "checkpoint_last.pt"), "--json"], cwd=tmp_path, env=clean_env(),
                               capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr
    record = json.loads(evaluated.stdout)
    assert record["num_updates"] == 3 and record["samples"] == 64 and 0 <= record["accuracy"] <= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_spawned_ranks_import_the_user_dir(project, tmp_path):
    _, work = project
    save_dir = tmp_path / "two"
    done = trainer(*toy_run(save_dir, "--distributed-world-size", "2"), cwd=work)
    assert done.returncode == 0, done.stderr
    assert "world size 2" in done.stderr + done.stdout
    assert [r["update"] for r in train_records(save_dir)] == [1, 2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_exception_in_the_users_code_shows_their_traceback(tmp_path):
    folder = tmp_path / "buggy"
    folder.mkdir()
    (folder / "__init__.py").write_text("from . import model  # noqa: F401\n")
    (folder / "model.py").write_text("width = 8\nraise ValueError('my own mistake')\n")
    failed = trainer("--user-dir", folder, "--print_config", cwd=tmp_path)
    assert failed.returncode != 0 and failed.returncode != 2
    assert f'File "{folder / "model.py"}", line 2, in <module>' in failed.stderr
    assert "ValueError: my own mistake" in failed.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_installed_package_registers_through_the_entry_point_group(tmp_path):
    """A distribution on sys.path whose entry_points.txt names a module in
    the group textbox_like.resolve.plugins, as ``pip install`` leaves one."""
    site = tmp_path / "site"
    (site / "flatpkg").mkdir(parents=True)
    (site / "flatpkg" / "__init__.py").write_text(
        "from textbox_like import Scheduler, register_scheduler\n\n\n"
        "@register_scheduler('my_flat')\nclass MyFlat(Scheduler):\n    pass\n")
    info = site / "flatpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flatpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[textbox_like.resolve.plugins]\nflat = flatpkg\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(site)])
    printed = trainer("--task", "mnist", "--lr_scheduler", "my_flat", "--print_config", cwd=tmp_path, env=env)
    assert printed.returncode == 0, printed.stderr
    assert yaml.safe_load(printed.stdout)["lr_scheduler"] == "my_flat"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_search_over_the_user_dirs_option_runs_each_trial_with_it(project, tmp_path):
    """run_hyper.py passes --user-dir on: the space names the user task's
    option, and each trial's process (handed its resolved configuration)
    imports the folder before reading it."""
    import torch
    _, work = project
    (work / "space.txt").write_text("toy_width choice [4, 8]\n")
    search = subprocess.run([sys.executable, str(REPO / "run_hyper.py"), "--space=space.txt", "--algo=exhaustive",
                             "--max_evals", "2",
                             "--output", str(tmp_path / "search"), *TOY],
                            cwd=work, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert search.returncode == 0, search.stderr
    widths = set()
    for trial in ("trial_1", "trial_2"):
        results = json.loads((tmp_path / "search" / trial / "results.json").read_text())
        assert results["num_updates"] == 2
        width = yaml.safe_load((tmp_path / "search" / trial / "config.yaml").read_text())["toy_width"]
        # the trial's model is that wide: the value reached the task, not only its file
        model = torch.load(tmp_path / "search" / trial / "checkpoint_last.pt", map_location="cpu",
                           weights_only=False)["model"]
        assert model["0.weight"].shape == (width, 4)
        widths.add(width)
    assert widths == {4, 8}
