"""Text data for the ``hf`` task, read through Hugging Face ``datasets``.

A split comes from local files only (nothing is downloaded): a directory
holding ``train.*`` and ``valid.*``/``test.*`` (csv, tsv, json, jsonl,
parquet, txt), one file (the training split), a ``save_to_disk`` directory,
one named file per split (kanachan's ``--training-data FILE`` /
``--validation-data FILE``), or a dataset name (``imdb``, ``user/name``)
that ``datasets.load_dataset`` left in the local datasets cache (read
offline). It is tokenised by the model's tokenizer with ``datasets.map``
(batched, several processes for large data) into Arrow files in
``--cache-dir`` (by default the Hugging Face datasets cache's ``textbox_like``
folder, never beside the data), named by a fingerprint of the raw data, the
tokenizer and the settings, so a second run (and every other rank) reads them
instead of tokenising again.

:class:`HFTextDataset` serves batches of the protocol in ``base.py`` from the
token ids held as flat arrays: padded to the batch's longest sample (dynamic
padding), with per-sample token counts for ``--max-tokens``.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from textbox_like.core.errors import UserError
from textbox_like.data.base import BatchDataset

#: file suffix -> datasets' builder for it
BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}

#: other names a split goes by in people's files
SPLIT_ALIASES = {"valid": ("valid", "validation", "dev", "val"), "validation": ("validation", "valid", "dev", "val"),
                 "test": ("test",), "train": ("train", "training")}

IGNORE_INDEX = -100


def offline():
    """Nothing is fetched: datasets and the hub read local files only (set
    before ``datasets`` is first imported, which reads them once)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def is_saved_dataset(path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    path = Path(path)
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def split_file(directory, split):
    """The file holding ``split`` in ``directory`` (``valid.jsonl``,
    ``validation.csv``, ...), or None."""
    for name in SPLIT_ALIASES.get(split, (split,)):
        for suffix in BUILDERS:
            path = Path(directory) / f"{name}{suffix}"
            if path.is_file():
                return path
    return None


def looks_like_path(text) -> bool:
    """Whether ``text`` is written as a path (``./x``, ``/x``, ``~/x``,
    ``a/b/c``, ``x.csv``) rather than a dataset name (``imdb``, ``user/name``)."""
    text = str(text)
    return (text.startswith((".", "/", "~")) or text.endswith("/") or text.count("/") > 1
            or Path(text).suffix.lower() in BUILDERS)


def cache_remedy(name, config=None) -> str:
    """How to put dataset ``name`` where an offline run finds it."""
    call = f"datasets.load_dataset({name!r}" + (f", {config!r})" if config else ")")
    return (f"on a connected machine run {call} and copy ~/.cache/huggingface/datasets here (or set "
            f"HF_DATASETS_CACHE to the copy), or save it there with .save_to_disk(DIR) and pass --data DIR")


def cached_dataset(name, config=None):
    """The builder of dataset ``name`` (and ``config``) as the local datasets
    cache holds it (offline: nothing is fetched); one line where it is not there."""
    offline()
    import datasets

    datasets.disable_progress_bars()
    where = datasets.config.HF_DATASETS_CACHE
    try:
        return datasets.load_dataset_builder(name, config)
    except (OSError, ValueError) as exc:  # not cached (ConnectionError offline), another config only (ValueError)
        text = str(exc)
        if config and "Available configs in the cache" in text:
            held = text.split("Available configs in the cache:", 1)[1].strip().strip("[]").replace("'", "")
            raise UserError(f"--data {name} --dataset_config {config}: the local Hugging Face datasets cache ({where}) "
                            f"holds {name!r} only in the configs {held}; {cache_remedy(name, config)}") from None
        raise UserError(f"--data {name}: no such file or directory, and no dataset {name!r}"
                        + (f" (config {config!r})" if config else "")
                        + f" in the local Hugging Face datasets cache ({where}; nothing is downloaded here); "
                        + cache_remedy(name, config)) from None


def load_cached(name, config, split):
    """``split`` of dataset ``name`` from the local datasets cache (split
    aliases as for files: valid, validation, dev, val)."""
    import datasets

    builder = cached_dataset(name, config)
    held = list((builder.info.splits or {}).keys())
    found = next((alias for alias in SPLIT_ALIASES.get(split, (split,)) if alias in held), None)
    if found is None:
        raise UserError(f"the cached dataset {name!r} has no split {split!r}; it has {', '.join(held) or 'none'} "
                        f"(choose with --train-subset/--valid-subset)")
    return datasets.load_dataset(name, config, split=found)


def default_cache_dir() -> Path:
    """Where tokenised data goes without --cache-dir: the Hugging Face datasets
    cache's ``textbox_like`` folder (HF_DATASETS_CACHE, else HF_HOME/datasets,
    else ~/.cache/huggingface/datasets), never beside the data: a data
    directory may be read-only, or shared by people who did not ask for it."""
    base = os.environ.get("HF_DATASETS_CACHE") or \
        Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "datasets"
    return Path(base) / "textbox_like"


def load_raw(data, split, named_file=None, training=False, dataset_config=None, cache_dir=None):
    """The raw rows of ``split`` (a ``datasets.Dataset``) and the directory its
    tokenised cache goes to: ``cache_dir`` (--cache-dir), else default_cache_dir()."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return read_split(data, split, named_file, training, dataset_config, cache), cache


def read_split(data, split, named_file, training, dataset_config, cache_dir):
    offline()
    import datasets

    datasets.disable_progress_bars()
    if named_file:
        return load_file(named_file, cache_dir)
    path = Path(data)
    if not path.exists() and not looks_like_path(data):
        return load_cached(str(data), dataset_config, split)
    if is_saved_dataset(path):
        saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            for name in SPLIT_ALIASES.get(split, (split,)):
                if name in saved:
                    return saved[name]
            raise UserError(f"the saved dataset {str(path)!r} has no split {split!r}; it has "
                            f"{', '.join(saved)} (choose with --train-subset/--valid-subset)")
        if training:
            return saved
        raise UserError(f"the saved dataset {str(path)!r} is one split, the training data; give validation data "
                        f"with --validation-data FILE, or --disable-validation")
    if path.is_file():
        if training:
            return load_file(path, cache_dir)
        raise UserError(f"--data {str(path)!r} is one file, the training data; give validation data with "
                        f"--validation-data FILE (or --data DIR holding train.* and valid.*), or "
                        f"--disable-validation")
    found = split_file(path, split)
    if found is None:
        raise UserError(f"no {split}.* file (csv, tsv, json, jsonl, parquet, txt) in --data {str(path)!r}; "
                        f"name the split's file so, or choose the split with --train-subset/--valid-subset")
    return load_file(found, cache_dir)


def load_file(path, cache_dir):
    """One local file as a ``datasets.Dataset`` (datasets' own cache of it in ``cache_dir``)."""
    import datasets

    path = Path(path)
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(f"{str(path)!r}: unknown file type {path.suffix!r}; use one of "
                        f"{', '.join(BUILDERS)}")
    extra = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    # a file that does not parse is one line, ours, below: datasets' own builders log it first ("Failed to
    # read file ... with error ...") before they raise, so their logging is kept to what is critical meanwhile
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files={"rows": str(path)}, split="rows",
                                     cache_dir=str(writable_cache(Path(cache_dir))), **extra)
    except (ValueError, datasets.exceptions.DatasetGenerationError) as exc:
        cause = exc.__cause__ or exc
        raise UserError(f"{str(path)!r} could not be read as {builder}: {str(cause).splitlines()[0]}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def writable_cache(directory) -> Path:
    """``directory``, created, or the user's cache where the data's own
    directory cannot be written (a line says where, once); neither writable:
    one line naming both and the variable that chooses the cache."""
    directory = Path(directory)
    why = cannot_write(directory)
    if why is None:
        return directory
    base = Path(os.environ.get("HF_DATASETS_CACHE", Path.home() / ".cache" / "huggingface" / "datasets"))
    fallback = base / "textbox_like" / hashlib.sha1(str(directory.resolve()).encode()).hexdigest()[:16]
    why_not_there = cannot_write(fallback)
    if why_not_there is not None:
        raise UserError(f"no writable place for the tokenised data: {directory} ({why}), nor {fallback} "
                        f"({why_not_there}); set HF_DATASETS_CACHE to a writable directory")
    if directory not in _MOVED_CACHES:
        _MOVED_CACHES.add(directory)
        from textbox_like.core.errors import note
        note(f"{directory} cannot be written ({why}): the tokenised data is cached in {fallback} instead "
             f"(HF_DATASETS_CACHE chooses where)")
    return fallback


_MOVED_CACHES = set()


def cannot_write(directory: Path):
    """None where files can be made in ``directory`` (created if need be), else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


@dataclass(frozen=True)
class TextColumns:
    """What the columns are, and what the model reads."""
    head: str
    text: str = "text"
    text_pair: str | None = None
    label: str = "label"
    target: str | None = None
    max_length: int = 512
    max_target_length: int = 128


def check_columns(raw, columns: TextColumns, where: str):
    """One line for a column the split lacks."""
    wanted = [("--text_column", columns.text)]
    if columns.text_pair:
        wanted.append(("--text_pair_column", columns.text_pair))
    if columns.head == "sequence_classification":
        wanted.append(("--label_column", columns.label))
    if columns.head == "seq2seq":
        if not columns.target:
            raise UserError("--hf_head seq2seq needs --target_column NAME: the column of the texts to generate")
        wanted.append(("--target_column", columns.target))
    for flag, name in wanted:
        if name not in raw.column_names:
            raise UserError(f"{where} has no column {name!r} ({flag}); its columns: {', '.join(raw.column_names)}")


def label_names(raw, columns: TextColumns, where="the data"):
    """The class names of a classification split: its ClassLabel names, the
    sorted distinct strings, or None where the labels are already 0..K-1. A
    sample without a label (an empty csv cell: a NaN) is one line naming it,
    not a class named 'None' or 'nan'."""
    feature = raw.features[columns.label]
    if hasattr(feature, "names"):
        return list(feature.names)
    values = raw.unique(columns.label)
    if any(v is None or isinstance(v, float) and v != v for v in values):
        row = first_row(raw, columns.label, lambda v: v is None or isinstance(v, float) and v != v)
        raise UserError(f"sample {row} of {where} has no label (--label_column {columns.label!r} is empty there); "
                        f"give every sample a label, or remove that one")
    if values and all(isinstance(v, float) and v.is_integer() for v in values):
        values = [int(v) for v in values]   # a csv column read as floats: 0.0 and 1.0 are classes 0 and 1
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        if any(v < 0 for v in values):
            raise UserError(f"--label_column {columns.label!r} holds negative class numbers; classes are 0..K-1")
        return None
    return sorted(str(v) for v in values)


def first_row(raw, column, wrong) -> int:
    """The index of the first sample of ``raw`` whose ``column`` value is ``wrong``."""
    return next(i for i, value in enumerate(raw[column]) if wrong(value))


def tokenize_rows(rows, *, tokenizer, columns, label_ids):
    """One batch of ``datasets.map``: raw rows to token ids (module level: it
    is pickled for the worker processes)."""
    texts = [t if isinstance(t, str) else "" if t is None else str(t) for t in rows[columns.text]]
    pairs = None
    if columns.text_pair:
        pairs = [t if isinstance(t, str) else "" if t is None else str(t) for t in rows[columns.text_pair]]
    encoded = tokenizer(texts, pairs, truncation=True, max_length=columns.max_length)
    out = {"input_ids": encoded["input_ids"]}
    if "token_type_ids" in encoded and columns.head in ("sequence_classification", "masked_lm"):
        out["token_type_ids"] = encoded["token_type_ids"]
    if columns.head == "sequence_classification":
        labels = rows[columns.label]
        out["labels"] = [label_ids[str(v)] if label_ids is not None else int(v) for v in labels]
    elif columns.head == "seq2seq":
        targets = [t if isinstance(t, str) else "" if t is None else str(t) for t in rows[columns.target]]
        out["labels"] = tokenizer(text_target=targets, truncation=True,
                                  max_length=columns.max_target_length)["input_ids"]
    if "id" in rows:  # a stream's sample ids, kept beside their samples
        out["id"] = list(rows["id"])
    if columns.head in ("causal_lm", "masked_lm"):  # empty lines of a text file teach nothing
        keep = [i for i, ids in enumerate(out["input_ids"]) if len(ids) > 1]
        if len(keep) < len(out["input_ids"]):
            out = {k: [v[i] for i in keep] for k, v in out.items()}
    return out


#: the parts of a fast tokenizer's serialisation that its last call left there, not what it is: a call with
#: truncation or padding sets them on the backend, so a tokenizer that had tokenised one split serialised
#: otherwise and the next split's cache key changed (a first run tokenised train twice, a second re-tokenised
#: valid). Each call sets its own, from the columns the key holds.
CALL_STATE = ("truncation", "padding")


def tokenizer_fingerprint(tokenizer) -> str:
    """What identifies a tokenizer's output: its full serialisation where it
    has one (fast tokenizers; without the state a call leaves, CALL_STATE),
    else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        serialised = json.loads(backend.to_str())
        text = json.dumps({k: v for k, v in serialised.items() if k not in CALL_STATE}, sort_keys=True)
    else:
        text = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True)
    return hashlib.sha1((text + special).encode()).hexdigest()


def tokenize(raw, tokenizer, columns: TextColumns, cache_dir, label_ids=None, num_proc=None):
    """``raw`` tokenised through ``datasets.map`` into an Arrow file in
    ``cache_dir`` named by what decides its content, and read from there when
    it exists already (a second run, the other ranks)."""
    import functools

    key = hashlib.sha1(json.dumps([raw._fingerprint, tokenizer_fingerprint(tokenizer), columns.__dict__,
                                   label_ids], sort_keys=True, default=str).encode()).hexdigest()[:20]
    cache_dir = writable_cache(cache_dir)
    if num_proc is None:  # worker processes pay off on large data only
        num_proc = min(8, os.cpu_count() or 1) if len(raw) >= 20000 else 1
    num_proc = max(1, min(num_proc, len(raw)))
    fn = functools.partial(tokenize_rows, tokenizer=tokenizer, columns=columns, label_ids=label_ids)
    from filelock import FileLock
    # two runs on the same data at once (another job, another node of a shared file system): one tokenises, the
    # other waits for it and reads its whole cache (never judges a file written a moment ago, its digest not yet
    # recorded, damaged); the lock is the kernel's, gone with a killed holder
    with FileLock(str(cache_dir / f"tokenized-{key}.lock")):
        drop_abandoned_writes(cache_dir)
        drop_damaged_cache(cache_dir, key)
        if not cache_files(cache_dir, key):  # the one wait before the start line that grows with the data
            from textbox_like.core.errors import note
            note(f"tokenizing {len(raw):,} rows into {cache_dir} (once: later runs read them from there)")
        tokenized = raw.map(fn, batched=True, num_proc=num_proc if num_proc > 1 else None,
                            remove_columns=raw.column_names, cache_file_name=str(cache_dir / f"tokenized-{key}.arrow"),
                            load_from_cache_file=True, new_fingerprint=key, desc="tokenizing")
        record_cache_digests(cache_dir, key, tokenized)
    return tokenized


def cache_files(cache_dir: Path, key: str) -> list:
    """The Arrow files of a tokenised cache: one, or one per worker process."""
    return sorted([*cache_dir.glob(f"tokenized-{key}.arrow"), *cache_dir.glob(f"tokenized-{key}_*_of_*.arrow")])


def digests_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"tokenized-{key}.digests.json"


def file_digest(path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "blake2b").hexdigest()


#: a temporary file of datasets' map (tempfile's tmpXXXXXXXX, renamed to its cache file when whole) not written
#: to for this long was left by a run killed while tokenising, not one tokenising now (it writes as it goes)
ABANDONED_AFTER_S = 3600


def drop_abandoned_writes(cache_dir: Path) -> None:
    """Remove the partial tokenised files of runs killed while they wrote
    them (as large as the data, never read again), with a line."""
    import time
    now = time.time()
    left = []
    for path in cache_dir.glob("tmp*"):
        try:
            if path.is_file() and now - path.stat().st_mtime > ABANDONED_AFTER_S:
                size = path.stat().st_size
                path.unlink()
                left.append((path.name, size))
        except OSError:   # another run removed it first, or it cannot be: it stays
            continue
    if left:
        from textbox_like.core.errors import note
        note(f"removed {len(left)} partial tokenised file(s) of a run killed while tokenising "
             f"({sum(size for _, size in left) / 2 ** 20:.1f} MiB in {cache_dir}: {', '.join(n for n, _ in left)})")


def drop_damaged_cache(cache_dir: Path, key: str) -> None:
    """A tokenised cache is read only where its files are whole: their
    digests, written with them, match. A truncated or overwritten file (or
    one no digest was written for: a run killed while writing it) is
    removed, with a line, and the data tokenised again: never trained on."""
    files = cache_files(cache_dir, key)
    if not files:
        return
    record = digests_path(cache_dir, key)
    try:
        expected = json.loads(record.read_text())
    except (OSError, ValueError):
        expected = {}
    damaged = [f.name for f in files if expected.get(f.name) != file_digest(f)]
    if not damaged and set(expected) == {f.name for f in files}:
        return
    from textbox_like.core.errors import note
    note(f"the tokenised cache {cache_dir / damaged[0] if damaged else record} is damaged or incomplete (its digest "
         f"does not match what was written); tokenising again")
    for path in [*files, record]:
        path.unlink(missing_ok=True)


def record_cache_digests(cache_dir: Path, key: str, tokenized) -> None:
    """The digests of the cache files ``tokenized`` was written to or read from, once."""
    record = digests_path(cache_dir, key)
    if record.exists():
        return
    files = [Path(f["filename"]) for f in tokenized.cache_files
             if Path(f["filename"]).resolve().parent == cache_dir.resolve()]
    if files:
        from textbox_like.storage.fileio import atomic_write_text
        atomic_write_text(record, json.dumps({f.name: file_digest(f) for f in files}, sort_keys=True))


class FlatColumn:
    """A column of token-id lists as one flat array and offsets."""

    def __init__(self, column):
        import pyarrow as pa

        array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        offsets = np.asarray(array.offsets, dtype=np.int64)
        self.values = np.asarray(array.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        self.starts = offsets[:-1] - offsets[0]
        self.lengths = np.diff(offsets)

    def padded(self, indices, pad):
        """(ids, real) for ``indices``: padded to the longest, and where the ids are real."""
        lengths = self.lengths[indices]
        width = int(lengths.max()) if len(indices) else 0
        steps = np.arange(width, dtype=np.int64)
        real = steps[None, :] < lengths[:, None]
        where = np.minimum(self.starts[indices][:, None] + steps[None, :], max(len(self.values) - 1, 0))
        ids = np.where(real, self.values[where] if len(self.values) else pad, pad)
        return ids, real


class HFTextDataset(BatchDataset):
    """Tokenised text in memory; batches padded to their longest sample."""

    def __init__(self, tokenized, head: str, pad_id: int, masking=None):
        """``masking``: for masked_lm, (seed, probability, mask id, vocab
        size, special ids): the masked positions of a sample are a pure
        function of the seed and the sample's index (the same on every rank
        and after a resume)."""
        if not hasattr(tokenized, "flatten_indices"):  # an Arrow table already
            table = tokenized
        elif tokenized._indices is None:  # rows in order: the cached table itself (flatten_indices would copy it)
            table = tokenized.data.table
        else:
            table = tokenized.flatten_indices().data.table
        self.head, self.pad_id, self.masking = head, int(pad_id), masking
        self.input_ids = FlatColumn(table.column("input_ids"))
        names = set(table.column_names)
        self.token_type_ids = FlatColumn(table.column("token_type_ids")) if "token_type_ids" in names else None
        self.labels = None
        if "labels" in names:
            column = table.column("labels")
            if head == "seq2seq":
                self.labels = FlatColumn(column)
            else:
                self.labels = np.asarray(column.to_numpy(), dtype=np.int64)

    def __len__(self):
        return len(self.input_ids.lengths)

    def num_tokens(self):
        return self.input_ids.lengths

    def batch_num_tokens(self, batch):
        return batch["attention_mask"].sum(dim=1).numpy()

    def sample(self, index: int) -> dict:
        """Sample ``index`` as data/text_batches.py's samples are (its arrays, its id)."""
        def row(column):
            return column.values[column.starts[index]:column.starts[index] + column.lengths[index]]
        out = {"input_ids": row(self.input_ids), "id": int(index)}
        if self.token_type_ids is not None:
            out["token_type_ids"] = row(self.token_type_ids)
        if self.labels is not None:
            out["labels"] = row(self.labels) if self.head == "seq2seq" else int(self.labels[index])
        return out

    def get_batch(self, indices):
        import torch

        indices = np.asarray(indices, dtype=np.int64)
        ids, real = self.input_ids.padded(indices, self.pad_id)
        batch = {"input_ids": ids, "attention_mask": real.astype(np.int64)}
        if self.token_type_ids is not None:
            batch["token_type_ids"] = self.token_type_ids.padded(indices, 0)[0]
        if self.head == "sequence_classification":
            batch["labels"] = self.labels[indices]
        elif self.head == "causal_lm":
            batch["labels"] = np.where(real, ids, IGNORE_INDEX)
        elif self.head == "masked_lm":
            from textbox_like.data.text_batches import mask_tokens
            batch["input_ids"], batch["labels"] = mask_tokens(ids, real, indices, self.masking)
        elif self.head == "seq2seq":
            targets, target_real = self.labels.padded(indices, IGNORE_INDEX)
            batch["labels"] = np.where(target_real, targets, IGNORE_INDEX)
        return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in batch.items()}


class StreamEncoder:
    """--streaming: a chunk of records (with their ids) tokenised as
    ``tokenize_rows`` tokenises a batch of ``datasets.map``, as the samples of
    data/text_batches.py (picklable: it runs in the --num-workers processes)."""

    def __init__(self, tokenizer, columns: TextColumns, label_ids=None):
        self.tokenizer, self.columns, self.label_ids = tokenizer, columns, label_ids

    def __call__(self, chunk) -> list:
        c = self.columns
        names = [c.text] + [n for n in (c.text_pair, c.target) if n] + \
            ([c.label] if c.head == "sequence_classification" else [])
        first = chunk[0][0] if chunk else {}
        for name in names:
            if name not in first:
                raise UserError(f"a streamed record has no column {name!r}; its columns: {', '.join(first)} (choose "
                                f"with --text_column, --text_pair_column, --label_column, --target_column)")
        rows = {name: [record.get(name) for record, _ in chunk] for name in names}
        rows["id"] = [sample_id for _, sample_id in chunk]
        out = tokenize_rows(rows, tokenizer=self.tokenizer, columns=c, label_ids=self.label_ids)
        keys = list(out)
        return [{k: (np.asarray(out[k][i], dtype=np.int64) if isinstance(out[k][i], list) else out[k][i])
                 for k in keys} for i in range(len(out["id"]))]


def sample_tokens(sample) -> int:
    """A streamed sample's token count (its input ids)."""
    return len(sample["input_ids"])
