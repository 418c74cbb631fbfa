"""The package as a user installs it: a non-editable ``pip install .`` into a
fresh venv, used from another directory, keeps properties/ (task defaults,
model presets) and has the ``textbox-like`` command.

The fresh venv sees the project venv's site-packages through a .pth file (the
dependencies: torch, setuptools, pip) and gets textbox_like itself from the
wheel, so the test needs no internet and takes seconds. The project venv's own
editable textbox_like is not visible there: .pth files in a directory added
by a .pth file are not processed."""
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_source_tree_reads_top_level_properties():
    """Running from the repository (and the editable install of scripts/bootstrap.sh)."""
    from textbox_like.config.layers import PROPERTIES
    assert PROPERTIES == ROOT / "properties"
    assert not (ROOT / "textbox_like" / "properties").exists()
    assert not [p for p in ROOT.glob("*.whl") if p.is_file()]   # a folder .whl/ (wheels for a device) is not a build


def test_top_level_scripts_stay():
    for name in ("run_hetseq.py", "run_hyper.py", "run_multi_seed.py"):
        assert (ROOT / name).is_file()
