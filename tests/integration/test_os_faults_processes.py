"""The tests of test_os_faults.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from textbox_like.storage.checkpoint import atomic_save, load_checkpoint

from conftest import N_SMALL_TEST, N_SMALL_TRAIN, REPO, clean_env, copy_of, refusal_in_process, run_main, write_mnist
from test_faults import bert_args, bert_data  # noqa: F401  (a fixture, used by name)
from test_os_faults import data, error_lines, mnist_args


LONG = ["--max-epoch", "100000"]  # with --max-update 1000000: runs until stopped


def in_process(args, capfd):
    """main() in this process, its output captured, as run_cli's
    CompletedProcess: for a run around a fault whose process is not what is
    tested (the run before a fault, the resume after it)."""
    return refusal_in_process(args, capfd)


class Run:
    """run_hetseq.py in a subprocess, its stderr collected line by line."""

    def __init__(self, args, preexec_fn=None, delay=None):
        """``delay``: TEXTBOX_LIKE_TEST_DELAY, e.g. 'save=4' (see faults.test_delay)."""
        from textbox_like.core.faults import DELAY_ENV
        self.lines = []
        env = {**clean_env(), **({DELAY_ENV: delay} if delay else {})}
        self.proc = subprocess.Popen([sys.executable, "run_hetseq.py", *map(str, args)], cwd=REPO, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=preexec_fn)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def stderr(self):
        return "\n".join(self.lines)

    def wait_for(self, condition, timeout=150, what="it"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                self.reader.join(5)
                pytest.fail(f"the run ended (rc {self.proc.returncode}) before {what}:\n{self.stderr[-3000:]}")
            time.sleep(0.01)
        self.kill()
        pytest.fail(f"no {what} within {timeout}s:\n{self.stderr[-3000:]}")

    def wait_for_update(self, n, timeout=150):
        pattern = re.compile(r"^train \|.*\| update (\d+) \|")

        def reached():
            return any(int(m.group(1)) >= n for m in map(pattern.match, list(self.lines)) if m)
        self.wait_for(reached, timeout, f"update {n}")

    def finish(self, timeout=150):
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- a full disk
@contextlib.contextmanager
def small_disk(path: Path, size_mb: int):
    """A directory on a file system of ``size_mb`` MiB: ("tmpfs", path), or
    ("rlimit", path) where mounting is refused (the caller then limits file
    sizes with :func:`file_size_limit`)."""
    path.mkdir(parents=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                                 capture_output=True, text=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    if not mounted:
        yield "rlimit"
        return
    try:
        yield "tmpfs"
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def file_size_limit(limit_bytes):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return preexec


def fill(directory: Path, leave_bytes: int) -> Path:
    """Fill the file system of ``directory`` up to ``leave_bytes`` free, for real."""
    filler = directory / "filler.bin"
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as handle:
        chunk = b"\0" * (1 << 20)
        left = free - leave_bytes
        while left > 0:
            handle.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)
    st = os.statvfs(directory)
    assert st.f_bavail * st.f_frsize <= leave_bytes + (1 << 20)
    return filler


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_really_full_disk_exits_74_keeps_the_last_checkpoint_and_resumes(data, tmp_path, capfd):
    out = tmp_path / "disk"
    common = ["--save-interval-updates", "2", "--log-interval", "1"]
    with small_disk(out, 64) as kind:
        first = in_process(mnist_args(data, out, *common, max_update=2), capfd)
        assert first.returncode == 0, first.stderr[-3000:]
        size = (out / "checkpoint_1_2.pt").stat().st_size
        assert size > 4 << 20  # the room left below is less than one checkpoint
        if kind == "tmpfs":
            filler, preexec, reason = fill(out, size // 3), None, "No space left on device"
        else:
            filler, preexec, reason = None, file_size_limit(size // 3), "File too large"
        full = Run(mnist_args(data, out, *common, "--resume", max_update=6), preexec_fn=preexec)
        rc = full.finish(200)
        assert rc == 74, full.stderr[-3000:]
        errors = error_lines(full.stderr)
        assert len(errors) == 1, full.stderr[-3000:]
        line = errors[0]
        assert str(out / "checkpoint_1_4.pt") in line and reason in line, line
        assert re.search(r"last good checkpoint is \S*(checkpoint_last|checkpoint_1_2)\.pt", line), line
        # no partial file, nothing half-written; what was saved before still verifies
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".checkpoint")]
        assert not (out / "checkpoint_1_4.pt").exists()
        for name in ("checkpoint_1_2.pt", "checkpoint_last.pt"):
            assert load_checkpoint(out / name)["train"]["num_updates"] == 2, name
        assert not (out / "run.lock").exists()  # released on the way out
        if filler is not None:
            filler.unlink()  # space freed
        resumed = in_process(mnist_args(data, out, *common, "--resume", max_update=4), capfd)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "update 2" in resumed.stderr
        assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 4


# ------------------------------------------------------ the save dir removed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_dir_removed_mid_run_exits_74_and_is_not_recreated(data, tmp_path):
    out = tmp_path / "out"
    run = Run(mnist_args(data, out, "--save-interval-updates", "3", "--log-interval", "1", *LONG,
                         max_update=1000000))
    try:
        run.wait_for(lambda: (out / "checkpoint_1_3.pt").exists(), what="the first checkpoint")
        while out.exists():
            shutil.rmtree(out, ignore_errors=True)
        rc = run.finish(200)
    finally:
        run.kill()
    assert rc == 74, run.stderr[-3000:]
    errors = error_lines(run.stderr)
    assert len(errors) == 1 and "removed" in errors[0] and str(out) in errors[0], run.stderr[-3000:]
    assert not out.exists()  # not silently recreated


# ------------------------------------------------ two runs, one save directory
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_second_run_on_a_save_dir_is_refused_then_a_dead_runs_lock_is_taken_over(data, tmp_path, capfd):
    out = tmp_path / "out"
    first = Run(mnist_args(data, out, "--save-interval-updates", "4", "--log-interval", "1", "--lr", "0.001",
                           *LONG, max_update=1000000))
    try:
        first.wait_for_update(2)
        config_before = (out / "config.yaml").read_text()
        second = refusal_in_process(mnist_args(data, out, "--lr", "0.5", max_update=4), capfd)
        assert second.returncode == 2, second.stderr[-3000:]
        errors = error_lines(second.stderr)
        assert len(errors) == 1, second.stderr[-3000:]
        assert f"pid {first.proc.pid}" in errors[0] and socket.gethostname() in errors[0], errors[0]
        assert "--save-dir" in errors[0]
        assert first.proc.poll() is None  # the first run goes on, untouched
        assert (out / "config.yaml").read_text() == config_before
        first.proc.send_signal(signal.SIGKILL)  # dies without a word: its lock stays behind
        first.finish()
    finally:
        first.kill()
    lock = json.loads((out / "run.lock").read_text())
    assert lock["pid"] == first.proc.pid
    third = in_process(mnist_args(data, out, "--resume", "--reset-dataloader", "--lr", "0.001", max_update=4),
                       capfd)
    assert third.returncode == 0, third.stderr[-3000:]
    notes = [line for line in third.stderr.splitlines() if "took over" in line]
    assert len(notes) == 1 and f"pid {first.proc.pid}" in notes[0] and "no longer running" in notes[0], \
        third.stderr[-3000:]
    assert not (out / "run.lock").exists()


# -------------------------------------------------------------------- signals
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 2])
def test_two_signals_one_second_apart_save_and_exit_75(data, tmp_path, world):
    """The second SIGTERM surely arrives while the first one's stop is saving:
    each save waits 4 s first (a slow file system, TEXTBOX_LIKE_TEST_DELAY),
    so the stop lasts longer than the second between the signals; the rank
    that saved says it absorbed one."""
    out = tmp_path / "out"
    run = Run(mnist_args(data, out, "--log-interval", "1", "--distributed-world-size", world, *LONG,
                         max_update=1000000), delay="save=4")
    try:
        run.wait_for_update(3)
        run.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert run.proc.poll() is None  # still stopping: the save takes 4 s
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish()
    finally:
        run.kill()
    assert rc == 75, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert "stopped by SIGTERM (1 more signal(s) during the stop, absorbed); checkpoint_last.pt saved" \
        in run.stderr, run.stderr[-3000:]
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] >= 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_under_fsdp_names_the_dcp_it_saved_and_the_resume_goes_on_from_it(data, tmp_path, capfd):
    """A real SIGTERM mid-run under --fsdp: the stop's line names the file the save wrote, checkpoint_last.dcp
    (it said checkpoint_last.pt, which an --fsdp run never writes), and --resume continues from that update."""
    out = tmp_path / "out"
    run = Run(mnist_args(data, out, "--log-interval", "1", "--fsdp", *LONG, max_update=1000000))
    try:
        run.wait_for_update(3)
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish()
    finally:
        run.kill()
    assert rc == 75, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    stop = [line for line in run.stderr.splitlines() if line.startswith("stopped by SIGTERM")]
    assert stop == ["stopped by SIGTERM; checkpoint_last.dcp saved: rerun the same command with --resume"], \
        run.stderr[-3000:]
    assert (out / "checkpoint_last.dcp").is_dir() and not (out / "checkpoint_last.pt").exists()
    from textbox_like.storage.sharded_checkpoint import read_extra_state
    saved = read_extra_state(out / "checkpoint_last.dcp")["train"]["num_updates"]
    assert saved >= 3
    resumed = in_process(mnist_args(data, out, "--fsdp", "--resume", max_update=saved + 2), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["num_updates"] == saved + 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_signal_during_start_up_exits_75_at_once(data, tmp_path):
    """Loading the data takes 60 s (a slow file system, TEXTBOX_LIKE_TEST_DELAY),
    after the save directory's lock is taken: the signal surely arrives during
    start-up, and the run ends at once, not when the data is loaded."""
    out = tmp_path / "out"
    run = Run(mnist_args(data, out, *LONG, max_update=1000000), delay="start=60")
    try:
        run.wait_for(lambda: (out / "run.lock").exists(), what="the save directory's lock")
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=50)  # well before the data would be loaded
    finally:
        run.kill()
    assert rc == 75, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM during start-up, before training began"), \
        run.stderr[-3000:]  # and nothing else: training never began
    assert not list(out.glob("checkpoint*.pt"))
    assert not (out / "run.lock").exists()



#: a user task whose data loading catches every exception (a careless retry
#: loop); the signal lands inside it, as one once landed in numpy's lazy
#: import of numpy.random under set_seed, which cleared it
SWALLOWING_TASK = """
import time
from pathlib import Path

