"""BERT for pre-training, with the MLM head computed only at masked positions.

The module is a ``transformers.BertForPreTraining`` (same sub-modules, same
state_dict keys, ``save_pretrained``/``from_pretrained`` compatible); only its
``forward`` learns one more argument, ``masked_lm_positions`` (B, P). Given it,
the encoder output is gathered at those positions before the prediction head,
as NVIDIA's BERT does: the vocabulary-sized decoder then runs on B*P rows
instead of B*L, which for small BERTs is most of the step's FLOPs. Without it
the forward is ``BertForPreTraining``'s own.

Import this module only where torch and transformers are wanted (tasks import
it inside methods).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForPreTraining

from textbox_like.config.files import load_yaml
from textbox_like.config.layers import PROPERTIES
from textbox_like.core.errors import UserError, first_line
from textbox_like.models import PRESETS, check_init_checkpoint, checked_vocab_size, read_bert_json
IGNORE_INDEX = -100


# ------------------------------------------------------------------ config
def load_preset(name) -> dict:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; choose from: {', '.join(PRESETS)}")
    return load_yaml(PROPERTIES / "model" / f"{name}.yaml", "model preset")


def build_bert_config(config_file=None, preset=None, vocab_file=None, dimension=None,
                      num_heads=None, dim_feedforward=None, num_layers=None,
                      activation=None, dropout=None, max_position_embeddings=None,
                      base=None) -> BertConfig:
    """The model's ``BertConfig``.

    Source, first that applies: ``config_file`` (Google/NVIDIA bert_config.json),
    ``preset``, ``base`` (a dict, e.g. a transformers save's config), else the
    ``base`` preset. Then the overrides: ``dimension`` (hidden size; the
    feed-forward follows at 4x unless ``dim_feedforward`` is given),
    ``num_heads``, ``num_layers``, ``activation``, ``dropout`` (hidden and
    attention dropout). The vocabulary size comes from ``vocab_file`` when
    given; a config_file whose vocab_size differs is an error, except NVIDIA's
    padding of the vocabulary to a multiple of 8.
    """
    if config_file:
        values = read_bert_json(config_file)
        source = f"config file {str(config_file)!r}"
    elif preset:
        values = dict(load_preset(preset))
        source = f"preset {preset!r}"
    elif base is not None:
        values = dict(base)
        source = "the initial checkpoint's config"
    else:
        values = dict(load_preset("base"))
        source = "preset 'base'"
    values = {k: v for k, v in values.items() if not k.startswith("_")}
    if vocab_file:
        declared = values.get("vocab_size") if (config_file or base is not None) else None
        values["vocab_size"] = checked_vocab_size(vocab_file, declared, source)
    values.setdefault("vocab_size", 30522)
    if dimension is not None:
        values["hidden_size"] = int(dimension)
        if dim_feedforward is None:
            values["intermediate_size"] = 4 * int(dimension)
    if dim_feedforward is not None:
        values["intermediate_size"] = int(dim_feedforward)
    if num_heads is not None:
        values["num_attention_heads"] = int(num_heads)
    if num_layers is not None:
        values["num_hidden_layers"] = int(num_layers)
    if activation is not None:
        values["hidden_act"] = activation
    if dropout is not None:
        values["hidden_dropout_prob"] = float(dropout)
        values["attention_probs_dropout_prob"] = float(dropout)
    if max_position_embeddings is not None:
        values["max_position_embeddings"] = int(max_position_embeddings)
    try:
        config = BertConfig(**values)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid BERT configuration from {source}: {exc}") from None
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        value = getattr(config, key, None)
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"BERT {key} must be a positive integer, got {value!r} (from {source} and the overrides)")
    if config.hidden_size % config.num_attention_heads:
        raise UserError(f"hidden size {config.hidden_size} is not a multiple of the number of heads "
                        f"{config.num_attention_heads}; change --dimension or --num-heads")
    return config


# ------------------------------------------------------------------ model
class BertForPreTrainingMasked(BertForPreTraining):
    """``BertForPreTraining`` whose forward can evaluate the MLM head only at
    ``masked_lm_positions``.

    ``forward(input_ids, attention_mask, token_type_ids, masked_lm_positions)``
    returns ``(mlm_logits (B*P, V), nsp_logits (B, 2))``; the MLM logits of
    row ``b*P + j`` belong to position ``masked_lm_positions[b, j]``. Without
    ``masked_lm_positions`` it is ``BertForPreTraining.forward``.
    """
    # the layer FSDP (ours and Accelerate's) shards as one unit; transformers'
    # BERT declares none, and the tied MLM decoder must stay with the embeddings (the root)
    _no_split_modules = ["BertLayer"]

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None,
                masked_lm_positions=None, **kwargs):
        if masked_lm_positions is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids, **kwargs)
        batch, length = input_ids.shape
        vocab = self.config.vocab_size
        if batch == 0:
            # An empty batch (e.g. a rank with nothing left): outputs of the
            # right shapes that still touch every trainable parameter, so that
            # backward and gradient all-reduce behave as for a real batch.
            from textbox_like.parallel.sharding import is_sharded
            if is_sharded(self):
                # --fsdp: every layer's forward all-gathers its shards (the other ranks wait in
                # them), and outside forward the parameters are shards: run them on one padding token
                out = self.bert(input_ids=input_ids.new_zeros((1, 1)), return_dict=True)
                anchor = (self.cls.predictions(out.last_hidden_state[:, 0]).sum()
                          + self.cls.seq_relationship(out.pooler_output).sum()) * 0.0
            else:
                anchor = sum(p.reshape(-1)[:1].sum() for p in self.parameters() if p.requires_grad) * 0.0
            mlm = input_ids.new_zeros((0, vocab), dtype=torch.float32) + anchor
            nsp = input_ids.new_zeros((0, 2), dtype=torch.float32) + anchor
            return mlm, nsp
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                        token_type_ids=token_type_ids, return_dict=True)
        sequence, pooled = out.last_hidden_state, out.pooler_output
        hidden = sequence.shape[-1]
        index = masked_lm_positions.clamp(0, length - 1).unsqueeze(-1).expand(-1, -1, hidden)
        picked = sequence.gather(1, index).reshape(-1, hidden)
        mlm = self.cls.predictions(picked)
        nsp = self.cls.seq_relationship(pooled)
        return mlm, nsp


def pretraining_sums(mlm_logits, nsp_logits, masked_lm_ids, next_sentence_labels):
    """Summed losses and counts for one batch (all scalar tensors).

    ``masked_lm_ids`` (B, P) holds ``IGNORE_INDEX`` where nothing is masked.
    """
    labels = masked_lm_ids.reshape(-1)
    mlm_sum = F.cross_entropy(mlm_logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    nsp_sum = F.cross_entropy(nsp_logits.float(), next_sentence_labels.reshape(-1), reduction="sum")
    valid = labels != IGNORE_INDEX
    n_masked = valid.sum()
    with torch.no_grad():
        mlm_correct = ((mlm_logits.argmax(-1) == labels) & valid).sum()
        nsp_correct = (nsp_logits.argmax(-1) == next_sentence_labels.reshape(-1)).sum()
    return {"mlm_loss_sum": mlm_sum, "nsp_loss_sum": nsp_sum, "n_masked": n_masked,
            "mlm_correct": mlm_correct, "nsp_correct": nsp_correct}


def full_labels(input_ids, masked_lm_positions, masked_lm_ids):
    """(B, L) MLM labels in HF's convention: the token at masked positions,
    ``IGNORE_INDEX`` everywhere else."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    valid = masked_lm_ids != IGNORE_INDEX
    rows = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1).expand_as(masked_lm_positions)
    labels[rows[valid], masked_lm_positions[valid]] = masked_lm_ids[valid]
    return labels


