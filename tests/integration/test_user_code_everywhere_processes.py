"""The tests of test_user_code_everywhere.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, clean_env, free_port, refusal_in_process
from test_user_dir import USER_TASK


ACCELERATE = str(Path(sys.executable).with_name("accelerate"))

#: the package's __init__: each process that imports it writes its rank
#: (torchrun's, Accelerate's and our spawn's RANK, srun's SLURM_PROCID)
MARKING_INIT = textwrap.dedent('''
    import os

    from . import task  # noqa: F401

    if os.environ.get("TOY_IMPORTS"):
        with open(os.path.join(os.environ["TOY_IMPORTS"], str(os.getpid())), "w") as log:
            log.write(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "-")
''')

#: the toy task as a plain module whose class nobody registered
UNREGISTERED = USER_TASK.replace('@register_task("toy", dataclass=ToyOptions)\nclass ToyTask(Task):\n',
                                 'class ToyTask(Task):\n    options = ToyOptions\n')


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """tmp/proj/toytask (the --user-dir package), tmp/mods/my_toy.py (a
    module on no path a child knows of) and tmp/work (where runs start)."""
    root = tmp_path_factory.mktemp("user_code")
    package = root / "proj" / "toytask"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(MARKING_INIT)
    (package / "task.py").write_text(USER_TASK)
    (root / "mods").mkdir()
    assert UNREGISTERED != USER_TASK
    (root / "mods" / "my_toy.py").write_text(UNREGISTERED)
    (root / "work").mkdir()
    return root

TOY = ["--user-dir", "../proj/toytask", "--task", "toy", "--max-sentences", "8", "--max-update", "2", "--cpu",
       "--log-interval", "1"]


def importers(directory):
    """The ranks of the processes that imported the user package."""
    return sorted(path.read_text() for path in Path(directory).iterdir())


def environment(imports, **extra):
    env = clean_env()
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env.update(TOY_IMPORTS=str(imports), **extra)
    return env


def start(cmd, cwd, env):
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs):
    """Each process's stderr, once all exited 0."""
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [err for _, err in outs]

