"""Elastic runs: nodes that leave and join, with the same maths.

Three moments, one mechanism (the checkpoint of the last completed update):

- **A peer dies.** A survivor's next collective raises (gloo: the peer's
  sockets close; NCCL: the watchdog aborts the communicator, see
  :func:`distributed.nccl_environment`), at most ``--distributed-timeout``
  later. The survivor cannot talk to the other survivors any more, so it
  writes, on its own, an *emergency checkpoint* of the last completed update
  (weights, optimizer, schedule, the data position rewound to the start of
  the update in flight, RNG as of that update's start): one writer among the
  survivors (a claim file made with ``O_EXCL``), atomically (a kill during
  it leaves the previous checkpoint intact). It exits 75: torchrun restarts
  the worker group on any failure; without an agent the line says to rerun
  with ``--resume``, on any number of ranks.
- **A node joins.** torchrun stops the workers with SIGTERM; they save
  through the preemption path (:mod:`~textbox_like.processes.preemption`).
- **The restart.** Under torchrun the new worker group resumes by itself
  (no ``--resume`` needed) when the agent restarted it after a failure
  (``TORCHELASTIC_RESTART_COUNT > 0``), or when the save directory holds
  this run's hand-off note, ``elastic.json``, written by either stop above
  (a membership change does not count as a restart). The global batch is
  kept: ``--global-batch-size``, or the first start's total, recorded in the
  note, and re-split over the new ranks (by speed with ``--balance``).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from textbox_like.core.threads import start_thread
from textbox_like.storage.fileio import atomic_write_text, remove
from textbox_like.storage.savelock import check_owner, owner_token
from textbox_like.core.torchrun_env import HANDOFF_NAME, Agent, read_handoff  # noqa: F401  (elastic's names)



def joining_note(agent, environ=None):
    """A line for a run that may change membership (torchrun with restarts)
    under torch's shared rendezvous store, or None. With that store (the
    default since torch 2.4), a round's first node keeps the store address
    of the first round it saw and does not publish the new round's, so a
    node that joins later waits for it until torchrun times out; torch's own
    opt-out variable avoids it (seen with torch 2.14.1)."""
    env = os.environ if environ is None else environ
    if agent is None or agent.max_restarts <= 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("a node joining this run would wait in torchrun's rendezvous until it times out (torch's shared "
            "rendezvous store); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment to let "
            "nodes join")


# ------------------------------------------------------------ the hand-off
def write_handoff(save_dir, agent, update: int, global_batch: int, why: str, emergency_save=False) -> None:
    """Say that this run stopped mid-way for its agent to restart it. The
    note names the run that wrote it (its owner token): a survivor that comes
    after the writer let go of the run reads there that its update is saved
    (``emergency_save``: by a survivor of a lost peer; else the restart goes
    on from the last checkpoint)."""
    note = {"run_id": agent.run_id if agent else None, "update": int(update), "global_batch": int(global_batch),
            "why": why, "written": time.time(), "owner": owner_token(), "emergency_save": bool(emergency_save)}
    try:
        atomic_write_text(Path(save_dir) / HANDOFF_NAME, json.dumps(note), make_parents=False)
    except OSError:
        pass  # the checkpoint is what matters; --resume still continues it


def clear_handoff(save_dir) -> None:
    """The run ended (completed, or stopped for a reason no restart fixes)."""
    try:
        remove(Path(save_dir) / HANDOFF_NAME)
    except OSError:
        pass


def resume_reason(cfg, agent):
    """Why this worker resumes by itself (a line for the log), or None.

    Only under torchrun, only where a checkpoint can be read back (a save
    directory, no explicit --restore-file), and only for a restart: after a
    failure, or after a stop that left this run's hand-off note."""
    ck = cfg.checkpoint
    if agent is None or ck.resume or ck.restore_file or ck.no_save:
        return None
    if agent.restart_count > 0:
        return f"torchrun restarted the workers (restart {agent.restart_count} of {agent.max_restarts})"
    note = read_handoff(ck.save_dir)
    if note is not None and note.get("run_id") == agent.run_id:
        return f"torchrun restarted the workers after a {note.get('why', 'stop')} at update {note.get('update')}"
    return None


def kept_global_batch(cfg):
    """The global batch a restart keeps when the first start had none
    (per-rank --max-sentences): the first start's total, from the hand-off
    note; None where nothing is to be kept or it cannot be (tokens,
    accumulation)."""
    if cfg.data.global_batch_size or cfg.data.max_tokens or list(cfg.schedule.update_freq) != [1]:
        return None
    note = read_handoff(cfg.checkpoint.save_dir)
    total = note.get("global_batch") if note else None
    return int(total) if isinstance(total, int) and total > 0 else None


# ------------------------------------------------------- the emergency save
class Claim:
    """One writer among survivors that can no longer talk to each other: the
    first to create the claim file writes; a claim older than ``stale_after``
    seconds (its writer died) is taken over. The holder keeps its claim fresh
    while it holds it: a writer that waits for the others (hybrid's shards)
    or writes a large model may take longer than ``stale_after``, and its
    claim must not read as a dead writer's."""

    def __init__(self, path, stale_after: float, note: str = ""):
        """``note``: what the holder writes into the claim, for the others to read (``holder_note``)."""
        self.path, self.stale_after, self.held, self.note = Path(path), stale_after, False, note
        self._stop, self._thread = threading.Event(), None

    def __enter__(self):
        for _ in range(2):
            check_owner(self.path)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    if time.time() - self.path.stat().st_mtime <= self.stale_after:
                        return self
                    remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            os.write(fd, f"{os.getpid()} {self.note}\n".encode())
            os.close(fd)
            self.held = True
            self._thread = threading.Thread(target=self._keep_fresh, name="textbox_like-claim", daemon=True)
            start_thread(self._thread)
            return self
        return self

    def _keep_fresh(self):
        while not self._stop.wait(max(self.stale_after / 4, 0.05)):
            try:
                os.utime(self.path)
            except OSError:
                return

    def holder_note(self):
        """The note of the survivor holding the claim, or None (gone, or not written yet)."""
        try:
            fields = self.path.read_text().split(maxsplit=1)
        except OSError:
            return None
        return fields[1].strip() if len(fields) == 2 else None

    def wait_for_writer(self):
        """Until the survivor that holds the claim has written (its claim is
        gone), or died (its claim went stale: untouched for ``stale_after``
        seconds)."""
        while True:
            try:
                if time.time() - self.path.stat().st_mtime > self.stale_after:
                    return
            except OSError:  # gone: written
                return
            time.sleep(0.1)

    def __exit__(self, *exc):
        if self.held:
            self._stop.set()
            if self._thread is not None and self._thread.is_alive():  # a signal may have cut its start short
                self._thread.join()
            # unfenced: the claim is named by this run's token, so no newer run owns it, and a
            # writer whose lock holder has ended the run meanwhile must still not leave it behind
            self.path.unlink(missing_ok=True)
            self.held = False
