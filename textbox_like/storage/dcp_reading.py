"""Reading torch's distributed checkpoint (DCP) format as data, never as code.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` without any
restriction, and its ``DefaultLoadPlanner.load_bytes`` reads every non-tensor
item of the shards (an optimizer's ``lr``, ``betas``...) with
``torch.load(weights_only=False)``: a copied checkpoint whose files were
replaced (and whose manifest digests were updated to match: a digest is not a
signature) would run code on export, eval, ``--restore-file`` and ``--resume``.
Here ``.metadata`` is read by an unpickler that admits only the classes DCP
writes into it, and the bytes items by ``torch.load(weights_only=True)``;
anything else is refused in one line (:class:`UnsafeCheckpoint`, a
:class:`~textbox_like.errors.UserError`: exit 2).

    check_metadata(path)                     # the Metadata, or one line (exit 2)
    safe_load(state, path, no_dist=True)     # dcp.load through the safe reader and planner
"""
from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path

from ..errors import UserError, first_line

METADATA = ".metadata"
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# what DCP (torch 2.1 .. 2.14) writes into .metadata besides the classes of DCP_METADATA_MODULE
ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),      # a layout by its name ("torch.strided")
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(UserError):
    """A checkpoint file that holds more than data."""


def admitted(module: str, name: str):
    """The object ``module.name`` where a DCP ``.metadata`` may name it, else None."""
    import importlib

    import torch
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
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
    return metadata


def check_metadata(path, named=None):
    """Read the ``.metadata`` of the DCP directory ``path`` safely; one line
    (exit 2) where it holds anything but DCP's metadata. ``named``: the name
    to show (a link's, where ``path`` is the directory it points to)."""
    with open(Path(path) / METADATA, "rb") as handle:
        return load_metadata(handle, named or path)


@functools.lru_cache(maxsize=None)
def reader_class():
    """torch's ``FileSystemReader``, whose ``.metadata`` is read by :class:`MetadataUnpickler`
    (a class made on first use: torch is imported lazily)."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as handle:
                metadata = load_metadata(handle, self.path)
            if getattr(metadata, "storage_meta", None) is None:   # as torch's own read_metadata
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return SafeFileSystemReader


@functools.lru_cache(maxsize=None)
def planner_class():
    """torch's ``DefaultLoadPlanner``, whose non-tensor items must pass ``torch.load(weights_only=True)``
    before torch's own (unrestricted) load of the same bytes in memory builds them."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except Exception as exc:
                raise UnsafeCheckpoint(f"a checkpoint's item {read_item.dest_index.fqn} holds a Python object "
                                       f"besides plain values ({first_line(exc, 120)}), which the safe load "
                                       f"refuses because loading it could run code; it was not read") from None
            value.seek(0)
            super().load_bytes(read_item, value)
    return SafeLoadPlanner


def safe_load(state: dict, path, named=None, **kwargs) -> None:
    """``dcp.load(state, ...)`` from the DCP directory ``path``, reading it as
    data only: its ``.metadata`` is checked first, on every rank before any
    collective, so a hostile one is refused alike on each; a hostile item is
    refused as :class:`UnsafeCheckpoint`, not wrapped in DCP's exception."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    check_metadata(path, named)
    try:
        with warnings.catch_warnings():
            # one process reading a checkpoint (export, eval, a one-rank run) is what no_dist says: not news
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader_class()(str(path)), planner=planner_class()(), **kwargs)
    except CheckpointException as exc:
        unsafe = [f[0] if isinstance(f, tuple) else f for f in (getattr(exc, "failures", None) or {}).values()]
        unsafe = [f for f in unsafe if isinstance(f, UnsafeCheckpoint)]
        if unsafe:
            raise UnsafeCheckpoint(f"checkpoint {named or path}: {unsafe[0]}") from None
        raise
