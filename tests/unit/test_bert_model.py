"""BERT model, configuration and task: masked-head loss, presets, init, errors."""
import argparse
import json

import numpy as np
import pytest
import torch

from textbox_like.data.bert_hdf5 import write_shard
from textbox_like.core.errors import UserError
from textbox_like.models.bert import (
    BertForPreTrainingMasked,
    build_bert_config,
    freeze_encoder,
    full_labels,
    load_init_checkpoint,
    pretraining_sums)
from textbox_like.tasks.bert import BertTask

V, L, P = 120, 24, 6


def tiny_config():
    return build_bert_config(preset="tiny")


def make_batch(b=5, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (b, L), generator=g)
    mask = torch.ones(b, L, dtype=torch.long)
    mask[1, 15:] = 0
    ids[1, 15:] = 0
    seg = torch.zeros(b, L, dtype=torch.long)
    seg[:, L // 2:] = 1
    pos = torch.zeros(b, P, dtype=torch.long)
    lab = torch.full((b, P), -100, dtype=torch.long)
    for r in range(b):
        k = [P, 2, 4, 1, 6][r % 5]
        chosen = torch.randperm(13, generator=g)[:k].sort().values + 1
        pos[r, :k] = chosen
        lab[r, :k] = torch.randint(5, vocab, (k,), generator=g)
    nsp = torch.randint(0, 2, (b,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": seg,
            "masked_lm_positions": pos, "masked_lm_ids": lab, "next_sentence_labels": nsp}


def write_vocab(path, n=V):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(n - 5)]
    path.write_text("\n".join(tokens) + "\n")
    return path


def task_cfg(tmp_path, **kw):
    """A resolved bert configuration (tiny unless a config file is given) with these settings."""
    from textbox_like.resolve.resolution import parse
    preset = {} if kw.get("config_file") else {"model_preset": "tiny"}
    return parse(overrides={"task": "bert", "data": str(tmp_path), "shuffle_block": 64, **preset, **kw})


@pytest.mark.parametrize("name,layers,hidden,heads", [
    ("tiny", 2, 128, 2), ("mini", 4, 256, 4), ("small", 4, 512, 8),
    ("medium", 8, 512, 8), ("base", 12, 768, 12), ("large", 24, 1024, 16)])
def test_presets(name, layers, hidden, heads):
    c = build_bert_config(preset=name)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == \
        (layers, hidden, heads, 4 * hidden)


def test_tiny_model_size():
    model = BertForPreTrainingMasked(tiny_config())
    assert model.bert.embeddings.word_embeddings.weight.shape == (30522, 128)
    assert len(model.bert.encoder.layer) == 2
    assert model.bert.encoder.layer[0].intermediate.dense.out_features == 512


def test_overrides_and_vocab(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    c = build_bert_config(preset="tiny", vocab_file=vocab, dimension=64, num_heads=4, num_layers=3,
                          activation="relu", dropout=0.0)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_hidden_layers) == \
        (V, 64, 256, 4, 3)
    assert c.hidden_act == "relu" and c.hidden_dropout_prob == 0.0 and c.attention_probs_dropout_prob == 0.0
    assert build_bert_config(preset="tiny", dimension=64, dim_feedforward=100, num_heads=4).intermediate_size == 100
    with pytest.raises(UserError, match="not a multiple"):
        build_bert_config(preset="tiny", dimension=100, num_heads=3)


def test_config_file_and_vocab_mismatch(tmp_path):
    conf = tmp_path / "bert_config.json"
    conf.write_text(json.dumps({"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64, "hidden_act": "gelu",
                                "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                                "max_position_embeddings": 64, "type_vocab_size": 2,
                                "initializer_range": 0.02}))
    c = build_bert_config(config_file=conf, vocab_file=write_vocab(tmp_path / "vocab.txt"))
    assert (c.vocab_size, c.hidden_size, c.max_position_embeddings) == (V, 32, 64)
    with pytest.raises(UserError, match="vocab_size"):
        build_bert_config(config_file=conf, vocab_file=write_vocab(tmp_path / "v2.txt", V - 10))
    # NVIDIA pads the vocabulary to a multiple of 8
    assert build_bert_config(config_file=conf, vocab_file=write_vocab(tmp_path / "v3.txt", V - 3)).vocab_size == V
    cfg = task_cfg(tmp_path, dict=str(tmp_path / "v2.txt"), config_file=str(conf))
    with pytest.raises(UserError, match="vocab_size"):
        BertTask.check_config(cfg)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        build_bert_config(config_file=bad)


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_head_loss_equals_full_head_loss(seed):
    torch.manual_seed(seed)
    # the full 30,522-way head, a narrower body to keep the test fast
    model = BertForPreTrainingMasked(build_bert_config(preset="tiny", dimension=64, num_heads=2))
    model.eval()
    batch = make_batch(seed=seed)
    mlm, nsp = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     token_type_ids=batch["token_type_ids"], masked_lm_positions=batch["masked_lm_positions"])
    sums = pretraining_sums(mlm, nsp, batch["masked_lm_ids"], batch["next_sentence_labels"])
    labels = full_labels(batch["input_ids"], batch["masked_lm_positions"], batch["masked_lm_ids"])
    assert int((labels != -100).sum()) == int(sums["n_masked"])
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 token_type_ids=batch["token_type_ids"], labels=labels,
                 next_sentence_label=batch["next_sentence_labels"])
    n = batch["input_ids"].shape[0]
    masked_loss = sums["mlm_loss_sum"] / sums["n_masked"] + sums["nsp_loss_sum"] / n
    assert torch.allclose(masked_loss, full.loss, atol=1e-5)
    # and through the task: each term over its own count is the same per-batch loss
    task = BertTask(argparse.Namespace())
    terms, stats = task.loss(model, batch)
    counts = {"nsamples": n, **task.count(batch)}
    assert torch.allclose(sum(t / counts[k] for k, t in terms.items()), full.loss, atol=1e-5)
    assert int(stats["nsamples"]) == n and int(stats["masked_tokens"]) == int(sums["n_masked"])
    # the logits themselves are the full head's at the masked positions
    valid = batch["masked_lm_ids"].reshape(-1) != -100
    rows = torch.arange(n).unsqueeze(1).expand_as(batch["masked_lm_positions"]).reshape(-1)
    gathered = full.prediction_logits[rows, batch["masked_lm_positions"].reshape(-1)]
    assert torch.allclose(mlm[valid], gathered[valid], atol=1e-5)


