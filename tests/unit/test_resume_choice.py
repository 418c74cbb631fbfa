"""Which checkpoint --resume continues (issue 51, item 11): checkpoint_last,
unless a checkpoint written after it records a later update (a run killed
between a save's names). By the update recorded inside, not by time alone:
a stale checkpoint touched later does not win (it did: a touched .dcp at
update 80 beat a .pt at 120); and after --restore-file of an earlier
checkpoint, the abandoned later updates do not win either. The trainer's
main in-process; the files' times set with os.utime."""
from __future__ import annotations

import os
import re
import shutil

import pytest

from conftest import base_args, refusal_in_process


@pytest.fixture(scope="module")
def six_updates(tmp_path_factory, small_mnist_dir):
    from conftest import run_main
    save = tmp_path_factory.mktemp("six") / "run"
    assert run_main(base_args(small_mnist_dir, save, "--save-interval-updates", 2, "--max-sentences", 8,
                              "--disable-validation", max_update=6)) == 0
    return save


def resumed_from(small_mnist_dir, save, capfd, *extra, max_update=6):
    out = refusal_in_process(base_args(small_mnist_dir, save, "--save-interval-updates", 2, "--max-sentences", 8,
                                       "--disable-validation", "--resume", "--log-format", "simple", *extra,
                                       max_update=max_update), capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"resumed from (\S+): epoch \d+, update (\d+)", out.stderr)
    assert found, out.stderr[-3000:]
    return os.path.basename(found.group(1)), int(found.group(2))


def later(path, seconds):
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + int(seconds * 1e9)))


def test_a_stale_checkpoint_touched_later_does_not_win(six_updates, small_mnist_dir, tmp_path, capfd):
    save = shutil.copytree(six_updates, tmp_path / "run")
    later(save / "checkpoint_1_2.pt", 60)   # copied back from a backup, say: newest by time, update 2
    assert resumed_from(small_mnist_dir, save, capfd) == ("checkpoint_last.pt", 6)


def test_a_later_update_written_after_checkpoint_last_wins(six_updates, small_mnist_dir, tmp_path, capfd):
    """A kill between a save's first name and its copy to checkpoint_last:
    checkpoint_last still holds update 4, checkpoint_1_6.pt (newer) update 6."""
    save = shutil.copytree(six_updates, tmp_path / "run")
    shutil.copy2(save / "checkpoint_1_4.pt", save / "checkpoint_last.pt")
    later(save / "checkpoint_1_6.pt", 60)
    assert resumed_from(small_mnist_dir, save, capfd) == ("checkpoint_1_6.pt", 6)


def test_after_a_restore_file_of_an_earlier_checkpoint_the_abandoned_updates_do_not_win(six_updates,
                                                                                        small_mnist_dir, tmp_path,
                                                                                        capfd):
    save = shutil.copytree(six_updates, tmp_path / "run")
    out = refusal_in_process(base_args(small_mnist_dir, save, "--save-interval-updates", 3, "--max-sentences", 8,
                                       "--disable-validation", "--restore-file", "checkpoint_1_2.pt",
                                       max_update=3), capfd)
    assert out.returncode == 0, out.stderr[-3000:]
    # checkpoint_1_4.pt and checkpoint_1_6.pt (older) record later updates of the branch given up
    assert resumed_from(small_mnist_dir, save, capfd, max_update=3) == ("checkpoint_last.pt", 3)
