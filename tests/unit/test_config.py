"""Configuration: spellings, aliases, dict options, layering, --print_config."""
from __future__ import annotations

from pathlib import Path

import yaml
import pytest

from conftest import base_args, run_main

from textbox_like.config.files import load_yaml, to_yaml
from textbox_like.config.layers import PROPERTIES
from textbox_like.config import layers
from textbox_like.cli import main
from textbox_like.resolve.resolution import parse


def cfg_of(*args):
    ns = parse([str(a) for a in args])
    return ns


def printed(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args] + ["--print_config"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


# ---------------------------------------------------------------- spellings
@pytest.mark.parametrize("flag", ["--max-update", "--max_update"])
def test_max_update_both_spellings(flag):
    assert cfg_of(flag, "7").get("max_update") == 7


@pytest.mark.parametrize("flag", ["--max-sentences", "--max_sentences", "--batch-size", "--batch_size"])
def test_batch_size_spellings(flag):
    assert cfg_of(flag, "48").get("max_sentences") == 48


@pytest.mark.parametrize("args,expected", [
    (["--update-freq", "3"], [3]),
    (["--update_freq", "3"], [3]),
    (["--accum_grad", "3"], [3]),
    (["--accum-grad", "5"], [5]),
    (["--update-freq", "4,2,1"], [4, 2, 1]),
])
def test_update_freq_forms(args, expected):
    assert cfg_of(*args).get("update_freq") == expected


def test_mixed_precision_options():
    assert cfg_of("--fp16").get("fp16") is True
    assert cfg_of("--bf16").get("bf16") is True
    assert cfg_of("--train_dtype", "bfloat16").get("train_dtype") == "bfloat16"
    assert cfg_of("--train-dtype", "float16").get("train_dtype") == "float16"


def test_adam_betas_tuple_literal():
    ns = cfg_of("--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-6")
    assert list(ns.optimizer_options.adam_betas) == [0.9, 0.98]
    assert ns.optimizer_options.adam_eps == 1e-6


def test_valid_subset_comma_list():
    assert cfg_of("--valid-subset", "train,test").get("valid_subset") == ["train", "test"]


# ---------------------------------------------------------------- dict options
DICT_CASES = {"--optim_conf": (["--optimizer", "adadelta"], "lr", "rho"),
              "--scheduler_conf": ([], "power", "end_learning_rate"),
              "--model_conf": ([], "dropout1", "dropout2")}


@pytest.mark.parametrize("option", list(DICT_CASES))
def test_dict_option_repeated_key_value(option):
    extra, a, b = DICT_CASES[option]
    ns = cfg_of(*extra, option, f"{a}=0.1", option, f"{b}=0.8")
    conf = ns.get(option[2:])
    assert (conf[a], conf[b]) == (0.1, 0.8)


@pytest.mark.parametrize("option", list(DICT_CASES))
def test_dict_option_flow_mapping(option):
    extra, a, b = DICT_CASES[option]
    ns = cfg_of(*extra, option, f"{{{a}: 0.1, {b}: 0.8}}")
    conf = ns.get(option[2:])
    assert (conf[a], conf[b]) == (0.1, 0.8)


def test_dict_option_later_occurrence_wins():
    ns = cfg_of("--optimizer", "adadelta", "--optim_conf", "{lr: 0.1, rho: 0.8}", "--optim_conf", "rho=0.7")
    assert (ns.optim.optim_conf["lr"], ns.optim.optim_conf["rho"]) == (0.1, 0.7)


def test_optim_conf_reaches_the_optimizer():
    import torch
    from textbox_like.optim import build_optimizer
    ns = cfg_of("--optimizer", "adadelta", "--optim_conf", "lr=0.1", "--optim_conf", "rho=0.8")
    opt = build_optimizer(ns.optim, [{"params": [torch.nn.Parameter(torch.zeros(3))]}])
    assert opt.param_groups[0]["rho"] == 0.8
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_optim_conf_lr_is_the_lr_trained_with(mnist_dir, tmp_path):
    """--optim_conf lr=0.1 must be the learning rate of the run, not silently
    replaced by --lr through the LR scheduler."""
    out = tmp_path / "o"
    rc = run_main(base_args(mnist_dir, out, "--optimizer", "adadelta", "--lr-scheduler", "constant",
                            "--warmup-updates", "0",
                            "--optim_conf", "lr=0.1", "--optim_conf", "rho=0.8", "--log-interval", "1",
                            "--disable-validation", max_update=2))
    assert rc == 0
    from conftest import read_jsonl
    lrs = [r["lr"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert lrs and all(lr == pytest.approx(0.1) for lr in lrs), lrs


def test_model_conf_reaches_the_model():
    from textbox_like.tasks import TASKS
    ns = cfg_of("--model_conf", "dropout1=0", "--model_conf", "{dropout2: 0.1, hidden: 64}")
    model = TASKS.get("mnist")(ns).build_model()
    assert model.dropout1.p == 0 and model.dropout2.p == 0.1
    assert model.fc1.out_features == 64


def test_scheduler_conf_reaches_the_scheduler():
    import torch
    from textbox_like.resolve.checks import check
    from textbox_like.resolve.options import build_options
    from textbox_like.optim.lr_scheduler import build_scheduler
    ns = parse(["--lr-scheduler", "constant", "--warmup-updates", "0",
                            "--scheduler_conf", "warmup_updates=4",
                            "--lr", "0.5", "--max-update", "10"])
    check(ns)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(ns, opt)
    assert sched.step_update(2) == pytest.approx(0.5 * 2 / 4)
    assert sched.step_update(4) == pytest.approx(0.5)


# ---------------------------------------------------------------- layering
def test_properties_beat_builtin_defaults():
    """Whatever properties/overall.yaml and properties/task/mnist.yaml say wins
    over the built-in defaults (task file over overall file)."""
    props = PROPERTIES
    merged = {}
    for path in (props / "overall.yaml", props / "task" / "mnist.yaml"):
        if path.is_file():
            merged.update(load_yaml(path))
    assert merged, "no properties files"
    from textbox_like.resolve.options import build_options
    defaults = {dest: action.default for dest, action in build_options().actions.items()}
    ns = parse(["--task", "mnist"])
    checked = 0
    for key, value in merged.items():
        got = ns.get(key)
        if isinstance(got, list) and not isinstance(value, list):
            got = got[0] if len(got) == 1 else got
        if isinstance(value, float) or isinstance(got, float):
            assert float(got) == pytest.approx(float(value)), key
        else:
            assert got == value, key
        checked += defaults.get(key) != value
    assert checked, "the properties files override no default"


def test_layering_full_chain(tmp_path, monkeypatch):
    props = tmp_path / "properties"
    (props / "task").mkdir(parents=True)
    (props / "overall.yaml").write_text("task: mnist\nlr: 0.2\nseed: 5\nclip_norm: 3.0\nlog_interval: 7\n")
    (props / "task" / "mnist.yaml").write_text("lr: 0.3\nclip_norm: 4.0\nlog_interval: 8\n")
    monkeypatch.setattr(layers, "PROPERTIES", props)
    ns = cfg_of()
    assert (ns.numerics.seed, ns.optim.lr, ns.schedule.clip_norm, ns.logging.log_interval) == (5, [0.3], 4.0, 8)  # task yaml > overall
    first = tmp_path / "a.yaml"
    first.write_text("lr: 0.4\nclip_norm: 9.0\nmax-update: 11\n")
    second = tmp_path / "b.yaml"
    second.write_text("lr: 0.6\n")
    ns = cfg_of("--config", first)
    assert (ns.numerics.seed, ns.optim.lr, ns.schedule.clip_norm, ns.schedule.max_update) == (5, [0.4], 9.0, 11)  # config file > properties
    ns = cfg_of("--config", first, "--config", second)
    assert (ns.optim.lr, ns.schedule.clip_norm) == ([0.6], 9.0)  # later --config > earlier
    ns = cfg_of("--config", second, "--config", first)
    assert ns.optim.lr == [0.4]
    ns = cfg_of("--config", first, "--config", second, "--lr", "0.9", "--clip-norm", "1")
    assert (ns.optim.lr, ns.schedule.clip_norm, ns.schedule.max_update) == ([0.9], 1.0, 11)  # command line > all
    ns = cfg_of("--lr", "0.9", "--config", second)  # position on the command line does not matter
    assert ns.optim.lr == [0.9]


def test_config_file_beats_real_properties(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: sgd\nlr: 0.05\nmomentum: 0.5\n")
    ns = cfg_of("--config", path)
    assert (ns.optim.optimizer, ns.optim.lr, ns.optimizer_options.momentum) == ("sgd", [0.05], 0.5)
    ns = cfg_of("--config", path, "--lr", "0.07", "--momentum", "0.9")
    assert (ns.optim.lr, ns.optimizer_options.momentum) == ([0.07], 0.9)


# ---------------------------------------------------------------- print_config
@pytest.mark.parametrize("optimizer,own", [
    ("adadelta", ["adadelta_rho", "adadelta_eps"]),
    ("sgd", ["momentum"]),
    ("adam", ["adam_betas", "adam_eps"]),
    ("adamw", ["adam_betas", "adam_eps"]),
])
def test_print_config_has_optimizer_options(capsys, optimizer, own):
    data = yaml.safe_load(printed(capsys, "--optimizer", optimizer))
    assert data["optimizer"] == optimizer
    for key in own:
        assert key in data, f"{key} missing from --print_config for {optimizer}"


@pytest.mark.parametrize("scheduler,own", [
    ("PolynomialDecayScheduler", ["end_learning_rate", "power", "force_anneal"]),
    ("inverse_sqrt", ["warmup_init_lr"]),
    ("cosine", ["min_lr"]),
])
def test_print_config_has_scheduler_options(capsys, scheduler, own):
    data = yaml.safe_load(printed(capsys, "--lr-scheduler", scheduler))
    for key in own + ["warmup_updates", "total_num_update"]:
        assert key in data, f"{key} missing from --print_config for {scheduler}"


def test_print_config_leaves_out_other_components(capsys):
    data = yaml.safe_load(printed(capsys, "--optimizer", "sgd", "--lr-scheduler", "constant"))
    assert "adadelta_rho" not in data and "adam_betas" not in data
    assert "end_learning_rate" not in data and "min_lr" not in data


def test_print_config_exits_zero_without_training(capsys, tmp_path):
    # no data, nothing run, nothing written
    rc = main(["--print_config", "--save-dir", str(tmp_path / "never")])
    assert rc == 0
    assert not (tmp_path / "never").exists()
    assert yaml.safe_load(capsys.readouterr().out)["task"] == "mnist"


ROUND_TRIPS = [
    [],
    ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.1,0.05", "--lr-scheduler", "cosine",
     "--min-lr", "0.001", "--update-freq", "4,2,1", "--valid-subset", "train,test"],
    ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01",
     "--optim_conf", "eps=1e-7", "--model_conf", "{dropout1: 0, dropout2: 0}",
     "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--scheduler_conf", "warmup_init_lr=1e-5",
     "--bf16", "--max-update", "33", "--clip-norm", "0"],
    ["--optimizer", "adadelta", "--adadelta_rho", "0.8", "--lr-scheduler", "polynomial_decay",
     "--power", "2", "--force-anneal", "3", "--end-learning-rate", "0.01", "--accum_grad", "2",
     "--train_dtype", "float16", "--maximize-best-checkpoint-metric", "false",
     "--best-checkpoint-metric", "loss", "--optimizer-overrides", "{'lr': 0.5}"],
]


@pytest.mark.parametrize("args", ROUND_TRIPS, ids=range(len(ROUND_TRIPS)))
def test_print_config_round_trip(capsys, tmp_path, args):
    first = printed(capsys, *args)
    path = tmp_path / "config.yaml"
    path.write_text(first)
    second = printed(capsys, "--config", path)
    assert second == first
    # and once more through the file the second run printed
    path2 = tmp_path / "config2.yaml"
    path2.write_text(second)
    assert printed(capsys, "--config", path2) == first


def test_print_config_round_trip_keeps_values(capsys, tmp_path):
    text = printed(capsys, *ROUND_TRIPS[2])
    data = yaml.safe_load(text)
    assert data["optimizer"] == "adam"
    assert list(data["adam_betas"]) == [0.9, 0.98]
    assert data["optim_conf"]["eps"] == 1e-7 and data["adam_eps"] == 1e-7
    assert data["optim_conf"]["betas"] == [0.9, 0.98]
    assert data["model_conf"] == {"dropout1": 0, "dropout2": 0}
    assert data["scheduler_conf"] == {"warmup_init_lr": 1e-5}
    assert data["max_update"] == 33
    assert data["bf16"] is True


TRAIN_CONFIGS = [
    ["--optimizer", "sgd", "--momentum", "0.5", "--lr", "0.05", "--lr-scheduler", "cosine",
     "--model_conf", "dropout1=0", "--disable-validation"],
    ["--optimizer", "adadelta", "--optim_conf", "rho=0.8", "--lr-scheduler", "polynomial_decay",
     "--scheduler_conf", "warmup_updates=2", "--scheduler_conf", "power=2", "--disable-validation"],
]


@pytest.mark.parametrize("extra", TRAIN_CONFIGS, ids=["cosine", "scheduler_conf"])
def test_training_config_yaml_equals_print_config(capsys, mnist_dir, tmp_path, extra):
    out = tmp_path / "run"
    args = base_args(mnist_dir, out, *extra, max_update=2)
    expected = printed(capsys, *args)
    assert run_main(args) == 0
    assert (out / "config.yaml").read_text() == expected
    # and the saved config.yaml reproduces the run's configuration
    assert printed(capsys, "--config", out / "config.yaml") == expected


@pytest.mark.parametrize("optimizer,text,expected", [
    ("adadelta", "eps=1e-7", {"eps": 1e-7}),
    ("adadelta", "lr=1e-3,rho=0.8", {"lr": 1e-3, "rho": 0.8}),
    ("adadelta", "{eps: 1e-8, lr: 2}", {"eps": 1e-8, "lr": 2.0}),
    ("sgd", "nesterov=true", {"nesterov": True}),
])
def test_dict_option_numbers_are_numbers(optimizer, text, expected):
    ns = cfg_of("--optimizer", optimizer, "--optim_conf", text)
    assert {k: ns.optim.optim_conf[k] for k in expected} == expected
    assert all(type(ns.optim.optim_conf[k]) is type(v) for k, v in expected.items()), ns.optim.optim_conf


def test_config_equals_sign_form(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.05\n")
    assert cfg_of(f"--config={path}").get("lr") == [0.05]


def test_unknown_key_in_config_file_names_closest(tmp_path):
    from textbox_like.core.errors import UserError
    path = tmp_path / "bad.yaml"
    path.write_text("max_updat: 3\n")
    with pytest.raises(UserError, match="max_update"):
        parse(["--config", str(path)])


# ---------------------------------------------------------------- switches take values
@pytest.mark.parametrize("args,expected", [
    (["--resume"], True), (["--resume", "true"], True), (["--resume", "True"], True), (["--resume=YES"], True),
    (["--resume", "1"], True), (["--resume", "false"], False), (["--resume", "No"], False),
    (["--resume=0"], False), ([], False),
])
def test_switch_values(args, expected):
    assert cfg_of(*args).get("resume") is expected


@pytest.mark.parametrize("flag", ["--find_unused_parameters=True", "--find-unused-parameters", "--cudnn_deterministic=true"])
def test_espnet_switch_spellings(flag):
    ns = cfg_of(flag)
    assert ns.distributed.find_unused_parameters or ns.numerics.cudnn_deterministic


def test_every_switch_takes_values():
    from textbox_like.resolve.options import build_options
    options = build_options()
    assert {"resume", "fp16", "no_save", "nesterov", "checkpointing", "fast_stat_sync"} <= options.switches
    owner = {dest: group.split(":") for group, dests in options.groups.items() if ":" in group for dest in dests}
    for dest in options.switches - {"print_config"}:
        flag = next(s for s in options.actions[dest].option_strings if s.startswith("--"))
        # a task's, optimizer's or scheduler's own switch is in the run's configuration when it is chosen
        chosen = [f"--{owner[dest][0].replace('_', '-')}", owner[dest][1]] if dest in owner else []
        assert cfg_of(*chosen, f"{flag}=false").get(dest) is False
        assert cfg_of(*chosen, flag, "yes").get(dest) is True


@pytest.mark.parametrize("text,expected", [("true", True), ("'True'", True), ("no", False), ("'0'", False),
                                           ("1", True)])
def test_switch_values_in_yaml(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"resume: {text}\n")
    assert cfg_of("--config", path).get("resume") is expected


def test_alias_names_as_config_file_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.02\nnum_epochs: 3\nvalid_batch_size: 7\noptim: sgd\n")
    ns = cfg_of("--config", path)
    assert (ns.optim.lr, ns.schedule.max_epoch, ns.data.max_sentences_valid, ns.optim.optimizer) == ([0.02], 3, 7, "sgd")


def test_ngpu_sets_processes_on_this_node():
    assert cfg_of("--ngpu", "2").get("distributed_world_size") == 2
    assert cfg_of("--ngpu", "0").get("cpu") is True
    ns = cfg_of("--ngpu", "2", "--distributed-init-method", "tcp://a:1", "--distributed-world-size", "3")
    assert ns.distributed.distributed_gpus == 2 and ns.distributed.distributed_world_size == 3


def test_device_option(monkeypatch):
    from textbox_like.config import compat
    assert cfg_of("--device", "cpu").get("cpu") is True
    monkeypatch.setattr(compat, "cuda_devices", lambda: 2)   # as on a machine with two GPUs
    assert cfg_of("--device", "cuda1").get("device_id") == 1
    assert cfg_of("--device", "cuda:0").get("device_id") == 0


def test_save_dir_from_prefix_and_name(tmp_path):
    assert cfg_of("--output-prefix", tmp_path, "--experiment-name", "a").get("save_dir") == str(tmp_path / "a")
    assert cfg_of("--experiment-name", "a").get("save_dir") == str(Path("checkpoints") / "a")
    # fed back through config.yaml: the same directory, not PREFIX/NAME/NAME
    import yaml as _yaml
    from textbox_like.resolve.resolution import parse as _parse
    ns = _parse(["--output-prefix", str(tmp_path), "--experiment-name", "a"])
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(ns))
    assert cfg_of("--config", path).get("save_dir") == str(tmp_path / "a")
    assert cfg_of("--config", path, "--save-dir", tmp_path / "b").get("save_dir") == str(tmp_path / "b")
