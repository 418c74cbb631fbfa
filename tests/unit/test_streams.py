"""Streamed data (data/streams.py, data/stream_batches.py) and packing
(data/packing.py, data/text_batches.py), in process.

- the units of every update are the same for any split over any ranks, every
  record of an epoch is trained exactly once (counted by sample ids), with a
  shuffle buffer, shards in a seeded order, token budgets and re-splits;
- a resume from the saved state (JSON, as in a checkpoint) on another world
  size continues the uninterrupted sequence, reading only from the saved
  byte offset: as many records read to resume at step 200 as at step 2;
- an update redone from its start (the offset set back) gets the same units;
- a packed row's loss equals the sum of its documents' losses computed alone
  (GPT-2 in transformers' flattened format, BERT with the block mask);
- bad input: a file cut mid-record, a csv record cut in a quote, a document
  longer than a packed row: one line each.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from textbox_like.core.errors import UserError
from textbox_like.data.packing import block_mask, pack_greedy, packed_arrays
from textbox_like.data.stream_batches import StreamBatchIterator, StreamedData
from textbox_like.data.streams import FileSource, SampleStream, stream_files


def write_shards(directory: Path, sizes=(37, 50, 23), kind="jsonl"):
    """train-0000N.{kind} shards of records "doc S.I" with a length that varies."""
    directory.mkdir(parents=True, exist_ok=True)
    for s, n in enumerate(sizes):
        path = directory / f"train-{s:05d}.{kind}"
        with open(path, "w", newline="") as out:
            if kind == "csv":
                out.write("text,label\n")
            for i in range(n):
                text = " ".join(["w"] * (1 + (7 * i + 3 * s) % 9)) + f" doc {s}.{i}"
                if kind == "jsonl":
                    out.write(json.dumps({"text": text}) + "\n")
                elif kind == "csv":
                    out.write(f'"{text}, quoted",{i % 2}\n')
                else:
                    out.write(text + "\n")
    return directory


def encode(chunk):
    """A stand-in tokenizer: one token per word (picklable, for worker processes)."""
    return [{"input_ids": np.arange(len(record["text"].split()), dtype=np.int64), "id": sample_id}
            for record, sample_id in chunk]


def tokens(sample):
    return len(sample["input_ids"])


def stream_of(directory, seed=5, buffer=16, workers=0, pack_to=None, chunk=8):
    files = stream_files(directory, "train")
    return SampleStream(FileSource(files, seed, shuffle=True), seed=seed, encode=encode, tokens=tokens,
                        shuffle_buffer=buffer, pack_to=pack_to, chunk=chunk, workers=workers)


def ids_of(units):
    return [s["id"] for u in units for s in (u if isinstance(u, list) else [u])]


def ranks_of(directory, batch_sizes, max_tokens=None, **kw):
    """One iterator per rank over its own stream (each rank reads the whole stream, as ranks do)."""
    world = len(batch_sizes)
    return [StreamBatchIterator(UnitLists(stream_of(directory, **kw), None), 5, r, world, batch_sizes, max_tokens)
            for r in range(world)]


class UnitLists(StreamedData):
    """A rank's units as they are, as its batch (none: an empty list)."""

    def batch(self, mine, step):
        return list(mine)


def epoch_steps(iterators, limit=None):
    """[(global count, [each rank's ids])] of an epoch, stepping the ranks together."""
    steps = []
    for parts in zip(*[iter(it) for it in iterators]):
        counts = {count for _, count in parts}
        assert len(counts) == 1
        steps.append((counts.pop(), [ids_of(batch) for batch, _ in parts]))
        if limit and len(steps) == limit:
            break
    return steps


def flat(steps):
    return [i for _, parts in steps for part in parts for i in part]


def test_every_split_trains_the_same_units_each_record_once(tmp_path):
    data = write_shards(tmp_path / "data")
    one = epoch_steps(ranks_of(data, [8]))
    for split in ([3, 5], [1, 2, 5], [8, 0]):
        many = epoch_steps(ranks_of(data, split))
        assert [c for c, _ in many] == [c for c, _ in one]
        assert flat(many) == flat(one), split
    ids = flat(one)
    assert len(ids) == 110 and len(set(ids)) == 110          # every record once
    assert ids != sorted(ids)                                 # shuffled
    # another epoch: another order of the same records
    its = ranks_of(data, [8])
    its[0].set_epoch(2)
    second = flat(epoch_steps(its))
    assert sorted(second) == sorted(ids) and second != ids


def test_token_budgets_split_alike_and_each_record_once(tmp_path):
    data = write_shards(tmp_path / "data")
    one = ranks_of(data, [64], max_tokens=[60])
    for it in one:
        it.set_split([60], by_tokens=True)
    reference = epoch_steps(one)
    two = ranks_of(data, [64, 64], max_tokens=[30, 30])
    for it in two:
        it.set_split([20, 40], by_tokens=True)
    split = epoch_steps(two)
    assert [c for c, _ in split] == [c for c, _ in reference]
    assert flat(split) == flat(reference) and len(set(flat(split))) == 110


def test_a_resume_on_another_world_size_continues_from_the_saved_offset(tmp_path):
    data = write_shards(tmp_path / "data", sizes=(400, 350, 300))
    whole = flat(epoch_steps(ranks_of(data, [4])))
    reads = {}
    for cut in (2, 100):
        first = ranks_of(data, [3, 5])
        before = epoch_steps(first, limit=cut)
        saved = json.loads(json.dumps(first[0].state_dict()))           # as a checkpoint holds it
        resumed = ranks_of(data, [1, 2, 5])
        for it in resumed:
            it.load_state_dict(saved)
        assert flat(before) + flat(epoch_steps(resumed)) == whole, cut
        reads[cut] = reads_to_first_step(data, saved)
    # the resume seeks to the saved position: as many records read to resume at step 100 as at step 2 (at most
    # the shuffle buffer's fill and a chunk), none of those trained before it read again
    assert reads[100] <= reads[2] + 8 and reads[100] <= 16 + 2 * 8, reads


