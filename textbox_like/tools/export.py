"""A checkpoint of ours to a directory its model loads from outside this toolkit.

    python -m textbox_like.tools.export CKPT --to DIR [--dict VOCAB]
    textbox-like export CKPT --to DIR

A BERT or ``--task hf`` checkpoint becomes a transformers ``save_pretrained``
directory (below). Any other task's (mnist, a ``--user-dir`` task, a class
given to ``textbox_like.train``) becomes its model's weights alone, whatever
the model is: ``save_pretrained`` where the model has one, else
``model.safetensors`` (``safetensors.torch.load_model(model, FILE)`` loads it
into the model the task builds) beside the run's ``config.yaml``.

``DIR`` receives ``config.json``, ``model.safetensors`` and the tokenizer
files (``vocab.txt`` first among them), so that
``transformers.BertForPreTraining.from_pretrained(DIR)`` (and ``AutoModel``,
``AutoTokenizer``) load the model where researchers use it, and a new run
starts from it with ``--init-checkpoint DIR``.

The model's configuration is rebuilt from the run's own resolved
configuration stored in the checkpoint (preset sizes, ``--config_file``,
overrides, ``--model_conf``), with the vocabulary size the weights have. The
vocabulary is the run's ``--dict``, else the ``vocab.txt`` that
``prepare_bert`` left beside the shards, else the initial weights' directory's;
``--dict`` here names another.

The directory appears whole or not at all: everything is written into a
temporary sibling directory that is renamed into place.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from textbox_like.core.errors import UserError
from textbox_like.storage.fileio import TargetTaken, atomic_directory


# ---------------------------------------------------------------- checks
def check_target(target) -> Path:
    """``target`` may be new or an empty directory; anything else is refused
    before the checkpoint is read."""
    target = Path(target)
    if target.is_file() or (target.exists() and not target.is_dir()):
        raise UserError(f"--to {str(target)!r} is a file; give a new or empty directory")
    if target.is_dir() and any(target.iterdir()):
        raise UserError(f"--to {str(target)!r} exists and is not empty; give a new or empty directory "
                        f"(nothing is overwritten)")
    return target


def read_bert_checkpoint(checkpoint, tasks=("bert",)) -> dict:
    """Our checkpoint of a BERT run (or of one of ``tasks``; None: of any
    task), or one line saying what it is instead."""
    from textbox_like.storage.checkpoint import load_checkpoint
    from textbox_like.storage.sharded_checkpoint import claims_to_be_sharded, consolidated_state

    path = Path(checkpoint)
    if claims_to_be_sharded(path):  # a sharded (FSDP) run's: its full weights gathered from the shards
        state = consolidated_state(path)
    elif path.is_dir():
        inside = path / "checkpoint_last.pt"
        hint = f"; did you mean {str(inside)!r}?" if inside.is_file() else ""
        raise UserError(f"{str(path)!r} is a directory, not a checkpoint file{hint}")
    else:
        state = load_checkpoint(path)
    if tasks is not None and state.get("task") not in tasks:
        raise UserError(f"{str(path)!r} is a checkpoint of task {state.get('task')!r}; only checkpoints of "
                        f"--task bert and --task hf export to transformers")
    if not isinstance(state.get("model"), dict) or not isinstance(state.get("config"), str):
        raise UserError(f"{str(path)!r} holds no model weights or run configuration to export")
    return state


# ---------------------------------------------------------------- the model's parts
def run_config(state):
    """The run's resolved configuration, as the checkpoint stored it."""
    import yaml

    from textbox_like.resolve.resolution import parse
    return parse(overrides=yaml.safe_load(state["config"]))


def model_config(cfg, weights):
    """The run's ``BertConfig``; the vocabulary size is the one the weights have
    (the run's --dict need not exist any more)."""
    from textbox_like.tasks import TASKS

    options = cfg.task_options
    if options.config_file and not Path(options.config_file).is_file():
        raise UserError(f"the run's --config_file {options.config_file!r} no longer exists and it defines the "
                        f"model; put it back at that path")
    task = TASKS.get("bert")(cfg.replace(dict=None))
    config = task.model_config()
    embeddings = weights.get("bert.embeddings.word_embeddings.weight")
    if embeddings is not None:
        config.vocab_size = int(embeddings.shape[0])
    return config


def find_vocab(cfg, given=None) -> Path:
    """The vocab.txt to ship: ``given``, else the run's --dict, else the one
    beside its data, else its initial weights' directory's."""
    if given:
        if not Path(given).is_file():
            raise UserError(f"--dict {given!r} does not exist; check the path")
        return Path(given)
    options = cfg.task_options
    if options.dict:
        if not Path(options.dict).is_file():
            raise UserError(f"the run's --dict {options.dict!r} no longer exists; give export --dict VOCAB")
        return Path(options.dict)
    places = []
    if cfg.data.data:
        data = Path(cfg.data.data)
        places.append(data if data.is_dir() else data.parent)
    if options.init_checkpoint and Path(options.init_checkpoint).is_dir():
        places.append(Path(options.init_checkpoint))
    for place in places:
        if (place / "vocab.txt").is_file():
            return place / "vocab.txt"
    raise UserError("the run named no vocabulary (--dict) and no vocab.txt lies beside its data; "
                    "give export --dict VOCAB (the vocab.txt the shards were prepared with)")


