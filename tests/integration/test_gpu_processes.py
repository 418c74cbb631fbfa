"""The tests of test_gpu.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_bitwise_equal, base_args, clean_env, free_port, read_jsonl, run_cli
from test_bert_train import bert_data  # noqa: F401  (fixture: shards, vocab.txt)
from test_compile import NO_DROPOUT
from test_hf_task import hf_args, models, text_data  # noqa: F401  (fixtures: tiny models, text files)
from test_faults import build_trainer, mnist_args, poison_batches, record_steps, run_trainer
from test_resume import command as resume_command
from test_resume import compare_final, kill_after_checkpoint
from test_resume import load as load_checkpoint


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")


def gpu(test):
    """Marked cuda (pytest -m cuda) and skipped without a GPU."""
    return pytest.mark.cuda(needs_cuda(test))

# flags -> what the start line says (Accelerate's mixed_precision)
PRECISIONS = {"float32": ([], "float32"), "bf16": (["--bf16"], "bf16"), "fp16": (["--fp16"], "fp16")}


def run_ok(args, timeout=300):
    out = run_cli(args, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    return out.stderr


def start_line(stderr):
    lines = [line for line in stderr.splitlines() if line.startswith("task ") and "| device " in line]
    assert lines, stderr[-3000:]
    return lines[-1]


def assert_on_cuda(stderr, precision="float32"):
    line = start_line(stderr)
    assert re.search(r"\| device cuda(:\d+)? \|", line), line
    assert f"| precision {precision}" in line, line
    assert "needs CUDA" not in stderr  # no fp16 -> bf16 fallback


def train_records(save_dir):
    return [r for r in read_jsonl(save_dir / "metrics.jsonl") if r["kind"] == "train"]


def assert_finite_losses(save_dir, n, keys=("loss",)):
    records = train_records(save_dir)
    assert [r["update"] for r in records] == list(range(1, n + 1))
    for r in records:
        for key in keys:
            assert math.isfinite(r[key]), (key, r)
    return records


def bert_args(d, save_dir, *extra, max_update=6):
    """Tiny BERT from its preset (not a config file) on test_bert_train's shards."""
    return ["--task", "bert", "--data", d / "shards", "--dict", d / "vocab.txt", "--model-preset", "tiny",
            "--max-sentences", "8", "--max-update", max_update, "--save-dir", save_dir, "--log-format", "simple",
            "--log-interval", "1", "--threads", "1", "--disable-validation", *extra]


# ---------------------------------------------------------------- training, by precision
@gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_mnist_trains_on_cuda(small_mnist_dir, tmp_path, precision):
    flags, name = PRECISIONS[precision]
    out = tmp_path / "out"
    err = run_ok(base_args(small_mnist_dir, out, "--log-format", "simple", "--log-interval", "1", "--threads", "1",
                           *flags, max_update=8))
    assert_on_cuda(err, name)
    assert_finite_losses(out, 8, ("loss", "accuracy"))
    state = load_checkpoint(out / "checkpoint_last.pt")
    assert state["train"]["num_updates"] == 8
    assert all(torch.isfinite(t).all() for t in state["model"].values() if torch.is_floating_point(t))


@gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_tiny_bert_trains_on_cuda(bert_data, tmp_path, precision):  # noqa: F811
    flags, name = PRECISIONS[precision]
    out = tmp_path / "out"
    err = run_ok(bert_args(bert_data, out, *flags))
    assert_on_cuda(err, name)
    records = assert_finite_losses(out, 6, ("loss", "mlm_loss", "nsp_loss"))
    assert all(r["tokens_per_s"] > 0 for r in records)


@gpu
@pytest.mark.timeout(300)
def test_peak_mem_gib_in_metrics_jsonl(small_mnist_dir, tmp_path):
    out = tmp_path / "out"
    run_ok(base_args(small_mnist_dir, out, "--log-interval", "2", "--threads", "1", max_update=6))
    records = train_records(out)
    assert len(records) == 3
    total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    for r in records:
        (peak,) = r["peak_mem_gib"]  # one figure per rank
        assert 0 < peak < total, r


