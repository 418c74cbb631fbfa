"""TextBox's documented search and seed commands on a Hugging Face model in
the local cache: ``run_hyper.py --space=FILE --algo=exhaustive
--model_path=facebook/bart-base --metrics=['rouge']
--metrics_for_best_model=['ROUGE-1']`` and ``run_multi_seed.py
--multi_seed=N`` with the same model flags and no ``--task`` (TextBox's
commands name none: --model_path picks the hf task). The model is a tiny BART
put where ``huggingface-cli download`` leaves one (a hub cache in tmp_path)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, clean_env
from test_hf_task import models, text_data  # noqa: F401  (module fixtures: tiny models, text files)

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)

TEXTBOX = ["--model_path=facebook/bart-base", "--metrics=['rouge']", "--metrics_for_best_model=['ROUGE-1']",
           "--target_column", "target", "--max-sentences", "8", "--max-update", "2", "--generation_max_length", "6"]


@pytest.fixture
def hub(models, tmp_path):  # noqa: F811
    """An environment whose Hugging Face cache holds facebook/bart-base (a tiny BART), as a download leaves it."""
    cache = tmp_path / "hub"
    repo = cache / "models--facebook--bart-base"
    shutil.copytree(models["seq2seq"], repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return {**clean_env(), "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}


def textbox(script, *args, env, cwd):
    proc = subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(900)
def test_textbox_run_hyper_searches_a_cached_hub_model_by_rouge(hub, text_data, tmp_path):  # noqa: F811
    (tmp_path / "space.test").write_text("learning_rate choice [0.001, 0.0003]\n")
    proc = textbox("run_hyper.py", "--space=space.test", "--algo=exhaustive", "--output", tmp_path / "search",
                   "--data", text_data, *TEXTBOX, env=hub, cwd=tmp_path)
    assert "trained by --task hf" in proc.stderr
    rates = set()
    for trial in ("trial_1", "trial_2"):
        config = yaml.safe_load((tmp_path / "search" / trial / "config.yaml").read_text())
        assert config["task"] == "hf" and config["hf_head"] == "seq2seq"
        rates.add(config["lr"][0])
        results = json.loads((tmp_path / "search" / trial / "results.json").read_text())
        assert results["num_updates"] == 2 and "ROUGE-1" in results["best"], results
    assert rates == {0.001, 0.0003}


@pytest.mark.timeout(900)
def test_textbox_run_multi_seed_trains_a_cached_hub_model_per_seed(hub, text_data, tmp_path):  # noqa: F811
    textbox("run_multi_seed.py", "--multi_seed=2", "--output", tmp_path / "seeds", "--data", text_data, *TEXTBOX,
            env=hub, cwd=tmp_path)
    summary = json.loads((tmp_path / "seeds" / "multi_seed_summary.json").read_text())
    assert "ROUGE-1" in json.dumps(summary), summary
    seeds = [yaml.safe_load(p.read_text())["seed"] for p in sorted((tmp_path / "seeds").glob("seed_*/config.yaml"))]
    assert len(set(seeds)) == 2