def test_masked_head_gradients_equal_full_head():
    torch.manual_seed(0)
    model = BertForPreTrainingMasked(build_bert_config(preset="tiny", dimension=32, num_heads=2, num_layers=1))
    model.eval()
    batch = make_batch(seed=3)
    task = BertTask(argparse.Namespace())
    terms, stats = task.loss(model, batch)
    counts = {"nsamples": batch["input_ids"].shape[0], **task.count(batch)}
    sum(t / counts[k] for k, t in terms.items()).backward()
    masked = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    labels = full_labels(batch["input_ids"], batch["masked_lm_positions"], batch["masked_lm_ids"])
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
          token_type_ids=batch["token_type_ids"], labels=labels,
          next_sentence_label=batch["next_sentence_labels"]).loss.backward()
    for k, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(masked[k], p.grad, atol=1e-5), k


def test_empty_batch():
    model = BertForPreTrainingMasked(build_bert_config(preset="tiny", dimension=32, num_heads=2, num_layers=1))
    batch = {k: v[:0] for k, v in make_batch().items()}
    terms, stats = BertTask(argparse.Namespace()).loss(model, batch)
    loss_sum = sum(terms.values())
    loss_sum.backward()
    assert loss_sum.item() == 0.0 and int(stats["masked_tokens"]) == 0 and int(stats["nsamples"]) == 0
    assert all(p.grad is not None for p in model.parameters())


def test_metrics():
    task = BertTask(argparse.Namespace())
    m = task.metrics({"mlm_loss_sum": 20.0, "nsp_loss_sum": 4.0, "mlm_correct": 5.0,
                      "nsp_correct": 6.0, "nsamples": 8.0, "masked_tokens": 10.0})
    assert m["loss"] == 2.5 and m["mlm_loss"] == 2.0 and m["nsp_loss"] == 0.5
    assert m["mlm_accuracy"] == 0.5 and m["nsp_accuracy"] == 0.75
    assert abs(m["ppl"] - np.exp(2.0)) < 1e-9


