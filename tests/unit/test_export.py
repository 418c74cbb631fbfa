"""Models leave as transformers models: a tiny BERT pre-trained here, exported
with ``python -m textbox_like.tools.export``, loads with ``from_pretrained`` and
gives our own eval's MLM loss; a new run starts from the exported directory."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from textbox_like.tools.prepare_bert import main as prepare
from textbox_like.tools.export import main as export_main

from conftest import base_args, refusal_in_process, run_main
from test_prepare_bert import write_corpus, write_vocab


REPO = Path(__file__).resolve().parents[2]

PY = sys.executable


def run(argv, timeout=300):
    return subprocess.run([PY, *map(str, argv)], capture_output=True, text=True, cwd=REPO, timeout=timeout)


def export_in_process(argv, capfd):
    """``python -m textbox_like.tools.export ARGV`` in-process, as a CompletedProcess
    (its main is what the module's process runs: one line and 2 on a mistake)."""
    capfd.readouterr()
    code = export_main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def assert_one_line_error(out, *fragments):
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Tiny BERT (--model-preset tiny) pre-trained 8 updates on synthetic
    shards, and its export."""
    root = tmp_path_factory.mktemp("export")
    write_vocab(root / "vocab.txt")
    write_corpus(root / "corpus.txt", n_docs=60)
    assert prepare(["--input", str(root / "corpus.txt"), "--vocab", str(root / "vocab.txt"),
                    "--output", str(root / "shards"), "--max-seq-length", "32", "--max-predictions-per-seq", "5",
                    "--dupe-factor", "2", "--valid-fraction", "0.1", "--no-progress-bar", "--num-proc", "1"]) == 0
    # in-process: what is tested here is the export, not a process (test_console_command_exports starts one)
    assert run_main(["--task", "bert", "--model-preset", "tiny", "--data", root / "shards",
                     "--dict", root / "vocab.txt", "--max-sentences", "8", "--max-update", "8", "--lr", "0.001",
                     "--warmup-updates", "2", "--save-dir", root / "run", "--log-format", "none"]) == 0
    checkpoint = root / "run" / "checkpoint_last.pt"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert export_main([str(checkpoint), "--to", str(root / "hf")]) == 0
    assert said.getvalue().count("\n") == 1 and "from_pretrained" in said.getvalue()
    return root, checkpoint, root / "hf"


def fixed_batch(root):
    from textbox_like.data.bert_hdf5 import BertHDF5Dataset, find_shards
    data = BertHDF5Dataset(find_shards(str(root / "shards"), "test"))
    return data.get_batch(list(range(min(16, len(data)))))


def our_model(checkpoint):
    """The checkpoint's model as our trainer and eval build it."""
    from textbox_like.storage.checkpoint import load_checkpoint
    from textbox_like.tools.export import run_config
    from textbox_like.tasks import TASKS
    state = load_checkpoint(checkpoint)
    task = TASKS.get("bert")(run_config(state))
    model = task.build_model()
    model.load_state_dict(state["model"])
    return task, model.eval(), state


def hf_mlm_sums(model, batch):
    """(summed MLM cross-entropy, masked tokens) of transformers' own forward."""
    from textbox_like.models.bert import IGNORE_INDEX, full_labels
    labels = full_labels(batch["input_ids"], batch["masked_lm_positions"], batch["masked_lm_ids"])
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"], labels=labels,
                    next_sentence_label=batch["next_sentence_labels"])
    logits = out.prediction_logits.reshape(-1, model.config.vocab_size).double()
    total = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum").item()
    return total, int((labels != IGNORE_INDEX).sum())