# ---------------------------------------------------------------- skipped updates
@gpu
def test_fp16_loss_scaler_skips_are_not_updates(small_mnist_dir, tmp_path):
    """A NaN batch under --fp16: the loss scaler skips the step and lowers its
    scale; weights, optimizer state and the schedule stay, and the skip is
    not counted as an update (the run still makes --max-update updates)."""
    trainer, _, _ = build_trainer(mnist_args(small_mnist_dir, tmp_path / "out", "--fp16", "--optimizer", "adam",
                                             "--log-interval", "1", "--no-save", "--disable-validation",
                                             max_update=8))
    acc = trainer.accelerator
    assert acc.device.type == "cuda" and acc.scaler is not None and not trainer.step.skips_on_device
    module = acc.unwrap_model(trainer.model)
    assert all(p.device.type == "cuda" for p in module.parameters())
    calls = poison_batches(trainer, {3})
    record = record_steps(trainer, calls)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        rc = run_trainer(trainer)
    assert rc == 0, err.getvalue()[-3000:]
    skipped = [r for r in record if not r[2]]
    assert 3 in [r[0] for r in skipped], [(r[0], r[2]) for r in record]  # the NaN batch (others may overflow)
    for _, before, _, after in skipped:
        assert_bitwise_equal(after["model"], before["model"], "model")
        assert_bitwise_equal(after["optimizer"]["state"], before["optimizer"]["state"], "optimizer state")
        assert after["num_updates"] == before["num_updates"]
        assert after["scheduler_updates"] == before["scheduler_updates"]
    assert trainer.state.num_updates == 8 and len(record) == 8 + len(skipped)
    assert trainer.state.skipped_updates == len(skipped)
    assert acc.scaler.get_scale() < 2.0 ** 16  # lowered at each skip (from GradScaler's 65536)
    for p in module.parameters():
        assert torch.isfinite(p).all()


@gpu
def test_fused_optimizer_skips_nan_on_the_device_and_reads_one_update_late(small_mnist_dir, tmp_path, monkeypatch):
    """Fused AdamW is the default on CUDA: a NaN batch is skipped inside the
    kernel (weights and optimizer state bitwise unchanged), and the host reads
    each update's gradient norm after the next update's forward and backward."""
    from textbox_like.core import faults
    trainer, _, _ = build_trainer(mnist_args(small_mnist_dir, tmp_path / "out", "--optimizer", "adamw",
                                             "--log-interval", "100", "--no-save", "--disable-validation",
                                             max_update=8))
    assert trainer.accelerator.device.type == "cuda"
    assert all(g["fused"] for g in trainer.optimizer.optimizer.param_groups)  # the default, not asked for
    events = []
    real_value = faults.HostCopy.value
    monkeypatch.setattr(faults.HostCopy, "value", lambda self: (events.append("read"), real_value(self))[1])
    calls = poison_batches(trainer, {3}, events)
    record = record_steps(trainer, calls)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        rc = run_trainer(trainer)
    assert rc == 0, err.getvalue()[-3000:]
    assert trainer.step.skips_on_device
    reads = [i for i, e in enumerate(events) if e == "read"]
    losses = {e: i for i, e in enumerate(events) if e.startswith("loss")}
    for k in range(2, 8):  # the first step (it creates the optimizer's state) is checked on the host
        assert any(losses[f"loss {k + 1}"] < r < losses.get(f"loss {k + 2}", len(events)) for r in reads), events
    _, before, _, after = record[2]  # the NaN batch
    assert_bitwise_equal(after["model"], before["model"], "model")
    assert_bitwise_equal(after["optimizer"]["state"], before["optimizer"]["state"], "optimizer state")
    assert record[3][3]["num_updates"] == 3 and record[3][2]
    assert "update 3: gradient norm nan is not finite; update skipped (1 in a row)" in err.getvalue()
    assert trainer.state.num_updates == 8 and trainer.state.skipped_updates == 1 and len(record) == 9
    assert trainer.scheduler.num_updates == 8
    for p in trainer.accelerator.unwrap_model(trainer.model).parameters():
        assert p.device.type == "cuda" and torch.isfinite(p).all()


