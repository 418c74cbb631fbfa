"""--peft: train a few weights of a frozen model instead of every weight.

``lora``, ``prefix-tuning``, ``p-tuning-v2`` and ``prompt-tuning`` are peft's
(``get_peft_model`` with the method's config; prefix-tuning makes its prefix
by an MLP of ``--prefix-mid-dim``, p-tuning-v2 trains the prefix itself, as
TextBox has them); ``bitfit`` needs no peft: every weight but the biases is
frozen. The trainer, validation, export and ``textbox_like.evaluate`` all
build the model through :func:`build_model`, so the adapted model is the
same wherever it is made.

What is trained is all a checkpoint holds of the model
(:func:`trained_state`), with the identity of the base model it adapts
(:func:`base_identity`: its path and a digest of its frozen weights): a
resume onto another base model is refused in one line
(:func:`check_same_base`). The maths is the trainer's as ever: the frozen
weights take no gradient, the adapters' gradients are all-reduced (DDP) or
sharded (--fsdp) like any other.

A task may name the modules LoRA adapts by default (``lora_target_modules``,
a tuple of the ends of module names) and peft's task type
(``peft_task_type``, e.g. ``"CAUSAL_LM"``); the hf task gives both from its
head and peft's table of model types.
"""
from __future__ import annotations

from textbox_like.core.errors import UserError, first_line

#: the methods that put virtual tokens before the input (peft's prompt learning)
PROMPT_METHODS = ("prefix-tuning", "p-tuning-v2", "prompt-tuning")
#: the ``--efficient_kwargs`` / option names of each method, for messages
METHOD_OPTIONS = {"lora": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"),
                  "prefix-tuning": ("prefix_length", "prefix_mid_dim", "prefix_dropout"),
                  "p-tuning-v2": ("prefix_length", "prefix_dropout"), "prompt-tuning": ("prompt_length",),
                  "bitfit": ()}


def enabled(adapters) -> bool:
    """Whether the run trains adapters (or biases) rather than every weight."""
    return adapters is not None and adapters.peft != "none"


def build_model(task, adapters):
    """The task's model with the run's adapters (``cfg.adapters``) applied."""
    return apply_adapters(task.build_model(), adapters, task)


def apply_adapters(model, adapters, task=None):
    """``model`` with the method of ``adapters`` applied: a peft model, or
    (bitfit) the model itself with only its biases left trainable. The base
    weights' digest is taken here, before any wrapper or shard."""
    if not enabled(adapters):
        return model
    method = adapters.peft
    if method == "bitfit":
        adapted = bitfit(model, task)
    else:
        adapted = peft_model(model, adapters, task)
        if method in ("prefix-tuning", "p-tuning-v2") and adapters.prefix_dropout:
            drop_out_prefix(adapted, adapters.prefix_dropout)
    adapted.textbox_like_base_digest = frozen_digest(adapted)
    return adapted


#: the heads of classification models, which train whole beside the adapters
#: (peft's modules_to_save for its SEQ_CLS task type)
CLASSIFIER_HEADS = ("classifier", "score")


def bitfit(model, task=None):
    """Every weight frozen but the biases (BitFit), and a classification
    head, which peft's other methods train whole too: a random head left
    frozen would make the biases learn nothing useful."""
    classifies = getattr(task, "peft_task_type", None) == "SEQ_CLS"
    heads = tuple(name for name, _ in model.named_children() if name in CLASSIFIER_HEADS) if classifies else ()
    trained = 0
    for name, param in model.named_parameters():
        keep = name.rsplit(".", 1)[-1] == "bias" or any(name.startswith(h + ".") for h in heads)
        param.requires_grad_(keep)
        trained += keep
    if not trained:
        raise UserError("--peft bitfit trains the biases, and this model has none; choose --peft lora (or train every "
                        "weight: leave --peft out)")
    return model


def peft_model(model, adapters, task):
    """``peft.get_peft_model`` with the method's configuration; a model or a
    target module that does not fit, one line."""
    import peft
    method = adapters.peft
    is_transformers = hasattr(model, "config") and hasattr(model.config, "to_dict")
    if method in PROMPT_METHODS and not is_transformers:
        raise UserError(f"--peft {method} puts virtual tokens before a Hugging Face transformers model's input; "
                        f"{type(model).__name__} is not one: choose --peft lora (with --lora-target-modules) or "
                        f"bitfit")
    task_type = getattr(task, "peft_task_type", None)
    if method == "lora":
        targets = list(adapters.lora_target_modules) or list(getattr(task, "lora_target_modules", ()) or ()) or None
        if targets is None and not default_lora_targets(model):
            raise UserError(f"--peft lora: peft has no default modules to adapt for {model_kind(model)}; name them "
                            f"with --lora-target-modules (its linear layers: {linear_layer_names(model)})")
        config = peft.LoraConfig(task_type=task_type, r=adapters.lora_r, lora_alpha=adapters.lora_alpha,
                                 lora_dropout=adapters.lora_dropout, target_modules=targets)
    elif method == "prompt-tuning":
        config = peft.PromptTuningConfig(task_type=task_type, num_virtual_tokens=adapters.prompt_length)
    else:
        projection = method == "prefix-tuning"
        config = peft.PrefixTuningConfig(task_type=task_type, num_virtual_tokens=adapters.prefix_length,
                                         prefix_projection=projection,
                                         **({"encoder_hidden_size": adapters.prefix_mid_dim} if projection else {}))
    try:
        return peft.get_peft_model(model, config)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = first_line(exc, 200)
        if method == "lora" and "target" in reason.lower():
            raise UserError(f"--lora-target-modules {','.join(adapters.lora_target_modules or targets or [])}: "
                            f"{model_kind(model)} has no such module; its linear layers: "
                            f"{linear_layer_names(model)}") from None
        raise UserError(f"--peft {method} does not fit {model_kind(model)}: {reason}") from None


