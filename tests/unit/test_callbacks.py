"""Public callbacks (issue 48, item 3): textbox_like.Callback's methods are
called at the run's start, after each update, validation and checkpoint, and at
its end; request_stop ends the run as a normal end at that update; a callback
that raises ends it with one line (exit 70) after saving; --callbacks names
registered classes; --patience is a callback too. Two ranks:
tests/integration/test_callbacks_processes.py."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import base_args, refusal_in_process, run_main

CONSTANT_LR = {"optimizer": "sgd", "lr": 0.05, "lr_scheduler": "constant", "warmup_updates": 0,
               "max_sentences": 32, "log_format": "none"}


def settings(data, save_dir, **more):
    return {"task": "mnist", "data": str(data), "save_dir": str(save_dir), **CONSTANT_LR, **more}


def weights(path):
    return torch.load(path, weights_only=True)["model"]


class Recorder:
    """Builds a Callback subclass that records what it sees (and may stop or raise)."""

    @staticmethod
    def make(stop_at=None, raise_at=None):
        import textbox_like

        class Recording(textbox_like.Callback):
            def __init__(self):
                self.events = []

            def on_train_start(self, run):
                self.events.append(("start", run.update, run.rank, run.world_size))

            def on_update_end(self, run):
                self.events.append(("update", run.update, run.epoch))
                if run.update == stop_at:
                    run.request_stop(f"enough at {stop_at}")
                if run.update == raise_at:
                    raise ValueError("the callback's own bug")

            def on_validation_end(self, run, metrics):
                assert metrics == run.metrics
                self.events.append(("valid", run.update, sorted(metrics)))

            def on_checkpoint(self, run, path):
                assert path.exists()
                self.events.append(("checkpoint", run.update, path.name))

            def on_train_end(self, run, results):
                self.events.append(("end", run.update, results["stop_reason"]))
        return Recording()


def test_a_callback_sees_the_start_every_update_once_each_validation_and_checkpoint_and_the_end(small_mnist_dir,
                                                                                                   tmp_path):
    import textbox_like
    seen = Recorder.make()
    results = textbox_like.train(settings(small_mnist_dir, tmp_path / "run", max_update=6,
                                          validate_interval_updates=3, save_interval_updates=3), callbacks=[seen])
    assert results["exit_code"] == 0 and results["num_updates"] == 6
    events = seen.events
    assert events[0] == ("start", 0, 0, 1)
    assert [e[1] for e in events if e[0] == "update"] == [1, 2, 3, 4, 5, 6]
    assert [e[1] for e in events if e[0] == "valid"] == [3, 6]
    assert all(e[2] == ["accuracy", "loss"] for e in events if e[0] == "valid")
    assert ("checkpoint", 3, "checkpoint_1_3.pt") in events
    assert [e[1] for e in events if e[0] == "checkpoint"] == [3, 6]
    assert events[-1] == ("end", 6, "max_update")


def test_request_stop_ends_the_run_as_a_normal_end_at_that_update(small_mnist_dir, tmp_path):
    """The stopped run's checkpoint is that of a run told --max-update 4, its exit 0."""
    import textbox_like
    stopper = Recorder.make(stop_at=4)
    stopped = textbox_like.train(settings(small_mnist_dir, tmp_path / "stopped", max_update=20), callbacks=[stopper])
    normal = textbox_like.train(settings(small_mnist_dir, tmp_path / "normal", max_update=4))
    assert stopped["exit_code"] == normal["exit_code"] == 0
    assert stopped["num_updates"] == normal["num_updates"] == 4
    assert stopped["stop_reason"] == "callback on rank 0: enough at 4" and stopped["stopped"] == "completed"
    assert stopped["final"] == normal["final"]        # the final weights validated, as at a normal end
    assert sorted(p.name for p in (tmp_path / "stopped").glob("checkpoint*")) == \
        sorted(p.name for p in (tmp_path / "normal").glob("checkpoint*"))
    a, b = weights(tmp_path / "stopped" / "checkpoint_last.pt"), weights(tmp_path / "normal" / "checkpoint_last.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [e[1] for e in stopper.events if e[0] == "update"] == [1, 2, 3, 4]
    assert stopper.events[-1] == ("end", 4, "callback on rank 0: enough at 4")


def test_a_callback_that_raises_is_one_line_the_run_saves_and_exits_70_and_resume_goes_on(small_mnist_dir, tmp_path,
                                                                                              capfd):
    import textbox_like
    capfd.readouterr()
    broken = textbox_like.train(settings(small_mnist_dir, tmp_path / "run", max_update=6),
                                callbacks=[Recorder.make(raise_at=3)])
    err = capfd.readouterr().err
    assert broken["exit_code"] == 70
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == ["error: callback Recording.on_update_end raised ValueError: the callback's own bug on rank 0 "
                     "at update 3; saved update 3: fix the callback and rerun with --resume"]
    assert "Traceback" not in err
    saved = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)
    assert saved["train"]["num_updates"] == 3
    resumed = textbox_like.train(settings(small_mnist_dir, tmp_path / "run", max_update=6, resume=True))
    assert resumed["exit_code"] == 0 and resumed["num_updates"] == 6


