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
def sentence(rng, n=None):
    n = n or int(rng.integers(3, 12))
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS) - 2, size=n))


def write_text_data(directory: Path, n_train=48, n_valid=16, seed=0):
    """train.jsonl / valid.jsonl for every head: text, a label (does the text
    hold 'good' or 'bad'), and a target (the text's words reversed)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid)):
        rows = []
        for i in range(n):
            words = sentence(rng).split()
            label = i % 2
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
            "--optimizer", "adam", "--lr", "0.003", "--log-format", "none", "--max-update", str(max_update),
            "--save-dir", str(save_dir), "--seed", "3", *[str(a) for a in extra]]
