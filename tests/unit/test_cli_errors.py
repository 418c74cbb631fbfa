"""Bad input answers with exactly one line on stderr starting 'error:', exit
code 2 and no traceback; --help answers at once."""
from __future__ import annotations

import pytest


@pytest.mark.timeout(120)
def test_unknown_option_names_closest_in_process(capsys):
    from textbox_like.cli import main
    assert main(["--max_epochs", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert "--max_epoch" in err[0] or "--max-epoch" in err[0]


@pytest.mark.parametrize("typed,wanted", [
    ("--learning-rat", "--learning-rate"), ("--num-epoch", "--num-epochs"), ("--valid_batch_sizes", "valid_batch_size"),
    ("--gradient-accumulation-step", "--gradient-accumulation-steps"), ("--optimiser", "--optimizer"),
    ("--max_epochs", "max_epoch"), ("--schedular", "--scheduler"),
])
def test_suggestions_include_aliases(typed, wanted, capsys):
    from textbox_like.cli import main
    assert main([typed, "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and wanted in err[0], err


@pytest.mark.parametrize("typed", ["--warmup", "--foo-bar", "--rate", "--learning"])
def test_no_unrelated_suggestion(typed, capsys):
    from textbox_like.cli import main
    assert main([typed, "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "did you mean" not in err or "end-learning-rate" not in err, err
    if typed in ("--foo-bar", "--rate"):
        assert "did you mean" not in err, err


def test_closest_match_rules():
    from textbox_like.core.errors import closest_match
    options = ["--end-learning-rate", "--lr", "--max-update", "--max-epoch"]
    assert closest_match("--learning-rate", options) is None
    assert closest_match("--max-updat", options) == "--max-update"
    assert closest_match("--max_update", ["--max-update", "--max_update"]) == "--max_update"
    assert closest_match("acc", ["loss", "accuracy"]) == "accuracy"
    assert closest_match("max", ["max-update", "max-epoch"]) is None  # ambiguous abbreviation


@pytest.mark.parametrize("args,needles", [
    (["--resume", "maybe"], ["--resume", "maybe", "true/false"]),
    (["--device", "gpu"], ["--device", "cuda"]),
    (["--gpu_id", "a,b"], ["--gpu_id"]),
    (["--amp-optimization-level", "O4"], ["O4"]),
    (["--epsilon", "1e-3", "--optim", "sgd"], ["--epsilon", "sgd"]),
    (["--amp-optimization-level", "O1", "--train_dtype", "float64"], ["--amp-optimization-level"]),
    (["--scheduler", "steplr"], ["step_size"]),
    (["--scheduler", "steplr", "--scheduler_conf", "step_siz=1"], ["step_siz", "step_size"]),
    (["--optim", "adadelta", "--optim_conf", "rhoo=0.5"], ["rhoo", "rho", "valid keys"]),
    (["--scheduler", "lambdalr", "--max-update", "1"], ["LambdaLR"]),
    (["--optim", "lbfgs", "--max-update", "1"], ["lbfgs", "closure"]),
    (["--training-data", "/nonexistent/mnist"], ["--training-data"]),
    (["--initial-optimizer", "/nonexistent.pt"], ["--initial-optimizer"]),
])
def test_new_options_bad_input_is_one_line(args, needles, capsys):
    from textbox_like.cli import main
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:"), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])


def test_bad_optim_conf_key_fails_print_config(capsys):
    from textbox_like.cli import main
    assert main(["--optim", "adadelta", "--optim_conf", "rhoo=0.5", "--print_config"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "rhoo" in out.err