def test_patience_is_a_callback_that_stops_every_rank_at_the_same_update(small_mnist_dir, tmp_path):
    """lr 0: no validation is better than the first, so --patience 2 stops at the third."""
    import textbox_like
    seen = Recorder.make()
    results = textbox_like.train(settings(small_mnist_dir, tmp_path / "run", max_update=20, lr=0.0, patience=2,
                                          validate_interval_updates=2), callbacks=[seen])
    assert results["exit_code"] == 0 and results["stop_reason"] == "patience" and results["num_updates"] == 6
    assert [e[1] for e in seen.events if e[0] == "valid"] == [2, 4, 6]


def test_callbacks_by_name_from_a_user_dir_are_recorded_in_config_yaml_and_run(small_mnist_dir, tmp_path):
    package = tmp_path / "my_callbacks"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        import json, os
        from textbox_like import Callback, register_callback

        @register_callback("write_updates_cbtest")
        class WriteUpdates(Callback):
            def on_update_end(self, run):
                with open(os.path.join(run.config.checkpoint.save_dir, "updates.txt"), "a") as f:
                    f.write(f"{run.update}\\n")
                if run.update == 3:
                    run.request_stop("three")
    """))
    save = tmp_path / "run"
    assert run_main(base_args(small_mnist_dir, save, "--user-dir", package, "--callbacks", "write_updates_cbtest",
                              max_update=8)) == 0
    assert (save / "updates.txt").read_text().split() == ["1", "2", "3"]
    import yaml
    assert yaml.safe_load((save / "config.yaml").read_text())["callbacks"] == ["write_updates_cbtest"]
    assert json.loads((save / "results.json").read_text())["num_updates"] == 3


def test_an_unknown_callback_name_is_one_line(small_mnist_dir, tmp_path, capfd):
    proc = refusal_in_process(base_args(small_mnist_dir, tmp_path / "run", "--callbacks", "nonesuch"), capfd)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --callbacks nonesuch: no callback of that name (registered: " + proc.stderr.split("(registered: ")[1]
        .split(")")[0] + "); register a textbox_like.Callback subclass with @register_callback('nonesuch') in your "
        "--user-dir package"]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_callback_objects_cannot_go_to_processes_a_run_starts_and_must_be_callbacks(small_mnist_dir, tmp_path):
    import textbox_like
    from textbox_like.core.errors import UserError
    with pytest.raises(UserError, match=r"callbacks=\[Recording\]: a run of 2 processes cannot take Python objects"):
        textbox_like.train(settings(small_mnist_dir, tmp_path / "a", max_update=2, distributed_world_size=2),
                           callbacks=[Recorder.make()])
    with pytest.raises(UserError, match="is not a textbox_like.Callback"):
        textbox_like.train(settings(small_mnist_dir, tmp_path / "b", max_update=2), callbacks=[object()])


def test_on_log_sees_each_record_of_metrics_jsonl_once_and_the_trainer_writes_them_through_callbacks(
        small_mnist_dir, tmp_path):
    """Users and the trainer share one mechanism: metrics.jsonl, the trackers
    and the progress are callbacks (callbacks/records.py) taking the same
    records a user's on_log gets."""
    import textbox_like
    from textbox_like.callbacks.records import MetricsFile, ProgressRecords, TrackerRecords, record_callbacks

    class Records(textbox_like.Callback):
        def __init__(self):
            self.seen = []

        def on_log(self, run, kind, record):
            assert record["update"] == run.update
            self.seen.append({"kind": kind, **record})
    records = Records()
    results = textbox_like.train(settings(small_mnist_dir, tmp_path / "run", max_update=6, log_interval=2,
                                          validate_interval_updates=3), callbacks=[records])
    assert results["exit_code"] == 0
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records.seen == written
    assert [r["update"] for r in written if r["kind"] == "train"] == [2, 4, 6]
    assert [r["update"] for r in written if r["kind"] == "valid"] == [3, 6]

    class Main:
        is_main, format, bar = True, "simple", None
    tracked = type("Tracked", (), {"log_with": ["tensorboard"]})()
    kinds = [type(c) for c in record_callbacks(Main(), tracked, tmp_path / "run")]
    assert kinds == [MetricsFile, TrackerRecords, ProgressRecords]
    Main.is_main = False
    assert record_callbacks(Main(), tracked, tmp_path / "run") == []   # rank 0's alone


def test_the_progress_callback_prints_records_in_each_log_format(capsys):
    from types import SimpleNamespace

    from textbox_like.callbacks.records import ProgressRecords
    from textbox_like.metrics.meters import Logger
    record = {"epoch": 1, "update": 4, "loss": 0.25, "lr": 1e-5}
    for fmt, expected in (("simple", "train | epoch 1 | update 4 | loss 0.2500 | lr 1.000e-05\n"),
                          ("json", json.dumps({"kind": "train", **record}) + "\n")):
        logger = Logger(SimpleNamespace(logging=SimpleNamespace(log_format=fmt)), True)
        progress = ProgressRecords(logger)
        progress.on_log(None, "train", record)
        progress.on_log(None, "balance", {"update": 4})   # an event: its own line is printed where it happens
        assert capsys.readouterr().err == expected
