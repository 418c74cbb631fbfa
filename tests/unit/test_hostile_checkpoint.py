"""A checkpoint is data: a `.dcp` whose files were replaced by pickles that run
a shell command (its manifest's sizes and digests updated to match, since a
digest is not a signature) runs nothing through any entry point that reads a
checkpoint: `textbox-like export`, `textbox-like eval`, `--restore-file` (with
and without `--fsdp`) and `--resume`. Each is refused in one line, exit 2, and
the command's marker file is never created.

Two hostile files: `.metadata` replaced (torch's FileSystemReader unpickles it
without restriction), and a non-tensor item of the shards (the optimizer's
`lr`, which torch's DefaultLoadPlanner reads with `weights_only=False`).

Every case runs the entry point's main in-process (what its process runs);
two cases also run as real processes started from a directory outside the
repository, as a user would."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_main, write_mnist


class Hostile:
    """Unpickling it runs ``touch MARKER`` (what a hostile file would do worse)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def update_manifest(directory: Path, *names):
    """Make the manifest agree with the replaced files, as an attacker would."""
    from textbox_like.storage.sharded_checkpoint import file_digest
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for name in names:
        manifest["files"][name] = {"bytes": (directory / name).stat().st_size, "blake2b": file_digest(directory / name)}
    manifest_path.write_text(json.dumps(manifest))


def hostile_metadata(checkpoint: Path, marker: Path):
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    update_manifest(checkpoint, ".metadata")


def hostile_item(checkpoint: Path, marker: Path):
    """Re-save the checkpoint's own model and optimizer state through DCP with
    the optimizer's lr replaced by a Hostile object: the .metadata is genuine."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = FileSystemReader(str(checkpoint)).read_metadata()   # our own genuine file
    flat = {key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata)
            else None for key, item in metadata.state_dict_metadata.items()}
    state = unflatten_state_dict(flat, metadata.planner_data)
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    lr = [key for key in metadata.state_dict_metadata if key.endswith(".lr")]
    assert lr, sorted(metadata.state_dict_metadata)[:20]
    set_element(state, metadata.planner_data[lr[0]], Hostile(marker))
    for name in os.listdir(checkpoint):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(checkpoint / name)
    dcp.save(state, checkpoint_id=str(checkpoint), no_dist=True)
    update_manifest(checkpoint, *[n for n in os.listdir(checkpoint) if n.endswith(".distcp") or n == ".metadata"])
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = {n: v for n, v in manifest["files"].items() if (checkpoint / n).exists()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """A real one-process --fsdp run of 3 updates: its checkpoints are .dcp directories."""
    root = tmp_path_factory.mktemp("hostile")
    data = root / "mnist"
    write_mnist(data, n_train=256, n_test=32, seed=3)
    save = root / "run"
    assert run_main(["--task", "mnist", "--data", str(data), "--max-sentences", "32", "--max-update", "3", "--fsdp",
                     "--log-format", "none", "--save-dir", str(save)]) == 0
    assert (save / "checkpoint_last.dcp" / ".metadata").is_file()
    return data, save


def poisoned_run(fsdp_run, tmp_path, poison):
    """A copy of the run whose every .dcp checkpoint is poisoned; the marker the poison would create."""
    data, save = fsdp_run
    run = Path(shutil.copytree(save, tmp_path / "run", symlinks=True))
    marker = tmp_path / "CODE_RAN"
    for link in run.glob("checkpoint_*.dcp"):
        poison(link.resolve(), marker)
    return data, run, marker


def entry_points(data, run, tmp_path):
    ckpt = run / "checkpoint_last.dcp"
    train = [str(REPO / "run_hetseq.py"), "--task", "mnist", "--data", str(data), "--max-sentences", "32", "--log-format", "none",
             "--max-update", "5"]
    return {
        "export": ["-m", "textbox_like", "export", str(ckpt), "--to", str(tmp_path / "exported")],
        "eval": ["-m", "textbox_like", "eval", "--model_ckpt", str(ckpt), "--data", str(data)],
        "restore-file": [*train, "--save-dir", str(tmp_path / "new"), "--restore-file", str(ckpt)],
        "restore-file --fsdp": [*train, "--save-dir", str(tmp_path / "new_fsdp"), "--restore-file", str(ckpt), "--fsdp"],
        "resume --fsdp": [*train, "--save-dir", str(run), "--resume", "--fsdp"],
        "resume": [*train, "--save-dir", str(run), "--resume"],
    }

READS_THE_OPTIMIZER = {"restore-file", "restore-file --fsdp", "resume", "resume --fsdp"}


def in_process(argv, capfd):
    """An entry point's command line run by its main in this process, as a
    CompletedProcess: ``-m textbox_like CMD ...`` through the console
    command's dispatch, the trainer's through cli.main."""
    from textbox_like.commands import main as console_main
    capfd.readouterr()
    if argv[:2] == ["-m", "textbox_like"]:
        program = sys.argv[0]
        try:
            code = console_main(argv[2:])
        finally:
            sys.argv[0] = program   # the dispatch names the tool there, for its --help
    else:
        code = run_main(argv[1:])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


@pytest.mark.parametrize("poison", [hostile_metadata, hostile_item], ids=["metadata", "optimizer-item"])
@pytest.mark.parametrize("entry", ["export", "eval", "restore-file", "restore-file --fsdp", "resume", "resume --fsdp"])
def test_a_hostile_dcp_runs_nothing_and_is_one_line(fsdp_run, tmp_path, poison, entry, capfd):
    data, run, marker = poisoned_run(fsdp_run, tmp_path, poison)
    proc = in_process(entry_points(data, run, tmp_path)[entry], capfd)
    assert_refused_and_nothing_ran(proc, marker, poison, entry)


def assert_refused_and_nothing_ran(proc, marker, poison, entry):
    assert not marker.exists(), f"the checkpoint ran code through {entry}"
    if poison is hostile_item and entry not in READS_THE_OPTIMIZER:
        # export and eval read the model's weights only: the poisoned optimizer item is never read
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:") or "error:" in line[:40]]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "could run code" in errors[0], errors[0]


def test_the_genuine_checkpoint_still_loads_everywhere(fsdp_run, tmp_path, capfd):
    """The safe reading refuses only what DCP never writes: the run's own .dcp exports, evaluates and resumes."""
    data, save = fsdp_run
    run = Path(shutil.copytree(save, tmp_path / "run", symlinks=True))
    commands = entry_points(data, run, tmp_path)
    for entry in ("export", "eval", "resume --fsdp"):
        proc = in_process(commands[entry], capfd)
        assert proc.returncode == 0, (entry, proc.stderr[-3000:])
    assert (tmp_path / "exported").is_dir()
    assert json.loads((run / "results.json").read_text())["num_updates"] == 5


