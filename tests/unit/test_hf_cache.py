"""The tokenised cache (issue 51, items 3, 4 and 10): a truncated cache file,
or one with bytes overwritten inside, is found by the digests written with
it, removed with a line and tokenised again (never trained on); by default
the cache is the datasets cache's, never beside the data; where --cache-dir
cannot hold it, a line says where it goes instead;
where no place can, one line names the variable that chooses it, exit 2.
Real files: truncated and overwritten on disk; an unwritable place is a path
under a regular file (ENOTDIR, whatever the user's rights: root ignores
permission bits). The trainer's main in-process."""
from __future__ import annotations

import json

from conftest import refusal_in_process
from test_hf_task import write_model, write_text_data


def run(model, data, save, capfd, *extra):
    """A run whose tokenised cache is DATA/.hf_cache (--cache-dir)."""
    return refusal_in_process(["--task", "hf", "--model_name_or_path", model, "--data", data, "--save-dir", save,
                               "--max-sentences", 4, "--max-update", 2, "--log-format", "simple", "--cpu",
                               "--cache-dir", data / ".hf_cache", *extra], capfd)


def test_the_default_cache_is_the_datasets_cache_not_the_data_directory(tmp_path, capfd, monkeypatch):
    """Without --cache-dir nothing is written beside the data (a read-only data directory works): the
    tokenised splits go to HF_DATASETS_CACHE/textbox_like, and a second run reads them from there."""
    model = write_model(tmp_path / "model", "causal_lm")
    data = write_text_data(tmp_path / "data")
    before = sorted(p.name for p in data.iterdir())
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    args = ["--task", "hf", "--model_name_or_path", model, "--data", data, "--max-sentences", 4, "--max-update", 2,
            "--log-format", "simple", "--cpu"]
    first = refusal_in_process([*args, "--save-dir", tmp_path / "a"], capfd)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in data.iterdir()) == before
    cache = tmp_path / "hf" / "textbox_like"
    assert len(list(cache.glob("tokenized-*.arrow"))) == 2
    assert [n for n in notes(first) if n.startswith("note: tokenizing")][0].endswith(
        f"into {cache} (once: later runs read them from there)")
    second = refusal_in_process([*args, "--save-dir", tmp_path / "b"], capfd)
    assert second.returncode == 0 and not [n for n in notes(second) if "tokenizing" in n]


def notes(out):
    return [line for line in out.stderr.splitlines() if line.startswith("note:")]


def test_a_damaged_cache_is_found_removed_and_tokenised_again(tmp_path, capfd):
    model = write_model(tmp_path / "model", "causal_lm")
    data = write_text_data(tmp_path / "data")
    first = run(model, data, tmp_path / "a", capfd)
    assert first.returncode == 0, first.stderr[-3000:]
    cache = data / ".hf_cache"
    arrow = sorted(cache.glob("tokenized-*.arrow"))
    digests = {p.name: json.loads(p.read_text()) for p in cache.glob("tokenized-*.digests.json")}
    assert arrow and len(digests) == len(arrow)
    whole = {p: p.read_bytes() for p in arrow}

    arrow[0].write_bytes(whole[arrow[0]][: len(whole[arrow[0]]) // 2])          # truncated
    middle = len(whole[arrow[-1]]) // 2
    arrow[-1].write_bytes(whole[arrow[-1]][:middle] + bytes(8) + whole[arrow[-1]][middle + 8:])  # overwritten inside
    again = run(model, data, tmp_path / "b", capfd)
    assert again.returncode == 0, again.stderr[-3000:]
    said = notes(again)
    assert len([n for n in said if "is damaged or incomplete" in n and "tokenising again" in n]) == 2, said
    assert {p: p.read_bytes() for p in arrow} == whole      # tokenised again, the same bytes
    third = run(model, data, tmp_path / "c", capfd)        # whole now: read, no line
    assert third.returncode == 0 and not [n for n in notes(third) if "damaged" in n], third.stderr[-3000:]


def test_an_unwritable_cache_dir_moves_the_cache_and_says_where(tmp_path, capfd, monkeypatch):
    model = write_model(tmp_path / "model", "sequence_classification")
    data = write_text_data(tmp_path / "data")
    (data / ".hf_cache").write_text("a file where the cache directory would be")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "user_cache"))
    out = run(model, data, tmp_path / "run", capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    moved = [n for n in notes(out) if "cannot be written" in n]
    assert moved and all(f"the tokenised data is cached in {tmp_path / 'user_cache' / 'textbox_like'}" in n
                         and "(HF_DATASETS_CACHE chooses where)" in n for n in moved), notes(out)
    assert list((tmp_path / "user_cache" / "textbox_like").rglob("tokenized-*.arrow"))


def test_no_writable_place_for_the_cache_is_one_line_naming_the_variable(tmp_path, capfd, monkeypatch):
    model = write_model(tmp_path / "model", "sequence_classification")
    data = write_text_data(tmp_path / "data")
    (data / ".hf_cache").write_text("not a directory")
    (tmp_path / "home_file").write_text("not a directory either")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "home_file" / "datasets"))
    out = run(model, data, tmp_path / "run", capfd)
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith(f"error: no writable place for the tokenised data: {data / '.hf_cache'} (")
    assert lines[0].endswith("; set HF_DATASETS_CACHE to a writable directory"), lines[0]


def test_a_first_run_tokenises_each_split_once_saying_so_and_the_next_run_reads_them_silently(tmp_path, capfd):
    """A fast tokenizer's serialisation holds the truncation and padding its
    last call set: keyed on it, a first run tokenised train twice (once
    before its tokenizer had been called, once after) and a second run
    tokenised valid again. Each split is one cache file, written once."""
    model = write_model(tmp_path / "model", "sequence_classification")
    data = write_text_data(tmp_path / "data", n_train=48, n_valid=16)
    first = run(model, data, tmp_path / "a", capfd)
    assert first.returncode == 0, first.stderr[-3000:]
    cache = data / ".hf_cache"
    written = {p.name: p.stat().st_mtime_ns for p in cache.glob("tokenized-*.arrow")}
    assert len(written) == 2, sorted(written)     # train and valid, once each
    assert [n for n in notes(first) if n.startswith("note: tokenizing")] == [
        f"note: tokenizing 48 rows into {cache} (once: later runs read them from there)",
        f"note: tokenizing 16 rows into {cache} (once: later runs read them from there)"], notes(first)
    second = run(model, data, tmp_path / "b", capfd)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not [n for n in notes(second) if "tokenizing" in n], notes(second)
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("tokenized-*.arrow")} == written
