"""When a launcher's ranks and a search's trials start as forks of it (children.can_fork): its imports done once
instead of once a process, where nothing a fork would break is there. Forked and fresh ranks train the same weights,
and a fork waits for a lock refresher at work: tests/integration/test_rank_start_processes.py."""
from __future__ import annotations

import threading

import pytest

from textbox_like.processes import children


@pytest.fixture
def threads(monkeypatch):
    """This process's Python threads as can_fork sees them: the main one, and those a test adds (the suite's own
    process may hold threads that earlier in-process runs' libraries left, such as tqdm's monitor)."""
    monkeypatch.delenv("TEXTBOX_LIKE_FORK", raising=False)
    others = []
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), *others])
    return others


def test_a_cpu_only_launcher_without_other_threads_forks_its_ranks(threads):
    assert children.can_fork() and children.can_fork({})


def test_ranks_that_need_a_variable_at_their_start_start_fresh(threads):
    # PYTHONPATH for a task class from textbox_like.train(task=...): read by a new interpreter only
    assert not children.can_fork({"PYTHONPATH": "/somewhere"})


def test_a_live_python_thread_means_fresh_interpreters(threads):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    threads.append(thread)
    try:
        assert not children.can_fork()
    finally:
        stop.set()
        thread.join()
    threads.remove(thread)
    assert children.can_fork()


def test_a_save_directorys_lock_refresher_does_not_stop_a_fork(threads, tmp_path):
    # a search holds its --output's lock (a thread refreshes it) while it starts trials
    from textbox_like.storage.savelock import SaveDirLock
    lock = SaveDirLock.acquire(tmp_path)
    threads.append(lock._thread)
    try:
        assert lock._thread.name == "textbox_like-save-lock" and children.can_fork()
    finally:
        lock.release()


def test_textbox_like_fork_0_always_starts_fresh_interpreters(threads, monkeypatch):
    monkeypatch.setenv("TEXTBOX_LIKE_FORK", "0")
    assert not children.can_fork()


def test_a_machine_with_cuda_starts_fresh_interpreters(threads, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not children.can_fork()