def lower_case(vocab) -> bool:
    """Whether the shards were prepared lower-cased (prepare_bert.json beside
    the vocabulary says so); BERT's uncased default otherwise."""
    info = Path(vocab).parent / "prepare_bert.json"
    try:
        return bool(json.loads(info.read_text())["settings"]["do_lower_case"])
    except (OSError, ValueError, KeyError, TypeError):
        return True


# ---------------------------------------------------------------- writing
def export_bert(checkpoint, target, vocab=None) -> dict:
    """Write ``checkpoint`` (a BERT run's) to ``target`` as transformers'
    ``save_pretrained`` output; returns what was written."""
    target = check_target(target)
    state = read_bert_checkpoint(checkpoint)
    cfg = run_config(state)
    vocab_file = find_vocab(cfg, vocab)
    config = model_config(cfg, state["model"])

    from transformers import BertForPreTraining

    from textbox_like.models import checked_vocab_size
    checked_vocab_size(vocab_file, config.vocab_size, f"the weights in {str(checkpoint)!r}")
    # the plain transformers class: config.json then names BertForPreTraining,
    # which AutoModel and from_pretrained know (our subclass only adds a forward)
    model = BertForPreTraining(config)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        first = (missing + unexpected)[0]
        raise UserError(f"the weights in {str(checkpoint)!r} do not fit a BertForPreTraining built from the "
                        f"run's configuration ({len(missing)} missing, {len(unexpected)} unexpected, e.g. {first})")
    write_directory(target, lambda tmp: _write_directory(tmp, model, vocab_file, config))
    return {"checkpoint": str(checkpoint), "to": str(target), "num_updates": state.get("train", {}).get("num_updates"),
            "vocab": str(vocab_file), "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "vocab_size": config.vocab_size, "files": sorted(p.name for p in target.iterdir())}


def model_with_weights(task, state, checkpoint, model_named, question):
    """``task``'s model with the checkpoint's weights, or one line saying
    they do not fit ``model_named`` (and ``question``: what likely changed)."""
    from textbox_like.models import adapters
    model = adapters.build_model(task, task.cfg.adapters)
    if adapters.enabled(task.cfg.adapters):  # the checkpoint holds what was trained, on this base model
        base = adapters.base_model_path(task.cfg.task_options, task.initial_weights_setting)
        adapters.check_same_base(state.get("base_model") or {}, adapters.base_identity(model, task.cfg.adapters, base),
                                 repr(str(checkpoint)))
        adapters.load_trained_state(model, state["model"], repr(str(checkpoint)))
        return model
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        first = (list(missing) + list(unexpected))[0]
        raise UserError(f"the weights in {str(checkpoint)!r} do not fit {model_named} ({len(missing)} missing, "
                        f"{len(unexpected)} unexpected, e.g. {first}); {question}")
    return model


def write_directory(target, fill):
    """``fill(tmp)`` writes the export into a temporary directory that
    becomes ``target`` whole (fileio.atomic_directory), or one line."""
    try:
        with atomic_directory(target) as tmp:
            fill(tmp)
    except TargetTaken as exc:
        raise UserError(f"--to {str(target)!r} could not be created ({exc.strerror or exc}); "
                        f"was it filled meanwhile?") from None


def export_hf(checkpoint, target, state=None, merge=False) -> dict:
    """Write a ``--task hf`` checkpoint to ``target`` with the model's own
    ``save_pretrained`` and its tokenizer's: the run's model (its
    --model_name_or_path and, for classification, its training labels must
    still be where the run read them) with the checkpoint's weights."""
    from textbox_like.tasks import TASKS

    target = check_target(target)
    state = state or read_bert_checkpoint(checkpoint, tasks=("hf",))
    task = TASKS.get("hf")(run_config(state))
    check_merge(task.cfg, merge)
    model = model_with_weights(task, state, checkpoint, f"the run's model in {task.model_dir!r}",
                               "was that directory changed?")
    from textbox_like.models.adapters import exported_model, is_peft_model
    adapter = is_peft_model(model) and not merge
    model = exported_model(model, merge)

    def fill(tmp):
        model.save_pretrained(str(tmp))
        task.tokenizer().save_pretrained(str(tmp))
    write_directory(target, fill)
    return {"checkpoint": str(checkpoint), "to": str(target), "num_updates": state.get("train", {}).get("num_updates"),
            "class": type(model).__name__, "files": sorted(p.name for p in target.iterdir()), "adapter": adapter,
            "base": task.model_dir}


def check_merge(cfg, merge) -> None:
    """--merge folds LoRA into the weights; prompt methods have nothing to fold."""
    from textbox_like.models.adapters import PROMPT_METHODS
    if merge and cfg.adapters.peft in PROMPT_METHODS:
        raise UserError(f"--merge: the checkpoint's {cfg.adapters.peft} adapter has nothing to fold into the model's "
                        f"weights (its virtual tokens come before the input); export it without --merge, as an "
                        f"adapter (peft.PeftModel.from_pretrained loads it)")


def export_weights(checkpoint, target, state, merge=False) -> dict:
    """Any other task's checkpoint: the model the run's task builds (its
    --user-dir or task class imported from the run's configuration), with
    the checkpoint's weights, written by its own ``save_pretrained`` where it
    has one, else as ``model.safetensors``; the run's ``config.yaml`` beside."""
    from textbox_like.tasks import TASKS

    target = check_target(target)
    cfg = run_config(state)
    check_merge(cfg, merge)
    model = model_with_weights(TASKS.get(cfg.data.task)(cfg), state, checkpoint,
                               f"the model task {cfg.data.task!r} builds now", "was its code changed?")
    from textbox_like.models.adapters import exported_model
    model = exported_model(model, merge)

    def fill(tmp):
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(str(tmp))
        else:
            from safetensors.torch import save_model
            save_model(model, str(tmp / "model.safetensors"))  # tied or shared weights stored once
        (tmp / "config.yaml").write_text(state["config"])
    write_directory(target, fill)
    return {"checkpoint": str(checkpoint), "to": str(target), "num_updates": state.get("train", {}).get("num_updates"),
            "task": cfg.data.task, "class": type(model).__name__, "files": sorted(p.name for p in target.iterdir())}


def _write_directory(tmp, model, vocab_file, config):
    from transformers import BertTokenizer
    model.save_pretrained(str(tmp))
    shutil.copyfile(vocab_file, tmp / "vocab.txt")
    # read back from the directory: the one way to hand BertTokenizer a
    # vocab.txt that transformers 4 and 5 share (their constructors differ)
    tokenizer = BertTokenizer.from_pretrained(str(tmp), do_lower_case=lower_case(vocab_file),
                                              model_max_length=config.max_position_embeddings)
    tokenizer.save_pretrained(str(tmp))
    shutil.copyfile(vocab_file, tmp / "vocab.txt")  # the run's own file, byte for byte


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m textbox_like.tools.export", allow_abbrev=False,
        description="Write a BERT checkpoint as a transformers save_pretrained directory (config.json, "
                    "model.safetensors, vocab.txt) for BertForPreTraining/AutoModel.from_pretrained; a --task hf "
                    "checkpoint as its own model class's save_pretrained directory with its tokenizer; any other "
                    "task's as its model's weights (model.safetensors, or save_pretrained) with config.yaml.")
    parser.add_argument("checkpoint", metavar="CKPT", help="a run's checkpoint, e.g. OUT/checkpoint_best.pt (or a "
                        "sharded run's OUT/checkpoint_best.dcp)")
    parser.add_argument("--to", required=True, metavar="DIR", help="new or empty output directory")
    parser.add_argument("--merge", action="store_true",
                        help="a --peft lora checkpoint: write the model with the adapters folded into its weights (a "
                             "plain transformers model) instead of the adapter alone")
    parser.add_argument("--dict", default=None, metavar="VOCAB",
                        help="vocab.txt to ship (default: the run's --dict, or the vocab.txt beside its data)")
    return parser


