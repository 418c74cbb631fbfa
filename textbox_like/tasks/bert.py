"""BERT pre-training (masked LM + next sentence prediction) on HDF5 shards.

Data: ``--data`` holds NVIDIA-layout shards (make them with
``python -m textbox_like.tools.prepare_bert``); a split is the shards whose
names contain it. Model: ``transformers.BertForPreTraining`` from
``--config_file`` (Google/NVIDIA bert_config.json) or ``--model-preset``,
with the MLM head evaluated only at the masked positions.

Loss: NVIDIA's ``mean MLM cross-entropy over masked tokens + mean NSP
cross-entropy over samples``, each mean taken over the whole update (all
micro-batches, all ranks): the task returns the two sums with their
denominators (``masked_tokens``, ``nsamples``) and the trainer divides each by
its update total, so an update is the same whatever the ranks' batch sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from textbox_like.config.schema import Section, setting
from textbox_like.config.value_types import nonneg_int, positive_int
from textbox_like.core.errors import UserError
from textbox_like.tasks import register_task
from textbox_like.tasks.base import Task

from textbox_like.models import PRESETS


def _probability(text):
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"must be within [0, 1), got {text}")
    return value


@dataclass(frozen=True)
class BertOptions(Section):
    """The bert task's own options (``cfg.task_options``)."""
    dict: str | None = setting(None, "WordPiece vocab.txt; sets the vocabulary size (must match --config_file's vocab_size)", metavar="VOCAB")
    config_file: str | None = setting(None, "BERT model configuration (Google/NVIDIA bert_config.json); wins over --model-preset", metavar="JSON", flag="--config_file")
    model_preset: str | None = setting(None, "model size when no --config_file is given (default base): layers/hidden/heads "
                                             "tiny 2/128/2, mini 4/256/4, small 4/512/8, medium 8/512/8, base 12/768/12, large 24/1024/16", choices=PRESETS)
    dimension: int | None = setting(None, "override: hidden size (feed-forward follows at 4x)", type=positive_int)
    num_heads: int | None = setting(None, "override: attention heads", type=positive_int)
    dim_feedforward: int | None = setting(None, "override: feed-forward size", type=positive_int)
    num_layers: int | None = setting(None, "override: transformer layers", type=positive_int)
    activation_function: str | None = setting(None, "override: activation", choices=["relu", "gelu"])
    dropout: float | None = setting(None, "override: hidden and attention dropout", type=_probability)
    max_pred_length: int = setting(512, "use at most this many masked positions of each instance", type=positive_int, flag="--max_pred_length")
    num_file: int = setting(0, "use the first N shards of a split (0: all)", type=nonneg_int, flag="--num_file")
    init_checkpoint: str | None = setting(None, "start from these weights: one of our checkpoints (.pt) or a transformers save directory")
    freeze_encoder: bool = setting(False, "train only the pooler and the pre-training heads (embeddings and layers frozen)", switch=True)
    shuffle_block: int = setting(8192, "rows per shuffled block of the epoch order (the unit read from disk)", type=positive_int)


