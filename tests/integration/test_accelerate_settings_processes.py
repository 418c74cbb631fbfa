"""The tests of test_accelerate_settings.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, RUNS_IN_ONE_PROCESS, clean_env, split_runs
from test_accelerate_settings import data, ours, start_lines  # noqa: F401 (fixtures)


ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def write_accelerate_config(path, mixed_precision, **extra):
    lines = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "downcast_bf16": "no",
             "machine_rank": 0, "main_training_function": "main", "mixed_precision": mixed_precision,
             "num_machines": 1, "num_processes": 1, "rdzv_backend": "static", "same_network": True,
             "use_cpu": True, "dynamo_config": {"dynamo_backend": "NO"}, **extra}
    import yaml
    path.write_text(yaml.safe_dump(lines))
    return path


# ------------------------------------------------------------ precision
# accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 (was test_launch_multi_gpu_two_
# processes_bf16_on_cpu): test_user_code_everywhere_processes.py::test_every_launchers_processes_import_the_
# user_dir[accelerate] launches those two processes and asserts what it asserted

# The runs of one accelerate config file: one ``accelerate launch --config_file`` of conftest's
# RUNS_IN_ONE_PROCESS (the trainer's main() for each test's arguments in turn, each reading the variables
# the launcher set), instead of one launch (the launcher and a run, two processes) per test.
CONFIG_RUNS = {  # the accelerate config's mixed_precision: {test: its own arguments}
    "bf16": {"config sets precision": (), "default train_dtype": ("--train_dtype", "float32")},
    "no": {"--bf16": ("--bf16",), "--fp16": ("--fp16",), "no launcher settings": ()},
}


@pytest.fixture(scope="module")
def config_runs(data, tmp_path_factory):
    """{test: (exit code, stderr)} of each test's run under its accelerate config."""
    root = tmp_path_factory.mktemp("config_runs")
    script = root / "runs.py"
    script.write_text(RUNS_IN_ONE_PROCESS)
    results = {}
    for precision, runs in CONFIG_RUNS.items():
        config = write_accelerate_config(root / f"accelerate_{precision}.yaml", precision)
        argvs = [ours(data, root / precision / str(i), *extra) for i, extra in enumerate(runs.values())]
        env = clean_env()
        env["HF_HOME"] = str(Path(env.get("TEXTBOX_LIKE_CACHE", "/tmp")) / "hf_home")  # no user accelerate config
        env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
        proc = subprocess.run([ACCELERATE, "launch", "--config_file", str(config), str(script), json.dumps(argvs)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.update(zip(runs, split_runs(proc.stderr, len(runs))))
    return results


@pytest.mark.slow
def test_accelerate_config_file_sets_precision(config_runs):
    code, stderr = config_runs["config sets precision"]
    assert code == 0, stderr[-4000:]
    lines = start_lines(stderr)
    assert len(lines) == 1 and "world size 1" in lines[0], stderr[-3000:]
    assert re.search(r"precision bf16 \(precision from accelerate launch / accelerate config", lines[0]), lines[0]


@pytest.mark.slow
def test_our_default_train_dtype_does_not_override_config(config_runs):
    """--train_dtype float32 is the default: the config's bf16 stays."""
    code, stderr = config_runs["default train_dtype"]
    assert code == 0, stderr[-4000:]
    lines = start_lines(stderr)
    assert len(lines) == 1 and "precision bf16 (precision from accelerate launch" in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--bf16", "--fp16"])
def test_our_precision_flag_wins_over_config(config_runs, flag):
    code, stderr = config_runs[flag]
    assert code == 0, stderr[-4000:]
    lines = start_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    # on CPU float16 runs as bfloat16 (with a warning); the source is our flag either way
    assert f"precision bf16 (precision from {flag}" in lines[0], lines[0]


@pytest.mark.slow
def test_no_launcher_settings_means_float32_default(config_runs):
    code, stderr = config_runs["no launcher settings"]
    assert code == 0, stderr[-4000:]
    lines = start_lines(stderr)
    assert len(lines) == 1 and "precision float32 |" in lines[0], lines