def reads_to_first_step(data, saved):
    it = ranks_of(data, [8])[0]
    count = []
    original = it.stream.source.records

    def counted(epoch, position):
        for item in original(epoch, position):
            count.append(1)
            yield item
    it.stream.source.records = counted
    it.load_state_dict(saved)
    next(iter(it))
    return len(count)


def test_an_update_redone_from_its_start_gets_the_same_units(tmp_path):
    data = write_shards(tmp_path / "data")
    it = ranks_of(data, [8])[0]
    batches = iter(it)
    next(batches)
    start = it.offset
    again = [ids_of(next(batches)[0]) for _ in range(2)]
    batches.close()
    it.offset = start
    batches = iter(it)
    assert [ids_of(next(batches)[0]) for _ in range(2)] == again


def test_text_csv_and_parquet_shards_stream_too(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    for kind in ("txt", "csv"):
        data = write_shards(tmp_path / kind, kind=kind)
        assert len(set(flat(epoch_steps(ranks_of(data, [8]))))) == 110, kind
    (tmp_path / "pq").mkdir()
    for s, n in enumerate((37, 50)):
        pq.write_table(pa.table({"text": [f"doc {s} {i} " + "w " * (i % 5) for i in range(n)]}),
                       tmp_path / "pq" / f"train-{s}.parquet", row_group_size=16)
    first = ranks_of(tmp_path / "pq", [8])
    before = epoch_steps(first, limit=3)
    saved = first[0].state_dict()
    after = epoch_steps([(lambda it: (it.load_state_dict(saved), it)[1])(ranks_of(tmp_path / "pq", [8])[0])])
    assert len(set(flat(before) + flat(after))) == 87 == len(flat(before) + flat(after))


def test_packed_rows_keep_every_document_once_in_order(tmp_path):
    data = write_shards(tmp_path / "data")
    plain = flat(epoch_steps(ranks_of(data, [8])))
    packed_steps = epoch_steps(ranks_of(data, [3, 5], pack_to=24))
    assert flat(packed_steps) == plain          # the same documents, in the same order, each once
    rows = [row for it in ranks_of(data, [8], pack_to=24) for batch, _ in it for row in batch]
    assert all(sum(tokens(s) for s in row) <= 24 for row in rows)
    assert len(rows) < len(plain) / 2


def test_bad_stream_files_are_one_line(tmp_path):
    data = tmp_path / "cut"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "a b c"}\n{"text": "d e')
    with pytest.raises(UserError, match=r"ends mid-record .*complete or remove its last line"):
        flat(epoch_steps(ranks_of(data, [2])))
    (data / "train.jsonl").write_text('{"text": "a b c"}\nnot json\n{"text": "d"}\n')
    with pytest.raises(UserError, match=r"byte 18 is not whole JSON .*repair or remove that line"):
        flat(epoch_steps(ranks_of(data, [2])))
    (data / "train.jsonl").unlink()
    (data / "train.csv").write_text('text,label\n"a b",1\n"c d\n')
    with pytest.raises(UserError, match=r"ends mid-record or is not csv"):
        flat(epoch_steps(ranks_of(data, [2])))
    with pytest.raises(UserError, match=r"document 1 has 5 tokens, more than the packed row's 4"):
        pack_greedy([3, 5], 4)


def test_pack_greedy_and_packed_arrays():
    assert [r.tolist() for r in pack_greedy([3, 2, 4, 1, 5], 6)] == [[0, 1], [2, 3], [4]]
    arrays = packed_arrays([[np.array([5, 6, 7]), np.array([8, 9])]], pad_id=0, causal=True)
    assert arrays["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert arrays["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert arrays["labels"].tolist() == [[-100, 6, 7, -100, 9]]   # no document predicts another's first token
    mask = block_mask(np.array([[0, 0, 1, -1]]))
    assert (mask[0, 0] == 0).tolist() == [[True, True, False, False], [True, True, False, False],
                                          [False, False, True, False], [False, False, False, True]]


@pytest.mark.parametrize("head", ["causal_lm", "masked_lm"])
def test_a_packed_rows_loss_is_the_sum_of_its_documents_losses_alone(head):
    """No attention across documents: the summed loss of a row of three
    documents equals the three losses of each document alone (and differs
    from one long sequence of the same tokens)."""
    import torch.nn.functional as F
    import transformers
    from textbox_like.data.text_batches import TextBatcher
    if head == "causal_lm":
        config = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(config)
    torch.manual_seed(0)
    model.eval()
    rng = np.random.default_rng(1)
    docs = [{"input_ids": rng.integers(5, 40, size=n), "id": i} for i, n in enumerate((7, 11, 5))]
    batcher = TextBatcher(head, pad_id=0, masking=(3, 0.3, 4, 40, [0, 1, 2, 3, 4]))

    def loss_sum(batch):
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        if head == "causal_lm":
            inputs["use_cache"] = False
        logits = model(**inputs).logits
        labels = batch["labels"]
        if head == "causal_lm":
            labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               reduction="sum")

    with torch.no_grad():
        packed = loss_sum(batcher.rows([docs + []]))
        alone = sum(loss_sum(batcher.samples([d])) for d in docs)
        joined = {"input_ids": np.concatenate([d["input_ids"] for d in docs]), "id": 0}
        together = loss_sum(batcher.samples([joined]))
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5)
    assert abs(together.item() - alone.item()) > 1e-3
