"""Sharded checkpoints: torch's distributed checkpoint format (DCP), written
by every rank in parallel, published whole or not at all.

A sharded checkpoint is a directory. Under a name the trainer chooses as for
file checkpoints (:meth:`~textbox_like.storage.checkpoint.CheckpointManager.names`),
with ``.dcp`` for ``.pt`` (``checkpoint_last.dcp``, ``checkpoint_best.dcp``,
``checkpoint3.dcp``, ``checkpoint_1_200.dcp``), the save directory holds a
relative symbolic link to a hidden data directory beside it
(``.checkpoint_last.dcp.3f9a2c1e``) holding:

* DCP's files: ``.metadata`` and the shards ``__<rank>_<n>.distcp``; each rank
  writes its own shards of the model and optimizer state
  (``torch.distributed.checkpoint.save`` of
  ``torch.distributed.checkpoint.state_dict.get_state_dict``: sharded
  DTensors under FSDP, full tensors under DDP or in one process, which DCP
  writes once);
* ``extra.pt``: the small replicated parts (train state, RNG of every rank,
  scheduler, iterator position, run metadata: whatever ``extra_state`` the
  caller gives), written by rank 0 for ``torch.load(weights_only=True)``;
* ``manifest.json``: the format marker, the world size, whether it holds the
  optimizer, and each file's size and BLAKE2b digest.

Atomic as a whole: every name is written into ``.<name>.<hex>.partial``
beside the save directory's files; only after every rank has finished
(DCP's own last collective, then an exchange of the ranks' outcomes) does
rank 0 rename it to its data directory and replace the link (a rename of a
link over a link: a reader sees the old checkpoint or the new one, never a
missing or half one). The data directory a name pointed to before stays,
linked as ``.<name>.prev``, until that name's next save or the end of the run
(:func:`drop_kept_copies`): a reader that resolved the name (:func:`pinned`)
before a save reads the checkpoint it began with, whole (disk: up to two
copies per name during a run). A save killed midway leaves a ``.partial``
directory that never becomes the newest; it, and any data directory no link
of the save directory points to, goes at the next start
(:func:`remove_leftovers`); the data a link of the user's points to (a name
renamed with ``mv``, an ``ln -s`` of a data directory) is never removed. The name
is a link: copy a checkpoint with ``cp -rL`` (``cp -r`` copies the link
alone), or write its model with ``textbox-like export``. Several names of one save
are copies (each rank copies its own part), not links to one directory, so
damage at rest to one leaves the others readable, as for file checkpoints.
Every write first proves the run still owns the save directory
(:func:`~textbox_like.storage.savelock.check_owner`).

Loading checks every file's digest first (the ranks share the reading), then
loads through DCP, which reshards: a checkpoint saved by N ranks loads into M
ranks, sharded or not, and into one process without a process group.

The API (every call on every rank of the group unless said otherwise)::

    ShardedCheckpointManager(cfg, parts, metadata, is_main, saves_sharded, group)  # the trainer's, below
    save_sharded(save_dir, names, model, optimizer, extra_state, group=None) -> [published paths]
    load_sharded(path, model, optimizer=None, group=None) -> extra_state
    read_extra_state(path, group=None) -> extra_state         # verified, without the model
    is_sharded_checkpoint(path) -> bool                       # any process
    claims_to_be_sharded(path) -> bool                        # a directory with a manifest, valid or not
    read_manifest(path) -> dict                               # any process
    verify_sharded(path, group=None)                          # UserError naming the bad file
    sharded_checkpoints_newest_first(save_dir) -> [paths]     # any process
    checkpoints_of_both_formats_newest_first(save_dir) -> [paths]  # .pt and .dcp
    pinned(path) -> Path                                      # the data directory a name points to now
    pinned_on_every_rank(path, group=None) -> Path            # rank 0's pinned, as each rank reaches it
    remove_sharded(path); remove_leftovers(save_dir)          # the main process
    drop_kept_copies(save_dir)                                # the main process, at the end of a run
    full_state_dicts(model, optimizer) -> (model, optimizer)  # a DDP-style (file checkpoint) state
    load_full_state(model, optimizer, model_state, optimizer_state)  # a DDP checkpoint into FSDP
    read_full_model_state(path) -> {name: tensor}             # one process, no model needed
    consolidated_state(path) -> dict                          # load_checkpoint's shape, for export.py

``group``: the process group of the save's collectives (the trainer's
long-timeout gloo group: a large save takes a while); None: the default
group, or no group in one process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from textbox_like.storage.checkpoint import CheckpointManager, check_trained_keys, load_checkpoint
from textbox_like.core.collectives import from_rank0, one_per_rank
from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import SaveFailed, Superseded, failed_writing, os_reason, test_delay
from textbox_like.storage.fileio import fsync_dir, remove
from textbox_like.storage.savelock import check_owner
from textbox_like.storage.dcp_reading import check_metadata, one_process_is_no_news, safe_load

FORMAT = "textbox_like-sharded-1"
SUFFIX = ".dcp"
MANIFEST = "manifest.json"
EXTRA = "extra.pt"
PARTIAL = ".partial"
#: the fix named where a checkpoint's file is damaged or missing
DAMAGED_FIX = "restore another checkpoint of that directory with --restore-file, or start without --resume"


# ------------------------------------------------------------------ names
def sharded_name(name: str) -> str:
    """The sharded checkpoint's name for a file checkpoint's (``checkpoint_last.pt`` -> ``checkpoint_last.dcp``)."""
    return name[:-3] + SUFFIX if name.endswith(".pt") else name if name.endswith(SUFFIX) else name + SUFFIX


def is_sharded_checkpoint(path) -> bool:
    """Whether ``path`` (a published name or its data directory) holds a sharded checkpoint of ours."""
    manifest = Path(path) / MANIFEST
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def claims_to_be_sharded(path) -> bool:
    """Whether ``path`` is a directory with a manifest, valid or not (:func:`read_manifest` says which)."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).exists()


