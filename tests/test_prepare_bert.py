"""python -m textbox_like.data.prepare_bert on a tiny corpus and vocabulary."""
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from textbox_like.data.bert_hdf5 import KEYS
from textbox_like.data.prepare_bert import main

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "cat", "dog", "sat", "on", "a", "mat", "big", "small", "red", "blue", "house", "tree",
         "runs", "jumps", "over", "under", "green", "field", "river", "stone", "bird", "sings", "all", "day"]
PIECES = ["play", "##ing", "##ed", "walk", "jump", "##er"]  # words split into word pieces
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(path):
    tokens = SPECIALS + [".", ","] + WORDS + PIECES
    path.write_text("\n".join(tokens) + "\n")
    return tokens


def write_corpus(path, n_docs=40, seed=0):
    rng = np.random.default_rng(seed)
    vocab_words = WORDS + ["playing", "walked", "jumper", "played", "walking"]
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.integers(2, 5)):  # paragraphs
            sentences = []
            for _ in range(rng.integers(2, 6)):
                words = rng.choice(vocab_words, rng.integers(4, 12))
                sentences.append(" ".join(words).capitalize() + ".")
            lines.append(" ".join(sentences))
        docs.append("\n".join(lines))
    path.write_text("\n\n".join(docs) + "\n")


@pytest.fixture()
def corpus(tmp_path):
    vocab = tmp_path / "vocab.txt"
    tokens = write_vocab(vocab)
    text = tmp_path / "corpus.txt"
    write_corpus(text)
    return tmp_path, vocab, text, tokens


def run(args):
    assert main([str(a) for a in args] + ["--no-progress-bar"]) == 0


def load(path):
    with h5py.File(path) as f:
        return {k: f[k][:] for k in f}


def test_shard_layout(corpus):
    tmp, vocab, text, tokens = corpus
    out = tmp / "out"
    run(["--input", text, "--vocab", vocab, "--output", out, "--max-seq-length", 32,
         "--max-predictions-per-seq", 6, "--valid-fraction", 0.1, "--shards", 2, "--num-proc", 1])
    names = sorted(p.name for p in out.glob("*.hdf5"))
    assert names == ["bert_seq32_test_0.hdf5", "bert_seq32_train_0.hdf5", "bert_seq32_train_1.hdf5"]
    expected = {"input_ids": ("int32", 32), "input_mask": ("int8", 32), "segment_ids": ("int8", 32),
                "masked_lm_positions": ("int32", 6), "masked_lm_ids": ("int32", 6),
                "next_sentence_labels": ("int8", None)}
    for name in names:
        with h5py.File(out / name) as f:
            assert set(f.keys()) == set(KEYS)
            n = f["input_ids"].shape[0]
            assert n > 0
            for key, (dtype, width) in expected.items():
                assert f[key].dtype == np.dtype(dtype), key
                assert f[key].shape == ((n, width) if width else (n,)), key
                assert f[key].compression == "gzip"
    d = load(out / "bert_seq32_train_0.hdf5")
    cls, sep = 2, 3
    # the text before masking (a random replacement may be any token, even [SEP])
    original = d["input_ids"].copy()
    for r in range(len(original)):
        ok = d["masked_lm_positions"][r] != 0
        original[r, d["masked_lm_positions"][r][ok]] = d["masked_lm_ids"][r][ok]
    assert np.all(original[:, 0] == cls)
    assert np.all((original == sep).sum(1) == 2)
    lengths = d["input_mask"].sum(1)
    assert np.all(d["input_mask"] == (np.arange(32)[None] < lengths[:, None]))
    # segment ids: 0 up to and including the first [SEP], then 1 up to the last
    for r in range(len(lengths)):
        first_sep = int(np.nonzero(original[r] == sep)[0][0])
        assert np.all(d["segment_ids"][r, :first_sep + 1] == 0)
        assert np.all(d["segment_ids"][r, first_sep + 1:lengths[r]] == 1)
        assert np.all(d["segment_ids"][r, lengths[r]:] == 0)
    # masked counts: min(max_pred, max(1, round(0.15 * length)))
    counts = (d["masked_lm_positions"] != 0).sum(1)
    assert np.array_equal(counts, np.minimum(6, np.maximum(1, np.round(lengths * 0.15).astype(int))))
    assert 0.3 < d["next_sentence_labels"].mean() < 0.75
    info = json.loads((out / "prepare_bert.json").read_text())
    assert info["vocab_size"] == len(tokens)
    assert (out / "vocab.txt").read_text() == vocab.read_text()


