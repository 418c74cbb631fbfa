"""Text corpus -> BERT pre-training shards (NVIDIA's HDF5 layout).

    python -m textbox_like.tools.prepare_bert --input FILES_OR_DIR --vocab vocab.txt --output DIR

Documents are separated by blank lines; each line is split into sentences
(unless ``--no-split-sentences``, for corpora already one sentence a line).
Sentences are WordPiece-tokenized with a fast tokenizer, in parallel through
``datasets.map(num_proc=...)``. Instances are built with Google's
create_pretraining_data algorithm: sentence pairs filling ``max_seq_length``
(a shorter target with ``--short-seq-prob``), B a random sentence of another
document half of the time (label 1, as NVIDIA's; never from A's own
document, so a one-document corpus has no random B), ``--masked-lm-prob`` of
the tokens (at most ``--max-predictions-per-seq``) masked 80% [MASK] / 10%
random / 10% kept, optionally by whole words; ``--dupe-factor`` passes with
different masks.

The documents are split before building instances: ``--valid-fraction`` of
them (at least two, from a 4-document corpus on) make the validation shard,
built once (dupe factor 1), so no sentence of it is trained on. Output files::

    DIR/<prefix>_train_<i>.hdf5   (--shards of them)
    DIR/<prefix>_test_<i>.hdf5    (HetSeq's documented --valid-subset is "test")
    DIR/vocab.txt                 (the vocabulary used, for --dict)
    DIR/prepare_bert.json         (settings and counts)

Everything random derives from ``--seed`` and a document's index, so the
output is the same for a seed whatever ``--num-proc`` is.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np

from textbox_like.core.errors import UserError
from textbox_like.storage.fileio import atomic_copy, atomic_write_text

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


# ---------------------------------------------------------------- options
def build_parser():
    from textbox_like.resolve.options import Options
    from textbox_like.config.value_types import positive_int

    def probability(text):
        value = float(text)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"must be within [0, 1], got {text}")
        return value

    options = Options("python -m textbox_like.tools.prepare_bert",
                      "Build BERT pre-training HDF5 shards from a text corpus "
                      "(documents separated by blank lines).")
    options.group("prepare")
    add = options.add
    add("--input", nargs="+", required=True, help="corpus files or directories (all files inside, sorted)")
    add("--vocab", default=None, help="WordPiece vocab.txt")
    add("--train-vocab", type=positive_int, default=None, metavar="SIZE",
        help="train a WordPiece vocabulary of SIZE tokens on the corpus instead of --vocab")
    add("--output", required=True, help="output directory")
    add("--prefix", default=None, help="shard name prefix (default bert_seq<max-seq-length>)")
    add("--max-seq-length", type=positive_int, default=128)
    add("--max-predictions-per-seq", type=positive_int, default=20)
    add("--masked-lm-prob", type=probability, default=0.15)
    add("--short-seq-prob", type=probability, default=0.1)
    add("--dupe-factor", type=positive_int, default=5, help="passes over the training documents")
    add("--do-lower-case", action=argparse.BooleanOptionalAction, default=True,
        help="lower-case and strip accents (uncased vocabularies)")
    add("--whole-word-mask", action="store_true", help="mask whole words, not single word pieces")
    add("--split-sentences", action=argparse.BooleanOptionalAction, default=True,
        help="split lines into sentences (turn off for one-sentence-a-line corpora)")
    add("--shards", type=positive_int, default=1, help="number of training shards")
    add("--valid-fraction", type=probability, default=0.02,
        help="fraction of documents for the validation shard (0: none)")
    add("--seed", type=int, default=12345)
    add("--num-proc", type=positive_int, default=max(1, min(4, os.cpu_count() or 1)),
        help="processes for tokenization and instance creation")
    add("--no-progress-bar", action="store_true", help="no progress bars")
    return options.parser


# ---------------------------------------------------------------- corpus
def list_inputs(inputs):
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"--input {item!r} does not exist; check the path")
    if not files:
        raise UserError(f"--input {' '.join(map(str, inputs))} holds no file")
    return files


def read_documents(files, split_sentences=True):
    """Documents (lists of sentence strings) of all files, in order."""
    documents, current = [], []
    for path in files:
        try:
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    line = line.strip()
                    if not line:
                        if current:
                            documents.append(current)
                            current = []
                        continue
                    if split_sentences:
                        current.extend(s for s in _SENTENCE_END.split(line) if s.strip())
                    else:
                        current.append(line)
        except UnicodeDecodeError as exc:
            raise UserError(f"corpus file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if current:
            documents.append(current)
            current = []
    if not documents:
        raise UserError(f"the corpus ({', '.join(str(f) for f in files[:3])}{', ...' if len(files) > 3 else ''}) "
                        f"holds no text; give a text file with documents separated by blank lines")
    return documents


def load_vocab(path):
    from textbox_like.models import read_vocab
    tokens = [t.strip() for t in read_vocab(path, "--vocab")]
    missing = [s for s in SPECIALS[1:] if s not in tokens]
    if missing:
        raise UserError(f"vocabulary {str(path)!r} lacks {', '.join(missing)}; give a BERT WordPiece vocab.txt")
    return tokens


def train_vocab(files, size, lower, output):
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=lower, strip_accents=lower if lower else None)
    tokenizer.train([str(f) for f in files], vocab_size=size, min_frequency=2,
                    special_tokens=list(SPECIALS), limit_alphabet=1000, wordpieces_prefix="##",
                    show_progress=False)
    output.mkdir(parents=True, exist_ok=True)
    saved = tokenizer.save_model(str(output))
    return Path(saved[0])


def tokenize(documents, vocab_file, lower, num_proc, progress):
    """Token ids of every sentence, grouped back into documents (empty
    sentences and documents dropped)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    from tokenizers import BertWordPieceTokenizer

    if not progress:
        datasets.disable_progress_bars()
    tokenizer = BertWordPieceTokenizer(str(vocab_file), lowercase=lower)
    sentences = [s for doc in documents for s in doc]
    doc_of = np.repeat(np.arange(len(documents)), [len(d) for d in documents])
    dataset = datasets.Dataset.from_dict({"text": sentences})

    def encode(batch):
        return {"ids": [e.ids for e in tokenizer.encode_batch(batch["text"], add_special_tokens=False)]}

    num_proc = min(num_proc, max(1, len(sentences) // 1000))
    encoded = dataset.map(encode, batched=True, batch_size=1000, remove_columns=["text"],
                          num_proc=num_proc if num_proc > 1 else None, desc="tokenizing")
    ids = encoded["ids"]
    if not isinstance(ids, list):  # datasets >= 4 returns a lazy column
        ids = list(ids)
    out = [[] for _ in documents]
    for d, sent in zip(doc_of.tolist(), ids):
        if sent:
            out[d].append(sent)
    return [d for d in out if d]


# ---------------------------------------------------------------- instances (Google's algorithm)
_STATE = {}


def _init_worker(documents, params):
    _STATE["documents"] = documents
    _STATE["params"] = params


def _truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def _mask(tokens, rng, p):
    """Google's create_masked_lm_predictions on ids: (tokens, positions, labels)."""
    cls_id, sep_id, mask_id = p["cls"], p["sep"], p["mask"]
    continuation = p["continuation"]
    cand = []
    after_special = True
    for i, tok in enumerate(tokens):
        if tok == cls_id or tok == sep_id:
            after_special = True
            continue
        # unlike Google's code, a word piece right after [SEP] (its word cut
        # off by truncation) does not join the word before the [SEP]
        if p["whole_word"] and not after_special and continuation[tok]:
            cand[-1].append(i)
        else:
            cand.append([i])
        after_special = False
    rng.shuffle(cand)
    output = list(tokens)
    num_to_predict = min(p["max_pred"], max(1, int(round(len(tokens) * p["masked_lm_prob"]))))
    masked = []
    covered = set()
    vocab_size = p["vocab_size"]
    for index_set in cand:
        if len(masked) >= num_to_predict:
            break
        if len(masked) + len(index_set) > num_to_predict:
            continue
        if any(i in covered for i in index_set):
            continue
        for index in index_set:
            covered.add(index)
            if rng.random() < 0.8:
                new = mask_id
            elif rng.random() < 0.5:
                new = tokens[index]
            else:
                new = rng.randint(0, vocab_size - 1)
            output[index] = new
            masked.append((index, tokens[index]))
    masked.sort()
    return output, [m[0] for m in masked], [m[1] for m in masked]


def random_other_document(n_documents, doc_index, rng):
    """The index of a document other than ``doc_index`` (``n_documents`` >= 2).

    NVIDIA's create_pretraining_data draws up to 10 times and, should every
    draw hit the same document, keeps it while still labelling B random (the
    label then lies). The same 10 draws here, so a seed gives NVIDIA's
    choice; after them one draw among the other documents, so B never comes
    from A's own document."""
    for _ in range(10):
        index = rng.randint(0, n_documents - 1)
        if index != doc_index:
            return index
    index = rng.randint(0, n_documents - 2)
    return index + 1 if index >= doc_index else index


def _instances_from_document(documents, doc_index, rng, p):
    document = documents[doc_index]
    max_num_tokens = p["max_seq_length"] - 3
    target_seq_length = max_num_tokens
    if rng.random() < p["short_seq_prob"]:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances = []
    chunk, chunk_len, i = [], 0, 0
    while i < len(document):
        segment = document[i]
        chunk.append(segment)
        chunk_len += len(segment)
        if i == len(document) - 1 or chunk_len >= target_seq_length:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                tokens_a = [t for j in range(a_end) for t in chunk[j]]
                tokens_b = []
                target_b_length = target_seq_length - len(tokens_a)
                if len(documents) == 1 and len(chunk) == 1:
                    # no other document to draw a random B from: B is what
                    # truly follows A (labelled is-next), its segments left
                    # for the next chunk
                    is_random_next = 0
                    for j in range(i + 1, len(document)):
                        tokens_b.extend(document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                elif len(documents) > 1 and (len(chunk) == 1 or rng.random() < 0.5):
                    is_random_next = 1
                    random_index = random_other_document(len(documents), doc_index, rng)
                    random_document = documents[random_index]
                    start = rng.randint(0, len(random_document) - 1)
                    for j in range(start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    i -= len(chunk) - a_end  # put the unused segments back
                else:
                    is_random_next = 0
                    tokens_b = [t for j in range(a_end, len(chunk)) for t in chunk[j]]
                _truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if tokens_a and tokens_b:
                    tokens = [p["cls"]] + tokens_a + [p["sep"]] + tokens_b + [p["sep"]]
                    n_a = len(tokens_a) + 2
                    tokens, positions, labels = _mask(tokens, rng, p)
                    instances.append((tokens, n_a, positions, labels, is_random_next))
            chunk, chunk_len = [], 0
        i += 1
    return instances


def _pack(instances, p):
    n, length, preds = len(instances), p["max_seq_length"], p["max_pred"]
    arrays = {
        "input_ids": np.zeros((n, length), np.int32),
        "input_mask": np.zeros((n, length), np.int8),
        "segment_ids": np.zeros((n, length), np.int8),
        "masked_lm_positions": np.zeros((n, preds), np.int32),
        "masked_lm_ids": np.zeros((n, preds), np.int32),
        "next_sentence_labels": np.zeros((n,), np.int8),
    }
    for r, (tokens, n_a, positions, labels, is_random) in enumerate(instances):
        k = len(tokens)
        arrays["input_ids"][r, :k] = tokens
        arrays["input_mask"][r, :k] = 1
        arrays["segment_ids"][r, n_a:k] = 1
        arrays["masked_lm_positions"][r, :len(positions)] = positions
        arrays["masked_lm_ids"][r, :len(labels)] = labels
        arrays["next_sentence_labels"][r] = is_random
    return arrays


def _work(job):
    split, dupe, lo, hi = job
    documents, p = _STATE["documents"][split], _STATE["params"]
    instances = []
    for d in range(lo, hi):
        rng = random.Random(f"{p['seed']}:{split}:{dupe}:{d}")
        instances.extend(_instances_from_document(documents, d, rng, p))
    return _pack(instances, p)


def create_instances(splits, params, dupes, num_proc, progress):
    """{split: arrays}, built in parallel over document ranges; the result
    does not depend on ``num_proc``."""
    from tqdm.auto import tqdm

    jobs = []
    for split, documents in splits.items():
        step = max(1, min(256, len(documents) // (4 * num_proc) or 1))
        for dupe in range(dupes[split]):
            for lo in range(0, len(documents), step):
                jobs.append((split, dupe, lo, min(lo + step, len(documents))))
    bar = tqdm(total=len(jobs), desc="creating instances", unit="job", disable=not progress)
    results = []
    if num_proc > 1 and len(jobs) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with cf.ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker,
                                    initargs=(splits, params)) as pool:
            for arrays in pool.map(_work, jobs, chunksize=1):
                results.append(arrays)
                bar.update()
    else:
        _init_worker(splits, params)
        for job in jobs:
            results.append(_work(job))
            bar.update()
    bar.close()
    out = {}
    for split in splits:
        parts = [r for job, r in zip(jobs, results) if job[0] == split]
        out[split] = {k: np.concatenate([r[k] for r in parts]) for k in parts[0]} if parts else None
    return out


# ---------------------------------------------------------------- main
def split_documents(n_docs, valid_fraction, seed):
    """(train, test) document indices: ``valid_fraction`` of the documents,
    whole, for the test split.

    A split's random next sentences come from its other documents, so a
    one-document split has none and its NSP figures mean nothing: from 4
    documents on, each split keeps at least 2 (a 40-document corpus at the
    default 0.02 gets 2 test documents, not round(0.8) = 1). A smaller corpus
    gets one test document (callers warn)."""
    if valid_fraction <= 0 or n_docs < 2:
        return list(range(n_docs)), []
    k = max(1, int(round(n_docs * valid_fraction)))
    k = min(n_docs - 2, max(2, k)) if n_docs >= 4 else 1
    chosen = set(np.random.default_rng([seed, 1]).permutation(n_docs)[:k].tolist())
    return [d for d in range(n_docs) if d not in chosen], sorted(chosen)


def few_documents_warning(n_docs, n_test):
    """One line when the corpus is too small for meaningful NSP labels, else None."""
    if n_docs == 1:
        return ("warning: the corpus holds 1 document (documents are separated by blank lines): no test split, "
                "and no next sentence can come from another document, so every NSP label is 0 (is-next); "
                "give at least 4 documents")
    if n_test == 1:
        return (f"warning: the corpus holds only {n_docs} documents (separated by blank lines), so the test split "
                f"has 1, whose next sentences cannot be random: its NSP figures mean nothing; give at least "
                f"4 documents or --valid-fraction 0")
    return None


def _check(args):
    if args.vocab and args.train_vocab:
        raise UserError("give either --vocab or --train-vocab, not both")
    if not args.vocab and not args.train_vocab:
        raise UserError("give --vocab vocab.txt (a WordPiece vocabulary) or --train-vocab SIZE")
    if args.max_seq_length < 5:
        raise UserError(f"--max-seq-length must be at least 5 ([CLS] A [SEP] B [SEP]), got {args.max_seq_length}")
    if args.max_seq_length > 32767:
        raise UserError(f"--max-seq-length {args.max_seq_length} is too large")
    if args.masked_lm_prob <= 0:
        raise UserError("--masked-lm-prob must be positive")
    if args.valid_fraction >= 1:
        raise UserError("--valid-fraction must be below 1")
    prefix = args.prefix or f"bert_seq{args.max_seq_length}"
    for word in ("train", "test", "valid"):
        if word in prefix:
            raise UserError(f"--prefix {prefix!r} contains {word!r}, which would mix up the splits; choose another")
    if "/" in prefix or not prefix:
        raise UserError(f"--prefix {prefix!r} must be a plain file name part")
    return prefix


def prepare(args):
    t0 = time.time()
    progress = not args.no_progress_bar
    prefix = _check(args)
    files = list_inputs(args.input)
    output = Path(args.output)
    documents = read_documents(files, args.split_sentences)
    make_writable_output(output)
    if args.train_vocab:
        vocab_file = train_vocab(files, args.train_vocab, args.do_lower_case, output)
    else:
        vocab_file = Path(args.vocab)
    vocab = load_vocab(vocab_file)
    target_vocab = output / "vocab.txt"
    if not target_vocab.exists() or not target_vocab.samefile(vocab_file):
        atomic_copy(vocab_file, target_vocab)

    token_docs = tokenize(documents, vocab_file, args.do_lower_case, args.num_proc, progress)
    if not token_docs:
        raise UserError("the corpus holds no token the vocabulary knows; check --input and --vocab")
    unk = vocab.index("[UNK]")
    total = sum(len(s) for d in token_docs for s in d)
    unknown = sum(t == unk for d in token_docs for s in d for t in s)
    if unknown > 0.2 * total:
        print(f"warning: {unknown / total:.0%} of the tokens are [UNK]; is --vocab the right vocabulary "
              f"(and --do-lower-case right for it)?", file=sys.stderr)
    train_idx, valid_idx = split_documents(len(token_docs), args.valid_fraction, args.seed)
    warning = few_documents_warning(len(token_docs), len(valid_idx))
    if warning:
        print(warning, file=sys.stderr)
    splits = {"train": [token_docs[d] for d in train_idx]}
    if valid_idx:
        splits["test"] = [token_docs[d] for d in valid_idx]
    index = {t: i for i, t in enumerate(vocab)}
    params = {
        "max_seq_length": args.max_seq_length, "max_pred": args.max_predictions_per_seq,
        "masked_lm_prob": args.masked_lm_prob, "short_seq_prob": args.short_seq_prob,
        "whole_word": args.whole_word_mask, "seed": args.seed, "vocab_size": len(vocab),
        "cls": index["[CLS]"], "sep": index["[SEP]"], "mask": index["[MASK]"],
        "continuation": [t.startswith("##") for t in vocab],
    }
    dupes = {"train": args.dupe_factor, "test": 1}
    arrays = create_instances(splits, params, dupes, args.num_proc, progress)
    if arrays["train"] is None or len(arrays["train"]["input_ids"]) == 0:
        raise UserError("no training instance could be built from the corpus; give more text")
    plan, written = write_shards(arrays, output, prefix, args.seed, args.shards, progress)
    info = {
        "files": [str(f) for f in files], "vocab": str(vocab_file), "vocab_size": len(vocab),
        "documents": {"train": len(train_idx), "test": len(valid_idx)},
        "instances": written, "shards": [p.name for p, _ in plan],
        "settings": {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()},
        "seconds": round(time.time() - t0, 2),
    }
    atomic_write_text(output / "prepare_bert.json", json.dumps(info, indent=1) + "\n")
    return info


def make_writable_output(output: Path) -> None:
    """--output made, and proven writable before minutes of tokenizing."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".prepare_bert.probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to --output {str(output)!r} ({exc.strerror or exc})") from None


def write_shards(arrays: dict, output: Path, prefix: str, seed: int, shards: int, progress: bool) -> tuple:
    """Each split's instances shuffled and cut into HDF5 shards (``shards``
    for train, one for test) in ``output``, replacing a previous run's
    shards of ``prefix``: (the plan of (path, arrays), instances per split)."""
    from tqdm.auto import tqdm

    from textbox_like.data.bert_hdf5 import write_shard

    pattern = re.compile(rf"^{re.escape(prefix)}_(train|test)_\d+\.hdf5$")
    for stale in output.iterdir():
        if pattern.match(stale.name):
            stale.unlink()
    written = {}
    plan = []
    for split, data in arrays.items():
        if data is None or len(data["input_ids"]) == 0:
            continue
        order = np.random.default_rng([seed, 2, 0 if split == "train" else 1]).permutation(len(data["input_ids"]))
        data = {k: v[order] for k, v in data.items()}
        n_shards = min(shards if split == "train" else 1, len(order))
        bounds = np.linspace(0, len(order), n_shards + 1).astype(int)
        for i in range(n_shards):
            plan.append((output / f"{prefix}_{split}_{i}.hdf5",
                         {k: v[bounds[i]:bounds[i + 1]] for k, v in data.items()}))
        written[split] = len(order)
    for path, part in tqdm(plan, desc="writing shards", unit="shard", disable=not progress):
        write_shard(path, part)
    return plan, written


def main(argv=None):
    from textbox_like.resolve.options import run_tool
    return run_tool(build_parser(), argv, prepare_and_report)


def prepare_and_report(args):
    info = prepare(args)
    counts = ", ".join(f"{k} {v}" for k, v in info["instances"].items())
    print(f"prepared {counts} instances in {len(info['shards'])} shards under {args.output} "
          f"({info['seconds']} s)")


if __name__ == "__main__":
    sys.exit(main())
