"""The generic Hugging Face task (--task hf): tiny models built from configs
and a tokenizer trained here, data files written here; nothing downloaded.

For each head: it trains (the loss falls), validates, and its export loads
with from_pretrained to the same eval loss. The language-model and
classification denominators make two ranks with unlike batches equal one
process of the same global batch; kill -9 and resume is bitwise; the
tokenised data is cached (--cache-dir, by default the datasets cache) and reused; a dataset name in the
local datasets cache trains offline."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import read_jsonl, run_main


PY = sys.executable

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

WORDS = ["the", "a", "cat", "dog", "bird", "sees", "likes", "eats", "big", "small", "red", "blue", "fish", "tree",
         "runs", "and", "good", "bad", "very", "quite"]


# ---------------------------------------------------------------- data and models written here
def sentence(rng, label):
    """Words of one half of the vocabulary by label: a class any model tells apart."""
    half = (len(WORDS) - 2) // 2
    words = WORDS[:half] if label else WORDS[half:-2]
    return [words[int(i)] for i in rng.integers(0, half, size=int(rng.integers(3, 12)))]


def write_text_data(directory: Path, n_train=48, n_valid=16, seed=0):
    """train.jsonl / valid.jsonl for every head: text, a label (which half of
    the words it uses, and 'good' or 'bad'), and a target (its words reversed)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid)):
        rows = []
        for i in range(n):
            label = i % 2
            words = sentence(rng, label)
            words.insert(int(rng.integers(0, len(words))), "good" if label else "bad")
            text = " ".join(words)
            rows.append({"text": text, "label": label, "target": " ".join(reversed(words))})
        with open(directory / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


def write_long_text_data(directory: Path, n_train=200_000):
    """train.jsonl of ``n_train`` short rows (long enough to be killed while it is tokenised) and a valid.jsonl
    of 4: the data of the tests that stop a run during tokenisation."""
    directory.mkdir(parents=True)
    words = ["the cat sees a dog", "a big red fish", "the small bird runs", "a very good tree"]
    with open(directory / "train.jsonl", "w") as out:
        for i in range(n_train):
            out.write(json.dumps({"text": words[i % 4] + f" {i}", "label": i % 2}) + "\n")
    (directory / "valid.jsonl").write_text("".join(json.dumps({"text": w, "label": i % 2}) + "\n"
                                                   for i, w in enumerate(words)))
    return directory


def build_tokenizer(directory: Path):
    """A WordPiece tokenizer over WORDS, BERT's special tokens and template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    from tokenizers import decoders
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", bos_token="[CLS]", eos_token="[SEP]")
    fast.save_pretrained(str(directory))
    return fast


def tiny_config(head):
    from transformers import BartConfig, BertConfig, GPT2Config
    vocab = len(SPECIAL) + len(WORDS)
    if head in ("sequence_classification", "masked_lm"):
        arch = "BertForSequenceClassification" if head == "sequence_classification" else "BertForMaskedLM"
        return BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=0, architectures=[arch])
    if head == "causal_lm":
        return GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                          architectures=["GPT2LMHeadModel"])
    return BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=2,
                      eos_token_id=3, decoder_start_token_id=3, forced_eos_token_id=3,
                      architectures=["BartForConditionalGeneration"])


def write_model(directory: Path, head, weights=True):
    """A save_pretrained directory (weights=False: config.json and tokenizer only)."""
    import transformers
    from textbox_like.tasks.hf import AUTO_CLASSES

    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(head)
    if weights:
        torch.manual_seed(0)
        getattr(transformers, AUTO_CLASSES[head]).from_config(config).save_pretrained(str(directory))
    else:
        config.save_pretrained(str(directory))
    build_tokenizer(directory)
    return directory


def hf_args(model, data, save_dir, *extra, max_update=12):
    return ["--task", "hf", "--model_name_or_path", str(model), "--data", str(data), "--max-sentences", "8",
            "--optimizer", "adam", "--lr", "0.01", "--log-format", "none", "--max-update", str(max_update),
            "--save-dir", str(save_dir), "--seed", "3", *[str(a) for a in extra]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A save_pretrained directory per head; masked_lm from a config.json only (from_config)."""
    root = tmp_path_factory.mktemp("hf_models")
    return {head: write_model(root / head, head, weights=head != "masked_lm")
            for head in ("sequence_classification", "causal_lm", "masked_lm", "seq2seq")}


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    return write_text_data(tmp_path_factory.mktemp("hf_text"))


def records(save_dir, kind):
    return [r for r in read_jsonl(Path(save_dir) / "metrics.jsonl") if r["kind"] == kind]


# ---------------------------------------------------------------- one process over any split
def exactness_args(model, data, save_dir, *extra):
    # a global budget of real tokens: the ranks' shares then hold unlike numbers of samples and tokens.
    # SGD: Adam scales rounding noise up to lr-sized steps where the true gradient is zero (GPT-2's key
    # biases: softmax ignores them), which no summation order can match
    return [PY, "run_hetseq.py", *hf_args(model, data, save_dir, "--optimizer", "sgd", "--lr", "0.5",
                                          "--global-batch-size", "120", "--max-tokens", "50",
                                          "--max-update", "6", "--disable-validation", "--threads", "1", "--log-format",
                                          "simple", *extra)]


# ---------------------------------------------------------------- data: cache, files, columns
def build(*args):
    from textbox_like.resolve.resolution import parse
    from textbox_like.tasks import TASKS
    return TASKS.get("hf")(parse(["--task", "hf", *[str(a) for a in args]]))


def test_csv_files_named_per_split_and_string_labels(models, tmp_path, capsys):
    """kanachan's --training-data FILE / --validation-data FILE, other column
    names, class names as labels; one file alone is training data only."""
    import csv
    rows = [json.loads(line) for line in (write_text_data(tmp_path / "src") / "train.jsonl").read_text().splitlines()]
    for name, part in (("mine.csv", rows[:40]), ("held_out.csv", rows[40:])):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "category"])
            writer.writerows([r["text"], "positive" if r["label"] else "negative"] for r in part)
    common = ["--task", "hf", "--model_name_or_path", models["sequence_classification"], "--text_column", "sentence",
              "--label_column", "category", "--max-sentences", "8", "--max-update", "2", "--log-format", "none"]
    out = tmp_path / "run"
    assert run_main(common + ["--training-data", tmp_path / "mine.csv", "--validation-data", tmp_path / "held_out.csv",
                              "--save-dir", out]) == 0
    valid = records(out, "valid")[-1]
    assert {"accuracy", "f1"} <= set(valid)
    task = build("--model_name_or_path", models["sequence_classification"], "--data", tmp_path / "mine.csv",
                 "--text_column", "sentence", "--label_column", "category")
    assert task.model_config().id2label == {0: "negative", 1: "positive"}
    capsys.readouterr()
    assert run_main(common + ["--data", tmp_path / "mine.csv", "--save-dir", tmp_path / "alone"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is one file, the training data" in err[-1] and "--disable-validation" in err[-1], err
    assert run_main(common + ["--data", tmp_path / "mine.csv", "--save-dir", tmp_path / "alone",
                              "--disable-validation"]) == 0
    assert run_main(common + ["--data", tmp_path / "mine.csv", "--save-dir", tmp_path / "typo", "--disable-validation",
                              "--text_column", "sentense"]) == 2
    assert "has no column 'sentense' (--text_column); its columns: sentence, category" in capsys.readouterr().err


def test_a_saved_dataset_directory_trains(models, tmp_path):
    import datasets
    rows = [json.loads(line) for line in (write_text_data(tmp_path / "src") / "train.jsonl").read_text().splitlines()]
    data = datasets.Dataset.from_list([{"text": r["text"]} for r in rows])
    datasets.DatasetDict({"train": data, "validation": data.select(range(8))}).save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "run"
    assert run_main(["--task", "hf", "--model_name_or_path", models["causal_lm"], "--data", tmp_path / "saved",
                     "--max-sentences", "8", "--max-update", "2", "--log-format", "none", "--save-dir", out]) == 0
    assert records(out, "valid")[-1]["ppl"] > 1


def test_head_and_metric_mistakes_are_one_line(models, text_data, tmp_path, capsys):
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((models["causal_lm"] / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2Model"]}))
    base = ["--task", "hf", "--data", text_data, "--max-update", "1", "--max-sentences", "4", "--save-dir", tmp_path / "x"]
    cases = [
        (["--model_name_or_path", odd], "names no architecture with a known head (architectures: GPT2Model); "
                                        "give --hf_head"),
        (["--model_name_or_path", models["causal_lm"], "--best-checkpoint-metric", "ROUGE-1"],
         "--best-checkpoint-metric 'ROUGE-1' is not a metric of --hf_head causal_lm"),
        (["--model_name_or_path", models["sequence_classification"], "--metrics", "rouge"],
         "--metrics rouge: not reported by --hf_head sequence_classification"),
        (["--model_name_or_path", models["seq2seq"]], "--hf_head seq2seq needs --target_column NAME"),
        (["--data", text_data], "--task hf needs a model"),
    ]
    for extra, expected in cases:
        capsys.readouterr()
        assert run_main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert expected in err[-1] and "Traceback" not in "\n".join(err), (extra, err)