import torch

from textbox_like import Task, register_task


@register_task("swallows_errors")
class SwallowsErrors(Task):
    metric_names = ("loss",)

    def prepare_data(self):
        try:
            Path(MARKER).write_text("loading")
            time.sleep(60)          # a slow file system
        except Exception:
            pass                    # 'retry later'

    def build_dataset(self, split):
        from torch.utils.data import TensorDataset
        x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, (x.sum(1) > 0).long())

    def build_model(self):
        return torch.nn.Linear(3, 2)

    def loss(self, model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss, {"loss_sum": loss.detach() * len(y), "nsamples": len(y)}

    def metrics(self, sums):
        return {"loss": sums.get("loss_sum", 0.0) / max(sums.get("nsamples", 0.0), 1.0)}
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_start_up_signal_swallowed_by_the_code_it_landed_in_still_stops_the_run(tmp_path):
    """SIGTERM while the task's data loading sleeps inside ``try: ... except
    Exception: pass``: the stop's exception is swallowed there, yet the run
    stops with 75 and its line as start-up goes on, before the model is built
    and before any update (it ignored the signal, slept 60 s and trained)."""
    package = tmp_path / "swallowing_task"
    package.mkdir()
    marker = tmp_path / "loading"
    (package / "__init__.py").write_text(SWALLOWING_TASK.replace("MARKER", repr(str(marker))))
    out = tmp_path / "out"
    run = Run(["--user-dir", package, "--task", "swallows_errors", "--max-sentences", 8, "--max-update", 50,
               "--save-dir", out, "--log-format", "simple", "--report_to", "none", "--threads", 1])
    try:
        run.wait_for(marker.exists, what="the task's data loading")
        time.sleep(0.5)  # inside its sleep, past the marker's write
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=30)  # well before the task's sleep would end
    finally:
        run.kill()
    assert rc == 75, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == ["stopped by SIGTERM during start-up, before training began; nothing to save: rerun the same "
                     "command"], run.stderr[-3000:]
    assert not list(out.glob("checkpoint*")) and not (out / "run.lock").exists()