LAUNCHERS = ["torchrun", "accelerate", "srun", "file_nodes"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launchers_processes_import_the_user_dir(project, tmp_path, launcher):
    imports = tmp_path / "imports"
    imports.mkdir()
    save = tmp_path / "out"
    work = project / "work"
    train = [REPO / "run_hetseq.py", *TOY, "--save-dir", save]
    env = environment(imports)
    if launcher == "torchrun":
        procs = [start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        free_port(), *train], work, env)]
    elif launcher == "accelerate":
        # bf16: also test_accelerate_settings_processes's launch of two processes at a precision (merged here):
        # no user accelerate config (HF_HOME of our own), no ACCELERATE_ variable but the launcher's
        env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
        env["HF_HOME"] = str(Path(env.get("TEXTBOX_LIKE_CACHE", "/tmp")) / "hf_home")
        procs = [start([ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                        "--mixed_precision", "bf16", "--dynamo_backend", "no", "--main_process_port", free_port(),
                        *train], work, env)]
    elif launcher == "srun":
        # what srun gives each of a step's two tasks (distributed.py reads these)
        port = str(free_port())
        procs = [start([sys.executable, *train], work,
                       {**env, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                        "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "31",
                        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "MASTER_PORT": port}) for rank in (0, 1)]
    else:
        # HetSeq's nodes: two node processes meeting at a file, each its rank
        procs = [start([sys.executable, *train, "--distributed-init-method", f"file://{tmp_path / 'rdzv'}",
                        "--distributed-world-size", "2", "--distributed-no-spawn", "--distributed-rank", rank],
                       work, env) for rank in (0, 1)]
    errs = finish(procs)
    results = json.loads((save / "results.json").read_text())
    assert (results["world_size"], results["num_updates"], results["task"]) == (2, 2, "toy")
    ranks = importers(imports)
    assert {"0", "1"} <= set(ranks) or launcher == "file_nodes" and len(ranks) == 2, ranks
    saved = yaml.safe_load((save / "config.yaml").read_text())
    assert saved["user_dir"] == str(project / "proj" / "toytask")
    if launcher == "accelerate":
        # (was test_accelerate_settings_processes.py::test_launch_multi_gpu_two_processes_bf16_on_cpu, which
        # launched the same two processes on MNIST) rank 0 speaks for all, at the launcher's precision; both
        # ranks trained at it: the start-up agreement compares the precision each rank chose, and the run
        # went through (a disagreement is refused before training)
        lines = [line for line in errs[0].splitlines() if line.startswith("task toy |")]
        assert len(lines) == 1, errs[0][-3000:]
        assert "world size 2" in lines[0]
        assert re.search(r"precision bf16 \(precision from accelerate launch", lines[0]), lines[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multi_seed_runs_each_seed_with_the_user_dir_and_eval_and_export_read_a_seeds_checkpoint(project, tmp_path):
    """run_multi_seed.py: each seed's trainer imports the user dir; then
    ``textbox-like eval`` and ``export``, each a fresh interpreter, read a
    seed's checkpoint of the user's task (one run of the toy task, as a
    training of its own would be: the seeds' runs are TOY with --seed).
    The seeds, two at once, are drawn from --seed, and the summary is scipy's
    interval over them (was test_search_e2e.py::test_multi_seed_draws_from_
    seed_and_uses_scipys_interval, which ran the same command on MNIST)."""
    import numpy as np
    from scipy import stats

    from textbox_like import search as S
    imports = tmp_path / "imports"
    imports.mkdir()
    out = tmp_path / "seeds"
    done = subprocess.run([sys.executable, str(REPO / "run_multi_seed.py"), "--multi_seed=2", "--seed", "5",
                           "--parallel", "2", "--output", str(out), *TOY, "--validate-interval-updates", "2"],
                          cwd=project / "work", env=environment(imports), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "multi_seed_summary.json").read_text())
    assert len(summary["ok_seeds"]) == 2
    for seed in summary["ok_seeds"]:
        run = out / f"seed_{seed}"
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert (saved["seed"], saved["task"]) == (seed, "toy")
        assert json.loads((run / "results.json").read_text())["num_updates"] == 2
    # the command imported it; each seed's trainer, which trained the toy task above, is a fork of the command
    # that has it already (processes/children.py), or, where a fork may not be, a fresh interpreter that imports it
    assert "-" in importers(imports)

    # the seeds drawn from --seed 5, and scipy's interval over each final metric
    seeds = S.draw_seeds(2, 5)
    assert f"seeds: {', '.join(map(str, seeds))} (2 drawn from seed 5)" in done.stdout
    assert summary["ok_seeds"] == seeds
    for metric in ("loss", "accuracy"):
        values = [json.loads((out / f"seed_{s}" / "results.json").read_text())["final"][metric] for s in seeds]
        st = summary["final"][metric]
        assert st["n"] == 2 and st["mean"] == pytest.approx(np.mean(values))
        if np.std(values) > 0:
            assert st["ci95"] == pytest.approx(list(stats.t.interval(0.95, 1, loc=np.mean(values),
                                                                     scale=stats.sem(values))))
    for s in seeds:
        assert f"seed: {s}" in (out / f"seed_{s}" / "config.yaml").read_text().splitlines()
    assert "95% CI" in done.stdout and "median" in done.stdout
    assert (out / "multi_seed_summary.csv").read_text().startswith("part,metric,n,mean,std,ci95_low")
    assert (out / "multi_seed_curves.png").stat().st_size > 20000

    # textbox-like eval and export on a seed's checkpoint (was test_textbox_like_eval_and_export_read_a_user_task_
    # checkpoint, which trained the same 2-update toy run for it)
    save = out / f"seed_{summary['ok_seeds'][0]}"
    checkpoint = save / "checkpoint_last.pt"
    where = tmp_path / "elsewhere"
    where.mkdir()
    env = environment(where)
    evaluated = subprocess.run([sys.executable, "-m", "textbox_like", "eval", "--model_ckpt", str(checkpoint),
                                "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = json.loads(evaluated.stdout)
    assert (record["num_updates"], record["samples"]) == (2, 64)
    valid = [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "valid"]
    assert record["loss"] == pytest.approx(valid[-1]["loss"], rel=1e-6)
    exported = subprocess.run([sys.executable, "-m", "textbox_like", "export", str(checkpoint), "--to",
                               str(tmp_path / "hf")], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "task toy, Sequential" in exported.stdout and "safetensors.torch.load_model" in exported.stdout
    import torch
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_search_over_the_user_tasks_own_options_trains_each_trial_with_its_values(project, tmp_path):
    """run_hyper.py --backend ray --algo tpe: each trial's process imports
    the user dir, and its config.yaml, model and data are the sampled ones."""
    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    import torch
    from test_search_ray import no_ray_left, ray_temp_dir
    work = project / "work"
    (work / "space.txt").write_text("toy_width choice [4, 8]\ntoy_samples choice [32, 48]\n")
    imports = tmp_path / "imports"
    imports.mkdir()
    out = tmp_path / "search"
    temp = ray_temp_dir(tmp_path)
    try:
        done = subprocess.run([sys.executable, str(REPO / "run_hyper.py"), "--backend", "ray", "--space",
                               "space.txt", "--algo", "tpe", "--max_evals", "2", "--parallel", "2", "--seed", "1",
                               "--output", str(out), *TOY], cwd=work,
                              env=environment(imports, TEXTBOX_LIKE_RAY_TMP=str(temp)), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        deadline = time.time() + 60
        while not no_ray_left(tmp_path) and time.time() < deadline:
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)
    records = [json.loads(line) for line in (out / "hyper_results.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        trial = out / f"trial_{record['trial']}"
        width, samples = record["params"]["toy_width"], record["params"]["toy_samples"]
        saved = yaml.safe_load((trial / "config.yaml").read_text())
        assert (saved["toy_width"], saved["toy_samples"]) == (width, samples)
        model = torch.load(trial / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
        assert model["0.weight"].shape == (width, 4)
        assert f"train {samples} samples" in (trial / "stderr.log").read_text()
    assert len(importers(imports)) >= 3        # the command and each trial's trainer

API_MODULE = '''
import json, sys
sys.path.insert(0, sys.argv[1])          # on this process's path only: the ranks must be handed it
import textbox_like
from my_toy import ToyTask

save = sys.argv[2]
results = textbox_like.train({"max_sentences": 8, "max_update": 2, "cpu": True, "save_dir": save, "log_interval": 1,
                              "toy_width": 6}, task=ToyTask, distributed_world_size=2)
print(json.dumps({"results": results,
                  "evaluated": textbox_like.evaluate(save + "/checkpoint_last.pt", task=ToyTask)}))
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_task_class_from_a_module_trains_in_two_ranks_from_python_and_its_config_yaml_finds_it(project,
                                                                                                  tmp_path, capfd,
                                                                                                  monkeypatch):
    save = tmp_path / "api"
    script = tmp_path / "train_it.py"
    script.write_text(API_MODULE)
    done = subprocess.run([sys.executable, str(script), str(project / "mods"), str(save)], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["results"]["world_size"], out["results"]["num_updates"], out["results"]["exit_code"]) == (2, 2, 0)
    assert out["evaluated"]["loss"] == pytest.approx(out["results"]["final"]["loss"], rel=1e-6)
    saved = yaml.safe_load((save / "config.yaml").read_text())
    assert (saved["task"], saved["task_class"], saved["toy_width"]) == ("ToyTask", "my_toy:ToyTask", 6)

    # a fresh interpreter reads the class from config.yaml where its module is on the path ...
    env = clean_env()
    env["PYTHONPATH"] += os.pathsep + str(project / "mods")
    printed = subprocess.run([sys.executable, str(REPO / "run_hetseq.py"), "--config", str(save / "config.yaml"),
                              "--print_config"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-3000:]
    again = yaml.safe_load(printed.stdout)
    assert {k: v for k, v in again.items() if k != "config"} == {k: v for k, v in saved.items() if k != "config"}
    # ... and says in one line where it is not (in-process: a refusal, and my_toy is on no path of this one)
    monkeypatch.chdir(tmp_path)
    assert "my_toy" not in sys.modules
    lost = refusal_in_process(["--config", save / "config.yaml", "--save-dir", tmp_path / "lost"], capfd)
    assert lost.returncode == 2 and lost.stderr.strip().splitlines() == [
        "error: task_class my_toy:ToyTask: no module named 'my_toy' here; put the folder holding it on PYTHONPATH, "
        "or the module in a --user-dir package"]

API_MAIN = '''
import json, sys
sys.path.insert(0, sys.argv[1])
import textbox_like
from textbox_like.core.errors import UserError
import my_toy


class MainToy(my_toy.ToyTask):
    name = "main_toy"


settings = {"max_sentences": 8, "max_update": 2, "cpu": True, "log_format": "none"}
try:
    textbox_like.train(settings, task=MainToy, save_dir=sys.argv[2] + "/two", distributed_world_size=2)
except UserError as exc:
    print(f"refused: {exc}", file=sys.stderr)
first = textbox_like.train(settings, task=MainToy, save_dir=sys.argv[2] + "/one")


class MainToy(my_toy.ToyTask):          # the notebook's cell, run again
    name = "main_toy"


second = textbox_like.train(settings, task=MainToy, save_dir=sys.argv[2] + "/rerun")
print(json.dumps([first, second]))
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_task_class_from_main_trains_in_one_process_and_two_are_refused_in_one_line(project, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(API_MAIN)
    done = subprocess.run([sys.executable, str(script), str(project / "mods"), str(tmp_path)], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = [line for line in done.stderr.splitlines() if line.startswith("refused: ")]
    assert refused == [
        "refused: task main_toy (__main__:MainToy) cannot train in 2 processes: it is defined in __main__ (a "
        "notebook, stdin or the script that started the run), and each process, a fresh interpreter, imports it by "
        "its module path; put the class in a module of its own (a .py file on sys.path, or in a --user-dir "
        "package) and pass it from there, or train in one process"]
    assert not (tmp_path / "two").exists()      # refused before any process started
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert (first["task"], first["num_updates"], first["world_size"]) == ("main_toy", 2, 1)
    assert second["final"] == first["final"]
    assert yaml.safe_load((tmp_path / "one" / "config.yaml").read_text())["task_class"] == "__main__:MainToy"

#: the toy task with its options declared the fairseq/HetSeq way
ADD_ARGS_TASK = USER_TASK.replace(
    '@register_task("toy", dataclass=ToyOptions)\nclass ToyTask(Task):\n',
    '@register_task("old_style")\nclass ToyTask(Task):\n'
    '    @staticmethod\n'
    '    def add_args(parser):\n'
    '        parser.add_argument("data", help="the data directory")   # fairseq\'s: the run\'s --data\n'
    '        parser.add_argument("--toy-width", type=int, default=8, help="hidden width (default: %(default)s)")\n'
    '        parser.add_argument("--toy-samples", type=int, default=64, help="samples in each split")\n'
    '        parser.add_argument("--toy-act", choices=["relu", "tanh"], default="relu")\n'
    '        parser.add_argument("--toy-verbose", action="store_true", help="a switch")\n')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_task_with_fairseqs_add_args_gets_a_real_parser_and_its_values(tmp_path):
    folder = tmp_path / "old_style"
    folder.mkdir()
    (folder / "__init__.py").write_text("from . import task  # noqa: F401\n")
    assert ADD_ARGS_TASK != USER_TASK
    (folder / "task.py").write_text(ADD_ARGS_TASK)
    run = [sys.executable, str(REPO / "run_hetseq.py"), "--user-dir", str(folder)]
    shown = subprocess.run([*run, "--help"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "task old_style:" in shown.stdout and "hidden width (default: 8)\n" in shown.stdout
    assert "--toy-act {relu,tanh}, --toy_act {relu,tanh}" in shown.stdout
    save = tmp_path / "out"
    done = subprocess.run([*run, "--task", "old_style", "--toy-width", "5", "--toy-samples", "24", "--toy_verbose",
                           "--max-sentences", "8", "--max-update", "1", "--cpu", "--save-dir", str(save)],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train 24 samples" in done.stderr
    saved = yaml.safe_load((save / "config.yaml").read_text())
    assert (saved["toy_width"], saved["toy_samples"], saved["toy_act"], saved["toy_verbose"]) == (5, 24, "relu", True)
    import torch
    model = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    assert model["0.weight"].shape == (5, 4)
