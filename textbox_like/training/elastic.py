"""A peer lost mid-run: every survivor saves the last completed update from
its own state (one of them writes, under a claim), writes the hand-off note
for the restart, and exits 75 (torchrun restarts on it). The agent's side
is :mod:`textbox_like.processes.elastic`.

Under --fsdp a survivor can save alone where every rank holds whole tensors
(``--fsdp-sharding none``, or hybrid with one rank per node): each DTensor's
local part is then the whole tensor, saved as DDP saves it. Under hybrid
with several ranks per node every node holds a whole copy, sharded over its
ranks: the survivors each write their shards, and one of them joins a
complete set (one survivor per shard, of one update) into the same whole
checkpoint (:func:`replica_save`). Under full sharding the lost rank's
shards exist nowhere else: the restart goes on from the last checkpoint,
and the updates since it are lost."""
from __future__ import annotations

import sys
import time

from textbox_like.processes import distributed
from textbox_like.storage.checkpoint import rng_state
from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import SaveFailed, failed_writing, os_reason
from textbox_like.processes.preemption import PREEMPTED_EXIT_CODE


def holds_whole_tensors(trainer) -> bool:
    """Whether every rank holds whole tensors: decided by the run's mesh
    (a shard degree of one), never by the parameters seen at the failure:
    between forward and post-backward FSDP2 puts plain gathered Parameters
    in the modules (the root always; every unit under
    --fsdp-reshard-after-forward false), which say nothing of the shards."""
    from textbox_like.parallel import sharding
    return sharding.shard_degree(trainer.cfg, trainer.placement) == 1


def local_whole(value):
    """A state (nested dicts and lists) with each DTensor as its local tensor,
    as a file keeps it: no collective. Where :func:`holds_whole_tensors`,
    that is the whole tensor (the model's state_dict hooks reshard a module
    caught mid-forward); under hybrid, this rank's shard (:func:`replica_save`)."""
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


def restart_notes(trainer, update: int, emergency_save: bool) -> None:
    """The hand-off note for the restart (from the emergency checkpoint of
    ``update``, or from the last checkpoint), and the rendezvous file gone
    (one survivor, under the claim)."""
    from textbox_like.processes import elastic
    t = trainer
    elastic.write_handoff(t.cfg.checkpoint.save_dir, t.agent, update, t.global_batch.total(), "lost peer",
                          emergency_save=emergency_save)
    distributed.remove_rendezvous_file(t.cfg)


def this_runs_handoff(trainer):
    """The hand-off note another survivor of this run wrote (it names this
    run's owner token), or None."""
    from textbox_like.processes.elastic import read_handoff
    from textbox_like.storage.savelock import owner_token
    note, token = read_handoff(trainer.cfg.checkpoint.save_dir), owner_token()
    return note if note is not None and token is not None and note.get("owner") == token else None


def saved_by_another(trainer):
    """The update another survivor of this run saved (or, where it could
    save none, the last checkpoint's), from its hand-off note, or None."""
    note = this_runs_handoff(trainer)
    return str(note["update"]) if note is not None else None


def write_once(trainer, update: str, write):
    """Run ``write`` in the one survivor that writes for the run: None where
    this one wrote; else the update another survivor saved. Survivors see a
    lost peer at different times (under load, seconds apart): one that comes
    after the writer let go of its claim (and, where the writer held the run's
    lock, of the run) finds the writer's hand-off note, and writes nothing."""
    from textbox_like.core.faults import Superseded
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


def run_name(trainer) -> str:
    """This run's files among the survivors' (its claim, its replica's
    shards), named by its owner token: what a killed writer of an earlier
    run left blocks nothing and is never read as this run's."""
    from textbox_like.storage import savelock
    return (savelock.owner_token() or "run")[:16]


def run_claim(trainer, note: str):
    """The claim of one writer among the survivors, one for the run, not per
    update: a collective can complete on one survivor and fail on another
    (gloo's ring all-reduce), so survivors may stand one update apart and
    must still write once."""
    from textbox_like.processes.elastic import Claim
    return Claim(trainer.checkpointer.checkpoints.dir / f".emergency-{run_name(trainer)}.claim",
                 stale_after=trainer.cfg.distributed.distributed_timeout, note=note)


