"""Optimizers by name and LR schedules against their formulas."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from conftest import base_args, read_jsonl, run_main

from textbox_like.resolve.resolution import parse
from textbox_like.optim.lr_scheduler import SCHEDULERS, build_scheduler
from textbox_like.optim import build_optimizer


def cfg_of(*args):
    ns = parse([str(a) for a in args])
    return ns


def one_param(value=1.0, n=4):
    return torch.nn.Parameter(torch.full((n,), float(value)))


# ---------------------------------------------------------------- optimizers
def test_adam_has_decoupled_weight_decay():
    p = one_param(1.0)
    opt = build_optimizer(cfg_of("--optimizer", "adam", "--lr", "0.1", "--weight-decay", "0.5").optim,
                          [{"params": [p]}])
    p.grad = torch.zeros_like(p)
    opt.step()
    # decoupled: p <- p - lr * wd * p (the Adam part is 0 for a zero gradient);
    # L2-coupled Adam would move p by about lr (to ~0.9)
    assert torch.allclose(p.detach(), torch.full_like(p, 1.0 - 0.1 * 0.5), atol=1e-6)


def test_adamw_has_decoupled_weight_decay():
    p = one_param(2.0)
    opt = build_optimizer(cfg_of("--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1").optim,
                          [{"params": [p]}])
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(p.detach(), torch.full_like(p, 2.0 * (1 - 0.01 * 0.1)), atol=1e-6)


def test_adam_betas_and_eps():
    opt = build_optimizer(cfg_of("--optimizer", "adam", "--lr", "0.002", "--adam-betas", "(0.8, 0.95)",
                                 "--adam-eps", "1e-6").optim, [{"params": [one_param()]}])
    g = opt.param_groups[0]
    assert tuple(g["betas"]) == (0.8, 0.95)
    assert g["eps"] == 1e-6 and g["lr"] == pytest.approx(0.002)


def test_adam_matches_reference_update():
    torch.manual_seed(0)
    p = one_param(0.5)
    ref = torch.nn.Parameter(p.detach().clone())
    opt = build_optimizer(cfg_of("--optimizer", "adam", "--lr", "0.01", "--adam-betas", "(0.9, 0.99)",
                                 "--adam-eps", "1e-7", "--weight-decay", "0.01").optim, [{"params": [p]}])
    ref_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert torch.allclose(p, ref)


def test_adadelta_options():
    opt = build_optimizer(cfg_of("--optimizer", "adadelta", "--lr", "1.01", "--adadelta_rho", "0.8",
                                 "--adadelta_eps", "1e-5", "--weight-decay", "0.01").optim,
                          [{"params": [one_param()]}])
    assert isinstance(opt, torch.optim.Adadelta)
    g = opt.param_groups[0]
    assert (g["rho"], g["eps"], g["weight_decay"]) == (0.8, 1e-5, 0.01)
    assert g["lr"] == pytest.approx(1.01)


def test_sgd_momentum():
    p = one_param(0.0, n=1)
    opt = build_optimizer(cfg_of("--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9").optim,
                          [{"params": [p]}])
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["momentum"] == 0.9
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    # v1 = 1, v2 = 0.9 * 1 + 1 = 1.9; p = -0.1 * (1 + 1.9)
    assert p.item() == pytest.approx(-0.29)


def test_optim_conf_overrides_constructor_arguments():
    # on the same level (here the command line) --optim_conf wins over the options
    opt = build_optimizer(cfg_of("--optimizer", "sgd", "--momentum", "0.9", "--optim_conf",
                                 "{momentum: 0.5, lr: 0.3}").optim, [{"params": [one_param()]}])
    assert opt.param_groups[0]["momentum"] == 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)


@pytest.mark.parametrize("name,cls", [("adam", torch.optim.AdamW), ("adamw", torch.optim.AdamW),
                                      ("adadelta", torch.optim.Adadelta), ("sgd", torch.optim.SGD)])
def test_optimizer_by_name(name, cls):
    opt = build_optimizer(cfg_of("--optimizer", name, "--lr", "0.5", "--weight-decay", "0.25").optim,
                          [{"params": [one_param()]}])
    assert isinstance(opt, cls)
    assert opt.param_groups[0]["weight_decay"] == 0.25
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


# ---------------------------------------------------------------- schedulers
def scheduler(*args):
    ns = cfg_of(*args)
    opt = torch.optim.SGD([one_param()], lr=123.0)
    return build_scheduler(ns, opt), opt


def test_scheduler_aliases():
    assert SCHEDULERS.get("polynomial_decay") is SCHEDULERS.get("PolynomialDecayScheduler")


def poly(n, lr, warmup, total, end, power):
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if n >= total:
        return end
    return (lr - end) * (1 - (n - warmup) / (total - warmup)) ** power + end


@pytest.mark.parametrize("name", ["PolynomialDecayScheduler", "polynomial_decay"])
@pytest.mark.parametrize("power", [1.0, 2.0, 0.5])
def test_polynomial_decay(name, power):
    lr, warmup, total, end = 0.4, 10, 110, 0.01
    s, opt = scheduler("--lr-scheduler", name, "--lr", lr, "--warmup-updates", warmup,
                       "--total-num-update", total, "--end-learning-rate", end, "--power", power,
                       "--max-update", 1000)
    for n in [1, 3, 5, 10, 11, 35, 60, 109, 110, 150]:
        got = s.step_update(n)
        assert got == pytest.approx(poly(n, lr, warmup, total, end, power), rel=1e-9, abs=1e-12), n
        assert opt.param_groups[0]["lr"] == pytest.approx(got)


def test_polynomial_decay_without_warmup():
    s, _ = scheduler("--lr-scheduler", "PolynomialDecayScheduler", "--lr", "1.01", "--warmup-updates", "0",
                     "--total-num-update", "50000", "--max-update", "10")
    assert s.step_update(0) == pytest.approx(1.01)
    assert s.step_update(1) == pytest.approx(1.01 * (1 - 1 / 50000))
    assert s.step_update(25000) == pytest.approx(1.01 * 0.5)
    assert s.step_update(50000) == pytest.approx(0.0)


def test_polynomial_decay_total_defaults_to_max_update():
    s, _ = scheduler("--lr-scheduler", "polynomial_decay", "--lr", "0.2", "--total-num-update", "0",
                     "--max-update", "40", "--warmup-updates", "0")
    assert s.step_update(10) == pytest.approx(0.2 * 0.75)
    assert s.step_update(40) == pytest.approx(0.0)


def test_polynomial_force_anneal_is_an_option():
    ns = cfg_of("--lr-scheduler", "PolynomialDecayScheduler", "--force-anneal", "3")
    assert ns.scheduler_options.force_anneal == 3


def test_per_epoch_lr_list():
    s, _ = scheduler("--lr-scheduler", "constant", "--lr", "0.5,0.3,0.1", "--max-update", "100",
                     "--warmup-updates", "0")
    for epoch, expected in [(1, 0.5), (2, 0.3), (3, 0.1), (4, 0.1)]:
        s.step_epoch(epoch)
        assert s.step_update(5) == pytest.approx(expected)


@pytest.mark.parametrize("warmup", [0, 8])
def test_constant(warmup):
    lr = 0.25
    s, _ = scheduler("--lr-scheduler", "constant", "--lr", lr, "--warmup-updates", warmup, "--max-update", 100)
    for n in [1, 2, 4, 7, 8, 9, 50, 1000]:
        expected = lr * n / warmup if warmup and n < warmup else lr
        assert s.step_update(n) == pytest.approx(expected), n


@pytest.mark.parametrize("init", [0.0, 1e-4])
def test_inverse_sqrt(init):
    lr, warmup = 0.5, 16
    s, _ = scheduler("--lr-scheduler", "inverse_sqrt", "--lr", lr, "--warmup-updates", warmup,
                     "--warmup-init-lr", init, "--max-update", 100)
    for n in [1, 4, 8, 15]:
        assert s.step_update(n) == pytest.approx(init + (lr - init) * n / warmup), n
    for n in [16, 25, 64, 400, 10000]:
        assert s.step_update(n) == pytest.approx(lr * math.sqrt(warmup) / math.sqrt(n)), n
    assert s.step_update(64) == pytest.approx(lr / 2)


def test_cosine():
    lr, low, warmup, total = 0.3, 0.01, 5, 105
    s, _ = scheduler("--lr-scheduler", "cosine", "--lr", lr, "--min-lr", low, "--warmup-updates", warmup,
                     "--total-num-update", total, "--max-update", 1000)
    for n in [1, 2, 4]:
        assert s.step_update(n) == pytest.approx(lr * n / warmup), n
    for n in [5, 30, 55, 80, 104, 105]:
        progress = (n - warmup) / (total - warmup)
        expected = low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress))
        assert s.step_update(n) == pytest.approx(expected), n
    assert s.step_update(55) == pytest.approx((lr + low) / 2)
    assert s.step_update(105) == pytest.approx(low)
    assert s.step_update(500) == pytest.approx(low)


def test_scheduler_state_roundtrip():
    s, opt = scheduler("--lr-scheduler", "inverse_sqrt", "--lr", "0.5", "--warmup-updates", "4",
                       "--max-update", "100")
    s.step_epoch(2)
    s.step_update(37)
    t, opt2 = scheduler("--lr-scheduler", "inverse_sqrt", "--lr", "0.5", "--warmup-updates", "4",
                        "--max-update", "100")
    t.load_state_dict(s.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_logged_lr_follows_polynomial_schedule(mnist_dir, tmp_path):
    """In a run, the LR is stepped once per update: the lr logged at update n
    is the schedule's value at n."""
    out = tmp_path / "o"
    lr, warmup, total = 0.05, 3, 8
    assert run_main(base_args(mnist_dir, out, "--optimizer", "sgd", "--lr", lr, "--lr-scheduler",
                              "PolynomialDecayScheduler", "--warmup-updates", warmup, "--total-num-update",
                              total, "--end-learning-rate", "0.001", "--power", "2", "--log-interval", "1",
                              "--disable-validation", "--max-sentences", "8", max_update=6)) == 0
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["update"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert r["lr"] == pytest.approx(poly(r["update"], lr, warmup, total, 0.001, 2.0)), r


def test_optim_conf_weight_decay_applies_with_default_weight_decay():
    """--optim_conf weight_decay=X reaches every group but those the task exempts."""
    import torch
    from textbox_like.resolve.resolution import parse
    from textbox_like.optim import build_optimizer
    cfg = parse(["--task", "mnist", "--optimizer", "adamw", "--optim_conf", "weight_decay=0.01"])
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer(cfg.optim, [{"params": [a], "weight_decay": cfg.optim.weight_decay},
                                {"params": [b], "weight_decay": 0.0, "no_decay": True}])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


# ---------------------------------------------------------------- torch.optim and lr_scheduler by name
def test_static_optimizer_list_covers_torch():
    from textbox_like.optim import TORCH_OPTIMIZERS
    found = {n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    assert found <= set(TORCH_OPTIMIZERS), found - set(TORCH_OPTIMIZERS)


def test_the_signature_table_is_this_torchs_and_defaults_read_it_without_torch(monkeypatch):
    """optim/signatures.py's table is the installed torch's signatures (after
    a torch upgrade: rewrite it, as its docstring says); every optimizer's
    defaults() are its signature's, through the table or torch; where torch
    is another version, the table is not used."""
    from textbox_like.optim import OPTIMIZERS, TORCH_OPTIMIZERS
    from textbox_like.optim import signatures
    installed = torch.__version__.split("+")[0]
    assert signatures.TORCH_VERSION == installed, (
        f"optim/signatures.py is for torch {signatures.TORCH_VERSION}, this is {installed}: run "
        f"python -c 'from textbox_like.optim import signatures; signatures.rewrite()'")
    for name in TORCH_OPTIMIZERS:
        if hasattr(torch.optim, name):
            live = signatures.signature_defaults(getattr(torch.optim, name))
            assert signatures.known_defaults(name) == live, name
    with open(signatures.__file__) as f:
        assert signatures.table_source() == f.read()  # rewrite() would write the file as it is
    read = []
    monkeypatch.setattr(signatures, "signature_defaults", lambda cls: read.append(cls) or {"lr": 0.5})
    through_table = {name: spec.defaults() for name, spec in OPTIMIZERS.items() if spec.torch_name}
    assert all(cls.__name__ == "Lamb" for cls in read), read  # only our own class is read from torch
    assert through_table["adam"]["betas"] == [0.9, 0.999] and through_table["sgd"]["lr"] == 0.001
    monkeypatch.setattr(signatures, "TORCH_VERSION", "0.0.1")
    adam = OPTIMIZERS.get("adam")
    assert adam.defaults()["lr"] == 0.5 and read[-1] is adam.optimizer_class()


def test_static_scheduler_list_covers_torch():
    from torch.optim import lr_scheduler as L

    from textbox_like.optim.lr_scheduler import TORCH_SCHEDULERS
    found = {n for n in dir(L) if isinstance(getattr(L, n), type) and not n.startswith("_")
             and n != "LRScheduler" and (issubclass(getattr(L, n), L.LRScheduler) or n == "ReduceLROnPlateau")}
    assert found <= set(TORCH_SCHEDULERS), found - set(TORCH_SCHEDULERS)


@pytest.mark.parametrize("name", ["rmsprop", "RMSprop", "adagrad", "Adamax", "nadam", "asgd", "adafactor",
                                  "rprop", "SGD", "Adam", "AdaDelta"])
def test_every_torch_optimizer_by_name_any_case(name):
    from textbox_like.optim import OPTIMIZERS
    ns = cfg_of("--optim", name)
    spec = OPTIMIZERS.get(ns.optim.optimizer)
    opt = build_optimizer(ns.optim, [{"params": [one_param()]}])
    assert isinstance(opt, spec.optimizer_class())
    assert set(ns.optim.optim_conf) == set(spec.defaults())


def test_torch_optimizer_conf_is_checked_against_its_signature():
    from textbox_like.core.errors import UserError
    with pytest.raises(UserError, match="valid keys: lr, alpha, eps"):
        cfg_of("--optim", "rmsprop", "--optim_conf", "alpah=0.9")
    ns = cfg_of("--optim", "rmsprop", "--optim_conf", "alpha=0.9", "--epsilon", "1e-5")
    opt = build_optimizer(ns.optim, [{"params": [one_param()]}])
    assert opt.param_groups[0]["alpha"] == 0.9 and opt.param_groups[0]["eps"] == 1e-5


@pytest.mark.parametrize("name", ["lbfgs", "sparseadam"])
def test_optimizers_this_trainer_cannot_step_are_refused_at_check(name):
    from textbox_like.resolve.checks import check
    from textbox_like.core.errors import UserError
    ns = parse(["--optim", name, "--max-update", "1"])
    assert ns.optim.optim_conf  # printable
    with pytest.raises(UserError, match=name):
        check(ns)


@pytest.mark.parametrize("name,conf", [
    ("steplr", "{step_size: 2, gamma: 0.5}"), ("MultiStepLR", "{milestones: [1, 3]}"),
    ("exponentiallr", "gamma=0.9"), ("CosineAnnealingLR", "{}"), ("linearlr", "{}"), ("constantlr", "{}"),
    ("polynomiallr", "{}"), ("cycliclr", "{base_lr: 0.001, max_lr: 0.01, cycle_momentum: false}"),
    ("onecyclelr", "max_lr=0.01"), ("CosineAnnealingWarmRestarts", "T_0=3"), ("reducelronplateau", "{}"),
])
def test_every_torch_scheduler_by_name(name, conf):
    from textbox_like.resolve.checks import check
    ns = parse(["--scheduler", name, "--scheduler_conf", conf, "--max-update", "10",
                            "--max-epoch", "3"])
    check(ns)
    opt = build_optimizer(ns.optim, [{"params": [one_param()]}])
    sched = build_scheduler(ns, opt)
    sched.planned_updates = 10
    lrs = [sched.step_epoch(1)] + [sched.step_update(n) for n in range(1, 4)] + [sched.step_epoch(2)]
    assert all(isinstance(lr, float) and lr >= 0 for lr in lrs)
    assert sched.step_valid(0.5) >= 0


def test_torch_scheduler_conf_checked_and_required_arguments_named():
    from textbox_like.core.errors import UserError
    with pytest.raises(UserError, match="step_size.*gamma"):
        cfg_of("--scheduler", "steplr", "--scheduler_conf", "step=2")
    with pytest.raises(UserError, match="needs step_size"):
        cfg_of("--scheduler", "steplr")


def test_steplr_steps_per_epoch_and_onecycle_per_update():
    ns = cfg_of("--optim", "sgd", "--lr", "1.0", "--scheduler", "steplr",
                "--scheduler_conf", "{step_size: 1, gamma: 0.5}", "--max-epoch", "3")
    sched = build_scheduler(ns, build_optimizer(ns.optim, [{"params": [one_param()]}]))
    assert sched.step_epoch(1) == pytest.approx(1.0)
    assert [sched.step_update(n) for n in (1, 2, 3)] == pytest.approx([1.0] * 3)
    assert sched.step_epoch(2) == pytest.approx(0.5)
    assert sched.step_epoch(3) == pytest.approx(0.25)
    ns = cfg_of("--optim", "sgd", "--scheduler", "steplr", "--scheduler_conf", "{step_size: 1, gamma: 0.5}",
                "--scheduler-interval", "update", "--lr", "1.0")
    sched = build_scheduler(ns, build_optimizer(ns.optim, [{"params": [one_param()]}]))
    assert sched.step_update(2) == pytest.approx(0.25)


def test_torch_scheduler_state_roundtrip_and_catch_up():
    def make():
        ns = cfg_of("--optim", "sgd", "--lr", "1.0", "--scheduler", "onecyclelr", "--scheduler_conf",
                    "max_lr=1.0", "--max-update", "20")
        sched = build_scheduler(ns, build_optimizer(ns.optim, [{"params": [one_param()]}]))
        sched.planned_updates = 20
        sched.step_epoch(1)
        return sched
    a = make()
    lrs = [a.step_update(n) for n in range(1, 8)]
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.step_update(8) == pytest.approx(a.step_update(8))
    c = make()  # --reset-lr-scheduler: the schedule at the restored update
    assert c.step_update(7) == pytest.approx(lrs[-1])


def plateau(*extra):
    ns = cfg_of("--optim", "sgd", "--lr", "0.4", "--scheduler", "ReduceLROnPlateau",
                "--scheduler_conf", "{patience: 0, factor: 0.5}", "--max-update", "10", *extra)
    sched = build_scheduler(ns, build_optimizer(ns.optim, [{"params": [one_param()]}]))
    sched.planned_updates = 10
    sched.step_epoch(1)
    return ns, sched


def test_plateau_lowers_the_lr_after_a_validation_without_improvement():
    ns, sched = plateau()
    assert ns.schedule.scheduler_conf["mode"] == "max"  # mnist: accuracy, higher is better
    assert sched.step_update(1) == pytest.approx(0.4)   # updates do not move it
    assert sched.step_valid(0.50) == pytest.approx(0.4)
    assert sched.step_valid(0.60) == pytest.approx(0.4)  # improved
    assert sched.step_update(2) == pytest.approx(0.4)
    assert sched.step_valid(0.55) == pytest.approx(0.2)  # forced plateau: halved
    assert sched.step_valid(0.55) == pytest.approx(0.1)
    assert sched.step_epoch(2) == pytest.approx(0.1)     # nor do epochs


def test_plateau_mode_follows_the_metric_and_survives_a_restart():
    ns, sched = plateau("--best-checkpoint-metric", "loss")
    assert ns.schedule.scheduler_conf["mode"] == "min"
    sched.step_valid(1.0)
    sched.step_valid(2.0)
    _, again = plateau("--best-checkpoint-metric", "loss")
    again.load_state_dict(sched.state_dict())
    assert again.get_lr() == pytest.approx(0.2)
    assert again.step_valid(1.5) == pytest.approx(0.1)  # the best (1.0) came back with the state
    ns, sched = plateau("--scheduler_conf", "mode=min")
    assert ns.schedule.scheduler_conf["mode"] == "min"


def test_our_schedulers_have_a_no_op_step_valid():
    for name in ("PolynomialDecayScheduler", "constant", "inverse_sqrt", "cosine"):
        ns = cfg_of("--lr-scheduler", name, "--max-update", "10", "--warmup-updates", "0")
        sched = build_scheduler(ns, build_optimizer(ns.optim, [{"params": [one_param()]}]))
        lr = sched.step_update(3)
        assert sched.step_valid(0.0) == lr and sched.step_update(3) == lr


def test_scheduler_names_any_case():
    assert cfg_of("--scheduler", "COSINE").get("lr_scheduler") == "cosine"
    assert cfg_of("--scheduler", "reducelronplateau").get("lr_scheduler") == "ReduceLROnPlateau"
    assert cfg_of("--lr-scheduler", "polynomialdecayscheduler").get("lr_scheduler") == "PolynomialDecayScheduler"


def test_optim_conf_and_options_agree_in_print_config(capsys):
    import yaml

    from textbox_like.cli import main
    capsys.readouterr()
    assert main(["--optim", "adadelta", "--print_config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert {"lr", "rho", "eps", "weight_decay", "maximize", "foreach"} <= set(data["optim_conf"])
    assert data["optim_conf"]["rho"] == data["adadelta_rho"]
    assert data["optim_conf"]["lr"] == data["lr"][0]


def test_a_later_layer_wins_between_option_and_optim_conf(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: adadelta\noptim_conf: {rho: 0.7, lr: 0.5}\n")
    ns = cfg_of("--config", path, "--adadelta_rho", "0.95")
    assert ns.optim.optim_conf["rho"] == 0.95 and ns.optimizer_options.adadelta_rho == 0.95
    assert ns.optim.optim_conf["lr"] == 0.5 and ns.optim.lr == [0.5]
    ns = cfg_of("--config", path, "--lr", "0.25")
    assert ns.optim.optim_conf["lr"] == 0.25
    path.write_text("optimizer: adadelta\nadadelta_rho: 0.8\noptim_conf: {rho: 0.7}\n")
    from textbox_like.core.errors import UserError
    with pytest.raises(UserError, match="rho"):
        cfg_of("--config", path)


def test_per_epoch_lr_list_survives_optim_conf():
    ns = cfg_of("--lr", "0.3,0.2,0.1", "--max-update", "10")
    assert ns.optim.lr == [0.3, 0.2, 0.1] and ns.optim.optim_conf["lr"] == 0.3


def test_printed_config_of_a_torch_scheduler_feeds_back(capsys, tmp_path):
    from textbox_like.cli import main
    capsys.readouterr()
    assert main(["--scheduler", "CosineAnnealingLR", "--optim", "rmsprop", "--max-epoch", "2",
                 "--print_config"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "c.yaml").write_text(text)
    assert main(["--config", str(tmp_path / "c.yaml"), "--print_config"]) == 0
    assert capsys.readouterr().out == text
