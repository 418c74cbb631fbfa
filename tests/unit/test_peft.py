"""--peft: LoRA, prefix-tuning, p-tuning-v2 and prompt-tuning through peft, and bitfit.

What holds here, in one process (the ranks, --fsdp and kill -9 are test_peft_processes.py's):

- the options are typed and TextBox's spelling (--efficient_methods, --efficient_kwargs) is ours, with
  TextBox's defaults for what it leaves out; a method peft lacks, two methods, an unknown option: one line;
- each method trains only its own weights: the base model's weights are bit-identical after training, the
  checkpoint holds exactly the trained tensors (a small fraction of a full one), and the start line says
  how many of the parameters train;
- a resume continues bitwise; a resume onto another base model, a full run's checkpoint resumed with --peft
  and a --peft checkpoint resumed without it are one line each;
- the export writes the adapter (peft.PeftModel.from_pretrained loads it to the same logits) or, with
  --merge, a plain transformers model with LoRA folded in (the same logits within 1e-5); --merge of a
  prompt-tuning adapter is one line and writes nothing.
"""
from __future__ import annotations


import pytest
import torch

from conftest import read_jsonl, refusal_in_process, run_main
from test_faults import build_trainer, run_trainer
from test_hf_task import hf_args, models, text_data  # noqa: F401 (fixtures)

METHODS = ("lora", "prefix-tuning", "p-tuning-v2", "prompt-tuning", "bitfit")
SMALL = {"lora": ["--lora-r", "2"], "prefix-tuning": ["--prefix-length", "3", "--prefix-mid-dim", "8"],
         "p-tuning-v2": ["--prefix-length", "3"], "prompt-tuning": ["--prompt-length", "3"], "bitfit": []}
SEQ2SEQ = ("--target_column", "target", "--generation_max_length", "4")


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def base_weights(model_dir, head):
    import transformers

    from textbox_like.tasks.hf import AUTO_CLASSES
    model = getattr(transformers, AUTO_CLASSES[head]).from_pretrained(str(model_dir), dtype=torch.float32)
    return {name: value.clone() for name, value in model.state_dict().items()}


