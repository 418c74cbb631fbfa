"""The BERT HDF5 dataset: split discovery, batches, labels, order, errors."""
import pickle

import h5py
import numpy as np
import pytest

from textbox_like.data.base import shuffled_blocks
from textbox_like.data.bert_hdf5 import KEYS, BertHDF5Dataset, find_shards, inspect_shard, write_shard
from textbox_like.core.errors import UserError

L, P, V = 16, 5, 50


def make_arrays(n, seed, length=L, preds=P):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, length + 1, n)
    ids = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), np.int8)
    seg = np.zeros((n, length), np.int8)
    pos = np.zeros((n, preds), np.int32)
    lab = np.zeros((n, preds), np.int32)
    for r, k in enumerate(lengths):
        ids[r, :k] = rng.integers(5, V, k)
        mask[r, :k] = 1
        seg[r, k // 2:k] = 1
        m = rng.integers(1, preds + 1)
        chosen = np.sort(rng.choice(np.arange(1, k - 1), size=min(m, k - 2), replace=False))
        pos[r, :len(chosen)] = chosen
        lab[r, :len(chosen)] = rng.integers(5, V, len(chosen))
    nsp = rng.integers(0, 2, n).astype(np.int8)
    # make row identity visible: first token after [CLS] encodes nothing, keep
    return {"input_ids": ids, "input_mask": mask, "segment_ids": seg,
            "masked_lm_positions": pos, "masked_lm_ids": lab, "next_sentence_labels": nsp}


@pytest.fixture()
def shards(tmp_path):
    parts = {"bert_train_0.hdf5": make_arrays(70, 0), "bert_train_1.hdf5": make_arrays(50, 1),
             "bert_test_0.hdf5": make_arrays(20, 2)}
    for name, arrays in parts.items():
        write_shard(tmp_path / name, arrays, chunk_rows=16)
    (tmp_path / "vocab.txt").write_text("x\n")  # not a shard: ignored
    return tmp_path, parts


def concat(parts, names):
    return {k: np.concatenate([parts[n][k] for n in names]) for k in KEYS}


def test_shard_layout_written(shards):
    path, parts = shards
    with h5py.File(path / "bert_train_0.hdf5") as f:
        assert set(f.keys()) == set(KEYS)
        for key in KEYS:
            assert f[key].compression == "gzip"
            assert f[key].dtype == parts["bert_train_0.hdf5"][key].dtype
    assert inspect_shard(path / "bert_train_0.hdf5") == (70, L, P)


def test_find_shards_by_name(shards):
    path, _ = shards
    assert [p.name for p in find_shards(str(path), "train")] == ["bert_train_0.hdf5", "bert_train_1.hdf5"]
    assert [p.name for p in find_shards(str(path), "train", num_file=1)] == ["bert_train_0.hdf5"]
    assert [p.name for p in find_shards(str(path), "test")] == ["bert_test_0.hdf5"]
    assert [p.name for p in find_shards(str(path / "bert_test_0.hdf5"), "test")] == ["bert_test_0.hdf5"]
    with pytest.raises(UserError, match="no shard of split 'valid'"):
        find_shards(str(path), "valid")
    with pytest.raises(UserError, match="does not exist"):
        find_shards(str(path / "nope"), "train")
    empty = path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds no HDF5 shard"):
        find_shards(str(empty), "train")


def test_one_named_file_is_the_training_data(shards):
    """--data FILE: the file trains whatever its name; validating needs a
    shard of the split, and the message names --disable-validation."""
    path, _ = shards
    one = path / "my_shard.hdf5"
    (path / "bert_train_1.hdf5").rename(one)
    assert find_shards(str(one), "train", training=True) == [one]
    with pytest.raises(UserError, match="one file, the training data.*--disable-validation") as info:
        find_shards(str(one), "test")
    assert "\n" not in str(info.value)
    # a directory without the validation split: the same way out is named
    with pytest.raises(UserError, match="no file name contains 'valid'.*--disable-validation"):
        find_shards(str(path), "valid")
    with pytest.raises(UserError, match="no file name contains 'dev'.*--train-subset"):
        find_shards(str(path), "dev", training=True)


def test_batches_match_rows_across_files(shards):
    path, parts = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"), block=32)
    ref = concat(parts, ["bert_train_0.hdf5", "bert_train_1.hdf5"])
    assert len(ds) == 120
    idx = np.array([3, 69, 70, 119, 0, 71, 5])
    batch = ds.get_batch(idx)
    import torch
    for key in batch:
        assert batch[key].dtype == torch.int64
    assert np.array_equal(batch["input_ids"].numpy(), ref["input_ids"][idx])
    assert np.array_equal(batch["attention_mask"].numpy(), ref["input_mask"][idx])
    assert np.array_equal(batch["token_type_ids"].numpy(), ref["segment_ids"][idx])
    assert np.array_equal(batch["next_sentence_labels"].numpy(), ref["next_sentence_labels"][idx])
    assert batch["masked_lm_positions"].shape == (7, P)
    empty = ds.get_batch(np.zeros(0, dtype=np.int64))
    assert empty["input_ids"].shape == (0, L) and empty["masked_lm_ids"].shape == (0, P)
    assert empty["next_sentence_labels"].shape == (0,)


def test_labels_ignored_except_masked_positions(shards):
    path, parts = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"), block=32)
    ref = concat(parts, ["bert_train_0.hdf5", "bert_train_1.hdf5"])
    idx = np.arange(len(ds))
    batch = ds.get_batch(idx)
    pos, ids = batch["masked_lm_positions"].numpy(), batch["masked_lm_ids"].numpy()
    for r in idx:
        n = int((ref["masked_lm_positions"][r] != 0).sum())  # positions are a 0-ended list
        assert np.array_equal(ids[r, :n], ref["masked_lm_ids"][r, :n])
        assert np.all(ids[r, n:] == -100)
        assert np.array_equal(pos[r, :n], ref["masked_lm_positions"][r, :n])
    # expanded to (B, L): the label at masked positions, -100 everywhere else
    labels = np.full((len(idx), L), -100)
    for r in idx:
        ok = ids[r] != -100
        labels[r, pos[r, ok]] = ids[r, ok]
    assert (labels != -100).sum() == (ref["masked_lm_positions"] != 0).sum()


def test_zero_position_ends_list(tmp_path):
    arrays = make_arrays(4, 3)
    arrays["masked_lm_positions"][0] = [3, 0, 7, 0, 0]  # garbage after the end marker
    arrays["masked_lm_ids"][0] = [11, 12, 13, 14, 15]
    write_shard(tmp_path / "x_train_0.hdf5", arrays)
    ds = BertHDF5Dataset([tmp_path / "x_train_0.hdf5"])
    batch = ds.get_batch(np.array([0]))
    assert batch["masked_lm_ids"][0].tolist() == [11, -100, -100, -100, -100]
    assert batch["masked_lm_positions"][0].tolist() == [3, 0, 0, 0, 0]


def test_max_pred_length_truncates(shards):
    path, parts = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"), max_pred_length=2)
    batch = ds.get_batch(np.arange(10))
    assert batch["masked_lm_positions"].shape == (10, 2)
    assert batch["masked_lm_ids"].shape == (10, 2)
    ref = parts["bert_train_0.hdf5"]
    expected = np.where(ref["masked_lm_positions"][:10, :2] != 0, ref["masked_lm_ids"][:10, :2], -100)
    assert np.array_equal(batch["masked_lm_ids"].numpy(), expected)
    # larger than the data's P: the data's P
    assert BertHDF5Dataset(find_shards(str(path), "train"), max_pred_length=512).pred_length == P


def test_epoch_order_is_shuffled_blocks_and_memory_bounded(shards):
    path, _ = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"), block=32)
    order = ds.epoch_order(seed=3, epoch=2)
    assert np.array_equal(order, shuffled_blocks(len(ds), 32, 3, 2))
    assert np.array_equal(np.sort(order), np.arange(len(ds)))
    assert np.array_equal(order, ds.epoch_order(seed=3, epoch=2))
    assert not np.array_equal(order, ds.epoch_order(seed=3, epoch=3))
    assert np.array_equal(ds.epoch_order(3, 2, shuffle=False), np.arange(len(ds)))
    for start in range(0, len(order), 8):
        part = order[start:start + 8]
        assert len(np.unique(part // 32)) <= 2  # a batch touches at most two blocks
        ds.get_batch(part)
        assert len(ds._blocks) <= 2


def test_num_tokens_counts_real_tokens(shards):
    path, parts = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"), block=32)
    ref = concat(parts, ["bert_train_0.hdf5", "bert_train_1.hdf5"])
    assert np.array_equal(ds.num_tokens(), ref["input_mask"].sum(1))


def test_pickle_roundtrip(shards):
    path, _ = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"))
    ds.get_batch(np.arange(4))
    clone = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(clone.get_batch(np.arange(4))["input_ids"], ds.get_batch(np.arange(4))["input_ids"])


def test_corrupt_shard(tmp_path):
    bad = tmp_path / "bert_train_0.hdf5"
    bad.write_bytes(b"this is not hdf5" * 100)
    with pytest.raises(UserError, match=r"is a text file, first line .this is not hdf5.*, not an HDF5 file"):
        BertHDF5Dataset([bad])


def test_wrong_shapes_and_keys(tmp_path):
    arrays = make_arrays(8, 4)
    arrays["input_mask"] = arrays["input_mask"][:, :-1]
    with h5py.File(tmp_path / "a_train_0.hdf5", "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
    with pytest.raises(UserError, match="input_mask has shape"):
        BertHDF5Dataset([tmp_path / "a_train_0.hdf5"])
    arrays = make_arrays(8, 4)
    with h5py.File(tmp_path / "b_train_0.hdf5", "w") as f:
        for k, v in arrays.items():
            if k != "segment_ids":
                f.create_dataset(k, data=v)
    with pytest.raises(UserError, match="lacks segment_ids"):
        BertHDF5Dataset([tmp_path / "b_train_0.hdf5"])
    with h5py.File(tmp_path / "c_train_0.hdf5", "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v.astype(np.float32) if k == "input_ids" else v)
    with pytest.raises(UserError, match="integer"):
        BertHDF5Dataset([tmp_path / "c_train_0.hdf5"])
    write_shard(tmp_path / "d_train_0.hdf5", make_arrays(8, 5))
    write_shard(tmp_path / "d_train_1.hdf5", make_arrays(8, 5, length=L + 4))
    with pytest.raises(UserError, match="sequence length"):
        BertHDF5Dataset(find_shards(str(tmp_path), "d_train"))


def test_token_ids_beyond_vocabulary(shards):
    path, _ = shards
    ds = BertHDF5Dataset(find_shards(str(path), "train"), vocab_size=20)
    with pytest.raises(UserError, match="vocabulary"):
        ds.get_batch(np.arange(4))