@pytest.mark.slow
def test_deterministic_for_a_seed(corpus):
    tmp, vocab, text, _ = corpus
    common = ["--input", text, "--vocab", vocab, "--max-seq-length", 32, "--dupe-factor", 2]
    run(common + ["--output", tmp / "a", "--seed", 7, "--num-proc", 1])
    run(common + ["--output", tmp / "b", "--seed", 7, "--num-proc", 2])
    run(common + ["--output", tmp / "c", "--seed", 8, "--num-proc", 1])
    for name in ("bert_seq32_train_0.hdf5", "bert_seq32_test_0.hdf5"):
        a, b = load(tmp / "a" / name), load(tmp / "b" / name)
        for key in KEYS:
            assert np.array_equal(a[key], b[key]), key
    a, c = load(tmp / "a" / "bert_seq32_train_0.hdf5"), load(tmp / "c" / "bert_seq32_train_0.hdf5")
    assert a["input_ids"].shape != c["input_ids"].shape or not np.array_equal(a["input_ids"], c["input_ids"])


@pytest.mark.slow
def test_masking_80_10_10(tmp_path):
    vocab = tmp_path / "vocab.txt"
    tokens = write_vocab(vocab)
    text = tmp_path / "corpus.txt"
    write_corpus(text, n_docs=150, seed=1)
    run(["--input", text, "--vocab", vocab, "--output", tmp_path / "out", "--max-seq-length", 64,
         "--max-predictions-per-seq", 10, "--dupe-factor", 4, "--valid-fraction", 0, "--num-proc", 2])
    d = load(tmp_path / "out" / "bert_seq64_train_0.hdf5")
    pos, ids = d["masked_lm_positions"], d["masked_lm_ids"]
    valid = pos != 0
    rows = np.nonzero(valid)[0]
    shown = d["input_ids"][rows, pos[valid]]
    original = ids[valid]
    n = len(original)
    assert n > 5000
    mask_frac = np.mean(shown == 4)
    kept_frac = np.mean(shown == original)
    random_frac = 1 - mask_frac - kept_frac
    # random replacements sometimes hit the original token (1 in len(vocab))
    assert abs(mask_frac - 0.8) < 0.02
    assert abs(kept_frac - (0.1 + 0.1 / len(tokens))) < 0.015
    assert abs(random_frac - 0.1) < 0.015
    # [CLS] and [SEP] are never masked; the labels are real tokens
    assert not np.isin(original, [0, 2, 3]).any()
    # nothing outside the masked positions was changed: each position holds a
    # vocabulary token, and unmasked positions never hold [MASK]
    unmasked = d["input_mask"].astype(bool).copy()
    unmasked[rows, pos[valid]] = False
    assert not (d["input_ids"][unmasked] == 4).any()


def original_token(d, r, p):
    pos = d["masked_lm_positions"][r].tolist()
    return d["masked_lm_ids"][r][pos.index(p)] if p in pos and p != 0 else d["input_ids"][r, p]


def test_whole_word_mask(corpus):
    tmp, vocab, text, tokens = corpus
    run(["--input", text, "--vocab", vocab, "--output", tmp / "out", "--max-seq-length", 32,
         "--whole-word-mask", "--dupe-factor", 3, "--num-proc", 1])
    d = load(tmp / "out" / "bert_seq32_train_0.hdf5")
    continuation = np.array([t.startswith("##") for t in tokens])
    checked = 0
    for r in range(len(d["input_ids"])):
        pos = d["masked_lm_positions"][r]
        pos = set(pos[pos != 0].tolist())
        labels = dict(zip(d["masked_lm_positions"][r].tolist(), d["masked_lm_ids"][r].tolist()))
        for p in pos:
            if continuation[labels[p]] and d["segment_ids"][r, p - 1] == d["segment_ids"][r, p] \
                    and p - 1 > 0:
                assert p - 1 in pos  # a word piece is masked with the piece before it
                checked += 1
            if p + 1 < 32 and continuation[original_token(d, r, p + 1)] and p + 1 not in pos:
                raise AssertionError(f"row {r}: {p} masked without its continuation {p + 1}")
    assert checked > 0


