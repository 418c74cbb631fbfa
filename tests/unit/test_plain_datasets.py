"""Plain datasets are enough (issue 31 item 2): a task's ``build_dataset``
may return a map-style ``torch.utils.data.Dataset`` (with the task's own
collate) or a ``datasets.Dataset``; data/plain.py wraps it in the
batch-read protocol. The user's package is written into tmp_path and found
with --user-dir, as a user would; the runs that test ranks and a kill are
processes of their own, the others run the trainer's main in-process."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from textbox_like.tools.eval import main as eval_main

from conftest import read_jsonl, refusal_in_process, run_main


USER_TASKS = textwrap.dedent('''
    import os
    import signal

    from textbox_like import Task, register_task


    def points(split, n=57):
        """n points of 4 features, labelled by the sign of their sum: learnable."""
        import torch
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0 if split == "train" else 1))
        return x, (x.sum(1) > 0).long()


    class Classifier(Task):
        """The model, loss and metrics the tasks below share; each returns its
        own kind of dataset and reads its own batch structure (``inputs``)."""
        metric_names = ("loss", "accuracy")
        loss_calls = 0

        def build_model(self):
            import torch
            torch.manual_seed(1)
            return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(float(os.environ.get("PLAIN_DROPOUT", "0"))),
                                       torch.nn.Linear(16, 2))

        def loss(self, model, batch):
            import torch.nn.functional as F
            if model.training:  # a real kill -9, at a training forward the test chose
                type(self).loss_calls += 1
                if type(self).loss_calls == int(os.environ.get("PLAIN_KILL_AT", "0")):
                    os.kill(os.getpid(), signal.SIGKILL)
            x, y = self.inputs(batch)
            logits = model(x)
            loss = F.cross_entropy(logits, y, reduction="sum")
            correct = (logits.argmax(1) == y).sum()
            return loss, {"loss_sum": loss.detach(), "correct": correct, "nsamples": len(y)}

        def metrics(self, sums):
            n = max(sums.get("nsamples", 0.0), 1.0)
            return {"loss": sums.get("loss_sum", 0.0) / n, "accuracy": sums.get("correct", 0.0) / n}


    @register_task("plain_tensors")
    class TensorTask(Classifier):
        def build_dataset(self, split):
            from torch.utils.data import TensorDataset
            return TensorDataset(*points(split))

        def inputs(self, batch):
            x, y = batch  # what a DataLoader over a TensorDataset gives
            return x, y


    @register_task("plain_collate")
    class CollateTask(Classifier):
        def build_dataset(self, split):
            from torch.utils.data import Dataset
            x, y = points(split)

            class Samples(Dataset):  # the user's own: a sample is (features, label, name)
                def __len__(self):
                    return len(y)

                def __getitem__(self, i):
                    return x[i], int(y[i]), f"row {i}"
            return Samples()

        def collate(self, samples):
            import torch
            return {"features": torch.stack([s[0] for s in samples]),
                    "label": torch.tensor([s[1] for s in samples]), "names": [s[2] for s in samples]}

        def inputs(self, batch):
            assert len(batch["names"]) == len(batch["label"])  # per-sample text cut with the tensors
            return batch["features"], batch["label"]


    @register_task("plain_hf")
    class HFTask(Classifier):
        def build_dataset(self, split):
            import datasets
            x, y = points(split)
            return datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()})

        def inputs(self, batch):
            return batch["x"], batch["label"]


    @register_task("plain_stream")
    class StreamTask(Classifier):
        """Training data streamed from the task's own IterableDataset (a sample: (features, label)); validation
        held whole, unless PLAIN_STREAM_VALID."""
        def build_dataset(self, split):
            from torch.utils.data import IterableDataset, TensorDataset

            class Stream(IterableDataset):
                def __iter__(self):
                    yield from zip(*points(split))
            if split == "train" or os.environ.get("PLAIN_STREAM_VALID"):
                return Stream()
            return TensorDataset(*points(split))

        def inputs(self, batch):
            x, y = batch
            return x, y


    @register_task("plain_hf_stream")
    class HFStreamTask(Classifier):
        """Training data as a datasets.IterableDataset (a sample: a dict of columns)."""
        def build_dataset(self, split):
            import datasets
            x, y = points(split)
            held = datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).with_format("torch")
            return held.to_iterable_dataset() if split == "train" else held

        def inputs(self, batch):
            return batch["x"], batch["label"]
''')


_USER_DIRS = []   # one per process: the folder's name is the package's, which --user-dir imports once


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """The folder of the user tasks: one per process, also where this module and its _processes half run in
    one (the README's command, an xdist worker): a second folder of the same package name is refused."""
    if not _USER_DIRS:
        folder = tmp_path_factory.mktemp("plain_user") / "plaintasks"
        folder.mkdir()
        (folder / "__init__.py").write_text(USER_TASKS)
        _USER_DIRS.append(folder)
    return _USER_DIRS[0]


def train_args(user_dir, task, save_dir, *extra):
    return ["--user-dir", user_dir, "--task", task, "--save-dir", save_dir, "--optimizer", "sgd", "--lr", "0.5",
            "--lr-scheduler", "constant", "--max-epoch", "0", "--max-sentences", "8", "--log-format", "simple",
            "--log-interval", "1", "--threads", "1", "--cpu", *extra]

PLAIN_TASKS = ("plain_tensors", "plain_collate", "plain_hf")


@pytest.fixture(scope="module")
def plain_runs(user_dir, tmp_path_factory):
    """One run of 14 updates (two epochs, validated at the first's end and
    at the last update) per kind of dataset, in-process."""
    root = tmp_path_factory.mktemp("plain_runs")
    codes = {task: run_main(train_args(user_dir, task, root / task, "--max-update", "14")) for task in PLAIN_TASKS}
    return {task: (codes[task], f"exit {codes[task]}", read_jsonl(root / task / "metrics.jsonl")
                   if codes[task] == 0 else [], root / task) for task in PLAIN_TASKS}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("task", PLAIN_TASKS)
def test_a_plain_dataset_trains_and_its_loss_falls(plain_runs, task):
    """A TensorDataset (its batch [x, y]), the user's Dataset and collate (a
    dict holding text), a datasets.Dataset (a dict of columns)."""
    code, err, records, _ = plain_runs[task]
    assert code == 0, err[-3000:]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses) == 14 and np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4]), losses
    valid = [r for r in records if r.get("kind") == "valid"]
    assert len(valid) == 2 and valid[-1]["loss"] < valid[0]["loss"] and valid[-1]["accuracy"] > 0.9


