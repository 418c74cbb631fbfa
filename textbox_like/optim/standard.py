"""The optimizers HetSeq offers, on torch.optim."""
from dataclasses import dataclass

from textbox_like.config.schema import Section, setting
from textbox_like.optim import BetasEpsSpec, OptimizerSpec, betas_eps_options, register_optimizer


@dataclass(frozen=True)
class AdadeltaOptions(Section):
    adadelta_rho: float = setting(0.9, "rho", type=float, flag="--adadelta_rho")
    adadelta_eps: float = setting(1e-6, "epsilon", type=float, flag="--adadelta_eps")
    adadelta_weight_decay: float | None = setting(None, "weight decay of adadelta (HetSeq's option; unset: "
                                                        "--weight-decay)", type=float, flag="--adadelta_weight_decay")


@dataclass(frozen=True)
class SGDOptions(Section):
    momentum: float = setting(0.0, "momentum", type=float)
    nesterov: bool = setting(False, "Nesterov momentum", switch=True)


@register_optimizer("adam", dataclass=betas_eps_options("adam", 1e-8))
class Adam(BetasEpsSpec):
    """Adam with decoupled weight decay, as HetSeq's (fairseq's) adam
    (torch.optim.AdamW; the same as torch.optim.Adam when weight_decay is 0)."""
    torch_name = "AdamW"
    overrides = {"weight_decay": 0.0}


@register_optimizer("adamw")
class AdamW(Adam):
    """torch.optim.AdamW (same update as adam; kept under its usual name)."""


@register_optimizer("adadelta", dataclass=AdadeltaOptions)
class Adadelta(OptimizerSpec):
    torch_name = "Adadelta"
    links = {"lr": ["lr"], "rho": ["adadelta_rho"], "eps": ["adadelta_eps", "epsilon"],
             "weight_decay": ["weight_decay", "adadelta_weight_decay"]}

    @classmethod
    def option_links(cls, defaults):
        return {k: list(v) for k, v in cls.links.items()}


@register_optimizer("sgd", dataclass=SGDOptions)
class SGD(OptimizerSpec):
    torch_name = "SGD"
    default_lr = 0.1
    links = {"lr": ["lr"], "momentum": ["momentum"], "nesterov": ["nesterov"], "weight_decay": ["weight_decay"]}