def frozen_base_weights(model):
    """The frozen weights of a trained model under the plain model's names (peft's base model inside; LoRA's
    wrapped layers keep theirs as ``base_layer``, a head trained whole its untouched copy as
    ``original_module``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {n.replace(".base_layer.", ".").replace(".original_module.", "."): p
            for n, p in base.named_parameters() if not p.requires_grad}


def peft_args(models, text_data, out, head, method, *extra, max_update=4):
    columns = SEQ2SEQ if head == "seq2seq" else ()
    return hf_args(models[head], text_data, out, "--peft", method, *SMALL[method], *columns, "--log-format", "json",
                   "--log-interval", "1", *extra, max_update=max_update)


# ---------------------------------------------------------------- options
def adapters_of(*args):
    from textbox_like.resolve.resolution import parse
    return parse([str(a) for a in args]).adapters


def test_textbox_spelling_is_ours_with_textboxs_defaults_for_what_it_leaves_out(models, text_data, tmp_path):
    common = hf_args(models["causal_lm"], text_data, tmp_path / "x")
    ours = adapters_of(*common, "--peft", "lora", "--lora-r", "4", "--lora-alpha", "32", "--lora-dropout", "0.1")
    theirs = adapters_of(*common, "--efficient_methods", "['lora']", "--efficient_kwargs",
                         "{'lora_r': 4, 'lora_alpha': 32, 'lora_dropout': 0.1}")
    fields = ("peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields] == ["lora", 4, 32.0, 0.1, []]
    defaults = adapters_of(*common, "--efficient_methods", "['lora']")
    assert (defaults.lora_r, defaults.lora_alpha, defaults.lora_dropout) == (4, 32.0, 0.1)   # TextBox's
    prefix = adapters_of(*common, "--efficient_methods", "['p-tuning-v2']", "--efficient_kwargs",
                         "{'prefix_length': 7, 'prefix_mid_dim': 16, 'prefix_dropout': 0.0}")
    assert (prefix.peft, prefix.prefix_length, prefix.prefix_mid_dim, prefix.prefix_dropout) == \
        ("p-tuning-v2", 7, 16, 0.0)
    prompt = adapters_of(*common, "--efficient_methods=['prompt-tuning']")
    assert (prompt.peft, prompt.prompt_length) == ("prompt-tuning", 100)
    assert adapters_of(*common).peft == "none"


@pytest.mark.parametrize("extra, expected", [
    (["--efficient_methods", "['adapter']"], "not supported (TextBox's adapter layers have no counterpart in peft); "
                                             "choose one of lora, prefix-tuning, p-tuning-v2, prompt-tuning, bitfit"),
    (["--efficient_methods", "['lora', 'bitfit']"], "one method at a time"),
    (["--efficient_methods", "['lora']", "--efficient_kwargs", "{'prefix_length': 3}"],
     "prefix_length is no option of lora (its options: lora_r, lora_dropout, lora_alpha)"),
    (["--efficient_methods", "['lora']", "--efficient_kwargs", "{'lora_r': 0}"], "--efficient_kwargs lora_r"),
    (["--efficient_methods", "['lora']", "--peft", "bitfit"], "name different methods; keep one"),
    (["--efficient_kwargs", "{'lora_r': 4}"], "--efficient_kwargs needs --efficient_methods"),
    (["--peft", "adapter"], "--peft: invalid choice"),
    (["--peft", "lora", "--lora-r", "0"], "--lora-r"),
    (["--peft", "lora", "--lora-dropout", "1"], "expects a probability"),
    (["--peft", "prompt-tuning", "--merge-on-export"], "has nothing to fold"),
    (["--peft", "lora", "--lora-target-modules", "no_such_proj"], "has no such module; its linear layers: "),
])
def test_bad_options_are_one_line_and_write_nothing(models, text_data, tmp_path, capfd, extra, expected):
    out = tmp_path / "out"
    result = refusal_in_process(hf_args(models["causal_lm"], text_data, out, *extra), capfd)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith(("error", "usage"))]) == 1, \
        result.stderr
    assert not (out / "checkpoint_last.pt").exists()


def test_help_and_print_config_show_the_options(models, text_data, tmp_path, capsys):
    from textbox_like.cli import main
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    for flag in ("--peft", "--lora-r", "--lora-target-modules", "--prefix-length", "--prompt-length",
                 "--merge-on-export", "--efficient_methods"):
        assert flag in help_text, flag
    assert run_main(hf_args(models["causal_lm"], text_data, tmp_path / "p", "--print_config")) == 0
    assert "lora_r" not in capsys.readouterr().out   # printed only where --peft is on
    assert run_main(hf_args(models["causal_lm"], text_data, tmp_path / "p", "--peft", "lora", "--print_config")) == 0
    printed = capsys.readouterr().out
    assert "peft: lora" in printed and "lora_r: 8" in printed


# ---------------------------------------------------------------- what trains
@pytest.mark.parametrize("head, method", [("causal_lm", m) for m in METHODS]
                         + [("seq2seq", m) for m in ("lora", "prefix-tuning", "prompt-tuning", "bitfit")])
def test_each_method_trains_only_its_weights_and_saves_only_them(models, text_data, tmp_path, head, method):
    out = tmp_path / "run"
    trainer, _, _ = build_trainer(peft_args(models, text_data, out, head, method))
    initial = {n: p.detach().clone() for n, p in trainer.task_model.named_parameters() if p.requires_grad}
    assert run_trainer(trainer) == 0
    model = trainer.task_model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if method == "bitfit":
        assert trained and all(n.endswith(".bias") for n in trained), trained
    else:
        assert trained and all(("lora_" in n or "prompt_encoder" in n) for n in trained), trained
    base = base_weights(models[head], head)
    frozen = frozen_base_weights(model)
    assert frozen
    for name, value in frozen.items():   # the base model's weights, bit for bit
        assert torch.equal(value, base[name]), name
    saved = load(out / "checkpoint_last.pt")
    assert set(saved["model"]) == trained
    assert all(torch.equal(saved["model"][n], p.detach()) for n, p in model.named_parameters() if n in trained)
    assert any(not torch.equal(saved["model"][n], initial[n]) for n in trained)   # it trained
    assert saved["base_model"]["method"] == method and saved["base_model"]["path"] == str(models[head])
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 4 and all(loss == loss for loss in losses)


@pytest.mark.parametrize("head, method", [(h, m) for h in ("sequence_classification", "masked_lm")
                                          for m in ("lora", "bitfit")])
def test_the_classification_and_masked_lm_heads_train_adapters_too(models, text_data, tmp_path, head, method):
    """peft's task type follows the head (SEQ_CLS; masked LM as FEATURE_EXTRACTION): LoRA trains its adapters
    and, for classification, the new classifier head whole (peft's modules_to_save); bitfit its biases and the
    classifier; every other weight of a saved base model stays as it was."""
    out = tmp_path / "run"
    trainer, _, _ = build_trainer(peft_args(models, text_data, out, head, method))
    assert run_trainer(trainer) == 0
    model = trainer.task_model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    classifier = {n for n in trained if any(f"{h}." in n for h in ("classifier", "score"))}
    assert bool(classifier) == (head == "sequence_classification"), classifier
    adapted = trained - classifier
    assert adapted and all(("lora_" in n) if method == "lora" else n.endswith(".bias") for n in adapted), adapted
    assert set(load(out / "checkpoint_last.pt")["model"]) == trained
    if head == "sequence_classification":   # masked_lm's base is built from its config: no saved weights
        base = base_weights(models[head], head)
        for name, value in frozen_base_weights(model).items():
            assert torch.equal(value, base[name]), name
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 4 and all(loss == loss for loss in losses)


def test_the_start_line_says_what_trains_and_a_lora_checkpoint_is_small(models, text_data, tmp_path, capfd):
    assert run_main(hf_args(models["causal_lm"], text_data, tmp_path / "full", "--max-update", "1")) == 0
    assert run_main(peft_args(models, text_data, tmp_path / "lora", "causal_lm", "lora", max_update=1)) == 0
    err = capfd.readouterr().err
    import transformers
    base = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(
        str(models["causal_lm"])).parameters())
    trained = sum(v.numel() for v in load(tmp_path / "lora" / "checkpoint_last.pt")["model"].values())
    share = f"{100.0 * trained / (base + trained):.2g}"
    assert f"task hf | {base + trained:,} parameters, {trained:,} trained ({share}%, --peft lora) | " in err, err
    full_bytes = (tmp_path / "full" / "checkpoint_last.pt").stat().st_size
    lora_bytes = (tmp_path / "lora" / "checkpoint_last.pt").stat().st_size
    assert lora_bytes < 0.25 * full_bytes, (lora_bytes, full_bytes)


# ---------------------------------------------------------------- resume
EACH = [("causal_lm", m) for m in METHODS] + [("seq2seq", m) for m in ("lora", "prefix-tuning", "prompt-tuning",
                                                                     "bitfit")]


@pytest.mark.parametrize("head, method", EACH)
def test_a_resume_continues_bitwise(models, text_data, tmp_path, head, method):
    """Cut at update 3 of 6 and resumed: the adapters, the optimizer state and every loss of the run that
    was never cut, bit for bit (kill -9 of two ranks: test_peft_processes.py)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    constant = ("--lr-scheduler", "constant", "--disable-validation")   # the same schedule cut at 3 of 6 updates
    assert run_main(peft_args(models, text_data, straight, head, method, *constant, max_update=6)) == 0
    assert run_main(peft_args(models, text_data, split, head, method, *constant, max_update=3)) == 0
    assert run_main(peft_args(models, text_data, split, head, method, *constant, "--resume", max_update=6)) == 0
    a, b = load(straight / "checkpoint_last.pt"), load(split / "checkpoint_last.pt")
    for key in ("model", "optimizer"):
        from conftest import assert_bitwise_equal
        assert_bitwise_equal(a[key], b[key], key)
    losses = [[r["loss"] for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "train"] for d in (straight, split)]
    assert losses[0] == losses[1]


def other_base(models, tmp_path, head="causal_lm"):
    """The same architecture with other weights, in another directory."""
    import shutil

    import transformers

    from textbox_like.tasks.hf import AUTO_CLASSES
    target = tmp_path / "other_base"
    shutil.copytree(models[head], target)
    model = getattr(transformers, AUTO_CLASSES[head]).from_pretrained(str(target))
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(0.01)
    model.save_pretrained(str(target))
    return target


def test_resumes_that_do_not_fit_are_one_line(models, text_data, tmp_path, capfd):
    lora = tmp_path / "lora"
    assert run_main(peft_args(models, text_data, lora, "causal_lm", "lora", max_update=2)) == 0
    before = load(lora / "checkpoint_last.pt")
    other = other_base(models, tmp_path)
    moved = [a if a != str(models["causal_lm"]) else str(other)
             for a in peft_args(models, text_data, lora, "causal_lm", "lora", "--resume", max_update=4)]
    result = refusal_in_process(moved, capfd)
    assert result.returncode != 0 and "resume onto the base model it was trained on" in result.stderr, result.stderr
    assert f"this run's base model {other} is another" in result.stderr
    # without --peft: the configuration says what changed
    result = refusal_in_process(hf_args(models["causal_lm"], text_data, lora, "--resume", max_update=4), capfd)
    assert result.returncode != 0 and "was trained with --peft 'lora', this run has 'none'" in result.stderr
    # a full run's checkpoint resumed with --peft
    full = tmp_path / "full"
    assert run_main(hf_args(models["causal_lm"], text_data, full, max_update=2)) == 0
    result = refusal_in_process(peft_args(models, text_data, full, "causal_lm", "lora", "--resume"), capfd)
    assert result.returncode != 0 and "this run has 'lora'" in result.stderr, result.stderr
    from conftest import assert_bitwise_equal
    assert_bitwise_equal(load(lora / "checkpoint_last.pt")["model"], before["model"])   # nothing written


# ---------------------------------------------------------------- export
def logits_of(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits


@pytest.mark.parametrize("head, method", [(h, m) for h, m in EACH if m != "lora"])
def test_each_methods_export_loads_to_the_trained_logits(models, text_data, tmp_path, head, method):
    """The adapter (prefix, prompt) loads with peft.PeftModel.from_pretrained onto the base model; bitfit's
    export is the whole model (it has no adapter); either gives the trained model's logits."""
    import peft
    import transformers

    from textbox_like.tasks.hf import AUTO_CLASSES
    from textbox_like.tools.export import main as export_main
    out = tmp_path / "run"
    trainer, _, _ = build_trainer(peft_args(models, text_data, out, head, method, "--lr", "0.05"))
    assert run_trainer(trainer) == 0
    tokens = torch.tensor([[2, 7, 8, 9, 10, 3]])
    extra = {"decoder_input_ids": tokens} if head == "seq2seq" else {}

    def logits(model):
        model.eval()
        with torch.no_grad():
            return model(input_ids=tokens, attention_mask=torch.ones_like(tokens), **extra).logits
    trained = logits(trainer.task_model)
    assert export_main([str(out / "checkpoint_last.pt"), "--to", str(tmp_path / "export")]) in (0, None)
    auto = getattr(transformers, AUTO_CLASSES[head])
    if method == "bitfit":
        loaded = auto.from_pretrained(str(tmp_path / "export"))
    else:
        assert (tmp_path / "export" / "adapter_config.json").is_file()
        loaded = peft.PeftModel.from_pretrained(auto.from_pretrained(str(models[head])), str(tmp_path / "export"))
    assert torch.allclose(logits(loaded), trained, atol=1e-6)


def test_export_writes_the_adapter_or_the_merged_model(models, text_data, tmp_path, capfd):
    import peft
    import transformers

    from textbox_like.tools.export import main as export_main
    out = tmp_path / "run"
    trainer, _, _ = build_trainer(peft_args(models, text_data, out, "causal_lm", "lora", "--lr", "0.05"))
    assert run_trainer(trainer) == 0
    tokens = torch.tensor([[2, 7, 8, 9, 10, 3]])
    trained = logits_of(trainer.task_model, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(models["causal_lm"]))
    assert not torch.allclose(logits_of(base, tokens), trained, atol=1e-4)   # the adapters changed something
    # the end-of-run hf_model/ is the adapter
    adapter = peft.PeftModel.from_pretrained(base, str(out / "hf_model"))
    assert torch.allclose(logits_of(adapter, tokens), trained, atol=1e-6)
    assert export_main([str(out / "checkpoint_last.pt"), "--to", str(tmp_path / "adapter")]) in (0, None)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    again = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(models["causal_lm"])), str(tmp_path / "adapter"))
    assert torch.allclose(logits_of(again, tokens), trained, atol=1e-6)
    assert export_main([str(out / "checkpoint_last.pt"), "--to", str(tmp_path / "merged"), "--merge"]) in (0, None)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(logits_of(merged, tokens), trained, atol=1e-5)
    assert "peft.PeftModel.from_pretrained(base" in capfd.readouterr().out


