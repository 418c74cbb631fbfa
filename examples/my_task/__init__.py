"""My own task, outside textbox_like: two interleaved spirals, a small MLP.

    textbox-like train --user-dir examples/my_task --task spirals --max-sentences 32 --max-update 300
"""
from dataclasses import dataclass

import torch

from textbox_like import Section, Task, register_task, setting


@dataclass(frozen=True)
class SpiralOptions(Section):
    spiral_width: int = setting(64, "hidden width of the MLP", type=int)  # --spiral-width


def spirals(n, seed):
    g = torch.Generator().manual_seed(seed)
    radius, label = torch.rand(n, generator=g), torch.randint(0, 2, (n,), generator=g)
    angle = 2 * torch.pi * radius + torch.pi * label
    points = radius[:, None] * torch.stack([angle.cos(), angle.sin()], 1)
    return torch.utils.data.TensorDataset(points + 0.02 * torch.randn(n, 2, generator=g), label)


@register_task("spirals", dataclass=SpiralOptions)
class Spirals(Task):
    metric_names, default_best_metric = ("loss", "accuracy"), "accuracy"

    def build_dataset(self, split):
        return spirals(4000, seed=0) if split == "train" else spirals(1000, seed=1)

    def build_model(self):
        w = self.cfg.task_options.spiral_width
        return torch.nn.Sequential(torch.nn.Linear(2, w), torch.nn.Tanh(), torch.nn.Linear(w, w), torch.nn.Tanh(),
                                   torch.nn.Linear(w, 2))

    def loss(self, model, batch):  # sums over the batch: the trainer divides by the update's samples
        points, label = batch
        logits = model(points)
        loss = torch.nn.functional.cross_entropy(logits, label, reduction="sum")
        return loss, {"loss_sum": loss.detach(), "correct": (logits.argmax(1) == label).sum(), "nsamples": len(label)}

    def metrics(self, sums):
        n = max(sums["nsamples"], 1)
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n}