def test_init_checkpoint_and_freeze(tmp_path):
    config = build_bert_config(preset="tiny", dimension=32, num_heads=2, num_layers=1)
    source = BertForPreTrainingMasked(config)
    torch.save({"model": source.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    target = BertForPreTrainingMasked(config)
    load_init_checkpoint(target, tmp_path / "ckpt.pt")
    for (k, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), k
    source.save_pretrained(tmp_path / "hf")
    target = BertForPreTrainingMasked(config)
    load_init_checkpoint(target, tmp_path / "hf")
    assert torch.equal(target.bert.embeddings.word_embeddings.weight, source.bert.embeddings.word_embeddings.weight)
    other = BertForPreTrainingMasked(build_bert_config(preset="tiny", dimension=64, num_heads=2, num_layers=1))
    with pytest.raises(UserError, match="does not fit"):
        load_init_checkpoint(other, tmp_path / "ckpt.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_init_checkpoint(target, tmp_path / "junk.pt")
    freeze_encoder(target)
    assert not any(p.requires_grad for p in target.bert.encoder.parameters())
    assert all(p.requires_grad for p in target.cls.seq_relationship.parameters())


def test_param_groups_skip_bias_and_layernorm(tmp_path):
    task = BertTask(task_cfg(tmp_path))
    model = BertForPreTrainingMasked(build_bert_config(preset="tiny", dimension=32, num_heads=2, num_layers=1))
    decay, plain = task.param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and plain["weight_decay"] == 0.0
    assert all(not names[id(p)].endswith("bias") and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert all(names[id(p)].endswith("bias") or "LayerNorm.weight" in names[id(p)] for p in plain["params"])
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))
    freeze_encoder(model)
    groups = task.param_groups(model, 0.01)
    assert all(p.requires_grad for g in groups for p in g["params"])


def shard_arrays(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    pos = np.zeros((n, P), np.int32)
    pos[:, :3] = np.sort(rng.choice(np.arange(1, L - 1), (n, 3)), axis=1)
    pos[:, 1] = np.maximum(pos[:, 1], pos[:, 0] + 1)
    pos[:, 2] = np.maximum(pos[:, 2], pos[:, 1] + 1)
    ids = np.zeros((n, P), np.int32)
    ids[:, :3] = rng.integers(5, vocab, (n, 3))
    return {"input_ids": rng.integers(5, vocab, (n, L)).astype(np.int32),
            "input_mask": np.ones((n, L), np.int8), "segment_ids": np.zeros((n, L), np.int8),
            "masked_lm_positions": pos, "masked_lm_ids": ids,
            "next_sentence_labels": rng.integers(0, 2, n).astype(np.int8)}


def test_task_end_to_end(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    write_shard(tmp_path / "d_train_0.hdf5", shard_arrays(40, V))
    write_shard(tmp_path / "d_test_0.hdf5", shard_arrays(10, V, seed=1))
    cfg = task_cfg(tmp_path, dict=str(vocab), dimension=32, num_heads=2, num_layers=1, max_pred_length=2)
    BertTask.check_config(cfg)
    task = BertTask(cfg)
    train = task.build_dataset("train")
    assert len(train) == 40 and len(task.build_dataset("test")) == 10
    model = task.build_model()
    assert model.config.vocab_size == V
    batch = task.collate_to_device(train.get_batch(train.epoch_order(1, 1)[:8]), "cpu")
    assert batch["masked_lm_ids"].shape == (8, 2)
    terms, stats = task.loss(model, batch)
    assert int(stats["masked_tokens"]) == 16 and int(stats["nsamples"]) == 8
    assert int(task.count(batch)["masked_tokens"]) == 16
    sum(terms.values()).backward()
    metrics = task.metrics({k: float(v) for k, v in stats.items()})
    assert set(metrics) == {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "ppl"}
    with pytest.raises(UserError, match="no shard of split 'valid'"):
        task.build_dataset("valid")


def test_data_prepared_with_a_bigger_vocabulary(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    write_shard(tmp_path / "d_train_0.hdf5", shard_arrays(20, 5000))
    task = BertTask(task_cfg(tmp_path, dict=str(vocab), dimension=32, num_heads=2, num_layers=1))
    data = task.build_dataset("train")
    with pytest.raises(UserError, match="vocabulary"):
        data.get_batch(np.arange(4))


def test_prepared_vocabulary_checked_at_once(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    write_shard(tmp_path / "d_train_0.hdf5", shard_arrays(20, V))
    (tmp_path / "prepare_bert.json").write_text(json.dumps({"vocab_size": 30522}))
    task = BertTask(task_cfg(tmp_path, dict=str(vocab), dimension=32, num_heads=2, num_layers=1))
    with pytest.raises(UserError, match="prepared with a vocabulary of 30522"):
        task.build_dataset("train")


def test_sequences_longer_than_positions(tmp_path):
    write_shard(tmp_path / "d_train_0.hdf5", shard_arrays(20, V))
    task = BertTask(task_cfg(tmp_path, dimension=32, num_heads=2, num_layers=1,
                             model_conf={"max_position_embeddings": 16}))
    with pytest.raises(UserError, match="max_position_embeddings"):
        task.build_dataset("train")