def test_merge_of_a_prompt_tuning_adapter_is_one_line_and_writes_nothing(models, text_data, tmp_path, capfd):
    from textbox_like.tools.export import main as export_main
    out = tmp_path / "run"
    assert run_main(peft_args(models, text_data, out, "causal_lm", "prompt-tuning", max_update=1)) == 0
    capfd.readouterr()
    code = export_main([str(out / "checkpoint_last.pt"), "--to", str(tmp_path / "merged"), "--merge"])
    err = capfd.readouterr().err
    assert code not in (0, None) and "has nothing to fold" in err and "Traceback" not in err, err
    assert not (tmp_path / "merged").exists() or not any((tmp_path / "merged").iterdir())


# ---------------------------------------------------------------- a user's own task
USER_TASK = '''
import torch
from textbox_like import Task, register_task


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.embed(x)))))


@register_task("adapted_net")
class AdaptedNet(Task):
    lora_target_modules = ("hidden",)   # what --peft lora adapts unless --lora-target-modules says otherwise

    def build_dataset(self, split):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        x = torch.randn(64, 4, generator=g)
        return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())

    def build_model(self):
        return Net()

    def loss(self, model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), {"nsamples": len(y)}
'''


@pytest.fixture
def user_dir(tmp_path):
    """A task of the user's own, in a folder outside the repository."""
    folder = tmp_path / "elsewhere" / "my_adapted_task"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(USER_TASK)
    return folder