# ------------------------------------------------------------------ init / freeze
def _strip_prefix(state):
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def weights_files(directory):
    """The weights files that ``from_pretrained`` reads in a save directory:
    model.safetensors (or its shards) before pytorch_model.bin (or its shards)."""
    import json
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            try:
                shards = json.loads((directory / index).read_text(encoding="utf-8"))["weight_map"].values()
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"--init-checkpoint: {str(directory / index)!r} is not a valid shard index "
                                f"({type(exc).__name__}: {exc}); re-save the model with save_pretrained") from None
            return [directory / name for name in dict.fromkeys(shards)]
    return []


def check_weights_files(directory):
    """Each weights file of a save directory opens with the safe loaders
    (header and extent of a safetensors file; a weights-only, memory-mapped
    torch.load of a .bin): a truncated, garbage or code-carrying file is one
    line naming it, before transformers reaches it."""
    from textbox_like.storage.checkpoint import unreadable_weights_reason
    for weights in weights_files(directory):
        if not weights.is_file():
            raise UserError(f"--init-checkpoint: weights file {str(weights)!r} is missing (named by the shard "
                            f"index); re-save the model with save_pretrained")
        try:
            if weights.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(weights), framework="pt") as handle:
                    handle.keys()
            else:
                torch.load(str(weights), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any failure to read is a bad file
            raise UserError(f"--init-checkpoint: weights file {str(weights)!r} cannot be loaded: "
                            f"{unreadable_weights_reason(exc)}") from None


def read_init_state(path):
    """State dict of ``--init-checkpoint``: one of our checkpoints (a
    torch.save'd dict with key "model") or a transformers save directory."""
    check_init_checkpoint(path)
    path = Path(path)
    if path.is_dir():
        check_weights_files(path)
        from transformers.utils import logging as transformers_logging

        # its per-tensor progress bar would sit among the run's log lines
        bar = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            model = BertForPreTraining.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise UserError(f"--init-checkpoint {str(path)!r} is not a transformers BERT save directory: "
                            f"{first_line(exc)}") from None
        finally:
            if bar:
                transformers_logging.enable_progress_bar()
        return model.state_dict()
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        from textbox_like.storage.checkpoint import unreadable_weights_reason
        raise UserError(f"--init-checkpoint {str(path)!r} is not a readable checkpoint "
                        f"({unreadable_weights_reason(exc)})") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        state = data["model"]
    elif isinstance(data, dict) and data and all(torch.is_tensor(v) for v in data.values()):
        state = data
    else:
        raise UserError(f"--init-checkpoint {str(path)!r} holds no model state (expected a dict with key 'model')")
    return _strip_prefix(state)


def load_init_checkpoint(model, path):
    state = read_init_state(path)
    own = model.state_dict()
    bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
           if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise UserError(f"--init-checkpoint {str(path)!r} does not fit this model: {bad[0]}"
                        f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; use the same model configuration")
    matched = [k for k in state if k in own]
    if not matched:
        raise UserError(f"--init-checkpoint {str(path)!r} shares no parameter with the BERT model")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # position_ids buffers and the tied decoder are allowed to be absent
    missing = [k for k in missing if not k.endswith("position_ids") and k != "cls.predictions.decoder.weight"]
    return missing, list(unexpected)


def freeze_encoder(model):
    """Freeze the embeddings and transformer layers; the pooler and the
    pre-training heads stay trainable (the MLM decoder weight is tied to the
    word embeddings and so is frozen with them)."""
    for module in (model.bert.embeddings, model.bert.encoder):
        for p in module.parameters():
            p.requires_grad_(False)


def no_decay(name: str) -> bool:
    """Biases and LayerNorm weights get no weight decay."""
    return name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name


def is_transformers_dir(path) -> bool:
    return bool(path) and os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
