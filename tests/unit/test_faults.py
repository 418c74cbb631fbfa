"""Faults during a run (issue 13): divergence, a single NaN batch, a full disk,
a corrupt newest checkpoint, an unwritable save dir, data that goes away.

Subprocess runs where the exit code and the exact stderr matter; in-process
Trainer runs where a fault is injected by monkeypatching (no environment
variable hooks exist in the source, and none are needed)."""
from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import re
from types import SimpleNamespace

import pytest
import torch

from conftest import _reset_accelerate, assert_bitwise_equal, read_jsonl, run_main, small_mnist_fixture


data = small_mnist_fixture("mnist_faults", seed=10)


def mnist_args(data, out, *extra, max_update=6):
    return ["--task", "mnist", "--data", str(data), "--max-sentences", "8", "--max-update", str(max_update),
            "--save-dir", str(out), "--threads", "1", "--log-format", "simple", "--report_to", "none",
            *map(str, extra)]


def error_lines(stderr):
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def build_trainer(argv):
    """A Trainer as cli.main/cli.run would build it for one process."""
    from textbox_like.processes import distributed
    from textbox_like.resolve.checks import check
    from textbox_like.resolve.resolution import parse
    from textbox_like.training.trainer import Trainer
    _reset_accelerate()
    ns = parse([str(a) for a in argv])
    check(ns)
    assert distributed.placement_from_env(ns) is None and distributed.local_plan(ns) is None
    distributed.apply_determinism(ns)
    return Trainer(ns), ns, ns.keys


def run_trainer(trainer):
    """trainer.train() with the handling of textbox_like.training.outcome.train (exit codes, one line)."""
    from textbox_like.core.faults import DataUnavailable, RunStopped
    try:
        try:
            return trainer.train()
        except DataUnavailable as exc:
            trainer.checkpointer.save(end_of_epoch=False, is_best=False, final=True)
            print(f"error: {exc}", flush=True, file=__import__("sys").stderr)
            return exc.exit_code
        except RunStopped as exc:
            print(f"error: {exc}", file=__import__("sys").stderr)
            return exc.exit_code
    finally:
        _reset_accelerate()


def poison_batches(trainer, numbers, events=None):
    """Make the loss of the given forward calls (1-based) NaN; returns the call counter."""
    real_loss, calls = trainer.task.loss, {"n": 0}

    def loss(model, batch):
        calls["n"] += 1
        if events is not None:
            events.append(f"loss {calls['n']}")
        terms, stats = real_loss(model, batch)
        if calls["n"] in numbers:
            nan = float("nan")
            terms = {k: v * nan for k, v in terms.items()} if isinstance(terms, dict) else terms * nan
        return terms, stats

    trainer.task.loss = loss
    return calls


def trainer_snapshot(trainer):
    """Everything an update may move: weights, optimizer, LR, schedule and counts."""
    module = trainer.accelerator.unwrap_model(trainer.model)
    return {"model": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "lr": [g["lr"] for g in trainer.optimizer.param_groups], "scheduler_lr": trainer.scheduler.get_lr(),
            "scheduler_updates": trainer.scheduler.num_updates, "num_updates": trainer.state.num_updates,
            "updates_in_epoch": trainer.state.updates_in_epoch}


def record_steps(trainer, calls):
    """Wrap train_step: a list of (forward calls so far, snapshot before, stepped, snapshot after)."""
    real_step, record = trainer.train_step, []

    def train_step(micro_batches, totals):
        before = trainer_snapshot(trainer)
        stepped = real_step(micro_batches, totals)
        record.append((calls["n"], before, stepped, trainer_snapshot(trainer)))
        return stepped

    trainer.train_step = train_step
    return record


def test_single_nan_batch_is_skipped_and_training_goes_on(data, tmp_path):
    trainer, ns, _ = build_trainer(mnist_args(data, tmp_path / "out", "--log-interval", "1", "--no-save",
                                              "--disable-validation", max_update=8))
    calls = poison_batches(trainer, {3})
    record = record_steps(trainer, calls)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_trainer(trainer)
    assert rc == 0, err.getvalue()[-3000:]
    skipped = [r for r in record if not r[2]]
    assert len(skipped) == 1 and skipped[0][0] == 3, [(r[0], r[2]) for r in record]
    _, before, _, after = skipped[0]
    assert_bitwise_equal(after["model"], before["model"], "model")
    assert_bitwise_equal(after["optimizer"], before["optimizer"], "optimizer")
    assert after["lr"] == before["lr"] and after["scheduler_lr"] == before["scheduler_lr"]
    assert after["scheduler_updates"] == before["scheduler_updates"] == 2
    assert after["num_updates"] == before["num_updates"] == 2
    assert after["updates_in_epoch"] == before["updates_in_epoch"] == 2
    # the next update moves everything again, and the run reaches --max-update
    nxt = record[record.index(skipped[0]) + 1]
    assert nxt[2] and nxt[3]["num_updates"] == 3
    assert any(not torch.equal(nxt[3]["model"][k], nxt[1]["model"][k]) for k in nxt[1]["model"])
    assert trainer.state.num_updates == 8
    assert trainer.state.skipped_updates == 1
    assert len(record) == 9
    assert "update 3: gradient norm nan is not finite; update skipped (1 in a row)" in err.getvalue()
    for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        assert torch.isfinite(p).all(), name

