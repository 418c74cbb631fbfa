"""A refused run leaves nothing behind (issue 51, item 11): no empty
metrics.jsonl (opened at the first record now), and no save directory it
made itself; a directory that was there stays as it was. --restore-file of a
.dcp whose manifest.json is garbage says so, not 'no such checkpoint'. The
trainer's main in-process."""
from __future__ import annotations

import pytest

from conftest import base_args, refusal_in_process


def one_error_line(out):
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("restore, said", [
    ("missing.pt", "no such checkpoint"),
    ("junk.pt", "is a text file, first line 'junk', not a checkpoint"),
    ("garbage.dcp", "its manifest.json cannot be read (Expecting property name"),
    ("plain_dir", "is a directory, not a checkpoint (a checkpoint_*.pt file, or a --fsdp run's checkpoint_*.dcp)"),
])
def test_a_refused_run_leaves_no_save_directory_and_names_what_the_restore_file_is(small_mnist_dir, tmp_path,
                                                                                      capfd, restore, said):
    (tmp_path / "junk.pt").write_text("junk\n")
    (tmp_path / "garbage.dcp").mkdir()
    (tmp_path / "garbage.dcp" / "manifest.json").write_text("{garbage")
    (tmp_path / "plain_dir").mkdir()
    save = tmp_path / "new" / "run"
    out = refusal_in_process(base_args(small_mnist_dir, save, "--restore-file", tmp_path / restore), capfd)
    assert said in one_error_line(out)
    assert not save.exists()
    assert (tmp_path / "new").exists()   # only the directory the run made goes


def test_a_refused_run_in_an_existing_directory_leaves_it_as_it_was(small_mnist_dir, tmp_path, capfd):
    save = tmp_path / "run"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    out = refusal_in_process(base_args(small_mnist_dir, save, "--restore-file", tmp_path / "missing.pt"), capfd)
    one_error_line(out)
    assert sorted(p.name for p in save.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    one_error_line(refusal_in_process(base_args(small_mnist_dir, empty, "--restore-file", tmp_path / "x.pt"), capfd))
    assert empty.is_dir() and not list(empty.iterdir())