def last_update_state(trainer):
    """The state of the last completed update, from this rank alone (the
    process group is broken, so no part may gather over ranks): the parts
    but the RNG, the data position rewound to the start of the update in
    flight, this rank's RNG as of then, and the emergency checkpoint's
    path. DTensors are left as they are."""
    t = trainer
    ck, state, start = t.checkpointer.checkpoints, t.state, t.in_flight.start
    t.step.settle()  # a host read of the last device-skipped update's norm, no collective
    if start is not None and start["updates"] == state.num_updates:
        t.iterator.offset = start["offset"]  # the update in flight is redone after the restart
    rng = [None] * t.world
    rng[t.rank] = start["rng"] if start is not None else rng_state()
    parts = {name: part.state_dict() for name, part in ck.parts.items() if name != "rng"}
    return parts, rng, ck.dir / f"checkpoint_{state.epoch}_{state.num_updates}.pt"


def write_emergency(trainer, parts: dict, rng: list, path) -> None:
    """The emergency checkpoint of whole tensors (DDP's file format), and the
    hand-off note; the one writer's."""
    from textbox_like.storage.checkpoint import FORMAT, atomic_save
    t = trainer
    ck = t.checkpointer.checkpoints
    try:
        atomic_save({"format": FORMAT, **ck.metadata, **parts, "rng": rng}, path, make_parents=False)
    except Exception as exc:
        if not failed_writing(exc):
            raise
        raise SaveFailed(f"rank {t.rank}: lost a peer, and could not write the emergency checkpoint "
                         f"{path} ({os_reason(exc)}); the newest earlier checkpoint is kept") from None
    restart_notes(t, t.state.num_updates, emergency_save=True)


def emergency_save(trainer):
    """A peer is lost: save the last completed update from this survivor
    alone (:func:`last_update_state`). One writer among the survivors (a
    claim file, one for the run: survivors may stand one update apart);
    (the path, or None where another survivor writes it; the update saved)."""
    from textbox_like.parallel import sharding
    t = trainer
    parts, rng, path = last_update_state(t)
    if sharding.is_sharded(t.model):  # whole tensors on every rank (peer_lost): DDP's file checkpoint
        parts = local_whole(parts)
    update = str(t.state.num_updates)
    saved_by_other = write_once(t, update, lambda: write_emergency(t, parts, rng, path))
    if saved_by_other is not None:
        return None, saved_by_other
    return path, update


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
    from textbox_like.parallel import sharding
    if sharding.is_sharded(trainer.model) and not holds_whole_tensors(trainer):
        if replicated_over_nodes(trainer):
            return replica_save(trainer, where)
        return shards_lost(trainer, where)
    path, update = emergency_save(trainer)
    trainer.lifecycle.release_save_dir()
    print(saved_line(trainer, where, path, update), file=sys.stderr)
    return PREEMPTED_EXIT_CODE


def saved_line(trainer, where: str, path, update) -> str:
    """A survivor's line where the last completed update is saved (``path``:
    None where another survivor wrote it)."""
    saved = f"saved update {update} to {path}" if path is not None else f"another survivor saved update {update}"
    how = ("torchrun restarts the workers and they resume from it by themselves" if trainer.agent is not None
           else "rerun with --resume, on any number of ranks (--global-batch-size keeps the global batch)")
    return f"error: {where}; {saved}: {how}"


def last_checkpoint(trainer):
    """The newest good checkpoint of the run, and its update where it can be
    read cheaply (a courtesy of the line: the path is what counts)."""
    from textbox_like.storage.sharded_checkpoint import is_sharded_checkpoint, read_extra_state
    last = trainer.checkpointer.checkpoints.newest_good()
    update = None
    if last is not None:
        try:
            extra = read_extra_state(last, verify=False) if is_sharded_checkpoint(last) else None
            update = extra["train"]["num_updates"] if extra is not None else None
        except (UserError, KeyError, TypeError):
            update = None
    return last, update


def nothing_saved_line(trainer, where: str, why: str) -> str:
    """A survivor's line where nothing could be saved (``why``): the run goes
    on from the last checkpoint, the way the run was started says how."""
    t = trainer
    last, update = last_checkpoint(t)
    at = f" at update {update}" if update is not None else ""
    if last is None:
        how = "no checkpoint was saved yet: " + ("torchrun restarts the workers and they start afresh"
                                                  if t.agent is not None else "rerun without --resume")
    elif t.agent is not None:
        how = f"torchrun restarts the workers and they resume by themselves from the last checkpoint ({last}){at}"
    else:
        how = f"rerun with --resume from the last checkpoint ({last}){at}"
    return f"error: {where}; {why}, so nothing is saved now and the updates since the last checkpoint are lost: {how}"