def user_args(user_dir, out, *extra):
    return ["--user-dir", str(user_dir), "--task", "adapted_net", "--max-sentences", "8", "--optimizer", "adam",
            "--lr", "0.05", "--max-update", "6", "--log-format", "simple", "--save-dir", str(out), *extra]


def test_a_user_task_trains_lora_on_the_modules_it_names(user_dir, tmp_path, capfd):
    assert run_main(user_args(user_dir, tmp_path / "own", "--peft", "lora", "--lora-r", "2")) == 0
    saved = load(tmp_path / "own" / "checkpoint_last.pt")
    assert sorted(saved["model"]) == ["base_model.model.hidden.lora_A.default.weight",
                                      "base_model.model.hidden.lora_B.default.weight"]
    assert saved["model"]["base_model.model.hidden.lora_A.default.weight"].shape == (2, 16)
    assert "parameters, 64 trained (" in capfd.readouterr().err   # 2 x 16 + 16 x 2
    # --lora-target-modules overrides the task's choice; bitfit trains its three biases
    assert run_main(user_args(user_dir, tmp_path / "named", "--peft", "lora", "--lora-target-modules", "embed,out")) == 0
    assert {k.split(".")[2] for k in load(tmp_path / "named" / "checkpoint_last.pt")["model"]} == {"embed", "out"}
    assert run_main(user_args(user_dir, tmp_path / "bitfit", "--peft", "bitfit")) == 0
    assert sorted(load(tmp_path / "bitfit" / "checkpoint_last.pt")["model"]) == ["embed.bias", "hidden.bias", "out.bias"]
    # a prompt method needs a transformers model: one line
    result = refusal_in_process(user_args(user_dir, tmp_path / "prompt", "--peft", "prompt-tuning"), capfd)
    assert result.returncode != 0 and "Net is not one: choose --peft lora" in result.stderr, result.stderr