@register_task("bert", dataclass=BertOptions)
class BertTask(Task):
    denominators = ("masked_tokens",)
    initial_weights_setting = "init_checkpoint"
    split_files = True
    width_key = "hidden_size"
    default_best_metric = "loss"

    # -- checks before anything heavy ---------------------------------------
    @classmethod
    def resolve_config(cls, ns):
        """The model's sizes as --dimension/--num-heads/--num-layers/--dim-feedforward
        (options given win), so --print_config and config.yaml show the model:
        from the preset, or, with no preset, from the config.json of a
        transformers --init-checkpoint directory. A --config_file defines them
        instead."""
        if ns.config_file:
            return
        init = getattr(ns, "init_checkpoint", None)
        if not ns.model_preset and init:
            from textbox_like.models import saved_model_sizes
            sizes = saved_model_sizes(init)
            if sizes is None:  # one of our checkpoints, or a bad directory (check_config says so)
                return
        else:
            from textbox_like.config.files import load_yaml
            from textbox_like.config.layers import PROPERTIES
            sizes = load_yaml(PROPERTIES / "model" / f"{ns.model_preset or 'base'}.yaml", "model preset")
        if ns.dim_feedforward is None:
            ns.dim_feedforward = 4 * ns.dimension if ns.dimension else sizes["intermediate_size"]
        ns.dimension = ns.dimension or sizes["hidden_size"]
        ns.num_heads = ns.num_heads or sizes["num_attention_heads"]
        ns.num_layers = ns.num_layers or sizes["num_hidden_layers"]

    @classmethod
    def check_config(cls, cfg):
        data, options = cfg.data.data, cfg.task_options
        if not data:
            raise UserError("BERT needs --data DIR_OR_FILE with HDF5 shards; "
                            "create them with python -m textbox_like.tools.prepare_bert")
        if not Path(data).exists():
            raise UserError(f"--data {data!r} does not exist; check the path")
        for flag in ("dict", "config_file"):
            value = getattr(options, flag)
            if value and not Path(value).is_file():
                raise UserError(f"--{flag} {value!r} does not exist; check the path")
        init = options.init_checkpoint
        if init:
            from textbox_like.models import check_init_checkpoint
            check_init_checkpoint(init)
        if cfg.task_options.dict and cfg.task_options.config_file:
            _check_vocab(cfg.task_options.dict, cfg.task_options.config_file)
        unknown = set(cfg.model.model_conf) - _BERT_CONF_KEYS
        if unknown:
            from textbox_like.core.errors import closest
            key = sorted(unknown)[0]
            raise UserError(f"unknown key {key!r} in --model_conf for bert{closest(key, _BERT_CONF_KEYS)}; "
                            f"valid keys: {', '.join(sorted(_BERT_CONF_KEYS))}")
        for key, value in cfg.model.model_conf.items():
            if key == "hidden_act":
                ok = isinstance(value, str)
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise UserError(f"--model_conf {key}={value!r}: expects " +
                                ("an activation name like gelu" if key == "hidden_act" else "a number >= 0"))

    # -- data ---------------------------------------------------------------
    def build_dataset(self, split):
        from textbox_like.data.bert_hdf5 import BertHDF5Dataset, find_shards

        data = self.cfg.data
        training = split == data.train_subset
        named = data.training_data if training else data.validation_data   # kanachan's FILE for this split
        if named and Path(named).is_file():
            files = find_shards(named, split, training=True)
        else:
            files = find_shards(data.data, split, self.cfg.task_options.num_file, training=training)
        config = self.model_config()
        _check_prepared_vocab(files, config.vocab_size)
        data = BertHDF5Dataset(files, max_pred_length=self.cfg.task_options.max_pred_length,
                               block=self.cfg.task_options.shuffle_block,
                               vocab_size=config.vocab_size)
        if data.seq_length > config.max_position_embeddings:
            raise UserError(f"the {split} shards hold sequences of {data.seq_length} tokens but the model has "
                            f"{config.max_position_embeddings} positions (max_position_embeddings)")
        return data

    # -- model --------------------------------------------------------------
    def model_config(self):
        if getattr(self, "_config", None) is None:
            config = self.config_without_model_conf()
            for key, value in self.cfg.model.model_conf.items():
                setattr(config, key, value)
            self._config = config
        return self._config

    def config_without_model_conf(self):
        """The BertConfig of the preset, config file or weights and the size options, before --model_conf."""
        from textbox_like.models.bert import build_bert_config, is_transformers_dir

        cfg = self.cfg
        base = None
        init = cfg.task_options.init_checkpoint
        if not cfg.task_options.config_file and not cfg.task_options.model_preset and is_transformers_dir(init):
            import json
            base = json.loads((Path(init) / "config.json").read_text())
        return build_bert_config(
            config_file=cfg.task_options.config_file, preset=cfg.task_options.model_preset, vocab_file=cfg.task_options.dict,
            dimension=cfg.task_options.dimension, num_heads=cfg.task_options.num_heads, dim_feedforward=cfg.task_options.dim_feedforward,
            num_layers=cfg.task_options.num_layers, activation=cfg.task_options.activation_function, dropout=cfg.task_options.dropout,
            base=base)

    def model_conf_defaults(self):
        config = self.config_without_model_conf()
        return {key: getattr(config, key) for key in sorted(_BERT_CONF_KEYS) if hasattr(config, key)}

    def build_model(self):
        from textbox_like.models.bert import BertForPreTrainingMasked, freeze_encoder, load_init_checkpoint

        model = BertForPreTrainingMasked(self.model_config())
        if self.cfg.task_options.init_checkpoint:
            missing, unexpected = load_init_checkpoint(model, self.cfg.task_options.init_checkpoint)
            if missing or unexpected:
                import sys
                print(f"| init checkpoint: {len(missing)} missing and {len(unexpected)} unexpected "
                      f"parameters (e.g. {(missing + unexpected)[0]})", file=sys.stderr)
        if self.cfg.task_options.freeze_encoder:
            freeze_encoder(model)
        if self.cfg.model.checkpointing:
            # kanachan's --checkpointing: recompute each layer's activations in
            # backward (less memory, the same loss); non-reentrant works under DDP
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def param_groups(self, model, weight_decay):
        from textbox_like.models.bert import no_decay

        decay, plain = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (plain if no_decay(name) else decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": plain, "weight_decay": 0.0, "no_decay": True}]
        return [g for g in groups if g["params"]]

    def loss(self, model, batch):
        from textbox_like.models.bert import pretraining_sums

        mlm_logits, nsp_logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       token_type_ids=batch["token_type_ids"],
                                       masked_lm_positions=batch["masked_lm_positions"])
        sums = pretraining_sums(mlm_logits, nsp_logits, batch["masked_lm_ids"], batch["next_sentence_labels"])
        n_samples = batch["input_ids"].shape[0]  # a host number: no tensor from a Python value per step
        stats = {
            "mlm_loss_sum": sums["mlm_loss_sum"].detach(),
            "nsp_loss_sum": sums["nsp_loss_sum"].detach(),
            "mlm_correct": sums["mlm_correct"],
            "nsp_correct": sums["nsp_correct"],
            "nsamples": n_samples,
            "masked_tokens": sums["n_masked"],
            "ntokens": batch["attention_mask"].sum(),
        }
        return {"masked_tokens": sums["mlm_loss_sum"], "nsamples": sums["nsp_loss_sum"]}, stats

    def count(self, batch):
        from textbox_like.models.bert import IGNORE_INDEX
        return {"masked_tokens": int((batch["masked_lm_ids"] != IGNORE_INDEX).sum())}

    metric_names = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "ppl")

    def metrics(self, sums):
        n_masked = max(sums.get("masked_tokens", 0.0), 1.0)
        n = max(sums.get("nsamples", 0.0), 1.0)
        mlm_loss = sums.get("mlm_loss_sum", 0.0) / n_masked
        return {
            "loss": mlm_loss + sums.get("nsp_loss_sum", 0.0) / n,
            "mlm_loss": mlm_loss,
            "nsp_loss": sums.get("nsp_loss_sum", 0.0) / n,
            "mlm_accuracy": sums.get("mlm_correct", 0.0) / n_masked,
            "nsp_accuracy": sums.get("nsp_correct", 0.0) / n,
            "ppl": math.exp(min(mlm_loss, 50.0)),
        }


def _check_vocab(vocab_file, config_file):
    """vocab.txt size against config_file's vocab_size, without heavy imports."""
    from textbox_like.models import checked_vocab_size, read_bert_json

    declared = read_bert_json(config_file).get("vocab_size")
    checked_vocab_size(vocab_file, declared, f"config file {config_file!r}")


def _check_prepared_vocab(files, vocab_size):
    """Shards made by prepare_bert sit next to prepare_bert.json, which names
    their vocabulary size: a smaller model vocabulary is an error at once
    (other shards are checked block by block as they are read)."""
    import json

    seen = set()
    for f in files:
        info = Path(f).parent / "prepare_bert.json"
        if info in seen or not info.is_file():
            continue
        seen.add(info)
        try:
            size = int(json.loads(info.read_text()).get("vocab_size"))
        except (ValueError, TypeError, AttributeError, OSError):
            continue
        if size > vocab_size:
            raise UserError(f"the shards in {str(info.parent)!r} were prepared with a vocabulary of {size} tokens "
                            f"but the model's has {vocab_size}; give --dict {str(info.parent / 'vocab.txt')!r} "
                            f"(or the matching --config_file)")


# BertConfig fields --model_conf may set (checked without importing transformers)
_BERT_CONF_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
    "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout",
}