# ------------------------------------- skipping on the device (fused optimizers)
# On CUDA the optimizers with a fused kernel (adam, adamw, sgd, adagrad) are
# fused by default and skip a non-finite update in the kernel (found_inf): the
# host reads the gradient norm one update later, so the guard costs no host
# sync per update. CPU has the same fused kernels, so the path is tested here
# with --optim_conf fused=true.
FUSED = ["--optim_conf", "fused=true"]


def test_fused_optimizer_is_the_default_on_cuda_only(monkeypatch):
    from textbox_like.resolve.resolution import parse
    from textbox_like.optim import build_optimizer

    def built(device_type, *argv):
        ns = parse(["--task", "mnist", "--max-sentences", "8", "--max-update", "1", *argv])
        return build_optimizer(ns.optim, [{"params": [torch.nn.Parameter(torch.zeros(3))]}],
                               fused_default=device_type == "cuda")

    for name in ("adam", "adamw", "sgd", "adagrad"):
        cuda = built("cuda", "--optimizer", name)
        assert cuda.defaults["fused"] is True and not cuda.defaults["foreach"], name
        assert cuda._step_supports_amp_scaling, name
        cpu = built("cpu", "--optimizer", name)
        assert not cpu.defaults["fused"] and cpu.defaults["foreach"] is True, name
    # no fused kernel: unchanged; an explicit choice is kept
    assert built("cuda", "--optimizer", "adadelta").defaults["foreach"] is True
    explicit = built("cuda", "--optimizer", "adam", "--optim_conf", "foreach=true")
    assert explicit.defaults["foreach"] is True and not explicit.defaults["fused"]
    assert built("cpu", "--optimizer", "adam", *FUSED).defaults["fused"] is True
    # the trainer asks for it on CUDA only, and not under float16's loss scaler
    from accelerate.utils import TorchDynamoPlugin

    from textbox_like import optim
    from textbox_like.processes.distributed import Placement
    from textbox_like.training.state import Ranks
    from textbox_like.training.trainer import Trainer
    asked = []
    monkeypatch.setattr(optim, "build_optimizer", lambda cfg, groups, fused_default=False: asked.append(
        fused_default) or torch.optim.SGD(groups[0]["params"], lr=0.1))
    for device, scaler, expected in (("cuda", None, True), ("cuda", object(), False), ("cpu", None, False)):
        fake = Trainer.__new__(Trainer)
        fake.cfg = parse(["--task", "mnist"])
        fake.accelerator = SimpleNamespace(device=torch.device(device), scaler=scaler,
                                           prepare=lambda m, o, device_placement=None: (m, o),
                                           device_placement=True, distributed_type="NO",
                                           state=SimpleNamespace(dynamo_plugin=TorchDynamoPlugin(backend="no")))
        fake.task = SimpleNamespace(build_model=lambda: torch.nn.Linear(2, 2),
                                    param_groups=lambda m, wd: [{"params": list(m.parameters())}])
        fake.ranks = Ranks(0, 1, None, True)
        fake.placement = Placement()  # one process: nothing to shard
        monkeypatch.setattr("textbox_like.optim.lr_scheduler.build_scheduler", lambda cfg, opt: None)
        Trainer.build_model(fake)
        assert asked[-1] is expected, (device, scaler)


