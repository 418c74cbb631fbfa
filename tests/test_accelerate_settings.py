"""Accelerate's settings honoured (issue 10 item 1) and HetSeq's validation at
interval saves, ESPnet2's ReduceLROnPlateau (issue 10 items 3 and 5).

``accelerate launch`` flags and an ``accelerate config`` file reach the
trainer as ACCELERATE_* variables: mixed precision and gradient accumulation
come from them unless our own options say otherwise, and the start line names
the source that won.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import N_SMALL_TEST, N_SMALL_TRAIN, REPO, clean_env, free_port, read_jsonl, run_main, write_mnist

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_accel")
    write_mnist(directory, n_train=N_SMALL_TRAIN, n_test=N_SMALL_TEST, seed=10)
    return directory


@pytest.fixture(scope="module")
def data64(tmp_path_factory):
    """64 training samples: 8 batches of 8 per epoch."""
    directory = tmp_path_factory.mktemp("mnist_accel64")
    write_mnist(directory, n_train=64, n_test=20, seed=4)
    return directory


def ours(data, out, *extra, max_update=3):
    return ["--task", "mnist", "--data", str(data), "--max-sentences", "8", "--max-update", str(max_update),
            "--save-dir", str(out), "--threads", "1", "--log-format", "simple", "--report_to", "none",
            *map(str, extra)]


def launch(launcher_args, args, timeout=150):
    env = clean_env()
    env["HF_HOME"] = str(Path(env.get("TEXTBOX_LIKE_CACHE", "/tmp")) / "hf_home")  # no user accelerate config
    env.pop("ACCELERATE_CONFIG_FILE", None)
    env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
    cmd = [ACCELERATE, "launch", *map(str, launcher_args), "run_hetseq.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def start_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("task mnist |")]


def write_accelerate_config(path, mixed_precision, **extra):
    lines = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "downcast_bf16": "no",
             "machine_rank": 0, "main_training_function": "main", "mixed_precision": mixed_precision,
             "num_machines": 1, "num_processes": 1, "rdzv_backend": "static", "same_network": True,
             "use_cpu": True, "dynamo_config": {"dynamo_backend": "NO"}, **extra}
    import yaml
    path.write_text(yaml.safe_dump(lines))
    return path


# ------------------------------------------------------------ precision
@pytest.mark.slow
def test_launch_multi_gpu_two_processes_bf16_on_cpu(data, tmp_path):
    out = tmp_path / "out"
    proc = launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16",
                   "--dynamo_backend", "no", "--main_process_port", free_port()], ours(data, out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = start_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]  # rank 0 speaks for all
    assert "world size 2" in lines[0]
    assert re.search(r"precision bf16 \(precision from accelerate launch", lines[0]), lines[0]
    # both ranks trained at the same precision: the start-up agreement compares the precision each
    # rank chose, and the run went through (a disagreement is refused before training)
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["num_updates"] == 3


# The runs of one accelerate config file: one ``accelerate launch --config_file`` of a script that runs
# the trainer's main() for each test's arguments in turn (the variables the launcher set, read by each),
# instead of one launch (the launcher and a run, two processes) per test. Each run's stderr is its own.
LAUNCHED_RUNS = '''
import json, sys
sys.path.insert(0, {tests!r})
from conftest import run_main   # main() with Accelerate's state reset before and after
for i, args in enumerate(json.loads(sys.argv[1])):
    print(f"--- run {{i}}", file=sys.stderr, flush=True)
    code = run_main(args)
    print(f"--- exit {{i}} {{0 if code is None else code}}", file=sys.stderr, flush=True)
'''

CONFIG_RUNS = {  # the accelerate config's mixed_precision: {test: its own arguments}
    "bf16": {"config sets precision": (), "default train_dtype": ("--train_dtype", "float32")},
    "no": {"--bf16": ("--bf16",), "--fp16": ("--fp16",), "no launcher settings": ()},
}


@pytest.fixture(scope="module")
def config_runs(data, tmp_path_factory):
    """{test: (exit code, stderr)} of each test's run under its accelerate config."""
    root = tmp_path_factory.mktemp("config_runs")
    script = root / "runs.py"
    script.write_text(LAUNCHED_RUNS.format(tests=str(Path(__file__).resolve().parent)))
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
        for i, name in enumerate(runs):
            part = proc.stderr.split(f"--- run {i}\n", 1)[1].split(f"--- exit {i} ", 1)
            results[name] = (int(part[1].split("\n", 1)[0]), part[0])
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


# ----------------------------------------------------- gradient accumulation


