"""A peer lost mid-run: every survivor saves the last completed update from
its own state (one of them writes, under a claim), writes the hand-off note
for the restart, and exits 75 (torchrun restarts on it). The agent's side
is :mod:`textbox_like.elastic`.

Under --fsdp a survivor can save alone only where every rank holds whole
tensors (``--fsdp-sharding none``, or hybrid with one rank per node): each
DTensor's local part is then the whole tensor, saved as DDP saves it. Under
full sharding the lost rank's shards exist nowhere else: the restart goes on
from the last checkpoint, and the updates since it are lost."""
from __future__ import annotations

import sys

from .. import distributed
from ..checkpoint import rng_state
from ..errors import UserError, first_line
from ..faults import SaveFailed, failed_writing, os_reason
from ..preemption import PREEMPTED_EXIT_CODE


def holds_whole_tensors(trainer) -> bool:
    """Whether every rank holds whole tensors: decided by the run's mesh
    (a shard degree of one), never by the parameters seen at the failure:
    between forward and post-backward FSDP2 puts plain gathered Parameters
    in the modules (the root always; every unit under
    --fsdp-reshard-after-forward false), which say nothing of the shards."""
    from .. import sharding
    return sharding.shard_degree(trainer.cfg, trainer.placement) == 1


def local_whole(value):
    """A state (nested dicts and lists) with each DTensor as its local tensor,
    which :func:`holds_whole_tensors` says is the whole one (the model's
    state_dict hooks reshard a module caught mid-forward): no collective."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        local = value.to_local()
        # torch.save writes a view's whole storage: a local part that is a view into
        # a larger buffer is copied, so the file holds this tensor only
        if local.untyped_storage().nbytes() != local.numel() * local.element_size():
            local = local.clone()
        return local
    if isinstance(value, dict):
        return {key: local_whole(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_whole(item) for item in value)
    return value


def restart_notes(trainer, update: int) -> None:
    """The hand-off note for the restart, and the rendezvous file gone (one
    survivor, under the claim)."""
    from .. import elastic
    t = trainer
    elastic.write_handoff(t.cfg.checkpoint.save_dir, t.agent, update, t.global_batch.total(), "lost peer")
    distributed.remove_rendezvous_file(t.cfg)


def saved_by_another(trainer):
    """The update another survivor of this run saved, read from the hand-off
    note it wrote (naming this run's owner token), or None."""
    from ..elastic import read_handoff
    from ..savelock import owner_token
    note, token = read_handoff(trainer.cfg.checkpoint.save_dir), owner_token()
    if note is None or token is None or note.get("owner") != token:
        return None
    return str(note["update"])


def write_once(trainer, update: str, write):
    """Run ``write`` in the one survivor that writes for the run: None where
    this one wrote; else the update another survivor saved. Survivors see a
    lost peer at different times (under load, seconds apart): one that comes
    after the writer let go of its claim (and, where the writer held the run's
    lock, of the run) finds the writer's hand-off note, and writes nothing."""
    from ..faults import Superseded
    try:
        with run_claim(trainer, update) as claim:
            if not claim.held:
                # every write of this run is the claim holder's, made before it lets go of
                # the claim; the lock holder leaves last: its release ends the run's writes
                saved_by_other = claim.holder_note() or update
                claim.wait_for_writer()
                return saved_by_other
            earlier = saved_by_another(trainer)  # written, and its claim let go, before this one took it
            if earlier is not None:
                return earlier
            write()
            return None
    except Superseded as exc:
        # the lock is gone: its holder wrote and ended the run, or saw the note and left. A
        # newer run's lock means this survivor slept past that run's start: refused (77)
        earlier = saved_by_another(trainer) if not exc.taken_over else None
        if earlier is None:
            raise
        return earlier


def run_claim(trainer, note: str):
    """The claim of one writer among the survivors, one for the run (named by
    its owner token, so a claim a killed writer of an earlier run left blocks
    nothing), not per update: a collective can complete on one survivor and
    fail on another (gloo's ring all-reduce), so survivors may stand one
    update apart and must still write once."""
    from .. import savelock
    from ..elastic import Claim
    run = (savelock.owner_token() or "run")[:16]
    return Claim(trainer.checkpointer.checkpoints.dir / f".emergency-{run}.claim",
                 stale_after=trainer.cfg.distributed.distributed_timeout, note=note)


def emergency_save(trainer):
    """A peer is lost: save the last completed update from this survivor
    alone (the process group is broken, so no part may gather over ranks),
    with the data position rewound to the start of the update in flight
    and this rank's RNG as of then. One writer among the survivors (a
    claim file, one for the run: survivors may stand one update apart);
    (the path, or None where another survivor writes it; the update saved)."""
    from .. import sharding
    from ..checkpoint import FORMAT, atomic_save
    t = trainer
    ck, state, start = t.checkpointer.checkpoints, t.state, t.in_flight.start
    t.step.settle()  # a host read of the last device-skipped update's norm, no collective
    if start is not None and start["updates"] == state.num_updates:
        t.iterator.offset = start["offset"]  # the update in flight is redone after the restart
    rng = [None] * t.world
    rng[t.rank] = start["rng"] if start is not None else rng_state()
    parts = {name: part.state_dict() for name, part in ck.parts.items() if name != "rng"}
    if sharding.is_sharded(t.model):  # whole tensors on every rank (peer_lost): DDP's file checkpoint
        parts = local_whole(parts)
    path = ck.dir / f"checkpoint_{state.epoch}_{state.num_updates}.pt"

    def write():
        try:
            atomic_save({"format": FORMAT, **ck.metadata, **parts, "rng": rng}, path, make_parents=False)
        except Exception as exc:
            if not failed_writing(exc):
                raise
            raise SaveFailed(f"rank {t.rank}: lost a peer, and could not write the emergency checkpoint "
                             f"{path} ({os_reason(exc)}); the newest earlier checkpoint is kept") from None
        restart_notes(t, state.num_updates)

    saved_by_other = write_once(t, str(state.num_updates), write)
    if saved_by_other is not None:
        return None, saved_by_other
    return path, str(state.num_updates)


def peer_lost(trainer, exc) -> int:
    """Every survivor: the emergency checkpoint and the hand-off note for
    the restart (one survivor writes both), one line, and 75 (torchrun
    restarts on it)."""
    state = trainer.state
    # within an update, the one in flight; between two (validating, saving), after the last one taken
    at = f"at update {state.num_updates + 1}" if trainer.in_flight.offset is not None \
        else f"after update {state.num_updates}"
    where = f"rank {trainer.rank}: lost a peer of this run {at} ({first_line(exc, 160)})"
    if not trainer.checkpointer.checkpoints.enabled:
        print(f"error: {where}; nothing saved (--no-save)", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    from .. import sharding
    if sharding.is_sharded(trainer.model) and not holds_whole_tensors(trainer):
        return shards_lost(trainer, where)
    path, update = emergency_save(trainer)
    saved = f"saved update {update} to {path}" if path is not None else f"another survivor saved update {update}"
    how = ("torchrun restarts the workers and they resume from it by themselves" if trainer.agent is not None
           else "rerun with --resume, on any number of ranks (--global-batch-size keeps the global batch)")
    trainer.lifecycle.release_save_dir()
    print(f"error: {where}; {saved}: {how}", file=sys.stderr)
    return PREEMPTED_EXIT_CODE


def shards_lost(trainer, where: str) -> int:
    """A survivor of a run whose ranks hold shards (--fsdp-sharding full, or
    hybrid with several ranks per node): the lost rank's shards exist nowhere
    else, so nothing can be saved now; the run goes on from the last
    checkpoint (one survivor writes the hand-off note for the restart). One
    line, saying how for the way the run was started, and 75."""
    from ..sharded_checkpoint import is_sharded_checkpoint, read_extra_state
    t = trainer
    last = t.checkpointer.checkpoints.newest_good()
    update = None
    if last is not None:
        try:
            extra = read_extra_state(last, verify=False) if is_sharded_checkpoint(last) else None
            update = extra["train"]["num_updates"] if extra is not None else None
        except (UserError, KeyError, TypeError):  # the update is a courtesy of the line; the path is what counts
            update = None
    write_once(t, str(update), lambda: restart_notes(t, update if update is not None else 0))
    t.lifecycle.release_save_dir()
    at = f" at update {update}" if update is not None else ""
    lost = (f"under --fsdp a rank holds only its shard of the weights (--fsdp-sharding "
            f"{t.cfg.sharding.fsdp_sharding}), and the lost rank's shards exist nowhere else, so nothing is saved now and the updates since the last "
            f"checkpoint are lost")
    if last is None:
        how = "no checkpoint was saved yet: " + ("torchrun restarts the workers and they start afresh"
                                                  if t.agent is not None else "rerun without --resume")
    elif t.agent is not None:
        how = f"torchrun restarts the workers and they resume by themselves from the last checkpoint ({last}){at}"
    else:
        how = f"rerun with --resume from the last checkpoint ({last}){at}"
    print(f"error: {where}; {lost}: {how}", file=sys.stderr)
    return PREEMPTED_EXIT_CODE
