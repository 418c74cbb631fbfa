"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and
Beyond"): torch.optim.RAdam, with decoupled weight decay like our adam."""
from textbox_like.optim import BetasEpsSpec, betas_eps_options, register_optimizer


@register_optimizer("radam", dataclass=betas_eps_options("radam", 1e-8))
class RAdam(BetasEpsSpec):
    torch_name = "RAdam"
    overrides = {"decoupled_weight_decay": True}