def launched_start_line(data, out, monkeypatch, steps, *extra):
    """The one start line of a run that Accelerate's launcher handed
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS=steps."""
    import contextlib
    import io
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", str(steps))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(ours(data, out, "--max-epoch", "1", *extra, max_update=0))
    assert rc == 0, err.getvalue()[-3000:]
    lines = start_lines(err.getvalue())
    assert len(lines) == 1, err.getvalue()[-3000:]
    return lines[0]


def test_gradient_accumulation_from_accelerate_environment(data64, tmp_path, monkeypatch):
    """What the launcher hands over (ACCELERATE_GRADIENT_ACCUMULATION_STEPS; accelerate 1.15 exports it
    from its DeepSpeed launcher) sets update_freq when ours is the default."""
    import yaml
    out = tmp_path / "out"
    line = launched_start_line(data64, out, monkeypatch, 2, "--log-interval", "1")
    assert "update-freq from accelerate launch" in line, line
    assert yaml.safe_load((out / "config.yaml").read_text())["update_freq"] == [2]
    assert json.loads((out / "results.json").read_text())["num_updates"] == 4


def test_our_update_freq_wins_over_launch(data64, tmp_path, monkeypatch):
    out = tmp_path / "out"
    line = launched_start_line(data64, out, monkeypatch, 2, "--update-freq", "4")
    assert "update-freq from command line" in line, line
    assert json.loads((out / "results.json").read_text())["num_updates"] == 2


def test_an_explicit_update_freq_of_1_wins_over_launch(data64, tmp_path, monkeypatch):
    """--update-freq 1 given is not "not given" (issue 20): it keeps 1 and the
    start line says it came from the command line."""
    import yaml
    out = tmp_path / "out"
    line = launched_start_line(data64, out, monkeypatch, 4, "--update-freq", "1")
    assert "update-freq from command line" in line, line
    assert yaml.safe_load((out / "config.yaml").read_text())["update_freq"] == [1]
    assert json.loads((out / "results.json").read_text())["num_updates"] == 8  # 64 samples, batch 8, no accumulation


# ------------------------------------------------- ReduceLROnPlateau, plateau
def test_reduce_lr_on_plateau_lowers_lr_after_a_validation_without_improvement(data, tmp_path, monkeypatch):
    import textbox_like.validate as validate
    # a forced plateau: every validation reports the same loss
    monkeypatch.setattr(validate, "evaluate", lambda *a, **k: {"loss": 1.0, "accuracy": 0.5})
    out = tmp_path / "out"
    rc = run_main(ours(data, out, "--scheduler", "ReduceLROnPlateau", "--scheduler_conf",
                       "{patience: 0, factor: 0.5}", "--optimizer", "adam", "--lr", "0.001",
                       "--validate-interval-updates", "2", "--log-interval", "1", "--log-format", "none",
                       max_update=8))
    assert rc == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["update"] for r in rows if r["kind"] == "valid"] == [2, 4, 6, 8]
    lr = {r["update"]: r["lr"] for r in rows if r["kind"] == "train"}
    # validation 2 sets the best (no change); 4 and 6 do not improve: halved after each
    assert lr[1] == pytest.approx(0.001) and lr[2] == pytest.approx(0.001)
    assert lr[3] == pytest.approx(0.001) and lr[4] == pytest.approx(0.001)
    assert lr[5] == pytest.approx(0.0005) and lr[6] == pytest.approx(0.0005)
    assert lr[7] == pytest.approx(0.00025) and lr[8] == pytest.approx(0.00025)


def test_reduce_lr_on_plateau_keeps_lr_while_improving(data, tmp_path, monkeypatch):
    import textbox_like.validate as validate
    values = iter([0.5, 0.6, 0.7, 0.8])  # MNIST's best-checkpoint metric is accuracy (maximized)
    monkeypatch.setattr(validate, "evaluate", lambda *a, **k: {"loss": 1.0, "accuracy": next(values)})
    out = tmp_path / "out"
    assert run_main(ours(data, out, "--scheduler", "ReduceLROnPlateau", "--scheduler_conf",
                         "{patience: 0, factor: 0.5}", "--optimizer", "adam", "--lr", "0.001",
                         "--validate-interval-updates", "2", "--log-interval", "1", "--log-format", "none",
                         max_update=8)) == 0
    lrs = [r["lr"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert lrs == pytest.approx([0.001] * 8)


# ------------------------------------------- HetSeq: validate at interval saves
def test_save_interval_updates_validates_at_each_save(data, tmp_path):
    out = tmp_path / "out"
    assert run_main(ours(data, out, "--save-interval-updates", "5", "--log-format", "none", max_update=12)) == 0
    valid = [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "valid"]
    assert [u for u in valid if u < 12] == [5, 10], valid
    assert (out / "checkpoint_1_5.pt").is_file() and (out / "checkpoint_1_10.pt").is_file()
