"""LAMB against the paper's formulas; RAdam builds and trains."""

import numpy as np
import torch

from textbox_like.optim import OPTIMIZERS, build_optimizer
from textbox_like.optim.lamb import Lamb


def reference_lamb(params, grads_per_step, lr, b1, b2, eps, wd_per_param):
    """You et al. 2019, Algorithm 2, in numpy (float64), phi = identity."""
    xs = [p.astype(np.float64).copy() for p in params]
    ms = [np.zeros_like(x) for x in xs]
    vs = [np.zeros_like(x) for x in xs]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1 ** t)
            v_hat = vs[i] / (1 - b2 ** t)
            r = m_hat / (np.sqrt(v_hat) + eps)
            u = r + wd_per_param[i] * xs[i]
            x_norm, u_norm = np.linalg.norm(xs[i]), np.linalg.norm(u)
            trust = x_norm / u_norm if x_norm > 0 and u_norm > 0 else 1.0
            xs[i] = xs[i] - lr * trust * u
    return xs


def test_lamb_matches_reference():
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (5,), (3,)]
    init = [rng.normal(size=s).astype(np.float32) for s in shapes]
    init[2][:] = 0.0  # a zero tensor (fresh bias): trust ratio 1
    steps = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(5)]
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.1
    params = [torch.nn.Parameter(torch.tensor(x)) for x in init]
    opt = Lamb([{"params": params[:2], "weight_decay": wd}, {"params": params[2:], "weight_decay": 0.0}],
               lr=lr, betas=(b1, b2), eps=eps)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        opt.step()
    expected = reference_lamb(init, steps, lr, b1, b2, eps, [wd, wd, 0.0])
    for p, e in zip(params, expected):
        assert np.allclose(p.detach().numpy(), e, atol=1e-6, rtol=1e-5)


def test_lamb_state_dict_roundtrip():
    p = torch.nn.Parameter(torch.ones(3))
    opt = Lamb([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    clone = Lamb([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    clone.load_state_dict(opt.state_dict())
    assert float(clone.state_dict()["state"][0]["step"]) == 1.0


def cfg(name):
    """The optimizer section of a run of this optimizer at lr 0.05, weight decay 0.01."""
    from textbox_like.resolve.resolution import parse
    return parse(["--optimizer", name, "--lr", "0.05", "--weight-decay", "0.01"]).optim


def train_quadratic(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1) + 0.5
    groups = [{"params": [model.weight]}, {"params": [model.bias], "no_decay": True}]
    opt = build_optimizer(cfg(name), groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return opt, losses


def test_radam_builds_and_steps():
    opt, losses = train_quadratic("radam")
    assert isinstance(opt, torch.optim.RAdam)
    assert opt.defaults["decoupled_weight_decay"] is True
    assert losses[-1] < 0.5 * losses[0]


def test_lamb_through_registry():
    assert {"lamb", "radam"} <= set(OPTIMIZERS.names())
    opt, losses = train_quadratic("lamb")
    assert type(opt).__name__ == "Lamb"
    assert losses[-1] < 0.5 * losses[0]