# ---------------------------------------------------------------- kill -9 and resume
@gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_sigkill_then_resume_is_bitwise_identical_on_cuda(mnist_dir, tmp_path, precision):
    """test_resume.py's check on the GPU: with --cudnn_deterministic a run
    killed with SIGKILL and resumed ends bitwise equal to one never stopped
    (dropout on: the CUDA RNG state is restored too)."""
    extra = ["--cudnn_deterministic", *PRECISIONS[precision][0]]
    ref_dir, save_dir = tmp_path / "ref", tmp_path / "run"
    ref = run_cli(resume_command(mnist_dir, ref_dir, *extra, "--log-format", "simple")[2:], timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_on_cuda(ref.stderr, PRECISIONS[precision][1])
    cmd = resume_command(mnist_dir, save_dir, *extra)
    # an H200 ran the 55 updates after the first checkpoint in under the
    # second this waited on the CPU (the run had ended): here the kill comes
    # within ~7 ms of the first checkpoint_last.pt (looked for every 2 ms)
    code, err = kill_after_checkpoint(cmd, save_dir, signal.SIGKILL, min_checkpoint="checkpoint_last.pt", seed=24,
                                      max_delay=0.005, poll=0.002)
    assert code == -signal.SIGKILL, f"the run was not killed (exit {code}): {err[-1000:]}"
    killed_at = load_checkpoint(save_dir / "checkpoint_last.pt")["train"]["num_updates"]
    assert 5 <= killed_at < 60
    resumed = run_cli(cmd[2:] + ["--log-format", "simple", "--resume"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # killed between a save's first name and its copy to checkpoint_last.pt,
    # the run resumes from that newer checkpoint (CheckpointManager.resume_path)
    found = re.search(r"resumed from \S+: epoch \d+, update (\d+)", resumed.stderr)
    assert found and int(found.group(1)) in (killed_at, killed_at + 5), resumed.stderr[-3000:]
    final = load_checkpoint(save_dir / "checkpoint_last.pt")
    assert "cuda" in final["rng"][0]
    compare_final(final, load_checkpoint(ref_dir / "checkpoint_last.pt"))


# ---------------------------------------------------------------- --compile
@gpu
@pytest.mark.timeout(600)
def test_compiled_mnist_on_cuda_equals_eager(small_mnist_dir, tmp_path):
    common = ["--log-interval", "1", "--threads", "1", "--disable-validation", "--max-epoch", "0", *NO_DROPOUT,
              "--log-format", "simple"]
    run_ok(base_args(small_mnist_dir, tmp_path / "eager", *common, max_update=10))
    err = run_ok(base_args(small_mnist_dir, tmp_path / "compiled", *common, "--compile", max_update=10), timeout=600)
    assert_on_cuda(err)
    # on CUDA the whole net compiles (no regions), and it did compile
    assert "compile from --compile (mode default)" in err and "regions" not in err, err[-3000:]
    assert err.count("compiled: the first update took") == 1 and "did not compile" not in err
    eager = [r["loss"] for r in train_records(tmp_path / "eager")]
    compiled = [r["loss"] for r in assert_finite_losses(tmp_path / "compiled", 10)]
    assert compiled == pytest.approx(eager, rel=1e-3)


@gpu
@pytest.mark.timeout(600)
def test_compiled_tiny_bert_bf16_on_cuda(bert_data, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    err = run_ok(bert_args(bert_data, out, "--bf16", "--compile"), timeout=600)
    assert_on_cuda(err, "bf16")
    assert err.count("compiled: the first update took") == 1 and "did not compile" not in err, err[-3000:]
    assert_finite_losses(out, 6, ("loss", "mlm_loss", "nsp_loss"))


# ---------------------------------------------------------------- checkpoints across devices
@gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["float32", "fp16"])
def test_checkpoint_written_on_cuda_resumes_on_cpu_and_back(small_mnist_dir, tmp_path, precision):
    """CUDA (fused Adam's state on the GPU) -> --cpu -> CUDA, one save dir:
    each leg resumes where the last one stopped, on its own device."""
    flags, name = PRECISIONS[precision]
    out = tmp_path / "out"
    common = ["--optimizer", "adam", "--log-format", "simple", "--log-interval", "1", "--threads", "1",
              "--disable-validation", "--max-epoch", "0", *flags]  # 8 updates an epoch: two epochs
    err = run_ok(base_args(small_mnist_dir, out, *common, max_update=5))
    assert_on_cuda(err, name)
    cuda_state = load_checkpoint(out / "checkpoint_last.pt")
    assert cuda_state["train"]["num_updates"] == 5 and "cuda" in cuda_state["rng"][0]

    err = run_ok(base_args(small_mnist_dir, out, *common, "--cpu", "--resume", max_update=10))
    assert re.search(r"\| device cpu[ |]", start_line(err)), start_line(err)
    assert re.search(r"resumed from \S*checkpoint_last\.pt: epoch 1, update 5\b", err), err[-3000:]
    if precision == "fp16":  # a CPU runs fp16 as bf16: a warned change, not a refusal (a GPU may be gone)
        assert "the same flags on another device" in err, err[-3000:]
    cpu_state = load_checkpoint(out / "checkpoint_last.pt")
    assert cpu_state["train"]["num_updates"] == 10
    assert any(not torch.equal(cpu_state["model"][k], cuda_state["model"][k]) for k in cuda_state["model"])

    err = run_ok(base_args(small_mnist_dir, out, *common, "--resume", max_update=15))
    assert_on_cuda(err, name)
    assert re.search(r"resumed from \S*checkpoint_last\.pt: epoch 2, update 10\b", err), err[-3000:]
    final = load_checkpoint(out / "checkpoint_last.pt")
    assert final["train"]["num_updates"] == 15
    assert all(torch.isfinite(t).all() for t in final["model"].values() if torch.is_floating_point(t))
    # one record per update over the three legs: none repeated, none lost
    assert [r["update"] for r in train_records(out)] == list(range(1, 16))


# ---------------------------------------------------------------- the generic Hugging Face task
@gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("head", ["sequence_classification", "causal_lm", "masked_lm", "seq2seq"])
def test_each_hf_head_trains_on_cuda_and_its_checkpoint_evaluates_on_cpu(models, text_data, tmp_path, head, precision):
    """--task hf on the GPU: the start line names cuda and the precision, the
    loss falls, the run exports its model, and the CUDA checkpoint evaluates on
    a CPU to the run's own last validation loss (float32 only: bf16 rounds)."""
    from textbox_like.api import evaluate

    flags, name = PRECISIONS[precision]
    out = tmp_path / "run"
    extra = ("--target_column", "target", "--generation_max_length", "12") if head == "seq2seq" else ()
    err = run_ok(hf_args(models[head], text_data, out, "--max-update", "18", "--log-format", "simple",
                         *extra, *flags))
    assert_on_cuda(err, name)
    train, valid = train_records(out), [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "valid"]
    assert all(math.isfinite(r["loss"]) for r in train + valid)
    assert valid[-1]["loss"] < train[0]["loss"] - 0.05, (train[0], valid[-1])
    assert (out / "hf_model" / "model.safetensors").is_file()
    state = load_checkpoint(out / "checkpoint_last.pt")
    assert "cuda" in state["rng"][0]
    if precision == "float32":
        assert evaluate(out / "checkpoint_last.pt", cpu=True)["loss"] == pytest.approx(valid[-1]["loss"], abs=1e-3)


# ---------------------------------------------------------------- --fsdp: BERT-large in bf16 (issue 32)
def fsdp_bert_large_args(d, save_dir, max_update):
    """BERT-large from its preset (24 layers, hidden 1024; 305M parameters with
    this vocabulary) on test_bert_train's shards: Adam at a constant LR, so the
    loss falls within a few updates; a sharded save and a validation every 4."""
    return ["--task", "bert", "--data", d / "shards", "--dict", d / "vocab.txt", "--model-preset", "large",
            "--max-sentences", "8", "--optimizer", "adam", "--lr", "0.0002", "--lr-scheduler", "constant",
            "--max-update", max_update, "--save-interval-updates", "4", "--validate-interval-updates", "4",
            "--save-dir", save_dir, "--log-format", "simple", "--log-interval", "1", "--threads", "1"]


def fsdp_command(launcher, args):
    """(command, environment) of a bf16 --fsdp run with one GPU per rank, by
    launcher: ours with one process (no launcher) or two, torchrun with one,
    and accelerate launch --use_fsdp --fsdp_version 2 with one (its flags,
    not ours, ask for FSDP and bf16)."""
    env = clean_env()
    args = [str(a) for a in args]
    if launcher == "accelerate":
        env["HF_HOME"] = str(Path(args[args.index("--save-dir") + 1]).parent / "hf_home")  # no user accelerate config
        env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
        return [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
                "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
                "--main_process_port", str(free_port()), "run_hetseq.py", *args], env
    ours = [*args, "--bf16", "--fsdp"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                "run_hetseq.py", *ours], env
    if launcher == "two ranks":
        return [sys.executable, "run_hetseq.py", *ours, "--distributed-world-size", "2"], env
    return [sys.executable, "run_hetseq.py", *ours], env


def run_fsdp(launcher, args, timeout=900):
    cmd, env = fsdp_command(launcher, args)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    return out.stderr


@gpu
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("launcher", ["python", "torchrun", "accelerate", "two ranks"])
def test_fsdp_bert_large_bf16_on_cuda_saves_sharded_and_resumes(bert_data, tmp_path, launcher):  # noqa: F811
    """BERT-large, bf16, --fsdp, one GPU per rank: Accelerate's FSDP2 plugin
    shards it (the start line says so, with each of the 24 BertLayers a unit
    and the expected memory per rank), the loss falls, every rank's peak
    memory is logged, the checkpoints are sharded (.dcp, saved by the ranks
    that ran), and a resume from the last one continues with the next update.
    One rank: by ours, torchrun and accelerate launch (a GPU machine here
    usually has one); two ranks where there are two GPUs. One rank's
    checkpoint also evaluates (to the run's own validation loss) and exports."""
    from textbox_like.storage.sharded_checkpoint import consolidated_state, read_extra_state, read_manifest

    ranks = 2 if launcher == "two ranks" else 1
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs: {torch.cuda.device_count()} here")
    out = tmp_path / "run"
    err = run_fsdp(launcher, fsdp_bert_large_args(bert_data, out, 8))
    line = start_line(err)
    assert_on_cuda(err, "bf16")
    source = "accelerate launch / accelerate config" if launcher == "accelerate" else "--fsdp"
    assert f"sharding from {source}" in line, line
    assert f"sharding full over {ranks} rank{'s' if ranks > 1 else ''} (Accelerate's FSDP2 plugin; units: " in line
    assert "24 BertLayer" in line, line
    # the expected figures: float32 masters (bf16 is the gathered copy), Adam's two states, split over the ranks
    params = int(re.search(r"task bert \| ([\d,]+) parameters", line).group(1).replace(",", ""))
    assert 300e6 < params < 340e6, line
    mib = params * 4 / ranks / 2 ** 20
    assert (f"expected per rank: parameters {mib:,.2f} MiB, gradients {mib:,.2f} MiB, optimizer states "
            f"{2 * mib:,.2f} MiB") in line, line

    records = assert_finite_losses(out, 8, ("loss", "mlm_loss", "nsp_loss"))
    total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    for r in records:
        assert len(r["peak_mem_gib"]) == ranks and all(0 < peak < total for peak in r["peak_mem_gib"]), r

    last = out / "checkpoint_last.dcp"
    assert last.is_dir() and (out / "checkpoint_1_4.dcp").is_dir() and not list(out.glob("*.pt"))
    assert read_manifest(last)["world_size"] == ranks
    assert read_extra_state(last)["train"]["num_updates"] == 8

    err = run_fsdp(launcher, [*fsdp_bert_large_args(bert_data, out, 12), "--resume"])
    assert f"resumed from {last}: epoch 1, update 8" in err, err[-3000:]
    assert read_extra_state(last)["train"]["num_updates"] == 12
    records = assert_finite_losses(out, 12, ("loss", "mlm_loss", "nsp_loss"))  # one record per update: none redone
    # the masked-word loss falls (batches of 8 with 5 masked words each: means over a few updates, not single ones;
    # the next-sentence loss of so few pairs is noise)
    mlm = [r["mlm_loss"] for r in records]
    assert sum(mlm[-3:]) / 3 < sum(mlm[:2]) / 2 - 0.1, mlm
    if ranks > 1 or launcher != "python":
        return

    from safetensors.torch import load_file

    from textbox_like.api import evaluate
    valid = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "valid"]
    assert valid and valid[-1]["update"] == 12, valid
    # evaluated in float32 on the CPU; the run validated in bf16: close, not equal
    evaluated = evaluate(last, cpu=True)
    assert evaluated["num_updates"] == 12
    assert evaluated["loss"] == pytest.approx(valid[-1]["loss"], rel=0.05)
    exported = subprocess.run([sys.executable, "-m", "textbox_like.tools.export", str(last), "--to", str(tmp_path / "hf")],
                              cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "(update 12: 24 layers, hidden 1024," in exported.stdout, exported.stdout
    weights, whole = load_file(tmp_path / "hf" / "model.safetensors"), consolidated_state(last)["model"]
    common = weights.keys() & whole.keys()
    assert "bert.encoder.layer.23.output.dense.weight" in common and len(common) > 350, sorted(weights)[:5]
    for key in common:
        assert torch.equal(weights[key], whole[key]), key


@gpu
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("strategy", ["none", "hybrid"])
def test_fsdp_on_two_gpus_splitting_nothing_is_sharded_by_textbox_like(bert_data, tmp_path, strategy):  # noqa: F811
    """Two GPUs, --fsdp-sharding none, and hybrid over two "nodes" of one GPU
    each (LOCAL_WORLD_SIZE 1): nothing is split over ranks, which Accelerate's
    FSDP2 plugin refuses ("no dimension for FSDP to shard across"), so the
    trainer applies fully_shard over a (2, 1) mesh itself, as on CPU: the
    start line says so, the run trains, saves sharded and resumes."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs: {torch.cuda.device_count()} here")
    out = tmp_path / "run"
    args = [*fsdp_bert_large_args(bert_data, out, 4), "--fsdp-sharding", strategy]
    cmd, env = fsdp_command("two ranks", args)
    if strategy == "hybrid":  # two one-GPU nodes on this machine: torchrun with one process per "node"
        port = str(free_port())
        cmd = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", port, "run_hetseq.py",
                *[str(a) for a in args], "--bf16", "--fsdp", "--device-id", str(n)] for n in (0, 1)]
        procs = [subprocess.Popen(c, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True) for c in cmd]
        errs = [p.communicate(timeout=1500)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
        err = errs[0]
    else:
        err = run_fsdp("two ranks", args)
    line = start_line(err)
    how = {"none": "sharding none (replicated over 2 ranks)",
           "hybrid": "sharding hybrid: over 1 ranks per node, replicated over 2 node(s)"}[strategy]
    assert f"{how} (fully_shard applied by textbox_like (Accelerate's FSDP needs ranks to shard across); " \
           in line, line
    assert_finite_losses(out, 4, ("loss", "mlm_loss", "nsp_loss"))
    assert (out / "checkpoint_last.dcp").is_dir() and not list(out.glob("*.pt"))

# ---------------------------------------------------------------- scripts/gpu-check.sh (runs anywhere)
SCRIPT = REPO / "scripts" / "gpu-check.sh"


def gpu_check(tmp_path, *args, **env):
    """The script with CUDA hidden (so the no-GPU path is taken on a GPU machine too)."""
    full = {k: v for k, v in clean_env().items() if not k.startswith(("WHEELS", "GPU_CHECK_"))}
    full.update({"CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(tmp_path / "report"), **env})
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_3(tmp_path):
    done = gpu_check(tmp_path, tmp_path)  # a wheels folder that exists: nothing is installed all the same
    assert done.returncode == 3, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA on this machine"), lines
    assert "Traceback" not in done.stderr
    report = json.loads((tmp_path / "report" / "gpu-report.json").read_text())
    assert report["status"] == "no-cuda" and report["exit_code"] == 3
    versions = report["versions"]
    assert versions["cuda_available"] is False and versions["torch"] == torch.__version__
    assert {"accelerate", "transformers", "driver", "python"} <= set(versions)
    assert report["tests"] == {} and report["benchmarks"] == [] and report["packages"]["installed"] == []
    md = (tmp_path / "report" / "gpu-report.md").read_text()
    assert md.startswith("# GPU check: no-cuda") and "No CUDA on this machine" in md
    assert f"| torch | {torch.__version__} |" in md


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, env, words", [
    (["/no/such/wheels"], {}, "the wheels folder '/no/such/wheels' does not exist"),
    ([], {"WHEELS": "/no/such/wheels"}, "the wheels folder '/no/such/wheels' does not exist"),
    (["--bogus"], {}, "unknown option '--bogus'"),
    (["a", "b"], {}, "one wheels folder at most"),
    ([], {"GPU_CHECK_BATCH": "x"}, "GPU_CHECK_BATCH expects a whole number"),
    ([], {"PYTHON": "/no/such/python"}, "no Python interpreter /no/such/python"),
])
@pytest.mark.slow
def test_gpu_check_bad_input_is_one_line(tmp_path, args, env, words):
    if args[:1] == ["a"]:
        (tmp_path / "a").mkdir()
    done = gpu_check(tmp_path, *args, **env)
    assert done.returncode == 2, done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines


@pytest.mark.slow
def test_gpu_check_names_the_commit_only_of_its_own_checkout(tmp_path):
    """A copy of the tree unpacked inside another repository (as carried to a
    device machine) names no commit: not the outer repository's."""
    outer = tmp_path / "outer"
    for where in (outer, outer / "copy"):
        (where / "scripts").mkdir(parents=True)
        (where / "scripts" / "gpu_check.py").write_text((REPO / "scripts" / "gpu_check.py").read_text())
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "scripts"], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + cmd, cwd=outer, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=outer, capture_output=True, text=True).stdout

    def commit_seen_from(where):
        spec = importlib.util.spec_from_file_location(f"gpu_check_{where.name}", where / "scripts" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.git_commit()
    assert commit_seen_from(outer) == head.strip()
    assert commit_seen_from(outer / "copy") is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gpu_check_writes_the_test_log_as_it_goes_so_a_cut_run_leaves_it(tmp_path):
    """The device's time limit kills a check mid-run (the whole process
    group, as a timeout does): tests.log already names the tests that passed
    and the one that was running."""
    import time
    (tmp_path / "test_cut.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                          "def test_hangs():\n    time.sleep(600)\n")
    log = tmp_path / "tests.log"
    script = (f"import importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('gpu_check', {str(REPO / 'scripts' / 'gpu_check.py')!r})\n"
              f"gc = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(gc)\n"
              f"with open({str(log)!r}, 'w') as log:\n"
              f"    gc.run_pytest('cut', [{str(tmp_path / 'test_cut.py')!r}, '-p', 'no:timeout'], {str(tmp_path)!r}, log)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=clean_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 150
        while "test_hangs" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else None
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text()
    assert "test_cut.py::test_quick PASSED" in text and "test_cut.py::test_hangs" in text, text