def notes_for_last_checkpoint(trainer) -> None:
    """The hand-off note (and the rendezvous file gone) for a restart from the
    last checkpoint; the one writer's."""
    _, update = last_checkpoint(trainer)
    restart_notes(trainer, update if update is not None else 0, emergency_save=False)


def shards_lost(trainer, where: str) -> int:
    """A survivor of a run whose ranks hold shards that exist nowhere else
    (--fsdp-sharding full): nothing can be saved now; the run goes on from
    the last checkpoint (one survivor writes the hand-off note for the
    restart). One line, saying how for the way the run was started, and 75."""
    t = trainer
    write_once(t, str(last_checkpoint(t)[1]), lambda: notes_for_last_checkpoint(t))
    t.lifecycle.release_save_dir()
    why = (f"under --fsdp a rank holds only its shard of the weights (--fsdp-sharding "
           f"{t.cfg.sharding.fsdp_sharding}), and the lost rank's shards exist nowhere else")
    print(nothing_saved_line(t, where, why), file=sys.stderr)
    return PREEMPTED_EXIT_CODE


# ------------------------------------------- hybrid: a whole copy on every node
def replicated_over_nodes(trainer) -> bool:
    """--fsdp-sharding hybrid over several nodes: every node holds a whole
    copy of the weights and optimizer state, sharded over its ranks."""
    from textbox_like.parallel import sharding
    return trainer.cfg.sharding.fsdp_sharding == "hybrid" and sharding.nodes(trainer.placement) > 1


def shard_file(trainer, update: int, index="*", rank="*"):
    """A survivor's file of its shards of ``update`` (shard ``index`` of the
    node's copy), or with the defaults the pattern of all of them."""
    return trainer.checkpointer.checkpoints.dir / f".emergency-{run_name(trainer)}.update-{update}.shard-{index}.rank-{rank}.pt"


def shard_placement(dtensor):
    """(the mesh dimension, the tensor dimension) along which a DTensor is
    split over a node's ranks, or None where it is whole. Hybrid's DTensors
    are (Replicate, Shard(0)) on our mesh and on Accelerate's alike, whatever
    the dimensions are named; FSDP2 splits as torch.chunk does, in the order
    of the ranks' coordinates on that mesh dimension."""
    from torch.distributed.tensor import Shard
    found = [(mesh_dim, p.dim) for mesh_dim, p in enumerate(dtensor.placements) if isinstance(p, Shard)]
    if len(found) > 1:
        raise ValueError(f"a tensor split over {len(found)} mesh dimensions ({dtensor.placements})")
    return found[0] if found else None


def shard_index(state, default: int) -> int:
    """This rank's place among a node's ranks in the split of its DTensors
    (its coordinate on the mesh dimension they are split over), from the
    first one in ``state``; ``default`` where none is split."""
    from torch.distributed.tensor import DTensor
    if isinstance(state, DTensor):
        where = shard_placement(state)
        return state.device_mesh.get_local_rank(where[0]) if where is not None else default
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for value in values:
        index = shard_index(value, None)
        if index is not None:
            return index
    return default