# ------------------------------------------------------ a corrupt HDF5 chunk
def corrupt_a_chunk(shard: Path, key="input_ids"):
    import h5py
    with h5py.File(shard, "r") as f:
        ds = f[key]
        assert ds.compression, "the shards are compressed"
        info = ds.id.get_chunk_info(ds.id.get_num_chunks() // 2)
    with open(shard, "r+b") as handle:
        handle.seek(info.byte_offset + info.size // 4)
        handle.write(os.urandom(max(info.size // 2, 1)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_corrupt_chunk_retry_at_the_same_position_exits_65(bert_data, tmp_path, capfd):  # noqa: F811
    copy = tmp_path / "copy"
    shutil.copytree(bert_data, copy)
    for shard in sorted((copy / "shards").glob("*train*.hdf5")):
        corrupt_a_chunk(shard)
    out = tmp_path / "out"
    first = in_process(bert_args(copy, out, max_update=40), capfd)
    assert first.returncode == 75, first.stderr[-3000:]
    line = error_lines(first.stderr)[0]
    assert ".hdf5" in line and "rows" in line, line
    saved = load_checkpoint(out / "checkpoint_last.pt")
    again = in_process(bert_args(copy, out, "--resume", max_update=40), capfd)
    assert again.returncode == 65, again.stderr[-3000:]
    errors = error_lines(again.stderr)
    assert len(errors) == 1, again.stderr[-3000:]
    assert ".hdf5" in errors[0] and "rows" in errors[0] and "same position" in errors[0], errors[0]
    # nothing lost: the checkpoint of the first attempt is still the newest state
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == saved["train"]["num_updates"]


@pytest.mark.slow
def test_checkpoint_passed_as_config_is_named(data, tmp_path, run_of_2_updates, capfd):
    out = run_of_2_updates
    proc = refusal_in_process(mnist_args(data, tmp_path / "o2", "--config", out / "checkpoint_last.pt", max_update=1),
                              capfd)
    assert proc.returncode == 2 and "zip archive (a torch checkpoint?)" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_batch_larger_than_the_data_is_clamped_with_a_note(data, tmp_path, capfd):
    proc = in_process(mnist_args(data, tmp_path / "out", "--max-sentences", "100000", max_update=1), capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--max-sentences 100000 is larger than the {N_SMALL_TRAIN} samples" in proc.stderr, proc.stderr
    assert f"batch sizes per rank [{N_SMALL_TRAIN}]" in proc.stderr


# ------------------------------------ checkpoint_last.pt damaged at rest
@pytest.mark.slow
def test_damaged_last_and_newest_checkpoint_fallback_names_every_skipped_file(data, tmp_path, capfd):
    out = tmp_path / "out"
    common = ["--save-interval-updates", "2", "--log-interval", "1"]
    assert in_process(mnist_args(data, out, *common, max_update=6), capfd).returncode == 0
    # copies, not hard links: one file's damage is not the other's
    assert (out / "checkpoint_last.pt").stat().st_ino != (out / "checkpoint_1_6.pt").stat().st_ino
    for name in ("checkpoint_last.pt", "checkpoint_1_6.pt"):
        path = out / name
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    resumed = in_process(mnist_args(data, out, *common, "--resume", max_update=8), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, resumed.stderr[-3000:]
    assert "skipped 2 checkpoint(s)" in warnings[0], warnings[0]
    assert "checkpoint_last.pt" in warnings[0] and "checkpoint_1_6.pt" in warnings[0], warnings[0]
    assert f"resuming from {out / 'checkpoint_1_4.pt'}" in warnings[0], warnings[0]
    assert "update 4" in resumed.stderr
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 8


# ------------------------------------------- --resume continues the same run
@pytest.mark.slow
def test_resume_refuses_a_numbers_changing_setting_unless_reset(data, tmp_path, capfd):
    out = tmp_path / "out"
    assert in_process(mnist_args(data, out, "--lr", "0.001", max_update=2), capfd).returncode == 0
    other = refusal_in_process(mnist_args(data, out, "--lr", "0.5", "--resume", max_update=4), capfd)
    assert other.returncode == 2, other.stderr[-3000:]
    errors = error_lines(other.stderr)
    assert len(errors) == 1 and "--lr" in errors[0] and "0.001" in errors[0] and "0.5" in errors[0], errors
    assert "--reset-lr-scheduler" in errors[0], errors[0]
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 2  # nothing written
    clip = refusal_in_process(mnist_args(data, out, "--lr", "0.001", "--clip-norm", "1.0", "--resume", max_update=4),
                              capfd)
    assert clip.returncode == 2 and "--clip-norm" in clip.stderr and "--restore-file" in clip.stderr, \
        clip.stderr[-3000:]
    betas = refusal_in_process(mnist_args(data, out, "--lr", "0.001", "--optim_conf", "amsgrad=true", "--resume",
                                          max_update=4), capfd)
    assert betas.returncode == 2 and "--optim-conf amsgrad=False" in betas.stderr, betas.stderr[-3000:]
    # the change allowed by the reset option that says so; a longer run is no change of numbers
    reset = in_process(mnist_args(data, out, "--lr", "0.5", "--resume", "--reset-lr-scheduler", max_update=4), capfd)
    assert reset.returncode == 0, reset.stderr[-3000:]
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 4


@pytest.fixture(scope="module")
def run_of_2_updates(data, tmp_path_factory):
    """A finished run of 2 updates with mnist_args' defaults: the run that the
    resume and rerun tests below start from, each in a copy of its own."""
    out = tmp_path_factory.mktemp("run_of_2") / "out"
    assert run_main(mnist_args(data, out, max_update=2)) == 0
    return out


def files_of(directory):
    """Every file of a save directory and its bytes (the lock and the logs of trackers aside)."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(Path(directory).rglob("*"))
            if p.is_file() and p.name != "run.lock" and "tensorboard" not in p.parts}


@pytest.mark.slow
def test_rerun_without_resume_is_refused_and_changes_nothing(data, tmp_path, run_of_2_updates, capfd):
    out = copy_of(run_of_2_updates, tmp_path)
    before = files_of(out)
    assert {"checkpoint_last.pt", "metrics.jsonl", "results.json", "config.yaml"} <= {p.name for p in before}
    again = refusal_in_process(mnist_args(data, out, "--lr", "0.5", max_update=4), capfd)  # config.yaml changes too
    assert again.returncode == 2, again.stderr[-3000:]
    errors = error_lines(again.stderr)
    assert len(errors) == 1, errors
    assert str(out) in errors[0] and "checkpoint_last.pt at update 2" in errors[0], errors[0]
    assert "--resume" in errors[0] and "another --save-dir" in errors[0], errors[0]
    assert files_of(out) == before  # not a byte overwritten or appended
    # the same command with --resume continues it
    resumed = in_process(mnist_args(data, out, "--resume", max_update=4), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 4


@pytest.mark.slow
def test_a_directory_with_only_metrics_is_a_run_and_one_with_only_a_config_is_not(data, tmp_path, capfd):
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text('{"kind": "train", "update": 7}\n')
    refused = refusal_in_process(mnist_args(data, metrics_only, max_update=1), capfd)
    assert refused.returncode == 2 and "metrics.jsonl" in error_lines(refused.stderr)[0], refused.stderr[-3000:]
    assert (metrics_only / "metrics.jsonl").read_text() == '{"kind": "train", "update": 7}\n'
    # a run that failed before training leaves only its config.yaml: a new run may use the directory
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "config.yaml").write_text("task: mnist\n")
    assert in_process(mnist_args(data, failed, max_update=1), capfd).returncode == 0


@pytest.mark.slow
def test_resume_refuses_a_change_of_precision(data, tmp_path, run_of_2_updates, capfd, monkeypatch):
    out = copy_of(run_of_2_updates, tmp_path)
    before = files_of(out)
    for flag in ("--bf16", "--fp16"):  # on CPU float16 runs as bfloat16: a change all the same
        other = refusal_in_process(mnist_args(data, out, flag, "--resume", max_update=4), capfd)
        assert other.returncode == 2, other.stderr[-3000:]
        errors = error_lines(other.stderr)
        assert len(errors) == 1 and "float32" in errors[0] and "bf16" in errors[0], errors
        assert flag in errors[0] and "--restore-file" in errors[0], errors[0]
    # Accelerate's --mixed_precision (accelerate launch / accelerate config) reaches the run by the environment
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    launched = refusal_in_process(mnist_args(data, out, "--resume", max_update=4), capfd)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert launched.returncode == 2, launched.stderr[-3000:]
    assert "accelerate" in error_lines(launched.stderr)[0], launched.stderr[-3000:]
    assert files_of(out) == before
    # a run trained in bf16 resumes in bf16
    bf16 = tmp_path / "bf16"
    assert in_process(mnist_args(data, bf16, "--bf16", max_update=2), capfd).returncode == 0
    assert in_process(mnist_args(data, bf16, "--bf16", "--resume", max_update=3), capfd).returncode == 0
    assert load_checkpoint(bf16 / "checkpoint_last.pt")["train"]["num_updates"] == 3


@pytest.mark.slow
def test_an_fp16_checkpoint_of_a_gpu_resumes_on_cpu_under_the_same_flag_with_a_warning(data, tmp_path, capfd):
    """fp16 needs CUDA: a GPU's --fp16 run continued on a CPU under --fp16 goes
    on in bf16 (its GPU may be gone), said in a warning; any other flag is
    still a refused change. The checkpoint is a CPU one whose precision record
    says what a GPU's would (the CUDA round trip is tests/integration/test_gpu_processes.py's)."""
    out = tmp_path / "out"
    assert in_process(mnist_args(data, out, "--fp16", max_update=2), capfd).returncode == 0
    path = out / "checkpoint_last.pt"
    state = load_checkpoint(path)
    assert state["precision"] == {"mixed": "bf16", "source": "--fp16"}
    state["precision"] = {"mixed": "fp16", "source": "--fp16"}
    atomic_save({k: v for k, v in state.items() if k != "digest"}, path)
    before = files_of(out)
    refused = refusal_in_process(mnist_args(data, out, "--bf16", "--resume", max_update=3), capfd)
    assert refused.returncode == 2 and "fp16 mixed precision" in error_lines(refused.stderr)[0], refused.stderr
    assert files_of(out) == before
    resumed = in_process(mnist_args(data, out, "--fp16", "--resume", max_update=3), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "this run has bf16 mixed precision (from --fp16): the same flags on another device" in resumed.stderr
    assert load_checkpoint(path)["train"]["num_updates"] == 3


@pytest.mark.slow
def test_resume_compares_model_conf_with_its_defaults_filled(data, tmp_path, run_of_2_updates, capfd):
    out = copy_of(run_of_2_updates, tmp_path)
    # hidden=128: the default
    same = in_process(mnist_args(data, out, "--model_conf", "hidden=128", "--resume", max_update=3), capfd)
    assert same.returncode == 0, same.stderr[-3000:]
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 3
    other = refusal_in_process(mnist_args(data, out, "--model_conf", "hidden=64", "--resume", max_update=4), capfd)
    assert other.returncode == 2, other.stderr[-3000:]
    errors = error_lines(other.stderr)
    assert len(errors) == 1 and "hidden=128" in errors[0] and "64" in errors[0], errors


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_of_another_tasks_checkpoint_names_the_task_first(data, bert_data, tmp_path,  # noqa: F811
                                                                 run_of_2_updates, capfd):
    bert_out, mnist_out = tmp_path / "bert", copy_of(run_of_2_updates, tmp_path)
    assert in_process(bert_args(bert_data, bert_out, max_update=2), capfd).returncode == 0
    for args, saved, now in [(mnist_args(data, bert_out, "--resume", max_update=4), "bert", "mnist"),
                             (bert_args(bert_data, mnist_out, "--resume", max_update=4), "mnist", "bert")]:
        proc = refusal_in_process(args, capfd)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = error_lines(proc.stderr)
        assert len(errors) == 1, errors
        assert f"checkpoint of task {saved!r}" in errors[0] and f"--task {saved}" in errors[0], errors[0]
        assert now in errors[0], errors[0]
    # bert's --model_conf too is compared with what the model had: its config file's width is no change
    width = json.loads((bert_data / "bert_config.json").read_text())["hidden_size"]
    same = in_process(bert_args(bert_data, bert_out, "--model_conf", f"hidden_size={width}", "--resume", max_update=3),
                      capfd)
    assert same.returncode == 0, same.stderr[-3000:]
    assert load_checkpoint(bert_out / "checkpoint_last.pt")["train"]["num_updates"] == 3


# -------------------------------------------------------- out of memory
@pytest.fixture(scope="module")
def data_1k(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_1k")
    write_mnist(directory, n_train=1024, n_test=N_SMALL_TEST, seed=13)
    return directory


def run_with_memory_limit(args, megabytes, at_update, timeout=200):
    """run_hetseq.py whose host allocations really fail from ``at_update`` on:
    the test hook lowers the process's RLIMIT_AS to its size then plus
    ``megabytes``; malloc maps large chunks afresh (as glibc does by default),
    so an update that needs more than that fails in torch's CPU allocator."""
    from textbox_like.core.faults import MEMORY_LIMIT_ENV
    env = {**clean_env(), MEMORY_LIMIT_ENV: f"{megabytes}@{at_update}", "MALLOC_MMAP_THRESHOLD_": "131072"}
    return subprocess.run([sys.executable, "run_hetseq.py", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_out_of_memory_at_the_first_batch_names_the_batch_size_and_exits_2(data_1k, tmp_path):
    out = tmp_path / "out"
    proc = run_with_memory_limit(mnist_args(data_1k, out, "--max-sentences", "1024", max_update=4), 64, 0)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "out of memory at the first update" in errors[0] and "can't allocate memory" in errors[0], errors[0]
    assert "lower --max-sentences (now 1024)" in errors[0], errors[0]
    assert not list(out.glob("checkpoint*.pt")) and not (out / "run.lock").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_out_of_memory_mid_training_saves_the_last_update_and_exits_71(data_1k, tmp_path, capfd):
    out = tmp_path / "out"
    common = ["--max-sentences", "256", "--log-interval", "1"]
    proc = run_with_memory_limit(mnist_args(data_1k, out, *common, max_update=10), 32, 3)
    assert proc.returncode == 71, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "out of memory at update 4" in errors[0] and "saved the state after update 3" in errors[0], errors[0]
    assert "--resume and a lower --max-sentences (now 256)" in errors[0], errors[0]
    saved = load_checkpoint(out / "checkpoint_last.pt")
    assert saved["train"]["num_updates"] == 3 and saved["iterator"]["offset"] == 3 * 256  # the 4th is redone
    assert not (out / "run.lock").exists()
    # as the line says: a smaller batch continues from there
    resumed = in_process(mnist_args(data_1k, out, "--max-sentences", "128", "--log-interval", "1", "--resume",
                                    max_update=5), capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "| update 4 |" in resumed.stderr
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 5


@pytest.mark.parametrize("content, says", [(b"", "is empty (0 bytes), not an HDF5 file"),
                                           (b"input_ids,input_mask\n1,2\n", "is a text file, first line")])
@pytest.mark.slow
def test_bert_shard_that_is_empty_or_text_is_named(bert_data, tmp_path, content, says, capfd):  # noqa: F811
    copy = tmp_path / "copy"
    shutil.copytree(bert_data, copy)
    shard = sorted((copy / "shards").glob("*train*.hdf5"))[0]
    shard.write_bytes(content)
    proc = refusal_in_process(bert_args(copy, tmp_path / "out", max_update=2), capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and str(shard) in errors[0] and says in errors[0], proc.stderr[-3000:]


# ------------------------------------------------ metrics.jsonl on a full disk
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_jsonl_on_a_really_full_disk_exits_74_with_one_line(data, tmp_path):
    out = tmp_path / "disk"
    with small_disk(out, 16) as kind:
        # no checkpoint before the disk is full: the metrics' append is the write that fails
        args = mnist_args(data, out, "--log-interval", "1", "--max-sentences", "2", "--save-interval-updates", "0",
                          *LONG, max_update=1000000)
        preexec = None if kind == "tmpfs" else file_size_limit(8 << 10)  # metrics.jsonl reaches it first
        run = Run(args, preexec_fn=preexec)
        try:
            run.wait_for_update(2)
            if kind == "tmpfs":
                filler = fill(out, 0)
            rc = run.finish(200)
        finally:
            run.kill()
        assert rc == 74, run.stderr[-3000:]
        errors = error_lines(run.stderr)
        assert len(errors) == 1, run.stderr[-3000:]
        reason = "No space left on device" if kind == "tmpfs" else "File too large"
        assert f"could not write {out / 'metrics.jsonl'} ({reason})" in errors[0], errors[0]
        assert "Exception ignored" not in run.stderr
        assert not (out / "run.lock").exists()
        if kind == "tmpfs":
            filler.unlink()
        # the lines written before are kept (the last may be cut where the disk filled)
        lines = (out / "metrics.jsonl").read_text().splitlines()
        assert lines and all(json.loads(line)["kind"] == "train" for line in lines[:-1])

# ------------------------------------------- the save directory made read-only
# capabilities that let root write through mode bits (linux/capability.h)
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER = 1, 2, 3


def without_root_overrides():
    """preexec_fn for a child that mode bits bind: the tests run as root here,
    and root writes into a 0555 directory. Not another user: this Python
    lives under /root (0700), which 'nobody' cannot enter. Root without
    CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER is held to the mode
    bits as any owner is (dropped from the bounding set; root's inheritable
    set is empty, so the exec'd program does not get them back)."""
    if os.geteuid() != 0:
        return None
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def drop():
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")
    return drop


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_dir_made_read_only_mid_run_exits_74_with_one_line(data, tmp_path):
    preexec = without_root_overrides()
    locked = tmp_path / "probe"
    locked.mkdir(mode=0o555)
    probe = subprocess.run([sys.executable, "-c", f"open({str(locked / 'x')!r}, 'w')"], preexec_fn=preexec,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "Permission denied" in probe.stderr, "the child still writes through chmod"
    out = tmp_path / "out"
    run = Run(mnist_args(data, out, "--save-interval-updates", "3", "--log-interval", "1", *LONG,
                         max_update=1000000), preexec_fn=preexec)
    try:
        run.wait_for(lambda: (out / "checkpoint_1_3.pt").exists(), what="the first checkpoint")
        out.chmod(0o555)  # an operator, or a quota script, takes the directory away
        rc = run.finish(200)
    finally:
        run.kill()
        out.chmod(0o755)
    assert rc == 74, run.stderr[-3000:]
    errors = error_lines(run.stderr)
    assert len(errors) == 1, run.stderr[-3000:]
    assert "Permission denied" in errors[0] and str(out) in errors[0], errors[0]
    assert re.search(r"last good checkpoint is \S*checkpoint_(last|1_3)\.pt", errors[0]), errors[0]
    assert load_checkpoint(out / "checkpoint_1_3.pt")["train"]["num_updates"] == 3  # kept, whole


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kept_copies_that_cannot_be_removed_at_the_end_are_one_warning(data, tmp_path):
    """The save directory turns read-only (chmod, in a child that mode bits
    bind) once results.json is written (TEXTBOX_LIKE_TEST_DELAY=finish holds
    the run there): the data a sharded name replaced, kept for readers,
    cannot be removed at the end. One warning line, the run completes (0),
    the kept copy stays; a rank never stops there while the others wait."""
    out = tmp_path / "out"
    out.mkdir()
    kept = out / ".checkpoint_last.dcp.0123abcd"  # what a replaced checkpoint_last.dcp leaves, linked as .prev
    kept.mkdir()
    (kept / ".metadata").write_bytes(b"shards")
    (out / ".checkpoint_last.dcp.prev").symlink_to(kept.name)
    run = Run(mnist_args(data, out, max_update=3), preexec_fn=without_root_overrides(), delay="finish=10")
    try:
        run.wait_for(lambda: (out / "results.json").exists(), what="results.json")
        out.chmod(0o555)  # an operator, or a quota script, takes the directory away
        rc = run.finish(200)
    finally:
        run.kill()
        out.chmod(0o755)
    assert rc == 0 and not error_lines(run.stderr), run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "could not be removed" in warnings[0] and "Permission denied" in warnings[0], \
        run.stderr[-3000:]
    assert (out / ".checkpoint_last.dcp.prev").is_symlink() and (kept / ".metadata").exists()
    assert json.loads((out / "results.json").read_text())["stopped"] == "completed"
    assert load_checkpoint(out / "checkpoint_last.pt")["train"]["num_updates"] == 3


# ------------------------------------------------ a file:// rendezvous, a rank killed
# (rank 1 of two killed by kill -9: rank 0 saves, stops with one line and 75, removes the rendezvous file):
# test_elastic_processes.py's test_without_an_agent_the_survivor_saves_and_resume_on_one_rank_continues


# ------------------------------------------- a stopped rank that wakes up in a newer run
def snapshot(*paths) -> dict:
    """Every file under ``paths``: its bytes' hash, size and mtime (ns)."""
    import hashlib
    found = {}
    for top in paths:
        for path in ([top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())):
            found[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size,
                                path.stat().st_mtime_ns)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_rank_woken_in_a_newer_run_writes_nothing_and_exits_77(data, tmp_path):
    """Rank 1 of a file:// run is stopped (SIGSTOP); rank 0 declares it lost,
    saves and exits 75; a --resume run on the same save directory and
    rendezvous path takes over and trains past that update. The old rank is
    then continued (SIGCONT), with the new run held still meanwhile so that
    every change is the old rank's: it writes nothing (no file of the save
    directory, nor the new run's rendezvous file, changes) and exits 77 with
    one line; the new run then ends normally."""
    out, rendezvous = tmp_path / "out", tmp_path / "rendezvous"

    def ranks(*extra, max_update, timeout):
        return [Run(mnist_args(data, out, "--log-interval", "1", "--distributed-no-spawn", "--distributed-init-method",
                               f"file://{rendezvous}", "--distributed-world-size", "2", "--distributed-rank", rank,
                               "--distributed-timeout", timeout, *LONG, *extra, max_update=max_update))
                for rank in (0, 1)]
    old = ranks(max_update=1000000, timeout=10)
    new = []
    try:
        old[0].wait_for_update(3)
        old[1].proc.send_signal(signal.SIGSTOP)
        assert old[0].finish(200) == 75, old[0].stderr[-3000:]
        stopped_at = int(re.search(r"saved update (\d+)", old[0].stderr).group(1))
        assert not rendezvous.exists() and not (out / "run.lock").exists()
        new = ranks("--resume", max_update=stopped_at + 60, timeout=120)
        new[0].wait_for_update(stopped_at + 2)
        for run in new:  # held still: from here on, a change in the save directory is the old rank's
            run.proc.send_signal(signal.SIGSTOP)
        before = snapshot(out, rendezvous)
        lock = json.loads((out / "run.lock").read_text())
        assert lock["pid"] == new[0].proc.pid and str(rendezvous) in before
        old[1].proc.send_signal(signal.SIGCONT)
        rc = old[1].finish(120)
        after = snapshot(out, rendezvous)
        for run in new:
            run.proc.send_signal(signal.SIGCONT)
        new_rcs = [run.finish(300) for run in new]
    finally:
        for run in old + new:
            run.kill()  # SIGKILL ends a stopped process too
    assert rc == 77, old[1].stderr[-3000:]
    errors = error_lines(old[1].stderr)
    assert len(errors) == 1, old[1].stderr[-3000:]
    assert "rank 1" in errors[0] and "no longer owns the run" in errors[0] and f"pid {new[0].proc.pid}" in errors[0], \
        errors[0]
    assert after == before  # not a byte, not a touch
    assert new_rcs == [0, 0], new[0].stderr[-3000:] + new[1].stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["num_updates"] == stopped_at + 60
    assert not (out / "run.lock").exists()

# ------------------------------------------------ a child whose parent is already gone
ORPHAN_SCRIPT = r"""
import ctypes, os, time
from textbox_like.processes.children import die_with_parent
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans below come to this process
reaper = os.getpid()
launcher = os.fork()
if launcher == 0:
    preexec = die_with_parent()  # what Popen runs in the child, made in the launcher
    child = os.fork()
    if child == 0:
        while os.getppid() != reaper:  # the launcher died between the fork and the prctl
            time.sleep(0.01)
        preexec()
        os._exit(0)  # would train on, an orphan
    os._exit(0)
os.waitpid(launcher, 0)
_, status = os.wait()
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow
def test_child_of_a_parent_that_died_before_the_prctl_stops():
    """PR_SET_PDEATHSIG set after the parent died never fires: the preexec
    sees it was reparented and stops the child (143) before it starts."""
    proc = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT], capture_output=True, text=True, env=clean_env(),
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["143"], proc.stdout + proc.stderr
