"""The optimizers HetSeq offers, on torch.optim."""
from . import BetasEpsSpec, OptimizerSpec, register_optimizer


@register_optimizer("adam")
class Adam(BetasEpsSpec):
    """Adam with decoupled weight decay, as HetSeq's (fairseq's) adam
    (torch.optim.AdamW; the same as torch.optim.Adam when weight_decay is 0)."""
    prefix, eps, torch_name = "adam", 1e-8, "AdamW"
    overrides = {"weight_decay": 0.0}


@register_optimizer("adamw")
class AdamW(Adam):
    """torch.optim.AdamW (same update as adam; kept under its usual name)."""


@register_optimizer("adadelta")
class Adadelta(OptimizerSpec):
    torch_name = "Adadelta"
    links = {"lr": ["lr"], "rho": ["adadelta_rho"], "eps": ["adadelta_eps", "epsilon"],
             "weight_decay": ["weight_decay", "adadelta_weight_decay"]}

    @staticmethod
    def add_args(options):
        options.add("--adadelta_rho", type=float, default=0.9, help="rho")
        options.add("--adadelta_eps", type=float, default=1e-6, help="epsilon")
        options.add("--adadelta_weight_decay", type=float, default=None,
                    help="weight decay of adadelta (HetSeq's option; unset: --weight-decay)")

    @classmethod
    def option_links(cls, defaults):
        return {k: list(v) for k, v in cls.links.items()}


@register_optimizer("sgd")
class SGD(OptimizerSpec):
    torch_name = "SGD"
    default_lr = 0.1
    links = {"lr": ["lr"], "momentum": ["momentum"], "nesterov": ["nesterov"], "weight_decay": ["weight_decay"]}

    @staticmethod
    def add_args(options):
        options.add("--momentum", type=float, default=0.0, help="momentum")
        options.add("--nesterov", action="store_true", help="Nesterov momentum")
