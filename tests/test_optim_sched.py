"""Optimizers by name and LR schedules against their formulas."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from conftest import base_args, read_jsonl, run_main

from textbox_like.cli import parse
from textbox_like.lr_scheduler import SCHEDULERS, build_scheduler
from textbox_like.optim import build_optimizer


def cfg_of(*args):
    _, ns, _ = parse([str(a) for a in args])
    return ns


def one_param(value=1.0, n=4):
    return torch.nn.Parameter(torch.full((n,), float(value)))


# ---------------------------------------------------------------- optimizers
def test_adam_has_decoupled_weight_decay():
    p = one_param(1.0)
    opt = build_optimizer(cfg_of("--optimizer", "adam", "--lr", "0.1", "--weight-decay", "0.5"),
                          [{"params": [p]}])
    p.grad = torch.zeros_like(p)
    opt.step()
    # decoupled: p <- p - lr * wd * p (the Adam part is 0 for a zero gradient);
    # L2-coupled Adam would move p by about lr (to ~0.9)
    assert torch.allclose(p.detach(), torch.full_like(p, 1.0 - 0.1 * 0.5), atol=1e-6)


def test_adamw_has_decoupled_weight_decay():
    p = one_param(2.0)
    opt = build_optimizer(cfg_of("--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1"),
                          [{"params": [p]}])
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(p.detach(), torch.full_like(p, 2.0 * (1 - 0.01 * 0.1)), atol=1e-6)


def test_adam_betas_and_eps():
    opt = build_optimizer(cfg_of("--optimizer", "adam", "--lr", "0.002", "--adam-betas", "(0.8, 0.95)",
                                 "--adam-eps", "1e-6"), [{"params": [one_param()]}])
    g = opt.param_groups[0]
    assert tuple(g["betas"]) == (0.8, 0.95)
    assert g["eps"] == 1e-6 and g["lr"] == pytest.approx(0.002)


def test_adam_matches_reference_update():
    torch.manual_seed(0)
    p = one_param(0.5)
    ref = torch.nn.Parameter(p.detach().clone())
    opt = build_optimizer(cfg_of("--optimizer", "adam", "--lr", "0.01", "--adam-betas", "(0.9, 0.99)",
                                 "--adam-eps", "1e-7", "--weight-decay", "0.01"), [{"params": [p]}])
    ref_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert torch.allclose(p, ref)


def test_adadelta_options():
    opt = build_optimizer(cfg_of("--optimizer", "adadelta", "--lr", "1.01", "--adadelta_rho", "0.8",
                                 "--adadelta_eps", "1e-5", "--weight-decay", "0.01"),
                          [{"params": [one_param()]}])
    assert isinstance(opt, torch.optim.Adadelta)
    g = opt.param_groups[0]
    assert (g["rho"], g["eps"], g["weight_decay"]) == (0.8, 1e-5, 0.01)
    assert g["lr"] == pytest.approx(1.01)


def test_sgd_momentum():
    p = one_param(0.0, n=1)
    opt = build_optimizer(cfg_of("--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9"),
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
                                 "{momentum: 0.5, lr: 0.3}"), [{"params": [one_param()]}])
    assert opt.param_groups[0]["momentum"] == 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)


@pytest.mark.parametrize("name,cls", [("adam", torch.optim.AdamW), ("adamw", torch.optim.AdamW),
                                      ("adadelta", torch.optim.Adadelta), ("sgd", torch.optim.SGD)])
def test_optimizer_by_name(name, cls):
    opt = build_optimizer(cfg_of("--optimizer", name, "--lr", "0.5", "--weight-decay", "0.25"),
                          [{"params": [one_param()]}])
    assert isinstance(opt, cls)
    assert opt.param_groups[0]["weight_decay"] == 0.25
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


# ---------------------------------------------------------------- schedulers
def scheduler(*args):
    ns = cfg_of(*args)
    opt = torch.optim.SGD([one_param()], lr=123.0)
    return build_scheduler(argparse.Namespace(**vars(ns)), opt), opt


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
    assert ns.force_anneal == 3


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
    from textbox_like.cli import parse
    from textbox_like.optim import build_optimizer
    _, cfg, _ = parse(["--task", "mnist", "--optimizer", "adamw", "--optim_conf", "weight_decay=0.01"])
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer(cfg, [{"params": [a], "weight_decay": cfg.weight_decay},
                                {"params": [b], "weight_decay": 0.0, "no_decay": True}])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
