"""Any Hugging Face ``transformers`` model on any local ``datasets`` data.

Model: ``--model_name_or_path DIR`` (TextBox's ``--model_path``): a
``save_pretrained`` directory (``from_pretrained``), a directory with only
``config.json`` (``from_config``: random weights), or a hub name already in the
local Hugging Face cache; nothing is downloaded. Its tokenizer is read from
the same place. ``--hf_head``: sequence_classification, causal_lm, masked_lm
or seq2seq, by default the one the config's ``architectures`` names.

Data: see ``textbox_like/data/hf_text.py`` (``--data`` a directory of
``train.*``/``valid.*`` files, one file, a ``save_to_disk`` directory, a
dataset name in the local datasets cache with ``--dataset_config``;
kanachan's ``--training-data FILE``/``--validation-data FILE``).

Loss: the SUM of per-token cross-entropies over the tokens predicted (labels
not -100) for the language-model heads, with the denominator ``tokens``
summed over the whole update across ranks before backward; the sum over
samples for classification (denominator: samples). So unlike per-rank batches
give the update of one process over the same global batch.

Metrics: loss and accuracy, and macro F1 (from per-class counts, which add up
over ranks) for classification; perplexity and token accuracy for language
models; and for seq2seq, at validation, ROUGE and BLEU of greedy (or beam)
generations (``textbox_like/metrics/text_metrics.py``; TextBox's ``--metrics`` picks
which, ``--metrics_for_best_model ROUGE-1`` ranks checkpoints by one).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from textbox_like.config.schema import Section, setting
from textbox_like.config.value_types import positive_int
from textbox_like.core.errors import UserError, closest, first_line
from textbox_like.tasks import register_task
from textbox_like.tasks.base import Task
from textbox_like.tasks.hf_data import check_streaming_and_packing, streamed_split
from textbox_like.tasks.hf_head import fit_to_the_trained_head

HEADS = ("sequence_classification", "causal_lm", "masked_lm", "seq2seq")

#: transformers' Auto class of each head
AUTO_CLASSES = {"sequence_classification": "AutoModelForSequenceClassification",
                "causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM",
                "seq2seq": "AutoModelForSeq2SeqLM"}

#: how an architecture's name ends -> its head (config.json's ``architectures``)
ARCHITECTURE_SUFFIXES = (("ForSequenceClassification", "sequence_classification"), ("ForCausalLM", "causal_lm"),
                         ("LMHeadModel", "causal_lm"), ("ForMaskedLM", "masked_lm"), ("ForPreTraining", "masked_lm"),
                         ("ForConditionalGeneration", "seq2seq"), ("ForSeq2SeqLM", "seq2seq"))

from textbox_like.metrics.text_metrics import GENERATION_METRICS as GENERATION  # noqa: E402  (rouge, bleu -> the metrics reported)

#: each head's metrics
HEAD_METRICS = {"sequence_classification": ("loss", "accuracy", "f1"),
                "causal_lm": ("loss", "accuracy", "ppl"),
                "masked_lm": ("loss", "accuracy", "ppl"),
                "seq2seq": ("loss", "accuracy", "ppl") + GENERATION["rouge"] + GENERATION["bleu"]}

#: each head as peft's task type (--peft): the peft model class that feeds it
#: (masked LM: feature extraction, whose forward passes the model's own output on)
PEFT_TASK_TYPES = {"sequence_classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM", "masked_lm": "FEATURE_EXTRACTION",
                   "seq2seq": "SEQ_2_SEQ_LM"}

#: macro F1 is reported up to this many classes (its counts are 3 sums per class)
MAX_F1_CLASSES = 128

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _probability(text):
    value = float(text)
    if not 0.0 < value < 1.0:
        raise ValueError(f"must be within (0, 1), got {text}")
    return value


@dataclass(frozen=True)
class HFOptions(Section):
    """The hf task's own options (``cfg.task_options``)."""
    model_name_or_path: str | None = setting(
        None, "the model: a save_pretrained directory, a directory with only config.json (random weights), or a "
              "hub name already in the local Hugging Face cache (nothing is downloaded); its tokenizer too "
              "(TextBox: --model_path)", metavar="DIR_OR_NAME")
    hf_head: str | None = setting(None, "the model's head (default: the one config.json's architectures names)",
                                  choices=HEADS)
    dataset_config: str | None = setting(None, "--data NAME, a dataset in the local Hugging Face datasets cache: "
                                               "its configuration (datasets.load_dataset(NAME, CONFIG))",
                                         metavar="CONFIG")
    text_column: str = setting("text", "the data's column of input texts")
    text_pair_column: str | None = setting(None, "a second input text per sample (sentence pairs)")
    label_column: str = setting("label", "sequence_classification: the column of class labels (0..K-1 or names)")
    target_column: str | None = setting(None, "seq2seq: the column of the texts to generate")
    max_length: int | None = setting(None, "inputs are truncated to this many tokens (default: the model's "
                                           "position limit, at most 512)", type=positive_int)
    max_target_length: int | None = setting(None, "seq2seq: targets are truncated to this many tokens (default: "
                                                  "the model's position limit, at most 128)", type=positive_int)
    mlm_probability: float = setting(0.15, "masked_lm: the share of tokens predicted", type=_probability)
    generation_max_length: int = setting(64, "seq2seq validation: the most new tokens generated",
                                         type=positive_int)
    num_beams: int = setting(1, "seq2seq validation: beams of generation (1: greedy)", type=positive_int)
    new_head: bool = setting(False, "sequence_classification: train a new head of the data's classes where the "
                                    "model was trained with one of other classes (its head is dropped)", switch=True)
    streaming: bool = setting(False, "read the training split as a stream as training goes (txt, jsonl, csv, tsv, "
                                     "parquet files; never held whole), tokenised on the fly in --num-workers "
                                     "processes; its position is saved in checkpoints", switch=True)
    shuffle_buffer: int = setting(1000, "--streaming: samples are shuffled in a seeded buffer of this many (1: the "
                                        "files' order; the files' order itself is shuffled per epoch unless "
                                        "--no-shuffle)", type=positive_int, metavar="N")
    packing: bool = setting(False, "causal_lm, masked_lm: whole documents packed into rows of --max_length tokens, "
                                   "position ids restarting per document, no attention across documents (see "
                                   "docs: packing)", switch=True)
    cache_dir: str | None = setting(None, "where tokenised data is cached (default: HF_DATASETS_CACHE/textbox_like, "
                                          "~/.cache/huggingface/datasets/textbox_like); a read-only data directory "
                                          "is fine", metavar="DIR")