@pytest.mark.timeout(300)
def test_eval_reads_a_plain_dataset(plain_runs, tmp_path, capfd):
    """``textbox-like eval`` (textbox_like.evaluate) of the last checkpoint of
    the user's Dataset and collate gives the run's last validation."""
    code, err, records, save_dir = plain_runs["plain_collate"]
    assert code == 0, err[-3000:]
    capfd.readouterr()
    assert eval_main(["--model_ckpt", str(save_dir / "checkpoint_last.pt"), "--json", "--batch-size", "5"]) == 0
    evaluated = capfd.readouterr()
    record, last = json.loads(evaluated.out), [r for r in records if r.get("kind") == "valid"][-1]
    assert record["samples"] == 57 and record["accuracy"] == last["accuracy"]
    assert record["loss"] == pytest.approx(last["loss"], rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["plain_stream", "plain_hf_stream"])
def test_an_iterable_dataset_trains_streamed_and_resumes_where_it_was(user_dir, tmp_path, task, capfd):
    """A task's torch IterableDataset or datasets.IterableDataset trains (streamed: 'train streamed' on the
    start line, its loss falls over two epochs of 57 samples), and a run cut at update 5 and resumed trains
    the uninterrupted run's losses exactly (the stream read again up to its saved position)."""
    whole = refusal_in_process(train_args(user_dir, task, tmp_path / "whole", "--max-update", "14"), capfd)
    assert whole.returncode == 0 and "| train streamed |" in whole.stderr, whole.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if r.get("kind") == "train"]
    assert len(losses) == 14 and np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4]), losses
    cut = train_args(user_dir, task, tmp_path / "cut", "--lr-scheduler", "constant")
    assert refusal_in_process(cut + ["--max-update", "5"], capfd).returncode == 0
    assert refusal_in_process(cut + ["--max-update", "14", "--resume"], capfd).returncode == 0
    resumed = [r["loss"] for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl") if r.get("kind") == "train"]
    assert resumed == losses


@pytest.mark.timeout(300)
def test_a_streamed_validation_split_is_refused_in_one_line(user_dir, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PLAIN_STREAM_VALID", "1")
    proc = refusal_in_process(train_args(user_dir, "plain_stream", tmp_path / "stream", "--max-update", "2"), capfd)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines == ["error: StreamTask.build_dataset('valid') returned an iterable dataset: a stream trains (the "
                     "training split), validation reads its split whole; return a map-style dataset for 'valid'"], \
        proc.stderr[-3000:]


def test_nested_batches_are_moved_cut_and_counted_in_their_structure():
    """The one helper behind moving, cutting and counting a batch keeps a
    tuple a tuple, a named tuple named, a dict a dict, and cuts per-sample
    text with the tensors; an empty read keeps the columns' shapes."""
    from collections import namedtuple

    import datasets

    from textbox_like.data.base import batch_samples, cut_batch, map_tensors
    from textbox_like.data.plain import as_batch_dataset
    Pair = namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.arange(10.0).view(5, 2), torch.arange(5)), "text": list("abcde"),
             "more": (torch.zeros(5, 3), [torch.ones(5)])}
    first, second = cut_batch(batch, [2, 3])
    assert isinstance(first["pair"], Pair) and type(first["more"]) is tuple and type(first["more"][1]) is list
    assert first["text"] == ["a", "b"] and second["text"] == ["c", "d", "e"]
    assert torch.equal(second["pair"].x, batch["pair"].x[2:]) and second["more"][1][0].shape == (3,)
    assert [batch_samples(b) for b in (batch, first, second, {"text": ["a"]}, {})] == [5, 2, 3, 1, 0]
    doubled = map_tensors(lambda v: v.double() if v.is_floating_point() else v, batch)
    assert doubled["pair"].x.dtype == torch.float64 and doubled["pair"].y.dtype == torch.int64

    columns = as_batch_dataset(datasets.Dataset.from_dict({"x": [[1.0, 2.0]] * 3, "label": [0, 1, 2],
                                                           "s": ["a", "b", "c"]}))
    read = columns.get_batch(np.array([2, 0]))
    assert read["s"] == ["c", "a"] and torch.equal(read["label"], torch.tensor([2, 0]))
    empty = columns.get_batch(np.zeros(0, dtype=np.int64))
    assert empty["x"].shape == (0, 2) and empty["label"].dtype == torch.int64 and empty["s"] == []
