"""--print_config shows the model a BERT preset builds (sizes resolved from properties/model/)."""
import subprocess
import sys
from pathlib import Path

import yaml
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

REPO = Path(__file__).resolve().parent.parent


def printed(*args):
    out = subprocess.run([sys.executable, "run_hetseq.py", "--task", "bert", *args, "--print_config"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_preset_sizes_printed_and_overrides_win():
    tiny = printed("--model-preset", "tiny")
    assert (tiny["dimension"], tiny["num_heads"], tiny["num_layers"], tiny["dim_feedforward"]) == (128, 2, 2, 512)
    small = printed("--model-preset", "tiny", "--dimension", "64")
    assert (small["dimension"], small["dim_feedforward"], small["num_layers"]) == (64, 256, 2)
    base = printed()
    assert (base["dimension"], base["num_layers"]) == (768, 12)