def test_the_python_api_trains_lora_on_a_task_class(user_dir, tmp_path):
    import importlib
    import sys

    import textbox_like
    sys.path.insert(0, str(user_dir.parent))
    try:
        module = importlib.import_module("my_adapted_task")
        results = textbox_like.train(task=module.AdaptedNet, max_sentences=8, optimizer="adam", lr=0.05,
                                     max_update=4, log_format="none", save_dir=str(tmp_path / "api"), peft="lora",
                                     lora_r=4)
    finally:
        sys.path.remove(str(user_dir.parent))
    assert results["exit_code"] == 0 and results["num_updates"] == 4
    saved = load(tmp_path / "api" / "checkpoint_last.pt")
    assert saved["model"]["base_model.model.hidden.lora_A.default.weight"].shape == (4, 16)


def test_lora_under_mixed_precision_trains_float32_adapters(models, text_data, tmp_path, capfd):
    """--bf16 (Accelerate's autocast; on CPU too): the adapters stay float32 masters and learn."""
    out = tmp_path / "bf16"
    assert run_main(peft_args(models, text_data, out, "causal_lm", "lora", "--bf16", "--lr", "0.05",
                              max_update=6)) == 0
    assert "precision bf16" in capfd.readouterr().err
    saved = load(out / "checkpoint_last.pt")["model"]
    assert saved and all(v.dtype == torch.float32 for v in saved.values())
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses
