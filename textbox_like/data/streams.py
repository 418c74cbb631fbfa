"""Streamed training data: samples read from files as training goes, never
held whole, in an order every rank computes alike, resumed from where the
last update left them.

One epoch of a stream is a pure function of (seed, epoch):

1. the source's shards (files) in a seeded order (:class:`FileSource`), read
   record by record from a position: a byte offset (txt, jsonl, csv) or a row
   (parquet), so a resume seeks there instead of reading again what was
   trained (its time does not grow with how far the run got);
2. tokenised a chunk at a time (in ``--num-workers`` processes), samples
   that teach nothing dropped;
3. shuffled by a seeded buffer of ``--shuffle-buffer`` samples;
4. packed into rows (``--packing``, data/packing.py), or not.

Every rank reads the whole stream (the records are cheap; each rank
tokenises every one, which ``--max-tokens`` and packing need anyway, to know
every sample's length) and takes its own slice of each update's units
(data/stream_batches.py): the global batch of update k is the same units for
any split over any ranks. The stream's state between two updates (the source
position, the samples read but not yet trained: the shuffle buffer, the rest
of the chunk, the open packed row, and the shuffle's random state) is small
and is saved in the checkpoint.

A task's own ``torch.utils.data.IterableDataset`` or ``datasets.IterableDataset``
is a :class:`IterableSource`: its order is its own (``set_epoch(epoch)`` is
called where it has one), the same on every rank, and a resume reads it again
from the epoch's start to the position (its time grows with the position).
"""
from __future__ import annotations

import csv
import itertools
import json
from collections import deque
from pathlib import Path

import numpy as np

from textbox_like.core.errors import UserError
from textbox_like.core.faults import DataUnavailable, os_reason

#: file suffix -> reader
STREAM_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv",
                  ".parquet": "parquet"}

#: a sample id is its file's number times this plus its record number in the file
ID_STRIDE = 1 << 36


def stream_files(path, split) -> list:
    """The files of ``split`` under ``path``: ``path`` itself (a file), or in
    a directory ``SPLIT.*``, ``SPLIT-*.*`` / ``SPLIT_*.*`` shards, or the files
    of a ``SPLIT/`` directory; sorted by name."""
    from textbox_like.data.hf_text import SPLIT_ALIASES
    path = Path(path)
    if path.is_file():
        return [path]
    for name in SPLIT_ALIASES.get(split, (split,)):
        found = [p for p in sorted(path.glob(f"{name}*")) if p.is_file() and p.suffix.lower() in STREAM_FORMATS
                 and (p.stem == name or p.stem[len(name):len(name) + 1] in "-_.")]
        folder = path / name
        if folder.is_dir():
            found += [p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix.lower() in STREAM_FORMATS]
        if found:
            return found
    raise UserError(f"no {split} file (txt, jsonl, csv, tsv, parquet) in --data {str(path)!r}: name it "
                    f"{split}.jsonl, shards {split}-00000.jsonl ..., or put them in {path / split}/")


def _lines(handle, start: int):
    """(line, offset after it) from byte ``start`` of a binary file."""
    handle.seek(start)
    at = start
    while True:
        line = handle.readline()
        if not line:
            return
        at += len(line)
        yield line, at


def read_text(path, start):
    with open(path, "rb") as handle:
        for line, end in _lines(handle, start):
            yield {"text": line.decode("utf-8", errors="replace").rstrip("\r\n")}, end


def read_json_lines(path, start):
    with open(path, "rb") as handle:
        for line, end in _lines(handle, start):
            if line.strip():
                yield json_record(path, line, end), end