def test_device_skip_reads_the_norm_one_update_late_and_skips_exactly(data, tmp_path, monkeypatch):
    """A NaN batch under a fused optimizer: the kernel leaves weights and
    optimizer state alone, the LR schedule does not step, the host learns of
    it after the next update's backward (never before stepping), and the
    counts come out as on the host path."""
    from textbox_like.core import faults
    trainer, ns, _ = build_trainer(mnist_args(data, tmp_path / "out", "--optimizer", "adam", *FUSED,
                                              "--log-interval", "100", "--no-save", "--disable-validation",
                                              max_update=8))
    events = []
    real_value = faults.HostCopy.value
    monkeypatch.setattr(faults.HostCopy, "value", lambda self: (events.append("read"), real_value(self))[1])
    calls = poison_batches(trainer, {3}, events)
    record = record_steps(trainer, calls)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_trainer(trainer)
    assert rc == 0, err.getvalue()[-3000:]
    assert trainer.step.skips_on_device
    # each update's norm is read after the next update's forward and backward
    # (or at the end): the host never waits for the update it is stepping
    reads = [i for i, e in enumerate(events) if e == "read"]
    losses = {e: i for i, e in enumerate(events) if e.startswith("loss")}
    for k in range(2, 8):  # the first step, which creates the optimizer's state, is checked on the host
        assert any(losses[f"loss {k + 1}"] < r < losses.get(f"loss {k + 2}", len(events)) for r in reads), events
    _, before, stepped, after = record[2]  # the NaN batch
    assert_bitwise_equal(after["model"], before["model"], "model")
    assert_bitwise_equal(after["optimizer"]["state"], before["optimizer"]["state"], "optimizer state")
    # the next update settles it: the count is taken back and the schedule
    # not stepped, so the next update steps with the skipped update's LR
    assert record[3][3]["num_updates"] == 3 and record[3][2]
    assert record[3][3]["lr"] == after["lr"] == [trainer.scheduler.lr_at(2)] * len(after["lr"])
    assert any(not torch.equal(record[3][3]["model"][k], record[3][1]["model"][k]) for k in before["model"])
    assert "update 3: gradient norm nan is not finite; update skipped (1 in a row)" in err.getvalue()
    assert trainer.state.num_updates == 8 and trainer.state.skipped_updates == 1 and len(record) == 9
    assert trainer.scheduler.num_updates == 8
    assert trainer.step.lr == trainer.scheduler.lr_at(8)
    for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        assert torch.isfinite(p).all(), name


def test_device_skip_lagged_equals_settled_every_update(data, tmp_path):
    """Reading the norm one update late changes nothing: a run with a NaN
    batch ends bitwise equal whether it settles every update (log interval 1)
    or lazily."""
    finals = []
    for interval in (1, 100):
        trainer, _, _ = build_trainer(mnist_args(data, tmp_path / f"out{interval}", "--optimizer", "adam", *FUSED,
                                                 "--log-interval", interval, "--no-save", "--disable-validation",
                                                 max_update=7))
        calls = poison_batches(trainer, {2, 5})
        with contextlib.redirect_stderr(io.StringIO()):
            assert run_trainer(trainer) == 0
        module = trainer.accelerator.unwrap_model(trainer.model)
        finals.append({"model": {k: v.detach().clone() for k, v in module.state_dict().items()},
                       "optimizer": copy.deepcopy(trainer.optimizer.state_dict()), "lr": trainer.step.lr,
                       "counts": (trainer.state.num_updates, trainer.state.skipped_updates, calls["n"],
                                  trainer.state.samples_trained)})
    assert finals[0]["counts"] == (7, 2, 9, 7 * 8)
    assert_bitwise_equal(finals[0], finals[1], "final")


def test_first_update_nan_under_fused_sgd_momentum_is_checked_on_the_host(data, tmp_path, monkeypatch):
    """Fused SGD creates its momentum buffers with empty_like in its first
    step: a first step skipped in the kernel would keep them uninitialised.
    The step that creates the optimizer's state is checked on the host."""
    from textbox_like.core import faults
    trainer, _, _ = build_trainer(mnist_args(data, tmp_path / "out", "--optimizer", "sgd", "--momentum", "0.9",
                                             *FUSED, "--log-interval", "100", "--no-save", "--disable-validation",
                                             max_update=4))
    copies = []
    real_init = faults.HostCopy.__init__
    monkeypatch.setattr(faults.HostCopy, "__init__",
                        lambda self, t: (copies.append(trainer.state.num_updates), real_init(self, t))[1])
    poison_batches(trainer, {1})
    with contextlib.redirect_stderr(io.StringIO()):
        assert run_trainer(trainer) == 0
    assert trainer.step.skips_on_device and trainer.state.skipped_updates == 1 and trainer.state.num_updates == 4
    assert copies == [1, 2, 3]  # updates 2..4 lagged; the skipped first and the state-creating second on the host
    for buffers in trainer.optimizer.optimizer.state.values():
        assert torch.isfinite(buffers["momentum_buffer"]).all()


