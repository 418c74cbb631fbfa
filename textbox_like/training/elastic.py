"""A peer lost mid-run: every survivor saves the last completed update from
its own state (one of them writes, under a claim), writes the hand-off note
for the restart, and exits 75 (torchrun restarts on it). The agent's side
is :mod:`textbox_like.elastic`."""
from __future__ import annotations

import os
import sys

from ..checkpoint import rng_state
from ..errors import first_line
from ..faults import SaveFailed, failed_writing, os_reason
from ..fileio import remove
from ..preemption import PREEMPTED_EXIT_CODE


def emergency_save(trainer):
    """A peer is lost: save the last completed update from this survivor
    alone (the process group is broken, so no part may gather over ranks),
    with the data position rewound to the start of the update in flight
    and this rank's RNG as of then. One writer among the survivors (a
    claim file, one for the run: survivors may stand one update apart);
    (the path, or None where another survivor writes it; the update saved)."""
    from .. import elastic, savelock
    from ..checkpoint import FORMAT, atomic_save
    from ..elastic import Claim
    t = trainer
    ck, state, start = t.checkpointer.checkpoints, t.state, t.in_flight.start
    t.step.settle()  # a host read of the last device-skipped update's norm, no collective
    if start is not None and start["updates"] == state.num_updates:
        t.iterator.offset = start["offset"]  # the update in flight is redone after the restart
    rng = [None] * t.world
    rng[t.rank] = start["rng"] if start is not None else rng_state()
    parts = {name: part.state_dict() for name, part in ck.parts.items() if name != "rng"}
    path = ck.dir / f"checkpoint_{state.epoch}_{state.num_updates}.pt"
    # one claim for the run (named by its owner token, so a claim a killed writer of an earlier run left
    # blocks nothing), not per update: a collective can complete on one survivor and fail on another
    # (gloo's ring all-reduce), so survivors may stand one update apart and must still write once
    run = (savelock.owner_token() or "run")[:16]
    with Claim(ck.dir / f".emergency-{run}.claim", stale_after=t.cfg.distributed.distributed_timeout,
               note=str(state.num_updates)) as claim:
        if not claim.held:
            # every write of this run is the claim holder's, made before it lets go of
            # the claim; the lock holder leaves last: its release ends the run's writes
            saved_by_other = claim.holder_note() or str(state.num_updates)
            claim.wait_for_writer()
            return None, saved_by_other
        try:
            atomic_save({"format": FORMAT, **ck.metadata, **parts, "rng": rng}, path, make_parents=False)
        except Exception as exc:
            if not failed_writing(exc):
                raise
            raise SaveFailed(f"rank {t.rank}: lost a peer, and could not write the emergency checkpoint "
                             f"{path} ({os_reason(exc)}); the newest earlier checkpoint is kept") from None
        elastic.write_handoff(t.cfg.checkpoint.save_dir, t.agent, state.num_updates, t.global_batch.total(),
                              "lost peer")
        init = os.environ.get("TEXTBOX_LIKE_INIT_METHOD") or t.cfg.distributed.distributed_init_method or ""
        if init.startswith("file://"):  # a rerun must not find this run's rendezvous file
            remove(init[len("file://"):])
    return path, str(state.num_updates)


def peer_lost(trainer, exc) -> int:
    """Every survivor: the emergency checkpoint and the hand-off note for
    the restart (one survivor writes both), one line, and 75 (torchrun
    restarts on it)."""
    state = trainer.state
    where = f"rank {trainer.rank}: lost a peer of this run at update {state.num_updates + 1} ({first_line(exc, 160)})"
    if not trainer.checkpointer.checkpoints.enabled:
        print(f"error: {where}; nothing saved (--no-save)", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    from .. import sharding
    if sharding.is_sharded(trainer.model):
        # a survivor holds its shard only, and gathering the rest needs the lost peer
        last = trainer.checkpointer.checkpoints.newest_good()
        trainer.lifecycle.release_save_dir()
        print(f"error: {where}; under --fsdp a rank holds only its shard of the weights, so nothing is saved "
              f"now: rerun with --resume from the last checkpoint ({last or 'none saved yet'})", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    path, update = emergency_save(trainer)
    saved = f"saved update {update} to {path}" if path is not None else f"another survivor saved update {update}"
    how = ("torchrun restarts the workers and they resume from it by themselves" if trainer.agent is not None
           else "rerun with --resume, on any number of ranks (--global-batch-size keeps the global batch)")
    trainer.lifecycle.release_save_dir()
    print(f"error: {where}; {saved}: {how}", file=sys.stderr)
    return PREEMPTED_EXIT_CODE