def model_kind(model) -> str:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model type {kind})" if kind else type(model).__name__


def default_lora_targets(model) -> list:
    """peft's default LoRA targets for the model's type (empty where it has none)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    return list(defaults.get(getattr(getattr(model, "config", None), "model_type", None), ()))


def linear_layer_names(model, limit=8) -> str:
    """The distinct ends of the names of the model's linear layers (what
    --lora-target-modules takes), for a message."""
    import torch
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Embedding)
    names = []
    for name, module in model.named_modules():
        end = name.rsplit(".", 1)[-1]
        if name and (isinstance(module, kinds) or type(module).__name__ == "Conv1D") and end not in names:
            names.append(end)
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") if names else "none"


def drop_out_prefix(model, p: float) -> None:
    """TextBox's prefix_dropout, which peft's prefix encoder lacks: dropout on
    the prefix's keys and values while training."""
    import torch.nn.functional as F
    for encoder in model.prompt_encoder.values():
        encoder.register_forward_hook(lambda module, args, out: F.dropout(out, p, module.training))


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def exported_model(model, merge: bool):
    """What ``save_pretrained`` writes of a trained model: a peft model's
    adapter alone (``PeftModel.from_pretrained(base, DIR)`` loads it), or with
    ``merge`` the base model with LoRA folded in, a plain transformers model
    (on a copy: the run's model keeps its adapters)."""
    if not (merge and is_peft_model(model)):
        return model
    import copy
    return copy.deepcopy(model).merge_and_unload()


def check_options(cfg) -> None:
    """Options of --peft that cannot work, before anything starts."""
    adapters = cfg.adapters
    method = adapters.peft
    if adapters.merge_on_export and method in PROMPT_METHODS:
        raise UserError(f"--merge-on-export: {method} has nothing to fold into the model's weights (its virtual "
                        f"tokens come before the input); leave --merge-on-export out: hf_model/ is then the adapter")
    if adapters.merge_on_export and method == "none":
        raise UserError("--merge-on-export folds --peft lora adapters into the model; this run trains every weight "
                        "(no --peft): leave it out")


# ---------------------------------------------------------------- checkpoints
def frozen_digest(model) -> str:
    """A digest of the frozen weights' names and bytes: the base model an
    adapter belongs to."""
    import hashlib

    import torch
    digest = hashlib.blake2b(digest_size=16)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            value = param.detach().to("cpu").contiguous()
            digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def trained_names(model) -> set:
    """The names (state-dict keys) of the parameters that train."""
    return {name for name, param in model.named_parameters() if param.requires_grad}


def trained_state(model) -> dict:
    """The model's state as a checkpoint holds it under --peft: the trained tensors only."""
    keep = trained_names(model)
    return {name: value for name, value in model.state_dict().items() if name in keep}


def load_trained_state(model, state: dict, where: str) -> None:
    """Load a checkpoint's trained tensors; the frozen ones stay the base
    model's. A full model's state (a run without --peft) or another
    method's, one line."""
    from textbox_like.storage.checkpoint import check_trained_keys
    check_trained_keys(trained_names(model), state, where)
    model.load_state_dict(state, strict=False)


def base_model_path(task_options, weights_setting):
    """Where the base model's weights come from: the task's own setting for
    its initial weights (``Task.initial_weights_setting``, e.g.
    --model_name_or_path), or None for a model of random weights."""
    return getattr(task_options, weights_setting, None) if weights_setting else None


def base_identity(model, adapters, base_path) -> dict:
    """What a checkpoint records of the base model an adapter belongs to."""
    return {"method": adapters.peft, "path": str(base_path) if base_path else None,
            "digest": getattr(model, "textbox_like_base_digest", None)}


def check_same_base(saved: dict, current: dict, where: str) -> None:
    """A resume onto another base model is refused in one line."""
    if saved.get("digest") and current.get("digest") and saved["digest"] != current["digest"]:
        raise UserError(f"{where} holds {saved.get('method')} adapters of the base model {saved.get('path')} "
                        f"(digest {saved['digest'][:12]}), and this run's base model "
                        f"{current.get('path')} is another (digest {current['digest'][:12]}); resume onto the base "
                        f"model it was trained on")