def main(argv=None):
    from textbox_like.resolve.options import run_tool
    return run_tool(build_parser(), argv, export_and_report)


def export_and_report(args):
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()  # a bar for one shard is noise beside our one line
    check_target(args.to)
    state = read_bert_checkpoint(args.checkpoint, tasks=None)
    if state["task"] not in ("bert", "hf"):
        info = export_weights(args.checkpoint, args.to, state, args.merge)
        how = (f"transformers' {info['class']}.from_pretrained({info['to']!r})" if "config.json" in info["files"] else
               f"safetensors.torch.load_model(model, {info['to'] + '/model.safetensors'!r}) into the model task "
               f"{info['task']!r} builds (its configuration: config.yaml there)")
        print(f"exported {info['checkpoint']} (update {info['num_updates']}: task {info['task']}, {info['class']}) to "
              f"{info['to']}; load it with {how}")
        return
    if state["task"] == "hf":
        info = export_hf(args.checkpoint, args.to, state, args.merge)
        how = (f"peft.PeftModel.from_pretrained(base, {info['to']!r}), base the model in {info['base']!r}"
               if info["adapter"] else f"transformers.{info['class']}.from_pretrained({info['to']!r})")
        print(f"exported {info['checkpoint']} (update {info['num_updates']}: {info['class']}"
              f"{' adapter' if info['adapter'] else ''}) with its tokenizer to {info['to']}; load it with {how} "
              f"(or AutoTokenizer.from_pretrained)")
        return
    info = export_bert(args.checkpoint, args.to, args.dict)
    print(f"exported {info['checkpoint']} (update {info['num_updates']}: {info['layers']} layers, hidden "
          f"{info['hidden']}, vocabulary {info['vocab_size']}) to {info['to']}; load it with "
          f"transformers.BertForPreTraining.from_pretrained({info['to']!r})")


if __name__ == "__main__":
    sys.exit(main())
