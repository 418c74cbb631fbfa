"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and
Beyond"): torch.optim.RAdam, with decoupled weight decay like our adam."""
from ..config import float_tuple
from . import OptimizerSpec, register_optimizer


@register_optimizer("radam")
class RAdam(OptimizerSpec):
    @staticmethod
    def add_args(options):
        options.add("--radam-betas", type=float_tuple, default="(0.9, 0.999)",
                    help="RAdam betas, as a Python tuple literal")
        options.add("--radam-eps", type=float, default=1e-8, help="RAdam epsilon")

    @staticmethod
    def kwargs(cfg):
        return {"lr": cfg.lr[0], "betas": list(cfg.radam_betas), "eps": cfg.radam_eps,
                "weight_decay": cfg.weight_decay, "decoupled_weight_decay": True}

    @staticmethod
    def build(param_groups, **kwargs):
        import torch
        return torch.optim.RAdam(param_groups, **kwargs)
