"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and
Beyond"): torch.optim.RAdam, with decoupled weight decay like our adam."""
from . import BetasEpsSpec, register_optimizer


@register_optimizer("radam")
class RAdam(BetasEpsSpec):
    prefix, eps = "radam", 1e-8

    @classmethod
    def kwargs(cls, cfg):
        return {**super().kwargs(cfg), "decoupled_weight_decay": True}

    @staticmethod
    def build(param_groups, **kwargs):
        import torch
        return torch.optim.RAdam(param_groups, **kwargs)
