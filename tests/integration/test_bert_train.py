"""BERT through the real trainer: HetSeq's command, loss weighting over ranks
and accumulation when the denominator is the masked-token count, --max-tokens
batching, bad shards."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import refusal_in_process
from test_prepare_bert import write_corpus, write_vocab
from textbox_like.tools.prepare_bert import main as prepare

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    vocab = root / "vocab.txt"
    tokens = write_vocab(vocab)
    corpus = root / "corpus.txt"
    write_corpus(corpus, n_docs=60)
    assert prepare(["--input", str(corpus), "--vocab", str(vocab), "--output", str(root / "shards"),
                    "--max-seq-length", "32", "--max-predictions-per-seq", "5", "--dupe-factor", "2",
                    "--valid-fraction", "0.1", "--no-progress-bar"]) == 0
    config = root / "bert_config.json"
    config.write_text(json.dumps({
        "attention_probs_dropout_prob": 0.0, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 32,
        "num_attention_heads": 2, "num_hidden_layers": 2, "type_vocab_size": 2, "vocab_size": len(tokens)}))
    return root


def train_args(d, save_dir, *extra):
    return ["--task", "bert", "--data", str(d / "shards"), "--dict", str(d / "vocab.txt"),
            "--config_file", str(d / "bert_config.json"), "--save-dir", str(save_dir),
            "--log-format", "simple", "--log-interval", "1", "--threads", "1", *extra]


def run(args, timeout=240):
    out = subprocess.run([PY, "run_hetseq.py", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def in_process(args, capfd=None):
    """A one-process run in this process (a process's ~3 s of imports saved), torch's thread count
    (--threads) restored after it; with ``capfd``, its output as a CompletedProcess like run's."""
    from conftest import run_main
    if capfd is not None:
        capfd.readouterr()
    threads = torch.get_num_threads()
    try:
        code = run_main(args)
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr() if capfd is not None else ("", "")
    assert code in (0, None), err[-4000:]
    return subprocess.CompletedProcess(args, code, out, err)


def model_state(save_dir):
    return torch.load(Path(save_dir) / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


def assert_close(a, b, rtol=1e-5):
    """Within rtol of each tensor's scale; exact-zero gradients (attention key
    biases) leave float noise around 1e-13, which an absolute floor absorbs."""
    for key in a:
        x, y = a[key].double(), b[key].double()
        assert (x - y).abs().max().item() <= rtol * max(y.abs().max().item(), 1e-2), key


@pytest.mark.timeout(300)
def test_hetseq_documented_bert_command(bert_data, tmp_path, capfd):
    """HetSeq's README command, GPU flags aside (a short --max-update)."""
    out = in_process(train_args(bert_data, tmp_path / "out", "--max-sentences", "8", "--fast-stat-sync",
                         "--max-update", "3", "--update-freq", "4", "--valid-subset", "test", "--num-workers", "4",
                         "--warmup-updates", "10000", "--total-num-update", "1000000", "--lr", "0.0001",
                         "--weight-decay", "0.01", "--distributed-world-size", "1", "--device-id", "1"), capfd)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["num_updates"] == 3
    assert set(results["final"]) >= {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "ppl"}
    assert "valid |" in out.stderr


@pytest.mark.timeout(300)
def test_loss_falls(bert_data, tmp_path):
    in_process(train_args(bert_data, tmp_path / "out", "--max-sentences", "16", "--max-update", "40", "--lr", "0.005",
                   "--warmup-updates", "5"))
    train = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl") if '"train"' in x]
    first, last = train[0]["mlm_loss"], sum(r["mlm_loss"] for r in train[-5:]) / 5
    # random words: the floor is about the unigram entropy, ln(30) = 3.4, from ln(38) = 3.64
    assert last < first - 0.15, (first, last)


@pytest.mark.timeout(300)
def test_accumulation_equals_big_batch_with_masked_token_denominator(bert_data, tmp_path):
    common = ["--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "constant", "--max-update", "4", "--no-shuffle"]
    in_process(train_args(bert_data, tmp_path / "big", "--max-sentences", "16", *common))
    in_process(train_args(bert_data, tmp_path / "acc", "--max-sentences", "8", "--update-freq", "2", *common))
    assert_close(model_state(tmp_path / "acc"), model_state(tmp_path / "big"))


@pytest.mark.timeout(300)
def test_two_ranks_equal_one_with_masked_token_denominator(bert_data, tmp_path):
    common = ["--optimizer", "sgd", "--lr", "0.5", "--lr-scheduler", "constant", "--max-update", "4"]
    in_process(train_args(bert_data, tmp_path / "one", "--max-sentences", "16", *common))
    run(train_args(bert_data, tmp_path / "two", "--max-sentences", "8", "--distributed-world-size", "2", *common))
    assert_close(model_state(tmp_path / "two"), model_state(tmp_path / "one"))


@pytest.mark.timeout(300)
def test_max_tokens_batching(bert_data, tmp_path):
    from textbox_like.data.bert_hdf5 import BertHDF5Dataset, find_shards
    from textbox_like.data.iterators import EpochBatchIterator
    data = BertHDF5Dataset(find_shards(str(bert_data / "shards"), "train"))
    it = EpochBatchIterator(data, seed=1, rank=0, world_size=1, batch_sizes=[0], max_tokens=[200])
    it.set_epoch(1)
    seen = 0
    for batch, count in it:
        real = int(batch["attention_mask"].sum())
        assert real <= 200 and count == batch["input_ids"].shape[0] >= 1
        seen += count
    assert seen == len(data)
    in_process(train_args(bert_data, tmp_path / "out", "--max-tokens", "200", "--max-update", "3"))


@pytest.mark.timeout(120)
def test_corrupt_shard_is_one_line(bert_data, tmp_path, capfd):
    bad = tmp_path / "shards"
    bad.mkdir()
    (bad / "x_train_0.hdf5").write_bytes(b"not an hdf5 file at all")
    (bad / "x_test_0.hdf5").write_bytes(b"not an hdf5 file at all")
    args = train_args(bert_data, tmp_path / "out", "--max-sentences", "8", "--max-update", "2")
    args[args.index("--data") + 1] = str(bad)
    out = refusal_in_process(args, capfd)   # one process's refusal: in this one
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and "x_train_0.hdf5" in lines[-1] and "Traceback" not in out.stderr


@pytest.mark.timeout(300)
def test_data_one_named_file_trains_on_it(bert_data, tmp_path, capfd):
    """--data path/to/one_shard.hdf5: the named file is the training data;
    with no shard to validate on, the one line names --disable-validation."""
    shard = next((bert_data / "shards").glob("*_train_0.hdf5"))
    args = train_args(bert_data, tmp_path / "out", "--max-sentences", "8", "--max-update", "2")
    args[args.index("--data") + 1] = str(shard)
    out = refusal_in_process(args, capfd)   # one process's refusal and run: in this one
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "--disable-validation" in last and "no file name contains" not in last
    in_process([*args, "--disable-validation"])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["num_updates"] == 2


@pytest.mark.timeout(300)
def test_best_checkpoint_of_nsp_accuracy_is_its_highest(bert_data, tmp_path):
    """An accuracy is better higher, though the task's default metric (loss) is better lower."""
    out = tmp_path / "out"
    in_process(train_args(bert_data, out, "--max-sentences", "8", "--max-update", "8", "--lr", "0.005",
                   "--warmup-updates", "2", "--validate-interval-updates", "1",
                   "--best-checkpoint-metric", "nsp_accuracy"))
    valid = [json.loads(x) for x in open(out / "metrics.jsonl") if '"valid"' in x]
    values = [r["nsp_accuracy"] for r in valid]
    assert len(set(values)) > 1, values  # else highest and lowest would be one checkpoint
    best_update = valid[values.index(max(values))]["update"]  # the first reaching the highest
    best = torch.load(out / "checkpoint_best.pt", map_location="cpu", weights_only=True)
    assert best["train"]["num_updates"] == best_update, (values, best["train"]["num_updates"])
    assert json.loads((out / "results.json").read_text())["best"]["nsp_accuracy"] == pytest.approx(max(values))
