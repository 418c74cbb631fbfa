"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and
Beyond"): torch.optim.RAdam, with decoupled weight decay like our adam."""
from . import BetasEpsSpec, register_optimizer


@register_optimizer("radam")
class RAdam(BetasEpsSpec):
    prefix, eps, torch_name = "radam", 1e-8, "RAdam"
    overrides = {"decoupled_weight_decay": True}
