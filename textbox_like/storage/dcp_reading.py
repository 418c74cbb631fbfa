"""Reading torch's distributed checkpoint (DCP) format as data, never as code.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` without any
restriction, and its ``DefaultLoadPlanner.load_bytes`` reads every non-tensor
item of the shards (an optimizer's ``lr``, ``betas``...) with
``torch.load(weights_only=False)``: a copied checkpoint whose files were
replaced (and whose manifest digests were updated to match: a digest is not a
signature) would run code on export, eval, ``--restore-file`` and ``--resume``.
Here ``.metadata`` is read once, by an unpickler that admits only the classes
DCP writes into it, and that checked object is what the load plans with; the
bytes items are read by ``torch.load(weights_only=True)`` alone. Anything else
is refused in one line (:class:`UnsafeCheckpoint`, a
:class:`~textbox_like.core.errors.UserError`: exit 2).

    check_metadata(path)                     # the Metadata, or one line (exit 2)
    safe_load(state, path, no_dist=True)     # dcp.load through the safe reader and planner
"""
from __future__ import annotations

import contextlib

import functools
import io
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath

from textbox_like.core.errors import UserError, first_line

METADATA = ".metadata"
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# what DCP writes into .metadata besides the classes of DCP_METADATA_MODULE (read from torch 2.14's writer)
ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),      # a layout by its name ("torch.strided"): a dict lookup
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
}
# StorageMeta.checkpoint_id is a path; Python 3.13 pickles it from pathlib._local. A pure path is built on any
# OS (a WindowsPath is not, on Linux) and touches no file
PATH_MODULES = ("pathlib", "pathlib._local")
PURE_PATHS = {"PosixPath": PurePosixPath, "PurePosixPath": PurePosixPath,
              "WindowsPath": PureWindowsPath, "PureWindowsPath": PureWindowsPath}


class UnsafeCheckpoint(UserError):
    """A checkpoint file that holds more than data."""


def admitted(module: str, name: str):
    """The object ``module.name`` where a DCP ``.metadata`` may name it, else None."""
    import importlib

    import torch
    if module == "torch":
        found = vars(torch).get(name)   # not getattr: torch's module __getattr__ imports on a name
        if isinstance(found, torch.dtype):
            return found
    if module in PATH_MODULES:
        return PURE_PATHS.get(name)
    if (module, name) not in ADMITTED and module != DCP_METADATA_MODULE:
        return None
    found = getattr(importlib.import_module(module), name, None)
    # a name of the metadata module must be one of its own classes, not a function or an import it holds
    if module == DCP_METADATA_MODULE and not (isinstance(found, type) and found.__module__ == module):
        return None
    return found


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch dtypes and sizes, and nothing else."""

    def find_class(self, module, name):
        found = admitted(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found


def outside_files(metadata) -> list:
    """The file names the metadata's storage entries point to that are not plain
    names inside the checkpoint's directory (``../x``, ``/etc/x``)."""
    names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    return sorted(str(n) for n in names if not isinstance(n, str) or not n or Path(n).name != n or n in (".", ".."))


def load_metadata(handle, path):
    """The ``Metadata`` pickled in the open file ``handle`` (of checkpoint ``path``)."""
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        metadata = MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(f"checkpoint {path}: its {METADATA} holds a Python object ({exc}) that DCP's metadata "
                               f"never holds, and reading it could run code; it was not read: use a checkpoint this "
                               f"tool wrote, from a source you trust") from None
    except Exception as exc:  # truncated or not a pickle at all
        raise UnsafeCheckpoint(f"checkpoint {path}: its {METADATA} cannot be read ({type(exc).__name__}); "
                               f"it is damaged: use another checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"checkpoint {path}: its {METADATA} holds {type(metadata).__name__}, not DCP's "
                               f"metadata; use another checkpoint")
    outside = outside_files(metadata)
    if outside:
        raise UnsafeCheckpoint(f"checkpoint {path}: its {METADATA} points to files outside its directory "
                               f"({', '.join(outside[:3])}); it was not read: use another checkpoint")
    return metadata


def check_metadata(path, named=None):
    """Read the ``.metadata`` of the DCP directory ``path`` safely; one line
    (exit 2) where it holds anything but DCP's metadata. ``named``: the name
    to show (a link's, where ``path`` is the directory it points to)."""
    with open(Path(path) / METADATA, "rb") as handle:
        return load_metadata(handle, named or path)


@functools.lru_cache(maxsize=None)
def reader_class():
    """torch's ``FileSystemReader`` that plans with a ``Metadata`` already read
    by :func:`check_metadata` (a class made on first use: torch is imported lazily)."""
    from torch.distributed.checkpoint import FileSystemReader

    class CheckedMetadataReader(FileSystemReader):
        def __init__(self, path, metadata):
            super().__init__(str(path))
            self.checked_metadata = metadata

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata = self.checked_metadata
            if getattr(metadata, "storage_meta", None) is None:   # as torch's own read_metadata
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return CheckedMetadataReader


@functools.lru_cache(maxsize=None)
def planner_class():
    """torch's ``DefaultLoadPlanner``, whose non-tensor items are read by
    ``torch.load(weights_only=True)`` and nothing else (torch's reads them
    with ``weights_only=False``)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpoint(f"its item {fqn} holds a Python object besides plain values "
                                       f"({first_line(exc, 120)}), which the safe load refuses because loading it "
                                       f"could run code; it was not read") from None
            except Exception as exc:
                raise UnsafeCheckpoint(f"its item {fqn} cannot be read ({first_line(exc, 120)}); it is damaged: "
                                       f"use another checkpoint") from None
            if self.flatten_state_dict:   # as DefaultLoadPlanner.load_bytes
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded
    return SafeLoadPlanner


@contextlib.contextmanager
def one_process_is_no_news():
    """DCP's warning that torch.distributed is not initialised, silenced: one
    process saving or reading a checkpoint (export, eval, a one-rank --fsdp
    run) is what ``no_dist`` says, not news to the user."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def safe_load(state: dict, path, named=None, **kwargs) -> None:
    """``dcp.load(state, ...)`` from the DCP directory ``path``, reading it as
    data only: its ``.metadata`` is checked first, on every rank before any
    collective, so a hostile one is refused alike on each; a hostile item is
    refused as :class:`UnsafeCheckpoint`, not wrapped in DCP's exception."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    metadata = check_metadata(path, named)
    try:
        with one_process_is_no_news():
            dcp.load(state, storage_reader=reader_class()(path, metadata), planner=planner_class()(), **kwargs)
    except (CheckpointException, UnsafeCheckpoint) as exc:
        failures = (getattr(exc, "failures", None) or {}).values() if isinstance(exc, CheckpointException) else [exc]
        unsafe = [f for f in (f[0] if isinstance(f, tuple) else f for f in failures) if isinstance(f, UnsafeCheckpoint)]
        if unsafe:   # DCP wraps what a rank's planner raised
            raise UnsafeCheckpoint(f"checkpoint {named or path}: {unsafe[0]}") from None
        raise
