"""python -m textbox_like.tools.prepare_bert on a tiny corpus and vocabulary."""
import json

import h5py
import numpy as np
import pytest

from textbox_like.data.bert_hdf5 import KEYS
from textbox_like.tools.prepare_bert import main


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

    from textbox_like.tools.prepare_bert import random_other_document

    class Stubborn(random.Random):
        def randint(self, a, b):
            self.calls = getattr(self, "calls", 0) + 1
            return 1 if self.calls <= 10 else b  # ten draws of document 1, then the last choice

    assert random_other_document(2, 1, Stubborn()) == 0
    assert random_other_document(5, 1, Stubborn()) == 4
    rng = random.Random(0)
    assert all(random_other_document(2, 0, rng) == 1 for _ in range(2000))