def json_record(path, line: bytes, end: int) -> dict:
    """One line of a jsonl file as its record; one line where it is not one."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        cut = not line.endswith(b"\n")
        raise UserError(f"{path}: the record at byte {end - len(line):,} is not whole JSON ({exc.msg})"
                        + ("; the file ends mid-record (cut while being written?): complete or remove its last "
                           "line" if cut else "; repair or remove that line")) from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: the record at byte {end - len(line):,} is a JSON {type(record).__name__}, "
                        f"not an object of columns")
    return record


def read_csv(path, start):
    with open(path, "rb") as handle:
        yield from csv_records(path, handle, start)


def csv_records(path, handle, start):
    delimiter = "\t" if Path(path).suffix.lower() == ".tsv" else ","
    header_lines = _lines(handle, 0)
    try:
        names = next(csv.reader((line.decode("utf-8") for line, _ in header_lines), delimiter=delimiter))
    except StopIteration:
        return
    header_end = handle.tell()
    consumed = [max(start, header_end)]

    def text_lines():
        for line, end in _lines(handle, consumed[0]):
            consumed[0] = end
            yield line.decode("utf-8", errors="replace")

    try:
        for values in csv.reader(text_lines(), delimiter=delimiter, strict=True):
            if not values:
                continue
            if len(values) != len(names):
                raise UserError(f"{path}: the record ending at byte {consumed[0]:,} has {len(values)} fields, the "
                                f"header {len(names)}; repair that record")
            yield dict(zip(names, values)), consumed[0]
    except csv.Error as exc:
        raise UserError(f"{path}: the file ends mid-record or is not csv ({exc}); complete or remove its last "
                        f"record") from None


def read_parquet(path, start):
    import pyarrow.parquet as pq
    table = pq.ParquetFile(path)
    row = 0
    for group in range(table.num_row_groups):
        rows = table.metadata.row_group(group).num_rows
        if row + rows <= start:
            row += rows
            continue
        for i, record in enumerate(table.read_row_group(group).to_pylist()):
            if row + i >= start:
                yield record, row + i + 1
        row += rows


READERS = {"text": read_text, "json": read_json_lines, "csv": read_csv, "parquet": read_parquet}


class FileSource:
    """Records of files, each epoch the files in a seeded order; a position
    is (the file's place in the epoch's order, where in the file: a byte or a
    row, the record number there)."""

    #: its records are plain values: the stream's buffers can be saved in a checkpoint
    saves_samples = True

    def __init__(self, files, seed: int, shuffle: bool):
        self.files = [Path(f) for f in files]
        self.seed, self.shuffle = int(seed), bool(shuffle)
        # taken as the run starts: the save after a file went away mid-run still names the data it trained on
        self._identity = [[f.name, f.stat().st_size] for f in self.files]

    def identity(self) -> list:
        """What a checkpoint's position refers to: the files' names and sizes."""
        return self._identity

    def order(self, epoch: int) -> list:
        if not self.shuffle:
            return list(range(len(self.files)))
        return np.random.default_rng([self.seed, epoch, 0x5a]).permutation(len(self.files)).tolist()

    def start(self, epoch: int) -> dict:
        return {"shard": 0, "offset": 0, "row": 0}

    def records(self, epoch: int, position: dict):
        """(record, sample id, the position after it) from ``position`` to the epoch's end."""
        order = self.order(epoch)
        shard, offset, row = position["shard"], position["offset"], position["row"]
        while shard < len(order):
            index = order[shard]
            path = self.files[index]
            reader = READERS[STREAM_FORMATS[path.suffix.lower()]]
            try:
                for record, end in reader(path, offset):
                    yield record, index * ID_STRIDE + row, {"shard": shard, "offset": end, "row": row + 1}
                    row += 1
            except OSError as exc:
                # a file gone or unreadable mid-run (a shared file system's outage, maybe on this node only):
                # the ranks agree on it (Feed), save the state before this update and exit 75 for a retry
                raise DataUnavailable(f"{path} can no longer be read ({os_reason(exc)})") from None
            shard, offset, row = shard + 1, 0, 0


class IterableSource:
    """A task's own iterable dataset: its order each epoch (after
    ``set_epoch(epoch)`` where it has one); a position is how many samples of
    the epoch were read, and reading from one reads the epoch again up to it."""

    saves_samples = False

    def __init__(self, dataset):
        self.dataset = dataset

    def identity(self) -> list:
        return [type(self.dataset).__qualname__]

    def start(self, epoch: int) -> dict:
        return {"read": 0}

    def records(self, epoch: int, position: dict):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        skip = int(position["read"])
        for i, sample in enumerate(self.dataset):
            if i >= skip:
                yield sample, i, {"read": i + 1}


def _encode_in_worker(chunk):
    return _WORKER_ENCODE(chunk)


def _install_encoder(encode):
    global _WORKER_ENCODE
    _WORKER_ENCODE = encode


