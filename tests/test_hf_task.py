"""The generic Hugging Face task (--task hf): tiny models built from configs
and a tokenizer trained here, data files written here; nothing downloaded.

For each head: it trains (the loss falls), validates, and its export loads
with from_pretrained to the same eval loss. The language-model and
classification denominators make two ranks with unlike batches equal one
process of the same global batch; kill -9 and resume is bitwise; the
tokenised data is cached beside the data and reused."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, assert_bitwise_equal, clean_env, read_jsonl, run_cli, run_main

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


def params(save_dir):
    return torch.load(Path(save_dir) / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


def export_eval_loss(export_dir, data, head, *extra):
    """The valid loss of a save_pretrained directory, read as a fresh run reads its model."""
    from accelerate import Accelerator

    from textbox_like.cli import parse
    from textbox_like.tasks import TASKS
    from textbox_like.validate import evaluate
    cfg = parse(["--task", "hf", "--model_name_or_path", str(export_dir), "--data", str(data), "--hf_head", head,
                 "--seed", "3",  # the run's: masked_lm's masks follow it
                 *extra])
    task = TASKS.get("hf")(cfg)
    return evaluate(task, task.build_model(), task.build_dataset("valid"), 8, Accelerator(cpu=True))["loss"]


HEAD_RUNS = {
    "sequence_classification": (),
    "causal_lm": (),
    "masked_lm": (),
    # TextBox's spellings of the metrics: the generation family, and one of its metrics for checkpoint_best.pt
    "seq2seq": ("--target_column", "target", "--metrics=['rouge']", "--metrics_for_best_model=['ROUGE-1']",
                "--generation_max_length", "12"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head", list(HEAD_RUNS))
def test_each_head_trains_validates_and_its_export_loads_to_the_same_loss(models, text_data, tmp_path, head):
    from textbox_like.api import evaluate
    from textbox_like.export import main as export_main

    out = tmp_path / "run"
    assert run_main(hf_args(models[head], text_data, out, "--max-update", "18", *HEAD_RUNS[head])) == 0
    train, valid = records(out, "train"), records(out, "valid")
    assert valid[-1]["loss"] < train[0]["loss"] - 0.05, (train[0], valid[-1])      # it learns
    expected = {"sequence_classification": {"accuracy", "f1"}, "causal_lm": {"ppl", "accuracy"},
                "masked_lm": {"ppl", "accuracy"}, "seq2seq": {"ROUGE-1", "ROUGE-2", "ROUGE-L", "ppl"}}[head]
    assert expected <= set(valid[-1]), valid[-1]
    if head == "seq2seq":  # --metrics rouge: no BLEU computed; the best checkpoint is the best ROUGE-1's
        assert "BLEU" not in valid[-1]
        best = torch.load(out / "checkpoint_best.pt", map_location="cpu", weights_only=True)
        assert best["train"]["best"] == pytest.approx(max(r["ROUGE-1"] for r in valid))
    # the export: the model's own class and its tokenizer, loading to the checkpoint's loss
    exported = tmp_path / "export"
    assert export_main([str(out / "checkpoint_last.pt"), "--to", str(exported)]) in (0, None)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    ours = evaluate(out / "checkpoint_last.pt", cpu=True)["loss"]
    assert ours == pytest.approx(valid[-1]["loss"], abs=1e-5)
    extra = HEAD_RUNS[head][:2] if head == "seq2seq" else ()
    assert export_eval_loss(exported, text_data, head, *extra) == pytest.approx(ours, abs=1e-5)


# ---------------------------------------------------------------- one process over any split
def exactness_args(model, data, save_dir, *extra):
    # a global budget of real tokens: the ranks' shares then hold unlike numbers of samples and tokens.
    # SGD: Adam scales rounding noise up to lr-sized steps where the true gradient is zero (GPT-2's key
    # biases: softmax ignores them), which no summation order can match
    return [PY, "run_hetseq.py", *hf_args(model, data, save_dir, "--optimizer", "sgd", "--lr", "0.5",
                                          "--global-batch-size", "120", "--max-tokens", "50",
                                          "--max-update", "6", "--disable-validation", "--threads", "1", "--log-format",
                                          "simple", *extra)]


def run_ok(cmd, timeout=300):
    out = subprocess.run([str(c) for c in cmd], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("head", ["causal_lm", "sequence_classification"])
def test_two_ranks_with_unlike_batches_equal_one_process(models, text_data, tmp_path, head):
    """Two ranks, each micro-batch its own number of samples and tokens, and the
    loss's denominator (tokens; samples for classification) summed over both:
    the update of one process over the same global batch."""
    run_ok(exactness_args(models[head], text_data, tmp_path / "one"))
    two = run_ok(exactness_args(models[head], text_data, tmp_path / "two", "--distributed-world-size", "2"))
    assert "tokens per rank [60, 60]" in two.stderr
    # the plan the two ranks ran: their slices of an update hold unlike numbers of samples
    from textbox_like.cli import parse
    from textbox_like.data.iterators import plan_global_tokens
    from textbox_like.tasks import TASKS
    task = TASKS.get("hf")(parse(exactness_args(models[head], text_data, tmp_path / "plan")[2:]))
    data = task.build_dataset("train")
    order = data.epoch_order(3, 1)
    rows = plan_global_tokens(data.num_tokens()[order], 120, [60, 60])[:6]
    assert any(row[1] - row[0] != row[2] - row[1] for row in rows), rows
    one_state, two_state = params(tmp_path / "one"), params(tmp_path / "two")
    for key in one_state:
        assert torch.allclose(one_state[key], two_state[key], atol=1e-5, rtol=0), key
    train1, train2 = records(tmp_path / "one", "train"), records(tmp_path / "two", "train")
    assert train1[-1]["loss"] == pytest.approx(train2[-1]["loss"], abs=1e-5)
