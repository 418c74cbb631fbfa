"""The optimizers HetSeq offers, on torch.optim."""
from . import BetasEpsSpec, OptimizerSpec, register_optimizer


@register_optimizer("adam")
class Adam(BetasEpsSpec):
    """Adam with decoupled weight decay, as HetSeq's (fairseq's) adam."""
    prefix, eps = "adam", 1e-8

    @staticmethod
    def build(param_groups, **kwargs):
        import torch
        return torch.optim.AdamW(param_groups, **kwargs)


@register_optimizer("adamw")
class AdamW(Adam):
    """torch.optim.AdamW (same update as adam; kept under its usual name)."""


@register_optimizer("adadelta")
class Adadelta(OptimizerSpec):
    @staticmethod
    def add_args(options):
        options.add("--adadelta_rho", type=float, default=0.9, help="rho")
        options.add("--adadelta_eps", type=float, default=1e-6, help="epsilon")

    @staticmethod
    def kwargs(cfg):
        return {"lr": cfg.lr[0], "rho": cfg.adadelta_rho, "eps": cfg.adadelta_eps,
                "weight_decay": cfg.weight_decay}

    @staticmethod
    def build(param_groups, **kwargs):
        import torch
        return torch.optim.Adadelta(param_groups, **kwargs)


@register_optimizer("sgd")
class SGD(OptimizerSpec):
    @staticmethod
    def add_args(options):
        options.add("--momentum", type=float, default=0.0, help="momentum")
        options.add("--nesterov", action="store_true", help="Nesterov momentum")

    @staticmethod
    def kwargs(cfg):
        return {"lr": cfg.lr[0], "momentum": cfg.momentum, "nesterov": cfg.nesterov,
                "weight_decay": cfg.weight_decay}

    @staticmethod
    def build(param_groups, **kwargs):
        import torch
        return torch.optim.SGD(param_groups, **kwargs)
