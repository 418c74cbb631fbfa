"""Model and tokenizer that do not fit (issue 51, item 2): --max_length
defaults to the model's own position limit (at most 512), so a tiny GPT-2 or
BART with few positions trains out of the box on texts longer than them; a
larger --max_length given, or a tokenizer with more tokens than the model's
embedding has rows, is one line naming the sizes and the fix, exit 2, at
start. The trainer's main in-process, on tiny models saved here."""
from __future__ import annotations

import json

import pytest
import yaml

from conftest import refusal_in_process
from test_hf_task import WORDS, build_tokenizer, tiny_config

LONG_TEXTS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) for i in range(24)]  # ~42 tokens each


def model_dir(tmp_path, head, **sizes):
    import torch
    import transformers

    from textbox_like.tasks.hf import AUTO_CLASSES
    directory = tmp_path / f"{head}_model"
    directory.mkdir()
    config = tiny_config(head)
    for key, value in sizes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    getattr(transformers, AUTO_CLASSES[head]).from_config(config).save_pretrained(str(directory))
    build_tokenizer(directory)
    return directory


def long_text_data(tmp_path, seq2seq=False):
    directory = tmp_path / "data"
    directory.mkdir()
    for split, texts in (("train", LONG_TEXTS[:16]), ("valid", LONG_TEXTS[16:])):
        rows = [{"text": t, **({"summary": t} if seq2seq else {})} for t in texts]
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def args(model, data, save, *extra):
    return ["--task", "hf", "--model_name_or_path", model, "--data", data, "--save-dir", save, "--max-sentences", 4,
            "--max-update", 2, "--log-format", "none", "--cpu", *extra]


def one_error_line(out):
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("head, positions, extra", [
    ("causal_lm", {"n_positions": 16}, ()),
    ("seq2seq", {"max_position_embeddings": 16}, ("--target_column", "summary")),
])
def test_a_model_with_few_positions_trains_on_long_texts_out_of_the_box(tmp_path, capfd, head, positions, extra):
    model = model_dir(tmp_path, head, **positions)
    data = long_text_data(tmp_path, seq2seq=head == "seq2seq")
    printed = refusal_in_process(args(model, data, tmp_path / "p", *extra, "--print_config"), capfd)
    options = yaml.safe_load(printed.stdout)
    assert options["max_length"] == 16, printed.stdout[-2000:]
    if head == "seq2seq":
        assert options["max_target_length"] == 16
    out = refusal_in_process(args(model, data, tmp_path / "run", *extra), capfd)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_max_length_beyond_the_models_positions_is_one_line(tmp_path, capfd):
    model = model_dir(tmp_path, "causal_lm", n_positions=16)
    out = refusal_in_process(args(model, long_text_data(tmp_path), tmp_path / "run", "--max_length", 64), capfd)
    assert one_error_line(out) == (
        f"error: --max_length 64 is more than the model takes: it embeds 16 positions (n_positions in "
        f"{model / 'config.json'}); give --max_length 16 or less (by default it is the model's limit)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tokenizer_larger_than_the_models_embedding_is_one_line(tmp_path, capfd):
    vocabulary = len(build_tokenizer(tmp_path / "probe"))
    model = model_dir(tmp_path, "masked_lm", vocab_size=vocabulary - 3)
    out = refusal_in_process(args(model, long_text_data(tmp_path), tmp_path / "run"), capfd)
    assert one_error_line(out) == (
        f"error: the tokenizer in {model} has {vocabulary:,} tokens but the model's embedding has {vocabulary - 3:,} "
        f"rows (vocab_size in its config.json): ids from {vocabulary - 3:,} on have no embedding; save the tokenizer "
        f"the model was trained with there, or resize the model's embedding (model.resize_token_embeddings("
        f"len(tokenizer)), then save_pretrained)")