_WORKER_ENCODE = None


class SampleStream:
    """One epoch at a time of a source's units (samples, or packed rows of
    them): ``peek`` and ``take`` from the front, ``snapshot``/``restore`` of
    the whole state between two takes (cheap: references, the samples are
    never changed), ``to_json``/``from_json`` for a checkpoint.

    ``encode``: a function of a list of (record, id) to a list of samples
    (dicts of arrays with an ``id``; None keeps the records as samples);
    ``tokens``: a sample's token count (for packing and token budgets)."""

    def __init__(self, source, *, seed: int, encode=None, tokens=None, shuffle_buffer: int = 0, pack_to=None,
                 chunk: int = 256, workers: int = 0):
        from textbox_like.data.packing import RowPacker
        self.source, self.encode, self.sample_tokens = source, encode, tokens
        self.seed, self.buffer_size = int(seed), int(shuffle_buffer)
        self.chunk = int(chunk) if source.saves_samples else 1
        self.packer = RowPacker(pack_to) if pack_to else None
        self.workers = int(workers) if encode is not None else 0
        self.pool = None
        self.epoch = 0
        self._reset(1)

    # -- state ----------------------------------------------------------------
    def _reset(self, epoch):
        self._close_reading()
        self.epoch = epoch
        self.position = self.source.start(epoch)   # after the last record moved into ``incoming``
        self.upstream_done = False
        self.incoming, self.buffer, self.lookahead = deque(), [], deque()
        self.rng = np.random.default_rng([self.seed, epoch, 0xb0f])
        if self.packer is not None:
            self.packer.open, self.packer.used = [], 0
        self.ended = False   # the packer flushed: nothing more this epoch

    def start_epoch(self, epoch: int):
        self._reset(int(epoch))

    def snapshot(self):
        packer = (list(self.packer.open), self.packer.used) if self.packer else None
        return (self.epoch, dict(self.position), self.upstream_done, list(self.incoming), list(self.buffer),
                list(self.lookahead), self.rng.bit_generator.state, packer, self.ended)

    def restore(self, snap):
        self._close_reading()
        epoch, position, done, incoming, buffer, lookahead, rng, packer, ended = snap
        self.epoch, self.position, self.upstream_done = epoch, dict(position), done
        self.incoming, self.buffer, self.lookahead = deque(incoming), list(buffer), deque(lookahead)
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = rng
        if self.packer is not None:
            self.packer.open, self.packer.used = list(packer[0]), packer[1]
        self.ended = ended

    def to_json(self, snap) -> str:
        epoch, position, done, incoming, buffer, lookahead, rng, packer, ended = snap
        if not self.source.saves_samples and (incoming or buffer or lookahead):
            raise RuntimeError("a task's own stream holds samples between updates")  # never: chunk 1, no buffer
        unit = self._unit_to_json
        return json.dumps({"epoch": epoch, "position": position, "upstream_done": done,
                           "incoming": [sample_to_json(s) for s in incoming],
                           "buffer": [sample_to_json(s) for s in buffer],
                           "lookahead": [unit(u) for u in lookahead], "rng": rng,
                           "packer": [[sample_to_json(s) for s in packer[0]], packer[1]] if packer else None,
                           "ended": ended})

    def from_json(self, text: str):
        d = json.loads(text)
        unit = self._unit_from_json
        packer = [[sample_from_json(s) for s in d["packer"][0]], d["packer"][1]] if d["packer"] else None
        return (d["epoch"], d["position"], d["upstream_done"], [sample_from_json(s) for s in d["incoming"]],
                [sample_from_json(s) for s in d["buffer"]], [unit(u) for u in d["lookahead"]], d["rng"], packer,
                d["ended"])

    def _unit_to_json(self, unit):
        return [sample_to_json(s) for s in unit] if self.packer else sample_to_json(unit)

    def _unit_from_json(self, unit):
        return [sample_from_json(s) for s in unit] if self.packer else sample_from_json(unit)

    # -- units ----------------------------------------------------------------
    def unit_tokens(self, unit) -> int:
        if self.packer is not None:
            return sum(self.sample_tokens(s) for s in unit)
        return self.sample_tokens(unit)

    def peek(self, count: int) -> list:
        """The next ``count`` units (fewer at the epoch's end), left in place."""
        self._fill(count)
        return list(itertools.islice(self.lookahead, count))

    def _fill(self, count: int) -> int:
        """Read units into the lookahead until it holds ``count`` (or the epoch ends); how many it holds."""
        while len(self.lookahead) < count:
            unit = self._next_unit()
            if unit is None:
                break
            self.lookahead.append(unit)
        return len(self.lookahead)

    def peek_tokens(self, budget: int) -> list:
        """The next units until they hold more than ``budget`` tokens (or the epoch ends)."""
        held = sum(self.unit_tokens(u) for u in self.lookahead)
        while held <= budget:
            unit = self._next_unit()
            if unit is None:
                break
            self.lookahead.append(unit)
            held += self.unit_tokens(unit)
        return list(self.lookahead)

    def take(self, count: int) -> list:
        self._fill(count)
        return [self.lookahead.popleft() for _ in range(min(count, len(self.lookahead)))]

    def exhausted(self) -> bool:
        return self._fill(1) == 0

    def _next_unit(self):
        if self.packer is None:
            return self._next_shuffled()
        if self.ended:
            return None
        while True:
            sample = self._next_shuffled()
            if sample is None:
                self.ended = True
                return self.packer.flush()
            row = self.packer.add(sample, self.sample_tokens(sample))
            if row is not None:
                return row

    def _next_shuffled(self):
        """The shuffle buffer: filled to its size, then a random one of it out."""
        while len(self.buffer) < max(self.buffer_size, 1):
            sample = self._next_sample()
            if sample is None:
                break
            self.buffer.append(sample)
        if not self.buffer:
            return None
        if self.buffer_size <= 1:
            return self.buffer.pop()
        i = int(self.rng.integers(len(self.buffer)))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def _next_sample(self):
        while not self.incoming:
            if self.upstream_done:
                return None
            chunk = self._next_chunk()
            if chunk is None:
                self.upstream_done = True
                return None
            samples, self.position = chunk
            self.incoming.extend(samples)
        return self.incoming.popleft()

    # -- reading --------------------------------------------------------------
    def _close_reading(self):
        self._records = None
        self._ahead = deque()

    def _read_chunk(self):
        """(records with their ids, the position after them) read from the source, or None at its end."""
        if self._records is None:
            self._records = self.source.records(self.epoch, self._read_position)
        chunk, position = [], None
        for record, sample_id, position in self._records:
            chunk.append((record, sample_id))
            if len(chunk) >= self.chunk:
                break
        if not chunk:
            return None
        self._read_position = position
        return chunk, position

    def _next_chunk(self):
        """The next chunk's samples and the position after it: encoded here,
        or in the worker processes a few chunks ahead."""
        if self._records is None:
            self._read_position = self.position
        if not self.workers:
            read = self._read_chunk()
            if read is None:
                return None
            chunk, position = read
            return (self.encode(chunk) if self.encode else [record for record, _ in chunk]), position
        pool = self._pool()
        while len(self._ahead) < 2 * self.workers:
            read = self._read_chunk()
            if read is None:
                break
            self._ahead.append((pool.submit(_encode_in_worker, read[0]), read[1]))
        if not self._ahead:
            return None
        future, position = self._ahead.popleft()
        return future.result(), position

    def _pool(self):
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            # a fresh interpreter (forkserver), not a fork of a process whose threads hold locks
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("forkserver"),
                                            initializer=_install_encoder, initargs=(self.encode,))
        return self.pool

    def close(self):
        self._close_reading()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def sample_to_json(sample):
    if isinstance(sample, dict):
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
    return sample


def sample_from_json(sample):
    if isinstance(sample, dict):
        return {k: (np.asarray(v, dtype=np.int64) if isinstance(v, list) else v) for k, v in sample.items()}
    return sample


def sniff_columns(path) -> list:
    """The column names of a stream file's first record (for checks before a run)."""
    path = Path(path)
    kind = STREAM_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"{str(path)!r}: unknown file type {path.suffix!r} for --streaming; use one of "
                        f"{', '.join(STREAM_FORMATS)}")
    if kind == "parquet":
        import pyarrow.parquet as pq
        return list(pq.ParquetFile(path).schema_arrow.names)
    for record, _ in READERS[kind](path, 0):
        return list(record)
    return []


