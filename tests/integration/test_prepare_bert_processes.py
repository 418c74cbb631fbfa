"""The tests of test_prepare_bert.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from textbox_like.data.bert_hdf5 import KEYS

from test_prepare_bert import (  # noqa: F401 (fixtures)
    corpus, load, run, segment_documents, write_corpus, write_marked_corpus, write_vocab)


ROOT = Path(__file__).resolve().parents[2]


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


def cli(*args):
    return subprocess.run([sys.executable, "-m", "textbox_like.tools.prepare_bert", *map(str, args)],
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
    from textbox_like.tools.prepare_bert import split_documents

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