@pytest.mark.timeout(600)
def test_round_trip_gives_the_same_mlm_loss(exported):
    from transformers import AutoModel, AutoTokenizer, BertForPreTraining

    root, checkpoint, target = exported
    assert {"config.json", "model.safetensors", "vocab.txt"} <= {p.name for p in target.iterdir()}
    assert (target / "vocab.txt").read_bytes() == (root / "vocab.txt").read_bytes()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".hf.")]  # no temporary left
    config = json.loads((target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 128, 38)

    task, ours, state = our_model(checkpoint)
    hf = BertForPreTraining.from_pretrained(str(target)).eval()
    for key, value in state["model"].items():
        assert torch.equal(hf.state_dict()[key], value), key

    # a fixed batch: our task's loss vs transformers' forward
    batch = fixed_batch(root)
    with torch.no_grad():
        _, stats = task.loss(ours, batch)
    ours_mlm = stats["mlm_loss_sum"].item() / int(stats["masked_tokens"])
    total, masked = hf_mlm_sums(hf, batch)
    print(f"fixed batch MLM loss: ours {ours_mlm:.7f}, from_pretrained {total / masked:.7f}")
    assert abs(ours_mlm - total / masked) < 1e-5

    # our eval over the whole test split vs transformers over the same rows
    from textbox_like.api import evaluate
    from textbox_like.data.bert_hdf5 import BertHDF5Dataset, find_shards
    ours_eval = evaluate(checkpoint, cpu=True)
    data = BertHDF5Dataset(find_shards(str(root / "shards"), "test"))
    total, masked = hf_mlm_sums(hf, data.get_batch(list(range(len(data)))))
    print(f"test split MLM loss: our eval {ours_eval['mlm_loss']:.7f}, from_pretrained {total / masked:.7f}")
    assert abs(ours_eval["mlm_loss"] - total / masked) < 1e-5

    # AutoModel: the encoder alone, the same hidden states
    encoder = AutoModel.from_pretrained(str(target)).eval()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        assert torch.allclose(encoder(**inputs).last_hidden_state, ours.bert(**inputs).last_hidden_state, atol=1e-6)
    tokens = (root / "vocab.txt").read_text().split("\n")
    ids = AutoTokenizer.from_pretrained(str(target))("the cat sat")["input_ids"]
    assert [tokens[i] for i in ids] == ["[CLS]", "the", "cat", "sat", "[SEP]"]


@pytest.mark.timeout(600)
def test_new_run_starts_from_the_exported_directory(exported, tmp_path):
    """--init-checkpoint DIR without a preset: the model's size comes from
    DIR/config.json and its weights at update 0 are the exported ones."""
    from safetensors.torch import load_file

    from textbox_like.resolve.resolution import parse
    from textbox_like.tasks import TASKS

    root, _, target = exported
    cfg = parse(["--task", "bert", "--data", str(root / "shards"), "--init-checkpoint", str(target),
                 "--max-sentences", "8", "--max-update", "2"])
    assert (cfg.task_options.dimension, cfg.task_options.num_layers, cfg.task_options.num_heads) == (128, 2, 2)
    task = TASKS.get("bert")(cfg)
    task.check_config(cfg)
    model = task.build_model()  # what the trainer starts from
    saved = load_file(str(target / "model.safetensors"))
    own = model.state_dict()
    for key, value in saved.items():
        assert torch.equal(own[key], value), key
    assert own["cls.predictions.decoder.weight"].data_ptr() == own["bert.embeddings.word_embeddings.weight"].data_ptr()

    assert run_main(["--task", "bert", "--data", root / "shards", "--init-checkpoint", target,
                     "--max-sentences", "8", "--max-update", "2", "--save-dir", tmp_path / "again",
                     "--log-format", "none"]) == 0
    assert json.loads((tmp_path / "again" / "results.json").read_text())["num_updates"] == 2
    # its checkpoints evaluate (the model's sizes come from the exported directory again)
    from textbox_like import evaluate
    metrics = evaluate(tmp_path / "again" / "checkpoint_last.pt", subset="test")
    assert metrics["num_updates"] == 2 and metrics["mlm_loss"] > 0


@pytest.mark.timeout(300)
def test_bad_input_is_one_line(exported, tmp_path, small_mnist_dir, capfd):
    """In-process (export's main, which its process runs; test_console_command_exports has a process's)."""
    root, checkpoint, target = exported
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")

    def run(argv):
        return export_in_process(argv[1:], capfd)

    export = ["export"]
    assert_one_line_error(run([*export, junk, "--to", tmp_path / "a"]), "junk.pt")
    assert_one_line_error(run([*export, tmp_path / "missing.pt", "--to", tmp_path / "a"]), "does not exist")
    assert_one_line_error(run([*export, root / "run", "--to", tmp_path / "a"]),
                          "is a directory", "checkpoint_last.pt")
    assert_one_line_error(run([*export, checkpoint, "--to", target]), "not empty")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run([*export, checkpoint, "--to", tmp_path / "file"]), "is a file")
    assert_one_line_error(run([*export, checkpoint]), "--to")
    small = tmp_path / "small_vocab.txt"
    small.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    assert_one_line_error(run([*export, checkpoint, "--to", tmp_path / "a", "--dict", small]),
                          "has 5 tokens", "vocab_size 38")
    assert not (tmp_path / "a").exists() and (tmp_path / "file").read_text() == "x"

    assert run_main(base_args(small_mnist_dir, tmp_path / "mnist", max_update=2)) == 0
    # any other task: its model's weights, as safetensors, with the run's config.yaml
    done = run([*export, tmp_path / "mnist" / "checkpoint_last.pt", "--to", tmp_path / "mnist_weights"])
    assert done.returncode == 0 and "task mnist, MNISTNet" in done.stdout, done.stderr[-3000:]
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "mnist_weights" / "model.safetensors"))
    saved = torch.load(tmp_path / "mnist" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert weights.keys() == saved["model"].keys()
    assert all(torch.equal(weights[k], saved["model"][k]) for k in weights)
    assert (tmp_path / "mnist_weights" / "config.yaml").read_text() == saved["config"]
    assert not (tmp_path / "a").exists()


@pytest.mark.timeout(300)
def test_init_checkpoint_that_is_no_local_path_is_one_line(exported, tmp_path, capfd):
    root, _, _ = exported

    def run(argv):
        return refusal_in_process(argv[1:], capfd)

    common = ["run_hetseq.py", "--task", "bert", "--data", root / "shards", "--max-sentences", "8",
              "--max-update", "1", "--save-dir", tmp_path / "out"]
    assert_one_line_error(run([*common, "--init-checkpoint", "bert-base-uncased"]),
                          "'bert-base-uncased'", "no model can be downloaded", "save_pretrained directory")
    assert_one_line_error(run([*common, "--init-checkpoint", root / "run"]),
                          "without config.json", "checkpoint_last.pt")


@pytest.fixture(scope="module")
def bad_weights(tmp_path_factory):
    """Tiny shards and transformers save directories whose weights file is
    bad: a truncated pytorch_model.bin, a pickle holding code (the
    weights-only load refuses it), a garbage model.safetensors."""
    from transformers import BertConfig, BertForPreTraining

    root = tmp_path_factory.mktemp("bad_weights")
    tokens = write_vocab(root / "vocab.txt")
    write_corpus(root / "corpus.txt", n_docs=20)
    assert prepare(["--input", str(root / "corpus.txt"), "--vocab", str(root / "vocab.txt"),
                    "--output", str(root / "shards"), "--max-seq-length", "32", "--max-predictions-per-seq", "5",
                    "--dupe-factor", "1", "--valid-fraction", "0.1", "--no-progress-bar", "--num-proc", "1"]) == 0
    model = BertForPreTraining(BertConfig(vocab_size=len(tokens), hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))
    model.config.to_json_file(str(root / "config.json"))
    torch.save(model.state_dict(), root / "good.bin")
    whole = (root / "good.bin").read_bytes()

    class RunsCode:
        def __reduce__(self):
            return (print, ("code ran",))

    files = {"truncated": "pytorch_model.bin", "code": "pytorch_model.bin", "garbage": "model.safetensors"}
    for name, weights in files.items():
        (root / name).mkdir()
        (root / name / "config.json").write_bytes((root / "config.json").read_bytes())
    (root / "truncated" / "pytorch_model.bin").write_bytes(whole[: len(whole) // 2])
    torch.save({"bert.pooler.dense.bias": RunsCode()}, root / "code" / "pytorch_model.bin")
    (root / "garbage" / "model.safetensors").write_bytes(b"not safetensors at all " * 40)
    return root, files


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flag, bad, problem", [
    ("--init-checkpoint", "truncated", "truncated or not a torch file"),
    ("--model_path", "code", "the safe (weights-only) load refuses"),
    ("--initial-encoder", "garbage", "not a valid safetensors file"),
    ("--model_path", "truncated", "truncated or not a torch file"),
    ("--initial-encoder", "code", "the safe (weights-only) load refuses"),
    ("--init-checkpoint", "garbage", "not a valid safetensors file"),
])
def test_bad_weights_file_in_a_save_directory_is_one_line(bad_weights, tmp_path, flag, bad, problem, capfd):
    """Each spelling of the initial weights, each kind of bad weights file:
    one line naming the file and its problem, exit 2; torch's advice to load
    with weights_only=False is never passed on, and the code never runs."""
    root, files = bad_weights
    out = refusal_in_process(["--task", "bert", "--data", root / "shards", "--dict", root / "vocab.txt",
               "--max-sentences", "4", "--max-update", "1", "--save-dir", tmp_path / "out", "--log-format", "none",
               flag, root / bad], capfd)
    assert_one_line_error(out, str(root / bad / files[bad]), problem)
    assert "weights_only=False" not in out.stderr and "weights_only` set to `False" not in out.stderr
    assert "code ran" not in out.stdout + out.stderr
    assert not (tmp_path / "out" / "checkpoint_last.pt").exists()