# -------------------------------------------------------------- full disk
def test_disk_full_on_second_checkpoint_exits_74_then_resume(data, tmp_path, monkeypatch):
    import textbox_like.storage.checkpoint as ckpt
    out = tmp_path / "out"
    real_write = ckpt.atomic_write
    calls = {"n": 0}

    def atomic_write(path, write, **kwargs):
        calls["n"] += 1
        if calls["n"] != 2:
            return real_write(path, write, **kwargs)

        def partial(handle):  # some bytes reach the temporary file, then the disk is full
            handle.write(b"PK\x03\x04" + b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, partial, **kwargs)

    monkeypatch.setattr(ckpt, "atomic_write", atomic_write)
    trainer, ns, keys = build_trainer(mnist_args(data, out, "--save-interval-updates", "2", "--disable-validation",
                                                 "--log-interval", "1", max_update=6))
    from textbox_like.training import outcome as trainer_module
    monkeypatch.setattr(trainer_module, "Trainer", lambda cfg, callbacks=(): trainer)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = trainer_module.train(ns)
        finally:
            _reset_accelerate()
    assert rc == 74, err.getvalue()[-3000:]
    assert calls["n"] == 2
    errors = error_lines(err.getvalue())
    assert len(errors) == 1, err.getvalue()[-3000:]
    line = errors[0]
    assert str(out / "checkpoint_1_4.pt") in line, line
    assert "No space left on device" in line, line
    assert str(out / "checkpoint_1_2.pt") in line, line  # the last good checkpoint
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".") or p.suffix in (".tmp", ".lnk")]
    assert leftovers == [], leftovers
    assert not (out / "checkpoint_1_4.pt").exists()
    assert load(out / "checkpoint_last.pt")["train"]["num_updates"] == 2

    monkeypatch.setattr(ckpt, "atomic_write", real_write)  # space freed
    monkeypatch.undo()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(mnist_args(data, out, "--save-interval-updates", "2", "--disable-validation", "--resume",
                                 "--log-interval", "1", max_update=6))
    assert rc == 0, err.getvalue()[-3000:]
    assert re.search(r"resumed from \S*checkpoint_last\.pt: epoch 1, update 2\b", err.getvalue()), \
        err.getvalue()[-3000:]
    updates = [r["update"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert updates == [1, 2, 3, 4, 5, 6]
    assert load(out / "checkpoint_last.pt")["train"]["num_updates"] == 6


# --------------------------------------------------------- unwritable dir
def test_unwritable_save_dir_refused_before_data_loads(data, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    from textbox_like.tasks import TASKS
    task_class = TASKS.get("mnist")
    touched = []
    for method in ("prepare_data", "build_dataset"):
        real = getattr(task_class, method)
        monkeypatch.setattr(task_class, method,
                            lambda self, *a, _m=method, _r=real, **k: (touched.append(_m), _r(self, *a, **k))[1])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_main(mnist_args(data, blocker / "sub" / "out", max_update=2))
    assert rc == 2, err.getvalue()
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert str(blocker / "sub" / "out") in lines[0]
    assert touched == []


# ----------------------------------------------------- data that goes away
@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    from test_prepare_bert import write_corpus, write_vocab
    from textbox_like.tools.prepare_bert import main as prepare
    root = tmp_path_factory.mktemp("bert_faults")
    vocab = root / "vocab.txt"
    tokens = write_vocab(vocab)
    corpus = root / "corpus.txt"
    write_corpus(corpus, n_docs=60)
    assert prepare(["--input", str(corpus), "--vocab", str(vocab), "--output", str(root / "shards"),
                    "--max-seq-length", "32", "--max-predictions-per-seq", "5", "--dupe-factor", "1",
                    "--valid-fraction", "0.1", "--shards", "3", "--no-progress-bar"]) == 0
    config = root / "bert_config.json"
    config.write_text(json.dumps({
        "attention_probs_dropout_prob": 0.0, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
        "hidden_size": 16, "initializer_range": 0.02, "intermediate_size": 32, "max_position_embeddings": 32,
        "num_attention_heads": 2, "num_hidden_layers": 1, "type_vocab_size": 2, "vocab_size": len(tokens)}))
    return root


def bert_args(d, out, *extra, max_update=8):
    return ["--task", "bert", "--data", str(d / "shards"), "--dict", str(d / "vocab.txt"),
            "--config_file", str(d / "bert_config.json"), "--save-dir", str(out), "--max-sentences", "4",
            "--shuffle-block", "4", "--max-update", str(max_update), "--lr", "0.001", "--warmup-updates", "2",
            "--log-format", "simple", "--log-interval", "1", "--threads", "1", "--report_to", "none",
            "--disable-validation", *map(str, extra)]
