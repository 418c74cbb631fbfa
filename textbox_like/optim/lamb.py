"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes", Algorithm 2).

For every parameter tensor x with gradient g, at step t::

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    m^ = m / (1 - b1^t)               v^ = v / (1 - b2^t)      (bias_correction)
    u  = m^ / (sqrt(v^) + eps) + wd x
    x  = x - lr * phi(||x||) / ||u|| * u

phi is the identity; the trust ratio ||x|| / ||u|| is 1 when either norm
is 0 (fresh zero-initialised biases, zero updates). The trust ratio applies to
every tensor, also those without weight decay (as in the paper; NVIDIA's
apex FusedLAMB skips it there unless use_nvlamb). Gradient clipping is the
trainer's --clip-norm.
"""
from textbox_like.optim import BetasEpsSpec, betas_eps_options, register_optimizer


def make_lamb():
    import torch

    class Lamb(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                     bias_correction=True):
            if lr < 0:
                raise ValueError(f"invalid learning rate {lr}")
            if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
                raise ValueError(f"invalid betas {betas}")
            if eps < 0:
                raise ValueError(f"invalid eps {eps}")
            defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                            bias_correction=bias_correction)
            super().__init__(params, defaults)

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    grad = p.grad
                    if grad.is_sparse:
                        raise RuntimeError("LAMB does not support sparse gradients")
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                    state["step"] += 1
                    step = float(state["step"])
                    grad32 = grad.float()
                    exp_avg.mul_(beta1).add_(grad32.to(exp_avg.dtype), alpha=1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad32.to(exp_avg.dtype), grad32.to(exp_avg.dtype),
                                                    value=1 - beta2)
                    if group["bias_correction"]:
                        c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step
                    else:
                        c1 = c2 = 1.0
                    update = (exp_avg.float() / c1) / ((exp_avg_sq.float() / c2).sqrt() + group["eps"])
                    if group["weight_decay"] != 0:
                        update.add_(p.float(), alpha=group["weight_decay"])
                    w_norm = p.float().norm()
                    u_norm = update.norm()
                    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                        torch.ones_like(w_norm))
                    p.add_((update * (-group["lr"] * trust)).to(p.dtype))
            return loss

    return Lamb


_LAMB = None


def __getattr__(name):
    """``Lamb``, the optimizer class, built on first access (torch is
    imported lazily so that the command line starts fast)."""
    global _LAMB
    if name == "Lamb":
        if _LAMB is None:
            _LAMB = make_lamb()
        return _LAMB
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@register_optimizer("lamb", dataclass=betas_eps_options("lamb", 1e-6))
class LambSpec(BetasEpsSpec):
    @classmethod
    def optimizer_class(cls):
        return __getattr__("Lamb")
