"""The tests of test_package.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from test_package import ROOT


COMMANDS = ["train", "hyper", "multi-seed", "prepare-bert", "eval", "plot", "bench", "export"]


def run(argv, cwd, timeout=120, check=True):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin dir, a working directory outside the source tree) of a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"                     # a copy: the build's build/ and egg-info stay out of the work tree
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "textbox_like", src / "textbox_like", ignore=ignore)
    shutil.copytree(ROOT / "properties", src / "properties", ignore=ignore)
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp)
    Path(purelib.stdout.strip(), "_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(src)],
        cwd=tmp, timeout=300)
    work = tmp / "elsewhere"
    work.mkdir()
    return venv / "bin", work


@pytest.mark.slow
def test_the_wheel_is_what_runs(installed):
    bin_dir, work = installed
    proc = run([str(bin_dir / "python"), "-c",
                "import textbox_like, textbox_like.config.layers as c; print(textbox_like.__file__); print(c.PROPERTIES)"],
               cwd=work)
    module, properties = proc.stdout.split()
    venv = bin_dir.parent
    assert Path(module).is_relative_to(venv) and not Path(module).is_relative_to(ROOT)
    assert Path(properties) == Path(module).parent / "properties"
    shipped = sorted(p.relative_to(properties).as_posix() for p in Path(properties).rglob("*.yaml"))
    assert shipped == sorted(p.relative_to(ROOT / "properties").as_posix()
                             for p in (ROOT / "properties").rglob("*.yaml"))
    assert "task/mnist.yaml" in shipped and "model/tiny.yaml" in shipped
    modules = sorted(p.relative_to(Path(module).parent).as_posix() for p in Path(module).parent.rglob("*.py"))
    assert modules == sorted(p.relative_to(ROOT / "textbox_like").as_posix()
                             for p in (ROOT / "textbox_like").rglob("*.py"))      # data/ has no __init__.py


@pytest.mark.slow
def test_train_print_config_has_the_mnist_defaults(installed):
    bin_dir, work = installed
    printed = run([str(bin_dir / "textbox-like"), "train", "--task", "mnist", "--print_config"], cwd=work).stdout
    # the same resolved configuration as the source tree's run_hetseq.py
    assert printed == run([sys.executable, str(ROOT / "run_hetseq.py"), "--task", "mnist", "--print_config"],
                          cwd=ROOT).stdout
    config = yaml.safe_load(printed)
    defaults = yaml.safe_load((ROOT / "properties" / "task" / "mnist.yaml").read_text())
    for key in ("max_sentences", "optimizer", "warmup_updates", "lr_scheduler"):
        assert config[key] == defaults[key], key
    assert config["lr"] in (defaults["lr"], [defaults["lr"]])


@pytest.mark.slow
def test_train_print_config_with_a_model_preset(installed):
    bin_dir, work = installed
    argv = ["train", "--task", "bert", "--model-preset", "tiny", "--print_config"]
    printed = run([str(bin_dir / "textbox-like"), *argv], cwd=work).stdout
    assert printed == run([sys.executable, "-m", "textbox_like", *argv], cwd=ROOT).stdout
    assert yaml.safe_load(printed)["model_preset"] == "tiny"
    # the preset's sizes, read from inside the wheel
    preset = yaml.safe_load((ROOT / "properties" / "model" / "tiny.yaml").read_text())
    proc = run([str(bin_dir / "python"), "-c",
                "import json; from textbox_like.config.layers import PROPERTIES; from textbox_like.config.files import load_yaml;"
                "print(json.dumps(load_yaml(PROPERTIES / 'model' / 'tiny.yaml', 'model preset')))"], cwd=work)
    loaded = yaml.safe_load(proc.stdout)
    assert loaded["hidden_size"] == preset["hidden_size"] == 128
    assert loaded["num_hidden_layers"] == preset["num_hidden_layers"]


@pytest.mark.slow
def test_every_subcommand_answers_help(installed):
    bin_dir, work = installed
    proc = run([str(bin_dir / "textbox-like"), "--help"], cwd=work)
    for name in COMMANDS:
        assert f"\n  {name} " in proc.stdout, name
    for name in COMMANDS:
        proc = run([str(bin_dir / "textbox-like"), name, "--help"], cwd=work)
        assert "usage:" in proc.stdout, name
    proc = run([str(bin_dir / "textbox-like"), "trian"], cwd=work, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "'train'" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_example_project_trains_from_the_wheel_with_its_user_dir(installed):
    """examples/my_task, copied outside the repository as a user's own folder,
    through the installed command: one process (loss falls), two spawned
    ranks, LoRA on one of its layers, and a two-trial search over the task's
    own option."""
    import json
    bin_dir, work = installed
    shutil.copytree(ROOT / "examples" / "my_task", work / "my_task", dirs_exist_ok=True)
    command = str(bin_dir / "textbox-like")
    common = ["--user-dir", "my_task", "--task", "spirals", "--cpu", "--max-sentences", "32", "--lr", "0.01",
              "--optimizer", "adam"]
    run([command, "train", *common, "--max-update", "150", "--save-dir", "one"], cwd=work, timeout=300)
    valid = [json.loads(line) for line in (work / "one" / "metrics.jsonl").read_text().splitlines()]
    valid = [row for row in valid if row["kind"] == "valid"]
    assert valid and valid[-1]["loss"] < 0.65, valid     # from ln 2 = 0.69: it learned (0.57)
    config = yaml.safe_load((work / "one" / "config.yaml").read_text())
    assert config["user_dir"] == str(work / "my_task") and config["task"] == "spirals"

    two = run([command, "train", *common, "--max-update", "3", "--save-dir", "two", "--distributed-world-size", "2"],
              cwd=work, timeout=300)
    assert "world size 2" in two.stdout + two.stderr
    assert json.loads((work / "two" / "results.json").read_text())["num_updates"] == 3

    # LoRA on the example's middle layer (nn.Sequential's "2"), from the wheel: the checkpoint holds the adapter
    import torch
    run([command, "train", *common, "--max-update", "5", "--save-dir", "lora", "--peft", "lora",
         "--lora-target-modules", "2", "--lora-r", "4"], cwd=work, timeout=300)
    saved = torch.load(work / "lora" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert sorted(saved) == ["base_model.model.2.lora_A.default.weight", "base_model.model.2.lora_B.default.weight"]
    assert saved["base_model.model.2.lora_A.default.weight"].shape[0] == 4

    (work / "space.txt").write_text("spiral_width choice [8, 16]\n")
    run([command, "hyper", "--space", "space.txt", "--max_evals", "2", "--output", "search", *common,
         "--max-update", "3"], cwd=work, timeout=600)
    widths = {yaml.safe_load((work / "search" / f"trial_{i}" / "config.yaml").read_text())["spiral_width"]
              for i in (1, 2)}
    assert widths == {8, 16}