def small_dcp(directory: Path):
    """An Adam-trained Linear saved by DCP in this process, with our manifest's files listed."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory), no_dist=True)
    (directory / "manifest.json").write_text(json.dumps({"files": {}}))
    return model, optimizer


def test_the_safe_reader_refuses_both_poisons_in_process(tmp_path):
    """The reader and planner themselves (no process started): a genuine file loads to the same values, a
    hostile .metadata and a hostile optimizer item are UnsafeCheckpoint, and nothing runs."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from textbox_like.storage.dcp_reading import UnsafeCheckpoint, check_metadata, safe_load
    model, optimizer = small_dcp(tmp_path / "good")
    assert check_metadata(tmp_path / "good").state_dict_metadata
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh(torch.randn(1, 3)).sum().backward()
    fresh_optimizer.step()
    model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    safe_load(state, tmp_path / "good", no_dist=True)
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.01

    marker = tmp_path / "CODE_RAN"
    shutil.copytree(tmp_path / "good", tmp_path / "meta")
    hostile_metadata(tmp_path / "meta", marker)
    with pytest.raises(UnsafeCheckpoint, match="could run code"):
        check_metadata(tmp_path / "meta")
    with pytest.raises(Exception, match="could run code"):
        safe_load({"model": get_state_dict(fresh, fresh_optimizer)[0]}, tmp_path / "meta", no_dist=True)
    shutil.copytree(tmp_path / "good", tmp_path / "item")
    hostile_item(tmp_path / "item", marker)
    check_metadata(tmp_path / "item")   # the metadata is genuine; the item is not
    model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
    with pytest.raises(Exception, match="could run code"):
        safe_load({"model": model_state, "optimizer": optimizer_state}, tmp_path / "item", no_dist=True)
    assert not marker.exists()


def test_the_metadata_unpickler_admits_dcps_classes_only():
    """What a .metadata may name: DCP's metadata classes, torch dtypes and Size, paths as pure paths (Python
    3.13 pickles them from pathlib._local; a WindowsPath cannot be built on Linux); nothing that runs code."""
    import pathlib

    import torch
    from textbox_like.storage.dcp_reading import admitted
    assert admitted("torch", "float32") is torch.float32 and admitted("torch", "Size") is torch.Size
    assert admitted("torch.distributed.checkpoint.metadata", "Metadata").__name__ == "Metadata"
    assert admitted("pathlib._local", "PosixPath") is pathlib.PurePosixPath
    assert admitted("pathlib", "WindowsPath") is pathlib.PureWindowsPath
    for module, name in [("os", "system"), ("builtins", "eval"), ("torch", "load"), ("torch", "compile"),
                         ("torch.distributed.checkpoint.metadata", "dataclass"), ("pathlib", "Path.write_text"),
                         ("subprocess", "Popen"), ("torch.serialization", "load")]:
        assert admitted(module, name) is None, (module, name)


def test_a_metadata_pointing_outside_its_directory_is_refused(tmp_path):
    """A storage entry's file must be a plain name inside the checkpoint: '../x' would read another file's bytes
    into the weights, past the manifest's digests."""
    import dataclasses
    from torch.distributed.checkpoint import FileSystemReader
    from textbox_like.storage.dcp_reading import UnsafeCheckpoint, check_metadata
    small_dcp(tmp_path / "ck")
    metadata = FileSystemReader(str(tmp_path / "ck")).read_metadata()   # our own genuine file
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="../outside.distcp")
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match="outside its directory"):
        check_metadata(tmp_path / "ck")