def read_manifest(path, named=None) -> dict:
    """The manifest of the sharded checkpoint ``path``, or one line saying what
    it is instead (``named``: the name a line gives it, for a :func:`pinned` path)."""
    path, read = Path(named or path), Path(path)
    if not read.exists():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    if not read.is_dir():
        raise UserError(f"{path} is a file, not a sharded checkpoint directory (a *.dcp name)")
    try:
        manifest = json.loads((read / MANIFEST).read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is not a textbox_like sharded checkpoint (no {MANIFEST}); pass a checkpoint_*.dcp "
                        f"of a save directory") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"checkpoint {path}: its {MANIFEST} cannot be read ({first_line(exc, 120)}); "
                        f"{DAMAGED_FIX}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise UserError(f"{path} is not a textbox_like sharded checkpoint (its {MANIFEST} has no '{FORMAT}' marker)")
    return manifest


def sharded_checkpoints_newest_first(directory) -> list:
    """The published sharded checkpoints of a save directory, newest first by
    the time each name was published (``checkpoint_last.dcp`` first among equals)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob(f"checkpoint*{SUFFIX}") if p.is_dir()]
    return sorted(found, key=lambda p: (os.lstat(p).st_mtime_ns, p.name == f"checkpoint_last{SUFFIX}"), reverse=True)


def checkpoints_of_both_formats_newest_first(directory) -> list:
    """The file (``.pt``) and sharded (``.dcp``) checkpoints of a save
    directory, newest first by the time each was written or published
    (``checkpoint_last`` first among equals)."""
    from textbox_like.storage.checkpoint import checkpoints_newest_first
    found = sharded_checkpoints_newest_first(directory) + checkpoints_newest_first(directory)
    return sorted(found, key=lambda p: (os.lstat(p).st_mtime_ns, p.stem == "checkpoint_last"), reverse=True)


def pinned(path) -> Path:
    """The data directory the published name ``path`` points to now (``path``
    itself where it is one, e.g. a copy): a reader reads every file through it,
    so a save that replaces the name meanwhile does not mix two checkpoints
    (the replaced data stays until the name's next save or the run's end)."""
    return Path(os.path.realpath(path))


def pinned_on_every_rank(path, group=None) -> Path:
    """The data directory rank 0 of ``group`` finds the published name ``path``
    pointing to now (:func:`pinned`), on every rank, as each rank reaches it:
    only its path relative to ``path``'s directory crosses, rebuilt beside
    ``path``, since each node may reach the save directory through a path of
    its own (another mount point, a symlinked /home) where rank 0's resolved
    path does not exist. Also where ``path`` is a link to a directory
    elsewhere (a link of the user's to a published name of another run): a
    rank resolving it itself, at its own moment, could find that name saved
    anew meanwhile, and read another checkpoint than the others."""
    path = Path(path)
    world, rank = world_and_rank(group)
    relative = os.path.relpath(pinned(path), pinned(path.parent)) if rank == 0 else None
    return path.parent / from_rank0(relative, world, group)


def data_directories(save_dir, name) -> list:
    """The data directories of the published name ``name`` (``checkpoint_last.dcp``):
    the one it points to and the one it replaced, or more after a killed save."""
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{8}}")
    return [p for p in Path(save_dir).glob(f".{name}.*") if pattern.fullmatch(p.name) and not p.is_symlink()]


def file_digest(path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


# ------------------------------------------------------------ collectives
def distributed() -> bool:
    """Whether this process is in a process group (else DCP reads and writes alone)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def world_and_rank(group=None) -> tuple:
    import torch.distributed as dist
    if not distributed():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def first_failure(exc) -> tuple:
    """(rank, exception) of the first rank a DCP CheckpointException names."""
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        inner = failures[rank]
        return rank, inner[0] if isinstance(inner, tuple) else inner
    return None, exc


def agree(step, group=None, what="the save"):
    """Run ``step()`` on this rank, then learn every rank's outcome: the rank
    that failed raises its own exception (a write failure as SaveFailed), the
    others a SaveFailed naming it. So no rank waits in a collective for a
    peer that gave up."""
    error, result = None, None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers learn of it
        error = exc
    outcomes = one_per_rank(None if error is None else f"{type(error).__name__}: {os_reason(error)}",
                            world_and_rank(group)[0], group)
    if error is not None:
        if isinstance(error, OSError) or failed_writing(error):
            raise SaveFailed(f"could not write {what} ({os_reason(error)})") from None
        raise error
    failed = [(rank, why) for rank, why in enumerate(outcomes) if why is not None]
    if failed:
        rank, why = failed[0]
        raise SaveFailed(f"rank {rank} could not write {what} ({why}); stopping")
    return result


# ------------------------------------------------------------------- save
def state_options(trained_only=False, **options):
    """DCP's state-dict options; ``trained_only`` (--peft): the frozen
    weights are left out of the state saved, and a state without them loads."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only, **options)


def trained_part(model, model_state: dict, trained_only: bool) -> dict:
    """``model_state`` without frozen tensors under ``trained_only``: DCP's
    ignore_frozen_params keeps a frozen weight tied under a second name
    (GPT-2's lm_head.weight, the embedding's), the size of a vocabulary."""
    if not trained_only:
        return model_state
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: value for name, value in model_state.items() if name in trained}


def save_sharded(save_dir, names, model, optimizer, extra_state: dict, group=None, trained_only=False) -> list:
    """Save ``model`` and ``optimizer`` (None: the model alone) sharded, with
    ``extra_state`` (plain values and tensors, rank 0's written), under each
    of ``names`` in ``save_dir`` (file names are mapped by :func:`sharded_name`);
    returns the published paths. On every rank of ``group``. A failure to
    write raises :class:`~textbox_like.core.faults.SaveFailed` on every rank and
    publishes nothing; the previous checkpoints stay as they were."""
    save_dir = Path(save_dir)
    names = [sharded_name(n) for n in names]
    if not names:
        return []
    world, rank = world_and_rank(group)
    targets = [save_dir / n for n in names]
    # the names alone cross: each node may reach the save directory through a path of its own
    # (another mount point, a symlinked /home), so each rank finds them in its own save_dir
    made = agree(lambda: make_partials(save_dir, targets, rank), group, f"{targets[0]}")
    partials = [save_dir / name for name in from_rank0(made, world, group)]
    try:
        files = save_shards(partials, targets, model, optimizer, group, trained_only)
        agree(lambda: write_extra_and_manifest(partials, files, extra_state, optimizer is not None, world, rank),
              group, f"{targets[0]}")
        agree(lambda: publish(save_dir, partials, targets, rank), group, f"{targets[0]}")
    except BaseException as exc:
        # a failed save leaves nothing behind; a superseded process writes (and removes) nothing
        if rank == 0 and not isinstance(exc, Superseded):
            for partial in partials:
                shutil.rmtree(partial, ignore_errors=True)
        raise
    return targets


def make_partials(save_dir: Path, targets: list, rank: int):
    """save_sharded's first step: every rank proves it owns the save
    directory before any write; rank 0 makes a partial directory per target
    (never the save directory itself: one removed under a run is a fault,
    not a fresh start) and returns their names."""
    for target in targets:
        check_owner(target)
    if rank != 0:
        return None
    made = []
    for target in targets:
        partial = save_dir / f".{target.name}.{uuid.uuid4().hex[:8]}{PARTIAL}"
        partial.mkdir()
        made.append(partial.name)
    return made


def save_shards(partials: list, targets: list, model, optimizer, group, trained_only=False) -> dict:
    """Every rank's shards of the model (and optimizer) into the first
    partial directory with DCP, then each file's size and digest, the ranks
    sharing the reading (each hashes every world-th file): {name: entry}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    world, rank = world_and_rank(group)
    options = state_options(trained_only)
    if optimizer is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": trained_part(model, model_state, trained_only), "optimizer": optimizer_state}
    else:
        state = {"model": trained_part(model, get_model_state_dict(model, options=options), trained_only)}
    try:  # DCP's own collectives carry a failing rank's exception to every rank
        with one_process_is_no_news():
            dcp.save(state, checkpoint_id=str(partials[0]), process_group=group, no_dist=not distributed())
    except CheckpointException as exc:
        failed_rank, inner = first_failure(exc)
        if failed_writing(inner):
            raise SaveFailed(f"rank {failed_rank} could not write the shards of {targets[0]} "
                             f"({os_reason(inner)})") from None
        raise

    def digest_share():
        files = sorted(p.name for p in partials[0].iterdir() if p.is_file())
        return {name: {"bytes": (partials[0] / name).stat().st_size, "blake2b": file_digest(partials[0] / name)}
                for name in files[rank::world]}
    files = {}
    for share in one_per_rank(agree(digest_share, group, f"{targets[0]}"), world, group):
        files.update(share)
    return files


def write_extra_and_manifest(partials: list, files: dict, extra_state: dict, with_optimizer: bool, world: int,
                             rank: int) -> None:
    """Every rank copies the files it hashed into the other names'
    directories; rank 0 writes the extra state and, into every partial
    directory, the manifest (``files`` gains the extra state's entry)."""
    for partial in partials[1:]:
        for name in sorted(files)[rank::world]:
            copy_synced(partials[0] / name, partial / name)
    if rank != 0:
        return
    import torch
    with open(partials[0] / EXTRA, "wb") as handle:
        torch.save(extra_state, handle)
        synced(handle)
    files[EXTRA] = {"bytes": (partials[0] / EXTRA).stat().st_size, "blake2b": file_digest(partials[0] / EXTRA)}
    manifest = {"format": FORMAT, "world_size": world, "optimizer": with_optimizer,
                "saved": time.time(), "files": files}
    for partial in partials:
        if partial is not partials[0]:
            copy_synced(partials[0] / EXTRA, partial / EXTRA)
        with open(partial / MANIFEST, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
            synced(handle)
        fsync_dir(partial)


def publish(save_dir: Path, partials: list, targets: list, rank: int) -> None:
    """Rank 0 renames each complete partial directory to its name."""
    if rank != 0:
        return
    time.sleep(test_delay("publish"))  # test hook: a save killed after its writes, before its rename
    for partial, target in zip(partials, targets):
        publish_directory(partial, target)
    fsync_dir(save_dir)


def synced(handle) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def copy_synced(source, target) -> None:
    with open(source, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
        synced(dst)


KEPT = ".prev"  # the kept link's suffix: .<name>.prev
#: what a killed save may leave: a data directory, a .partial one, a half-made link
LEFTOVER = re.compile(rf"\.checkpoint.*{re.escape(SUFFIX)}\.[0-9a-f]{{8}}({re.escape(PARTIAL)}|\.link)?")
KEPT_LINK = re.compile(rf"\.checkpoint.*{re.escape(SUFFIX)}{re.escape(KEPT)}")


def kept_link(target: Path) -> Path:
    """The link to the data directory the published name ``target`` replaced
    at its last save (``.checkpoint_last.dcp.prev``), kept for its readers."""
    return target.with_name(f".{target.name}{KEPT}")


def replace_link(link: Path, points_to, name: str) -> None:
    """``link`` points to ``points_to`` (None: no link) after one rename; a
    half-made link (``.<name>.<hex>.link``) is what a kill leaves at worst."""
    if points_to is None:
        link.unlink(missing_ok=True)
        return
    made = link.with_name(f".{name}.{uuid.uuid4().hex[:8]}.link")
    os.symlink(points_to, made)
    try:
        os.replace(made, link)
    except BaseException:
        made.unlink(missing_ok=True)
        raise


def linked_directories(save_dir) -> set:
    """The resolved paths that the links of ``save_dir`` point to: its
    published names, their kept links, and links of the user's (a name
    renamed with ``mv``, an ``ln -s .checkpoint_best.dcp.3f9a2c1e ep3.dcp``);
    the data they point to is never removed. A half-made link of a killed
    save protects nothing."""
    return {os.path.realpath(path) for path in Path(save_dir).iterdir()
            if path.is_symlink() and not (LEFTOVER.fullmatch(path.name) and path.name.endswith(".link"))}


def remove_unlinked(save_dir, name) -> None:
    """The data directories of ``name`` that no link of ``save_dir`` points to, removed."""
    linked = linked_directories(save_dir)
    for data in data_directories(save_dir, name):
        if os.path.realpath(data) not in linked:
            shutil.rmtree(data)


def publish_directory(partial: Path, target: Path) -> None:
    """``partial`` (complete, synced) becomes the checkpoint named ``target``:
    renamed to its data directory, then a new link replaces the name's old
    one in one rename. The data directory the old link pointed to stays,
    linked by :func:`kept_link` (a reader that pinned it goes on reading it);
    the name's other data directories are removed unless a link of the
    user's points to them. A kill at any moment leaves every directory
    worth keeping linked: what no link points to is garbage, removed at the
    next start (:func:`remove_leftovers`). Ownership is proved again before
    the links change and before the removal: a newer run that took the
    directory meanwhile may have renamed its own data directory of the name
    into place, not linked yet, which the removal would take for garbage."""
    check_owner(target)  # writing took a while: a newer run may own the directory by now
    data = partial.with_name(partial.name[:-len(PARTIAL)])
    os.replace(partial, data)
    time.sleep(test_delay("renamed"))  # test hook: a save killed (or its run taken over) between its renames
    check_owner(target)
    old = os.readlink(target) if target.is_symlink() else None
    replace_link(kept_link(target), old, target.name)
    replace_link(target, data.name, target.name)
    check_owner(target)
    remove_unlinked(target.parent, target.name)


def remove_sharded(path) -> None:
    """Remove a published sharded checkpoint (pruning): its name and kept
    link, then its data, the replaced one too, unless a link of the user's
    points to it (main process)."""
    path = Path(path)
    check_owner(path)
    path.unlink(missing_ok=True)
    kept_link(path).unlink(missing_ok=True)
    remove_unlinked(path.parent, path.name)


def remove_leftovers(save_dir) -> list:
    """What killed saves left (``.partial`` directories, half-made links, data
    directories no link points to: one a kill between the renames of
    :func:`publish_directory` left, or one it left half-removed), and kept
    links whose data is gone, removed; the main process, at start, before
    the first save. The data a link points to stays: a published name's,
    the one it replaced (its kept link), and any a link of the user's points
    to. Returns what was removed."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    linked = linked_directories(save_dir)
    removed = []
    for path in save_dir.iterdir():
        match = LEFTOVER.fullmatch(path.name)
        if match and match.group(1) is None and os.path.realpath(path) in linked:
            continue
        if not match and not (KEPT_LINK.fullmatch(path.name) and path.is_symlink() and not path.exists()):
            continue
        check_owner(path)
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def drop_kept_copies(save_dir) -> list:
    """The data each name replaced, removed with its kept link: at the end of
    a run that finished (the main process), so that it leaves one copy of
    each checkpoint. A reader still reading a replaced checkpoint then loses
    it; the data a link of the user's points to stays. Returns what was removed."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    for link in save_dir.iterdir():
        if KEPT_LINK.fullmatch(link.name) and link.is_symlink():
            check_owner(link)
            link.unlink(missing_ok=True)
    return remove_leftovers(save_dir)


# ------------------------------------------------------------------- load
def verify_sharded(path, group=None, alone=False, named=None) -> dict:
    """Check every file of the checkpoint against its manifest (sizes, then
    digests; the ranks of ``group`` share the reading, or this process
    ``alone``); one line naming the first damaged or missing file, on every
    rank. Returns the manifest. ``named``: as for :func:`read_manifest`."""
    read = Path(path)
    manifest = read_manifest(read, named)
    path = Path(named or path)
    world, rank = (1, 0) if alone else world_and_rank(group)

    def check(name, expected):
        file = read / name
        if not file.is_file():
            return f"checkpoint {path} is missing its file {name}; {DAMAGED_FIX}"
        size = file.stat().st_size
        if size != expected.get("bytes"):
            return (f"checkpoint {path}: its file {name} is truncated or changed ({size} bytes, {expected.get('bytes')}"
                    f" written); {DAMAGED_FIX}")
        if file_digest(file) != expected.get("blake2b"):
            return (f"checkpoint {path}: its file {name} fails its digest check (its contents were changed or "
                    f"corrupted after it was written); {DAMAGED_FIX}")
        return None
    names = sorted(manifest["files"])
    mine = [problem for name in names[rank::world] if (problem := check(name, manifest["files"][name]))]
    problems = mine if alone else [p for share in one_per_rank(mine, world, group) for p in share]
    if problems:
        raise UserError(problems[0])
    return manifest


def load_sharded(path, model, optimizer=None, group=None, verify=True, named=None, trained_only=False) -> dict:
    """Load the sharded checkpoint ``path`` into ``model`` (FSDP, DDP or plain;
    any world size: DCP reshards) and into ``optimizer`` when given and the
    checkpoint holds an optimizer state (``read_manifest(path)["optimizer"]``);
    returns the ``extra_state`` it was saved with. Digests are checked first
    (unless ``verify=False``: checked just before, by :func:`read_extra_state`),
    so a damaged checkpoint changes nothing. ``named``: as for :func:`read_manifest`."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)
    path = Path(path)
    manifest = verify_sharded(path, group, named=named) if verify else read_manifest(path, named)
    from torch.distributed.checkpoint.api import CheckpointException
    options = state_options(trained_only)
    try:
        if optimizer is not None and manifest["optimizer"]:
            model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
            state = {"model": trained_part(model, model_state, trained_only), "optimizer": optimizer_state}
            safe_load(state, path, named, process_group=group, no_dist=not distributed())
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=options)
        else:
            state = {"model": trained_part(model, get_model_state_dict(model, options=options), trained_only)}
            safe_load(state, path, named, process_group=group, no_dist=not distributed())
            set_model_state_dict(model, state["model"], options=options)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
        reason = first_line(first_failure(exc)[1] if isinstance(exc, CheckpointException) else exc, 200)
        raise UserError(f"the model or optimizer state in {named or path} does not fit this run ({reason}); "
                        f"use the model and optimizer it was trained with, or pass --reset-optimizer") from None
    return read_extra_state(path, verify=False, named=named)


def read_extra_state(path, group=None, verify=True, named=None) -> dict:
    """The ``extra_state`` a sharded checkpoint was saved with, its files'
    digests checked first (on every rank of ``group``, sharing the reading).
    ``named``: as for :func:`read_manifest`."""
    import torch
    verify_sharded(path, group, named=named) if verify else read_manifest(path, named)
    try:
        return torch.load(Path(path) / EXTRA, map_location="cpu", weights_only=True)
    except Exception as exc:  # verified: only a foreign file that was never ours gets here
        from textbox_like.storage.checkpoint import unreadable_weights_reason
        raise UserError(f"checkpoint {named or path}: its {EXTRA} cannot be read "
                        f"({unreadable_weights_reason(exc)})") from None


# ------------------------------------------------------- DDP <-> sharded
def optimizer_param_names(model, optimizer) -> list:
    """The model's name of each parameter of ``optimizer``, in the order of its
    param_groups: the ids a DDP-style (``optimizer.state_dict()``) state uses."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    try:
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the model's") from None


def full_state_dicts(model, optimizer=None, trained_only=False) -> tuple:
    """The model's and optimizer's full state (gathered from the shards;
    every rank takes part, rank 0 gets the values, the others empty dicts),
    in the DDP-style form a file checkpoint holds: the model's own keys, the
    optimizer's ``state_dict()`` with parameter ids."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    options = state_options(trained_only, full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return trained_part(model, get_model_state_dict(model, options=options), trained_only), None
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    model_state = trained_part(model, model_state, trained_only)
    if not optimizer_state:
        return model_state, optimizer_state
    ids = {name: i for i, name in enumerate(optimizer_param_names(model, optimizer))}
    return model_state, {"state": {ids[name]: value for name, value in optimizer_state["state"].items()},
                         "param_groups": [{**group, "params": [ids[n] for n in group["params"]]}
                                          for group in optimizer_state["param_groups"]]}


def load_full_state(model, optimizer, model_state: dict, optimizer_state: dict | None = None,
                    trained_only=False) -> None:
    """Load a DDP-style full state (a file checkpoint's ``model`` and
    ``optimizer`` entries, every rank holding all of it) into a sharded
    ``model`` and its ``optimizer``: each rank keeps its own shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    options = state_options(trained_only, full_state_dict=True)
    if optimizer is None or optimizer_state is None:
        set_model_state_dict(model, model_state, options=options)
        return
    if not optimizer_state["state"]:
        # no per-parameter state (SGD without momentum): torch's set_state_dict finds no tensor to
        # take the device from and fails; the param groups alone load by position, as the ids name them
        set_model_state_dict(model, model_state, options=options)
        optimizer.load_state_dict(optimizer_state)
        return
    names = optimizer_param_names(model, optimizer)
    by_name = {"state": {names[int(i)]: value for i, value in optimizer_state["state"].items()},
               "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                                for group in optimizer_state["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=by_name, options=options)


# ----------------------------------------------------------------- export
def read_full_model_state(path, verify=True, named=None) -> dict:
    """The model's full weights from a sharded checkpoint, in one process, without
    building the model (nor reading the optimizer's shards): DCP reads each
    tensor whole from the shards of every rank that saved a piece of it."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    path = Path(path)
    verify_sharded(path, alone=True, named=named) if verify else read_manifest(path, named)
    metadata = check_metadata(path, named)
    weights = {}
    for key, item in metadata.state_dict_metadata.items():
        where = metadata.planner_data[key]
        if where[0] == "model" and len(where) == 2 and isinstance(item, TensorStorageMetadata):
            weights[where[1]] = torch.empty(item.size, dtype=item.properties.dtype)
    state = {"model": weights}
    safe_load(state, path, named, no_dist=True)
    return state["model"]


def consolidated_state(path) -> dict:
    """The checkpoint in the shape :func:`~textbox_like.storage.checkpoint.load_checkpoint`
    returns (its extra state, e.g. task, config and train, with the full model
    weights as ``model``), so that :mod:`textbox_like.tools.export`'s
    ``export_hf``/``export_weights``/``model_with_weights`` take it. Read
    whole from the data directory ``path`` points to at the start: a training
    run saving under that name meanwhile (``textbox-like eval`` of
    ``checkpoint_best.dcp`` during training) changes nothing of it."""
    data = pinned(path)
    model = read_full_model_state(data, named=path)
    return {**read_extra_state(data, verify=False, named=path), "model": model}


# ------------------------------------------------------------------ manager
SHARDED_FROM = "sharded_checkpoint"  # the key under which a read sharded state names its directory


class ShardedCheckpointManager(CheckpointManager):
    """The trainer's :class:`~textbox_like.storage.checkpoint.CheckpointManager` for a
    run that may meet sharded checkpoints: with ``saves_sharded`` (an FSDP
    run) it saves sharded checkpoints (every rank writes; the same names with
    ``.dcp``), else file checkpoints as the base class does. It resumes from
    the newest checkpoint of either format: a sharded one through DCP (any
    world size, into a sharded or a DDP model), a file one (a DDP run's) into
    a sharded model through :func:`load_full_state`. So a run switches
    between DDP and FSDP across a --resume.

    ``parts["model"]`` has ``module()`` (the model, unwrapped of DDP and
    torch.compile; an FSDP module itself), ``parts["optimizer"]`` has
    ``optimizer``, ``name`` and ``saved`` (training/state.py's ModelPart and
    OptimizerPart); the other parts are saved in ``extra.pt``. ``group``: the
    process group of the save's and load's collectives (the long-timeout
    gloo group). Call ``save``, ``load_newest`` and ``restore`` on every rank."""

    def __init__(self, cfg, parts: dict, metadata: dict, is_main: bool, saves_sharded: bool, group=None):
        super().__init__(cfg, parts, metadata, is_main)
        self.saves_sharded, self.group = saves_sharded, group
        if self.enabled and is_main and self.dir.is_dir():
            remove_leftovers(self.dir)

    def file_name(self, name: str) -> str:
        return sharded_name(name) if self.saves_sharded else name

    @property
    def trained_only(self) -> bool:
        """--peft: the model's checkpoint state is the weights that train."""
        return getattr(self.parts["model"], "trained_only", False)

    def model_and_optimizer(self):
        model = self.parts["model"].module()
        part = self.parts.get("optimizer")
        optimizer = getattr(part.optimizer, "optimizer", part.optimizer)  # Accelerate's wrapper: torch's own
        return model, optimizer, part

    # save ----------------------------------------------------------------
    def save(self, names) -> list:
        if not self.saves_sharded:
            return super().save(names)
        if not names:
            return []
        model, optimizer, optimizer_part = self.model_and_optimizer()
        extra = {**self.metadata, "optimizer_name": optimizer_part.name,
                 **{name: part.state_dict() for name, part in self.parts.items() if name not in ("model", "optimizer")}}
        try:
            paths = save_sharded(self.dir, names, model, optimizer if optimizer_part.saved else None, extra, self.group,
                                 self.trained_only)
        except SaveFailed as exc:
            if not self.dir.is_dir():
                raise SaveFailed(f"could not write {self.dir / sharded_name(names[0])}: the save directory {self.dir} "
                                 f"was removed during the run, with its checkpoints, config.yaml and metrics.jsonl; "
                                 f"stopping (nothing is recreated)") from None
            last = self.newest_good()
            raise SaveFailed(f"{exc}; " + (f"the last good checkpoint is {last}: free space or fix the directory, "
                                           f"then rerun with --resume" if last else
                                           "no checkpoint was saved before this one")) from None
        if self.is_main:
            self.prune_sharded()
        self.last_saved = paths[0]
        return paths

    def prune_after_save(self):
        """A file save's pruning (the base class calls it) counts the .dcp
        checkpoints an earlier --fsdp run left here too."""
        self.prune_sharded()

    def prune_sharded(self):
        """--keep-interval-updates and --keep-last-epochs for sharded checkpoints
        (the main process), counted together with the file checkpoints of the
        same names beside them: a survivor's emergency save
        (``checkpoint_E_U.pt``, training/elastic.py), an earlier DDP leg's;
        the base class's pruning, which would take those, does not run for
        sharded saves."""
        cfg = self.cfg
        kinds = rf"(?P<kind>{re.escape(SUFFIX)}|\.pt)"
        for pattern, keep, index in ((rf"checkpoint_(\d+)_(\d+){kinds}", cfg.keep_interval_updates, 1),
                                     (rf"checkpoint(\d+){kinds}", cfg.keep_last_epochs, 0)):
            if keep <= 0:
                continue
            found = [(int(m.group(index + 1)), path) for path in self.dir.iterdir()
                     if (m := re.fullmatch(pattern, path.name))
                     and (path.is_symlink() if m.group("kind") == SUFFIX else path.is_file())]
            for _, path in sorted(found, reverse=True)[keep:]:
                if path.suffix == SUFFIX:
                    remove_sharded(path)
                else:
                    remove(path)

    # restore -------------------------------------------------------------
    def candidates(self) -> list:
        """The checkpoints of the save directory of both formats, newest first."""
        return checkpoints_of_both_formats_newest_first(self.dir)

    def is_checkpoint(self, path) -> bool:
        return Path(path).is_file() or is_sharded_checkpoint(path)

    def recorded_update(self, path) -> int:
        if not Path(path).is_dir():
            return super().recorded_update(path)
        try:
            return int(read_extra_state(path, verify=False)["train"]["num_updates"])
        except (UserError, KeyError, TypeError, ValueError):
            return -1

    def why_not_a_checkpoint(self, path) -> str:
        if claims_to_be_sharded(path):
            try:
                read_manifest(path)   # what is wrong with its manifest
            except UserError as exc:
                return str(exc)
        return super().why_not_a_checkpoint(path)

    def resume_path(self):
        """Under --resume, the checkpoint rank 0 finds newest, on every rank:
        each rank listing the save directory itself could choose another (a
        shared file system's client answering from its cache; a save
        directory per node), a ``.pt`` on one rank and a ``.dcp`` on another,
        whose reads' collectives do not match. Its name crosses, found in
        each rank's own save directory (a node may reach it by its own path)."""
        if self.cfg.restore_file or not self.cfg.resume:
            return super().resume_path()
        world, rank = world_and_rank(self.group)
        path = super().resume_path() if rank == 0 else None
        name = from_rank0(path.name if path is not None else None, world, self.group)
        return self.dir / name if name is not None else None

    def read(self, path) -> dict:
        """A checkpoint's state, verified: a file checkpoint whole; a sharded
        one's extra state (its model and optimizer are loaded by :meth:`restore`
        from the same data directory, :func:`pinned_on_every_rank`)."""
        path = Path(path)
        if path.is_dir():
            data = pinned_on_every_rank(path, self.group)
            return {**read_extra_state(data, self.group, named=path), SHARDED_FROM: str(data)}
        return load_checkpoint(path)

    def restore(self, state, path) -> list:
        sharded_state = SHARDED_FROM in state
        if not sharded_state and not self.saves_sharded:
            return super().restore(state, path)  # a file checkpoint into a DDP run: as ever
        # the other parts first, as the base class restores them (the task checked before anything)
        fresh = [name for name in super().restore({**state, "model": None, "optimizer": None}, path)
                 if name not in ("model", "optimizer")]
        model, optimizer, optimizer_part = self.model_and_optimizer()
        if sharded_state:
            saved_name = state.get("optimizer_name")
            has_optimizer = read_manifest(state[SHARDED_FROM], path)["optimizer"]
        else:
            saved = state.get("optimizer")
            saved_name, has_optimizer = (saved or {}).get("name"), saved is not None
        keep_optimizer = has_optimizer and not self.cfg.reset_optimizer
        if keep_optimizer and saved_name != optimizer_part.name:
            raise UserError(f"the checkpoint holds {saved_name} state, this run uses {optimizer_part.name}; "
                            f"pass --reset-optimizer to start {optimizer_part.name} afresh")
        if not keep_optimizer:
            fresh.append("optimizer")
        if sharded_state:
            load_sharded(state[SHARDED_FROM], model, optimizer if keep_optimizer else None, self.group, verify=False,
                         named=path, trained_only=self.trained_only)
        else:  # a DDP run's file checkpoint into this sharded run
            optimizer_state = {k: v for k, v in state["optimizer"].items() if k != "name"} if keep_optimizer else None
            if self.trained_only:
                check_trained_keys({n for n, p in model.named_parameters() if p.requires_grad}, state["model"], path)
            try:
                load_full_state(model, optimizer if keep_optimizer else None, state["model"], optimizer_state,
                                self.trained_only)
            except (ValueError, KeyError, RuntimeError, TypeError) as exc:
                raise UserError(f"the model or optimizer state in {path} does not fit this run "
                                f"({first_line(exc, 150)}); use the model options it was trained with, or pass "
                                f"--reset-optimizer") from None
        return fresh


# ------------------------------------------------ a save directory's earlier run (either format)
def run_held_in(directory) -> str | None:
    """What a save directory holds of an earlier run, for a message
    (``checkpoint_last.pt at update 142``), or None where it holds none: a
    directory that is empty or holds only a config.yaml (a run that failed
    before training) is not a run."""
    # checkpoints of either format: a sharded (FSDP) run's are directories
    directory = Path(directory)
    found = checkpoints_of_both_formats_newest_first(directory)
    if found:
        newest = found[0]
        try:
            state = read_extra_state(newest, verify=False) if newest.is_dir() else load_checkpoint(newest, verify=False)
            update = f" at update {int(state['train']['num_updates'])}"
        except (UserError, KeyError, TypeError, ValueError):
            update = ""  # unreadable: named all the same, it is still a run's file
        more = f" and {len(found) - 1} other checkpoint(s)" if len(found) > 1 else ""
        return f"{newest.name}{update}{more}"
    # metrics.jsonl is opened (created empty) with the log, before this check
    held = [name for name in ("metrics.jsonl", "results.json")
            if (directory / name).is_file() and (directory / name).stat().st_size]
    return " and ".join(held) or None


def restores_own_checkpoint(cfg) -> bool:
    """--restore-file names a checkpoint of the save directory itself
    (fairseq's way to go on from an earlier point of the same run)."""
    if not cfg.restore_file:
        return False
    path, directory = Path(cfg.restore_file), Path(cfg.save_dir)
    if not path.is_absolute() and not path.exists():
        path = directory / path
    return (path.is_file() or is_sharded_checkpoint(path)) and directory.is_dir() \
        and path.resolve().parent == directory.resolve()


def refuse_rerun(cfg) -> None:
    """A new run (no --resume) in a save directory that holds a run would
    overwrite its checkpoints and append to its metrics.jsonl: refused
    before anything is written (``cfg``: the checkpoint section)."""
    if cfg.resume or cfg.no_save or restores_own_checkpoint(cfg):
        return
    held = run_held_in(cfg.save_dir)
    if held:
        raise UserError(f"--save-dir {cfg.save_dir} already holds a run ({held}); continue it with --resume, "
                        f"or start a new run in another --save-dir")