def test_train_vocab(corpus):
    tmp, _, text, _ = corpus
    out = tmp / "out"
    run(["--input", text, "--train-vocab", 120, "--output", out, "--max-seq-length", 32, "--num-proc", 1])
    size = len((out / "vocab.txt").read_text().split())
    assert 30 < size <= 120
    d = load(out / "bert_seq32_train_0.hdf5")
    assert d["input_ids"].max() < size


def test_input_directory_and_several_files(tmp_path):
    vocab = tmp_path / "vocab.txt"
    write_vocab(vocab)
    (tmp_path / "in").mkdir()
    write_corpus(tmp_path / "in" / "a.txt", n_docs=10, seed=2)
    write_corpus(tmp_path / "in" / "b.txt", n_docs=10, seed=3)
    run(["--input", tmp_path / "in", "--vocab", vocab, "--output", tmp_path / "out", "--num-proc", 1,
         "--valid-fraction", 0.1])
    info = json.loads((tmp_path / "out" / "prepare_bert.json").read_text())
    assert len(info["files"]) == 2
    assert info["documents"] == {"train": 18, "test": 2}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "textbox_like.data.prepare_bert", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def assert_one_line_error(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_errors(tmp_path):
    vocab = tmp_path / "vocab.txt"
    write_vocab(vocab)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    assert_one_line_error(cli("--input", empty, "--vocab", vocab, "--output", tmp_path / "o"), "holds no text")
    assert_one_line_error(cli("--input", tmp_path / "missing.txt", "--vocab", vocab, "--output", tmp_path / "o"),
                          "does not exist")
    text = tmp_path / "c.txt"
    write_corpus(text, n_docs=3)
    assert_one_line_error(cli("--input", text, "--vocab", tmp_path / "nope.txt", "--output", tmp_path / "o"),
                          "does not exist")
    assert_one_line_error(cli("--input", text, "--output", tmp_path / "o"), "--vocab")
    assert_one_line_error(cli("--input", text, "--vocab", vocab, "--output", tmp_path / "o",
                              "--max-seq-length", "abc"), "max-seq-length")
    assert_one_line_error(cli("--input", text, "--vocab", vocab, "--output", tmp_path / "o", "--bogus"),
                          "unknown option --bogus")
    bad_vocab = tmp_path / "bad_vocab.txt"
    bad_vocab.write_text("a\nb\n")
    assert_one_line_error(cli("--input", text, "--vocab", bad_vocab, "--output", tmp_path / "o"), "lacks")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert_one_line_error(cli("--input", text, "--vocab", vocab, "--output", not_a_dir), "cannot write")


# ---------------------------------------------------------------- NSP labels and the test split
def write_marked_corpus(path, n_docs, sentences=12):
    """Document d uses only the words WORDS[2d] and WORDS[2d+1], so a
    token tells which document it came from."""
    docs = []
    for d in range(n_docs):
        a, b = WORDS[2 * d], WORDS[2 * d + 1]
        docs.append(" ".join(f"{a.capitalize()} {b} {a} {b}." for _ in range(sentences)))
    path.write_text("\n\n".join(docs) + "\n")


def segment_documents(d, tokens):
    """Per instance: (documents of A's words, documents of B's words, label)."""
    word_doc = {tokens.index(w): i // 2 for i, w in enumerate(WORDS[:12])}
    out = []
    for r in range(len(d["input_ids"])):
        length = int(d["input_mask"][r].sum())
        ids = [int(original_token(d, r, p)) for p in range(length)]
        seg = d["segment_ids"][r, :length]
        docs_a = {word_doc[t] for t, s in zip(ids, seg) if s == 0 and t in word_doc}
        docs_b = {word_doc[t] for t, s in zip(ids, seg) if s == 1 and t in word_doc}
        out.append((docs_a, docs_b, int(d["next_sentence_labels"][r])))
    return out


def test_random_next_never_from_its_own_document(tmp_path):
    """Label 1 (NVIDIA's is_random_next) exactly when B comes from another
    document, and 0 when B continues A (the rare case of ten draws all
    hitting A's own document is the next test's)."""
    vocab = tmp_path / "vocab.txt"
    tokens = write_vocab(vocab)
    write_marked_corpus(tmp_path / "corpus.txt", n_docs=3)
    run(["--input", tmp_path / "corpus.txt", "--vocab", vocab, "--output", tmp_path / "out",
         "--max-seq-length", 24, "--dupe-factor", 20, "--valid-fraction", 0, "--num-proc", 1])
    rows = segment_documents(load(tmp_path / "out" / "bert_seq24_train_0.hdf5"), tokens)
    assert {label for _, _, label in rows} == {0, 1}
    for docs_a, docs_b, label in rows:
        assert len(docs_a) == 1 and len(docs_b) == 1
        assert label == int(docs_a != docs_b), (docs_a, docs_b, label)


def test_random_other_document_after_ten_failed_draws():
    """NVIDIA keeps the 10th draw even when it is A's own document (and
    still labels B random); ours then draws among the other documents."""
    import random

    from textbox_like.data.prepare_bert import random_other_document

    class Stubborn(random.Random):
        def randint(self, a, b):
            self.calls = getattr(self, "calls", 0) + 1
            return 1 if self.calls <= 10 else b  # ten draws of document 1, then the last choice

    assert random_other_document(2, 1, Stubborn()) == 0
    assert random_other_document(5, 1, Stubborn()) == 4
    rng = random.Random(0)
    assert all(random_other_document(2, 0, rng) == 1 for _ in range(2000))


@pytest.mark.slow
def test_one_document_corpus_has_no_random_next(tmp_path):
    vocab = tmp_path / "vocab.txt"
    tokens = write_vocab(vocab)
    write_marked_corpus(tmp_path / "corpus.txt", n_docs=1, sentences=40)
    result = cli("--input", tmp_path / "corpus.txt", "--vocab", vocab, "--output", tmp_path / "out",
                 "--max-seq-length", 24, "--dupe-factor", 5, "--num-proc", 1, "--no-progress-bar")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 document" in warnings[0]
    rows = segment_documents(load(tmp_path / "out" / "bert_seq24_train_0.hdf5"), tokens)
    assert len(rows) > 20 and all(label == 0 for _, _, label in rows)
    assert not (tmp_path / "out" / "bert_seq24_test_0.hdf5").exists()


@pytest.mark.slow
def test_test_split_takes_at_least_two_documents(tmp_path):
    from textbox_like.data.prepare_bert import split_documents

    for n_docs in (4, 10, 40, 74, 75, 200):
        train, test = split_documents(n_docs, 0.02, seed=1)
        assert len(test) == max(2, round(n_docs * 0.02)) and len(train) == n_docs - len(test)
        assert not set(train) & set(test)
    assert len(split_documents(5, 0.9, seed=1)[0]) == 2  # the training split keeps 2 as well
    assert split_documents(10, 0, seed=1) == (list(range(10)), [])
    # the default --valid-fraction on a 40-document corpus: 2 whole test documents, no warning
    vocab = tmp_path / "vocab.txt"
    write_vocab(vocab)
    write_corpus(tmp_path / "corpus.txt", n_docs=40)
    result = cli("--input", tmp_path / "corpus.txt", "--vocab", vocab, "--output", tmp_path / "out",
                 "--max-seq-length", 32, "--num-proc", 1, "--no-progress-bar")
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    info = json.loads((tmp_path / "out" / "prepare_bert.json").read_text())
    assert info["documents"] == {"train": 38, "test": 2}
    d = load(tmp_path / "out" / "bert_seq32_test_0.hdf5")
    assert set(d["next_sentence_labels"].tolist()) == {0, 1}


@pytest.mark.slow
def test_three_document_corpus_warns_in_one_line(tmp_path):
    vocab = tmp_path / "vocab.txt"
    write_vocab(vocab)
    write_corpus(tmp_path / "corpus.txt", n_docs=3)
    result = cli("--input", tmp_path / "corpus.txt", "--vocab", vocab, "--output", tmp_path / "out",
                 "--max-seq-length", 32, "--num-proc", 1, "--no-progress-bar")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "only 3 documents" in warnings[0] and "--valid-fraction 0" in warnings[0]
    info = json.loads((tmp_path / "out" / "prepare_bert.json").read_text())
    assert info["documents"] == {"train": 2, "test": 1}
    d = load(tmp_path / "out" / "bert_seq32_test_0.hdf5")
    assert set(d["next_sentence_labels"].tolist()) == {0}