def architecture_head(architectures):
    """The head an ``architectures`` entry names, or None."""
    for name in architectures or ():
        for suffix, head in ARCHITECTURE_SUFFIXES:
            if str(name).endswith(suffix):
                return head
    return None


def local_model_dir(name, flag="--model_name_or_path"):
    """``name`` as a local directory: itself, or its snapshot in the local
    Hugging Face cache; one line saying how to provide it otherwise."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise UserError(f"{flag} {name} is a file; give the directory save_pretrained wrote (config.json, weights, "
                        f"tokenizer files)")
    from textbox_like.data.hf_text import offline
    offline()  # nothing is downloaded
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, local_files_only=True)
    except Exception:  # not cached, or not a repository name at all: the same remedy
        raise UserError(f"{flag} {name}: no such directory, and no model {name!r} in the local Hugging Face cache "
                        f"(nothing is downloaded here); on a connected machine run `huggingface-cli download "
                        f"{name}` (then copy ~/.cache/huggingface here), or save_pretrained the model and its "
                        f"tokenizer to a directory and pass that") from None


def read_model_config(directory) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"the model directory {str(directory)!r} holds no config.json; give a directory written by "
                        f"save_pretrained (or holding a model's config.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc})") from None


def trained_head(model_dir):
    """(its classes, their names or None) of the classification head the
    model in ``model_dir`` was trained with, or None where its weights hold none."""
    config = read_model_config(model_dir)
    if not any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or ()) or \
            not any((Path(model_dir) / name).is_file() for name in WEIGHT_FILES):
        return None
    id2label = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(id2label) or 2)
    names = [str(id2label.get(str(i), id2label.get(i, ""))) for i in range(count)] if id2label else None
    if names is not None and all(name == f"LABEL_{i}" for i, name in enumerate(names)):
        names = None   # transformers' placeholders: a head of numbered classes
    return count, names


#: config.json's names of the most positions a model embeds (the first found counts)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions")
#: models whose position ids start after the padding id (RoBERTa's family): that many fewer usable positions
POSITION_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert", "longformer", "xlm-roberta-xl", "data2vec-text")


def position_limit(config: dict):
    """(the most tokens the model's positions take, the config.json key that
    says so), or (None, None) for a model without a fixed limit (T5's
    relative positions)."""
    for where in (config, config.get("text_config") or {}):
        for key in POSITION_KEYS:
            value = where.get(key)
            if isinstance(value, int) and value > 0:
                offset = int(where.get("pad_token_id") or 0) + 1 if where.get("model_type") in POSITION_OFFSET_TYPES \
                    else 0
                return value - offset, key
    return None, None


def fit_lengths_to_the_model(ns, config: dict):
    """--max_length (and seq2seq's --max_target_length) default to the
    model's position limit (at most 512 and 128); a larger value given is one
    line naming both sizes, instead of an index error at the first long text."""
    limit, key = position_limit(config)
    for option, default in (("max_length", 512), ("max_target_length", 128)):
        given = getattr(ns, option, None)
        if given is None:
            setattr(ns, option, min(default, limit) if limit else default)
        elif limit and given > limit:
            raise UserError(f"--{option} {given} is more than the model takes: it embeds {limit} positions "
                            f"({key} in {Path(ns.model_name_or_path) / 'config.json'}); give --{option} {limit} or "
                            f"less (by default it is the model's limit)")


def requested_generation(metrics) -> tuple:
    """TextBox's --metrics as generation families (rouge, bleu): all where none is named."""
    if not metrics:
        return tuple(GENERATION)
    families = []
    for name in metrics:
        family = next((f for f, names in GENERATION.items() if name.lower() == f or name in names), None)
        if family and family not in families:
            families.append(family)
    return tuple(families)


def unwrapped(model):
    """The transformers model inside DDP / torch.compile wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def export_hf_model(model, tokenizer, merge: bool, save_dir):
    """SAVE_DIR/hf_model: the trained model's own save_pretrained and its
    tokenizer, as HF Trainer leaves one (``textbox-like export`` writes
    any checkpoint's). A resumed run's earlier export is replaced once the
    new one is whole."""
    import shutil

    from textbox_like.storage.fileio import atomic_directory
    from textbox_like.storage.savelock import check_owner
    target = Path(save_dir) / "hf_model"
    check_owner(target)  # a process that no longer owns the run moves nothing of it
    earlier = target.with_name(f".hf_model.{os.getpid()}.old") if target.exists() else None
    if earlier:
        os.rename(target, earlier)
    from textbox_like.models.adapters import exported_model
    model = exported_model(model, merge)
    try:
        with atomic_directory(target) as tmp:
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
    except BaseException:
        if earlier:
            os.rename(earlier, target)
        raise
    if earlier:
        shutil.rmtree(earlier, ignore_errors=True)
    return target


@register_task("hf", dataclass=HFOptions)
class HFTask(Task):
    initial_weights_setting = "model_name_or_path"
    #: a hub name in the local cache is resolved by resolve_config, not refused as a missing path
    accepts_cached_names = True
    split_files = True
    default_best_metric = "loss"
    #: every head's names (the checks before a run narrow them to the chosen head's)
    metric_names = tuple(dict.fromkeys(m for names in HEAD_METRICS.values() for m in names))
    metric_families = GENERATION

    # -- checks before anything heavy ---------------------------------------
    @classmethod
    def resolve_config(cls, ns):
        """The model as a local directory, and the head its config names."""
        if not ns.model_name_or_path:
            return
        given = "--model_path" if getattr(ns, "model_path", None) == ns.model_name_or_path else "--model_name_or_path"
        ns.model_name_or_path = local_model_dir(ns.model_name_or_path, given)
        config = read_model_config(ns.model_name_or_path)
        fit_lengths_to_the_model(ns, config)
        if ns.hf_head is None:
            head = architecture_head(config.get("architectures"))
            if head is None:
                named = ", ".join(config.get("architectures") or []) or "none"
                raise UserError(f"the model's config.json names no architecture with a known head (architectures: "
                                f"{named}); give --hf_head, one of {', '.join(HEADS)}")
            ns.hf_head = head

    @classmethod
    def check_config(cls, cfg):
        options, data = cfg.task_options, cfg.data
        if not options.model_name_or_path:
            raise UserError("--task hf needs a model: --model_name_or_path DIR (or TextBox's --model_path DIR), a "
                            "save_pretrained directory or one holding a config.json")
        read_model_config(options.model_name_or_path)
        if not (data.data or data.training_data):
            raise UserError("--task hf needs data: --data DIR (train.* and valid.* files: csv, tsv, json, jsonl, "
                            "parquet, txt; or a save_to_disk directory), --data FILE (training only) or --data NAME "
                            "(a dataset in the local Hugging Face datasets cache)")
        from textbox_like.data.hf_text import cached_dataset, looks_like_path
        if data.data and not Path(data.data).exists():
            if looks_like_path(data.data):
                raise UserError(f"--data {data.data!r} does not exist; check the path")
            cached_dataset(data.data, options.dataset_config)   # a dataset name: one line where it is not cached
        elif options.dataset_config:
            raise UserError(f"--dataset_config {options.dataset_config} is for --data NAME, a dataset in the local "
                            f"Hugging Face datasets cache; --data {data.data or data.training_data} is a path")
        if options.hf_head == "seq2seq" and not options.target_column:
            raise UserError("--hf_head seq2seq needs --target_column NAME: the column of the texts to generate")
        check_streaming_and_packing(cfg)
        ours = HEAD_METRICS[options.hf_head]
        if options.hf_head == "seq2seq":  # generation metrics only of the families --metrics asks for
            asked = {m for family in requested_generation(cfg.validation.metrics) for m in GENERATION[family]}
            ours = tuple(m for m in ours if m in asked or not any(m in names for names in GENERATION.values()))
        metric = cfg.validation.best_checkpoint_metric
        if metric and metric not in ours:
            raise UserError(f"--best-checkpoint-metric {metric!r} is not a metric of --hf_head {options.hf_head}"
                            f"{closest(metric, ours)}; choose from: {', '.join(ours)}")
        for name in cfg.validation.metrics or ():
            if name not in ours and not (options.hf_head == "seq2seq" and name.lower() in GENERATION):
                raise UserError(f"--metrics {name}: not reported by --hf_head {options.hf_head}; it reports "
                                f"{', '.join(ours)}" + (" (rouge, bleu: generation metrics)"
                                                         if options.hf_head == "seq2seq" else ""))

    def __init__(self, cfg):
        super().__init__(cfg)
        self.head = cfg.task_options.hf_head
        self.metric_names = HEAD_METRICS[self.head]
        # the language-model heads' loss is a mean over predicted tokens
        self.denominators = () if self.head == "sequence_classification" else ("tokens",)
        self.generation = requested_generation(cfg.validation.metrics) if self.head == "seq2seq" else ()
        self._tokenizer = self._classes = None
        self.head_note = None   # a classification head trained anew, for the start line

    @property
    def peft_task_type(self):
        """--peft: peft's task type of the head (models/adapters.py)."""
        return PEFT_TASK_TYPES[self.head]

    # -- tokenizer and data -------------------------------------------------
    @property
    def model_dir(self):
        return self.cfg.task_options.model_name_or_path

    def tokenizer(self):
        if self._tokenizer is None:
            from textbox_like.data.hf_text import offline
            offline()  # nothing is downloaded
            from transformers import AutoTokenizer
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            except (OSError, ValueError) as exc:
                raise UserError(f"no tokenizer could be read from {self.model_dir!r} ({str(exc).splitlines()[0]}); "
                                f"save it there with tokenizer.save_pretrained(DIR)") from None
        return self._tokenizer

    def pad_id(self):
        tok = self.tokenizer()
        for value in (tok.pad_token_id, tok.eos_token_id):
            if value is not None:
                return int(value)
        return 0

    def columns(self):
        from textbox_like.data.hf_text import TextColumns
        o = self.cfg.task_options
        return TextColumns(head=self.head, text=o.text_column, text_pair=o.text_pair_column, label=o.label_column,
                           target=o.target_column, max_length=o.max_length, max_target_length=o.max_target_length)

    def raw_split(self, split):
        from textbox_like.data.hf_text import check_columns, load_raw
        data = self.cfg.data
        training = split == data.train_subset
        named = data.training_data if training else data.validation_data   # kanachan's FILE for this split
        named = named if named and Path(named).is_file() else None
        options = self.cfg.task_options
        raw, cache = load_raw(data.data, split, named, training, options.dataset_config, options.cache_dir)
        check_columns(raw, self.columns(), f"the {split!r} split")
        return raw, cache

    def classes(self):
        """(class names or None, number of classes), from the training split;
        where the model was trained with a classification head, that head's
        classes, which every label must be one of (else one line), unless
        --new_head."""
        if self._classes is None:
            from textbox_like.data.hf_text import label_names
            split = self.cfg.data.train_subset
            raw, _ = self.raw_split(split)
            names = label_names(raw, self.columns(), f"the {split!r} split")
            count = len(names) if names is not None else int(max(raw.unique(self.columns().label), default=0)) + 1
            self._classes, self.head_note = fit_to_the_trained_head(
                raw, split, names, count, trained_head(self.model_dir), self.model_dir, self.columns().label,
                self.cfg.task_options.new_head)
        return self._classes

    def start_notes(self):
        return [self.head_note] if self.head_note else []

    def prepare_data(self):
        """Tokenise every split the run reads into the cache, once per file
        system (the other ranks wait, then read it: no two processes write
        the same cache file)."""
        data = self.cfg.data
        streamed = [data.train_subset] if self.cfg.task_options.streaming else []   # tokenised as it is read
        for split in [data.train_subset] + ([] if self.cfg.validation.disable_validation else data.valid_subset):
            if split not in streamed:
                self.tokenized(split)

    def build_dataset(self, split):
        from textbox_like.data.hf_text import HFTextDataset
        from textbox_like.data.text_batches import PackedTextDataset, TextBatcher
        options, training = self.cfg.task_options, split == self.cfg.data.train_subset
        batcher = TextBatcher(self.head, self.pad_id(), self.masking())
        if training and options.streaming:
            return streamed_split(self.cfg, split, self.tokenizer(), self.columns(), batcher)
        documents = HFTextDataset(self.tokenized(split), self.head, self.pad_id(), self.masking())
        if training and options.packing:
            return PackedTextDataset(documents, options.max_length, self.cfg.numerics.seed, batcher)
        return documents

    def masking(self):
        """masked_lm: (seed, probability, mask id, vocabulary size, special ids) of data/text_batches.mask_tokens."""
        if self.head != "masked_lm":
            return None
        tok = self.tokenizer()
        if tok.mask_token_id is None:
            raise UserError(f"--hf_head masked_lm needs a tokenizer with a mask token; {self.model_dir!r}'s has none")
        return (self.cfg.numerics.seed, self.cfg.task_options.mlm_probability, tok.mask_token_id, len(tok),
                list(tok.all_special_ids))

    def tokenized(self, split):
        """``split`` tokenised (a ``datasets.Dataset``), from the cache where it is there."""
        from textbox_like.data.hf_text import label_names, tokenize
        raw, cache = self.raw_split(split)
        label_ids = None
        if self.head == "sequence_classification":
            names, count = self.classes()
            here = label_names(raw, self.columns(), f"the {split!r} split")
            if names is not None and here is None:
                raise UserError(f"the {split!r} split's labels are class numbers, the training split's are names "
                                f"({', '.join(names[:3])}, ...); give every split the same kind of label")
            # a ClassLabel column holds numbers: each maps through its own names to the training split's class
            own = getattr(raw.features[self.columns().label], "names", None)
            label_ids = None if names is None else \
                {str(i): names.index(name) for i, name in enumerate(own) if name in names} if own is not None else \
                {name: i for i, name in enumerate(names)}
            if names is not None and here is not None and set(here) - set(names):
                raise UserError(f"the {split!r} split has labels the training split lacks: "
                                f"{', '.join(sorted(set(here) - set(names))[:5])}")
            if names is None and (here is not None or max(raw.unique(self.columns().label), default=0) >= count):
                raise UserError(f"the {split!r} split's labels do not fit the training split's classes 0..{count - 1}")
        workers = self.cfg.data.num_workers or None
        return tokenize(raw, self.tokenizer(), self.columns(), cache, label_ids, workers)

    # -- model --------------------------------------------------------------
    def model_config(self):
        from textbox_like.data.hf_text import offline
        offline()  # nothing is downloaded
        from transformers import AutoConfig
        try:
            config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:  # no config.json, an unknown model_type, remote code
            raise UserError(f"{self.model_dir}: transformers cannot read its config.json: {first_line(exc)}") from None
        for key, value in self.cfg.model.model_conf.items():
            if not hasattr(config, key):
                raise UserError(f"unknown key {key!r} in --model_conf for {type(config).__name__}; it has no such "
                                f"setting")
            setattr(config, key, value)
        if self.head == "sequence_classification":
            if getattr(config, "pad_token_id", None) is None:  # GPT-2, Llama...: the classifier finds each row's end by it
                config.pad_token_id = self.pad_id()
            names, count = self.classes()
            if names is not None:
                config.id2label = dict(enumerate(names))
                config.label2id = {name: i for i, name in enumerate(names)}
            elif config.num_labels != count:
                config.num_labels = count
        return config

    def build_model(self):
        import transformers
        transformers.utils.logging.disable_progress_bar()  # a bar for loading a few tensors is noise in our log
        import torch
        auto = getattr(transformers, AUTO_CLASSES[self.head])
        config = self.model_config()
        # weights in float32 whatever the files hold (transformers 5 loads a bf16 save as bf16: no master
        # weights, fp16 gradients the scaler refuses); the run's precision is Accelerate's to set
        float32 = {("dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"): torch.float32}
        if any((Path(self.model_dir) / name).is_file() for name in WEIGHT_FILES):
            mismatched = {"ignore_mismatched_sizes": True} if self.head == "sequence_classification" else {}
            try:
                model = auto.from_pretrained(self.model_dir, config=config, local_files_only=True, **mismatched,
                                             **float32)
            except ValueError as exc:
                raise UserError(f"{self.model_dir!r} has no {self.head} model: {str(exc).splitlines()[0]}") from None
        else:
            try:
                model = auto.from_config(config, **float32)
            except ValueError as exc:
                raise UserError(f"{type(config).__name__} has no {self.head} model: "
                                f"{str(exc).splitlines()[0]}") from None
        self.check_vocabulary(model)
        if self.cfg.model.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def check_vocabulary(self, model):
        """Every token id the tokenizer gives has a row in the model's embedding;
        else one line naming both sizes (not an index error at the first batch)."""
        rows = model.get_input_embeddings().num_embeddings
        tokens = len(self.tokenizer())
        if tokens > rows:
            raise UserError(f"the tokenizer in {self.model_dir} has {tokens:,} tokens but the model's embedding has "
                            f"{rows:,} rows (vocab_size in its config.json): ids from {rows:,} on have no embedding; "
                            f"save the tokenizer the model was trained with there, or resize the model's embedding "
                            f"(model.resize_token_embeddings(len(tokenizer)), then save_pretrained)")

    def param_groups(self, model, weight_decay):
        decay, plain = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:  # biases and norms take no decay, as in HF Trainer
                (plain if p.ndim < 2 else decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": plain, "weight_decay": 0.0, "no_decay": True}]
        return [g for g in groups if g["params"]]

    # -- loss and metrics -------------------------------------------------------
    def inputs(self, batch):
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids", "position_ids")}
        if "position_ids" in batch and self.head == "causal_lm":
            # packed rows (transformers' flattened format): the model finds the documents from the position ids
            # only without a cache (data/packing.py)
            inputs["use_cache"] = False
        return inputs

    @staticmethod
    def real_tokens(batch):
        """The batch's real (non-padding) tokens: packed rows mark them, padded batches have their 2-D mask."""
        return batch["real"].sum() if "real" in batch else batch["attention_mask"].sum()

    def count(self, batch):
        if self.head == "sequence_classification":
            return {}
        labels = batch["labels"][:, 1:] if self.head == "causal_lm" else batch["labels"]
        return {"tokens": int((labels != -100).sum())}

    def loss(self, model, batch):
        import torch
        import torch.nn.functional as F

        n = batch["input_ids"].shape[0]  # a host number
        if n == 0:  # a rank with no samples in this step: transformers' models fail on zero rows
            return self.empty_loss(model)
        labels = batch["labels"]
        if self.head == "sequence_classification":
            logits = model(**self.inputs(batch)).logits.float()
            loss_sum = F.cross_entropy(logits, labels, reduction="sum")
            predicted = logits.argmax(dim=-1)
            stats = {"loss_sum": loss_sum.detach(), "correct": (predicted == labels).sum(), "nsamples": n,
                     "ntokens": self.real_tokens(batch)}
            classes = logits.shape[-1]
            if classes <= MAX_F1_CLASSES:  # per-class counts: sums, so F1 adds up over ranks
                hits = torch.bincount(labels[predicted == labels], minlength=classes)
                guessed = torch.bincount(predicted, minlength=classes)
                true = torch.bincount(labels, minlength=classes)
                for c in range(classes):
                    stats[f"f1_hit.{c}"], stats[f"f1_guessed.{c}"], stats[f"f1_true.{c}"] = hits[c], guessed[c], true[c]
            return loss_sum, stats
        if self.head == "seq2seq":
            logits = model(**self.inputs(batch), labels=labels).logits
        else:
            # --peft prompt-tuning: the logits of its virtual tokens come first
            logits = model(**self.inputs(batch)).logits[:, -labels.shape[1]:]
            if self.head == "causal_lm":  # token t predicts token t + 1: the labels move, not the (large) logits
                labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                   ignore_index=-100, reduction="sum")
        predicted = labels != -100
        stats = {"loss_sum": loss_sum.detach(), "tokens": predicted.sum(), "nsamples": n,
                 "ntokens": self.real_tokens(batch)}
        if not model.training:  # an argmax over the vocabulary costs ~4% of a training update: validation only
            stats["correct"] = ((logits.argmax(dim=-1) == labels) & predicted).sum()
        return {"tokens": loss_sum}, stats

    def empty_loss(self, model):
        """The loss terms and stats of a batch of no samples: zeros that still
        touch every trainable parameter, through the model's forward (DDP
        readies its gradient all-reduce there) on one padding token, so
        backward and the all-reduce run as for a real batch; the stats have
        the keys and dtypes a real batch's have on the other ranks (their
        sums are reduced key by key)."""
        import torch
        params = [p for p in model.parameters() if p.requires_grad]
        token = torch.full((1, 1), self.pad_id(), dtype=torch.long, device=params[0].device)
        inputs = {"input_ids": token, "attention_mask": torch.ones_like(token)}
        if self.head == "seq2seq":
            inputs["labels"] = token  # the decoder's inputs come from them
        from textbox_like.parallel import sharding
        # under --fsdp the parameters are shards (DTensors) outside forward: the forward alone touches them
        touched = 0.0 if sharding.is_sharded(model) else sum(p.reshape(-1)[:1].sum() for p in params)
        anchor = (model(**inputs).logits.float().sum() + touched) * 0.0
        count = torch.zeros((), dtype=torch.long, device=anchor.device)
        stats = {"loss_sum": anchor.detach().float(), "nsamples": 0, "ntokens": count.clone()}
        if self.head == "sequence_classification":
            stats["correct"] = count.clone()
            classes = unwrapped(model).config.num_labels
            if classes <= MAX_F1_CLASSES:
                for c in range(classes):
                    stats[f"f1_hit.{c}"], stats[f"f1_guessed.{c}"], stats[f"f1_true.{c}"] = count, count, count
            return anchor, stats
        stats["tokens"] = count.clone()
        if not model.training:
            stats["correct"] = count.clone()
        return {"tokens": anchor}, stats

    def export_at_end(self, model, save_dir):
        """SAVE_DIR/hf_model: the trained model's own save_pretrained and its tokenizer (export_hf_model)."""
        return export_hf_model(model, self.tokenizer(), self.cfg.adapters.merge_on_export, save_dir)

    def validation_stats(self, model, batch):
        """seq2seq: generate from the batch's inputs and score against its targets."""
        if self.head != "seq2seq" or not self.generation:
            return {}
        from textbox_like.metrics.text_metrics import generation_sums
        tok = self.tokenizer()
        if batch["input_ids"].shape[0]:
            o = self.cfg.task_options
            generated = unwrapped(model).generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                                  max_new_tokens=o.generation_max_length, num_beams=o.num_beams,
                                                  do_sample=False)
            predictions = tok.batch_decode(generated, skip_special_tokens=True)
            labels = batch["labels"].masked_fill(batch["labels"] == -100, self.pad_id())
            references = tok.batch_decode(labels, skip_special_tokens=True)
        else:
            predictions = references = []
        return generation_sums([p.strip() for p in predictions], [r.strip() for r in references], self.generation)

    def metrics(self, sums):
        n = max(sums.get("nsamples", 0.0), 1.0)
        if self.head == "sequence_classification":
            out = {"loss": sums.get("loss_sum", 0.0) / n, "accuracy": sums.get("correct", 0.0) / n}
            classes = [key.split(".", 1)[1] for key in sums if key.startswith("f1_true.")]
            scores = []
            for c in classes:
                hit, guessed, true = (sums.get(f"f1_{part}.{c}", 0.0) for part in ("hit", "guessed", "true"))
                if guessed + true > 0:  # a class neither present nor predicted has no F1
                    scores.append(2.0 * hit / (guessed + true))
            if classes:
                out["f1"] = sum(scores) / max(len(scores), 1)
            return out
        tokens = max(sums.get("tokens", 0.0), 1.0)
        loss = sums.get("loss_sum", 0.0) / tokens
        out = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
        if "correct" in sums:  # token accuracy: counted at validation only
            out["accuracy"] = sums["correct"] / tokens
        if self.generation and "gen_nsamples" in sums:
            from textbox_like.metrics.text_metrics import generation_metrics
            out.update(generation_metrics(sums, self.generation))
        return out