def join_shards(template, shards: list):
    """``template`` (this rank's state, with DTensors) with every DTensor made
    whole from ``shards``: the same state's local values of every shard
    index, in index order. Everything else is this rank's own."""
    import torch
    from torch.distributed.tensor import DTensor
    if isinstance(template, DTensor):
        where = shard_placement(template)
        whole = torch.cat([piece.cpu() for piece in shards], where[1]) if where is not None else shards[0]
        if tuple(whole.shape) != tuple(template.shape):
            raise ValueError(f"shards joined into {tuple(whole.shape)}, not {tuple(template.shape)}")
        return whole
    if isinstance(template, dict):
        return {key: join_shards(value, [shard[key] for shard in shards]) for key, value in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(join_shards(value, [shard[i] for shard in shards]) for i, value in enumerate(template))
    return template


def wait_for_replica(trainer, update: int, degree: int):
    """The survivors' shard files of ``update``, one per shard index, once
    they make a whole copy: ({index: path}, []); or, where none came within
    the wait, ({}, the missing indices). A survivor may sit in a collective
    with one that already left, up to --distributed-timeout, before it sees
    the loss: that long, and a little more, is waited (the claim stays
    fresh meanwhile: Claim)."""
    deadline = time.monotonic() + trainer.cfg.distributed.distributed_timeout + 10
    pattern = shard_file(trainer, update)
    while True:
        found = {}
        for path in sorted(pattern.parent.glob(pattern.name)):
            found.setdefault(int(path.name.split(".shard-")[1].split(".")[0]), path)
        missing = [index for index in range(degree) if index not in found]
        if not missing:
            return found, []
        if time.monotonic() >= deadline:
            return {}, missing
        time.sleep(0.2)


def replica_save(trainer, where: str) -> int:
    """A survivor under --fsdp-sharding hybrid with several ranks per node:
    it writes its shards of the last completed update (weights, optimizer
    state), unless another survivor's copy of them is there already; the
    one writer waits for a whole copy among the survivors' (for each shard
    index, a survivor that holds it, all of one update: a whole node
    survived, or enough of several), joins it into the emergency checkpoint
    DDP writes, and the restart goes on from it on any number of ranks.
    Where the lost ranks held every copy of a shard, nothing is saved: the
    run goes on from the last checkpoint. One line, and 75."""
    from textbox_like.parallel import sharding
    from textbox_like.storage.checkpoint import FORMAT, atomic_save, load_checkpoint
    from textbox_like.core.faults import Superseded
    t = trainer
    degree = sharding.shard_degree(t.cfg, t.placement)
    parts, rng, path = last_update_state(t)
    update = t.state.num_updates
    sharded = {name: parts[name] for name in ("model", "optimizer") if parts.get(name) is not None}
    index = shard_index(sharded, t.rank % degree)
    mine = shard_file(t, update, index, t.rank)
    why_not = []  # the writer's reason, where it saved nothing
    copies = "under --fsdp-sharding hybrid each node holds a whole copy sharded over its ranks"

    def write():
        try:
            found, missing = wait_for_replica(t, update, degree)
            if missing:
                which = ", ".join(str(i + 1) for i in missing)
                why_not.append(f"{copies}, and the lost ranks held every copy of shard{'s' * (len(missing) > 1)} "
                               f"{which} of {degree}")
            else:
                try:
                    whole = join_shards(sharded, [load_checkpoint(found[i])["state"] for i in range(degree)])
                except UserError as exc:  # a survivor's file damaged since it was written
                    why_not.append(f"a survivor's shards of update {update} cannot be read ({first_line(exc, 200)})")
                except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as exc:  # unlike states or splits
                    why_not.append(f"the survivors' shards cannot be joined ({first_line(exc, 200)})")
            if why_not:
                notes_for_last_checkpoint(t)
                return
            write_emergency(t, {**parts, **whole}, rng, path)
        finally:
            # unfenced: files named by this run's token, which no newer run writes or reads
            for other in mine.parent.glob(f".emergency-{run_name(t)}.update-*"):
                other.unlink(missing_ok=True)

    try:
        # a survivor that comes after the writer has been and gone writes nothing
        saved_by_other = saved_by_another(t)
        if saved_by_other is None:
            if not any(mine.parent.glob(shard_file(t, update, index).name)):  # one copy of each shard is enough
                try:
                    atomic_save({"format": FORMAT, "update": update, "state": local_whole(sharded)}, mine,
                                make_parents=False)
                except Exception as exc:
                    if not failed_writing(exc):
                        raise
                    print(f"warning: rank {t.rank}: could not write its shards of update {update} "
                          f"({os_reason(exc)}); another survivor's copy of them may still make the emergency "
                          f"checkpoint", file=sys.stderr)
            saved_by_other = write_once(t, str(update), write)
    except Superseded as exc:
        # as write_once: the run's lock is gone, its holder having ended the run after the writer's note
        saved_by_other = saved_by_another(t) if not exc.taken_over else None
        if saved_by_other is None:
            raise
    finally:
        mine.unlink(missing_ok=True)  # as above
    note = this_runs_handoff(t)  # before the release: it forgets this run's token
    t.lifecycle.release_save_dir()
    if saved_by_other is None and not why_not:
        line = saved_line(t, where, path, update)
    elif saved_by_other is not None and note is not None and note.get("emergency_save"):
        line = saved_line(t, where, None, saved_by_other)
    else:
        line = nothing_saved_line(t, where, why_not[0] if why_not else
                                  f"{copies}, and the survivors found no whole copy (another survivor's line says why)")
    print(line, file=sys.stderr)
    return PREEMPTED_EXIT_CODE
