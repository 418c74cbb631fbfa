"""MNIST digit classification with HetSeq's CNN."""
from textbox_like.core.errors import UserError, closest, note
from textbox_like.tasks import register_task
from textbox_like.tasks.base import Task


MODEL_OPTIONS = {"hidden": 128, "dropout1": 0.25, "dropout2": 0.5}


@register_task("mnist")
class MNISTTask(Task):
    metric_names = ("loss", "accuracy")
    default_best_metric = "accuracy"

    @classmethod
    def resolve_config(cls, ns):
        """HetSeq's --data may name an MNIST file: its directory holds the splits."""
        import os

        from textbox_like.data.mnist import has_mnist_files
        if ns.data and os.path.isfile(ns.data):
            directory = os.path.dirname(os.path.abspath(ns.data))
            if not has_mnist_files(directory):
                raise UserError(f"--data {ns.data} is a file, and its directory holds no MNIST idx files; give the "
                                f"directory holding them, or leave --data out to fetch MNIST")
            note(f"--data {ns.data} is a file: MNIST reads its splits from its directory, {directory}")
            ns.data = directory

    @classmethod
    def check_config(cls, cfg):
        from pathlib import Path
        if cfg.data.data and not Path(cfg.data.data).is_dir():
            raise UserError(f"--data {cfg.data.data}: no such directory; give the directory holding the MNIST "
                            f"idx files, or leave --data out to fetch MNIST")
        for key, value in cfg.model.model_conf.items():
            if key not in MODEL_OPTIONS:
                raise UserError(f"unknown key {key!r} in --model_conf for mnist{closest(key, MODEL_OPTIONS)}; "
                                f"valid keys: {', '.join(MODEL_OPTIONS)}")
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
                value >= 1 and value == int(value) if key == "hidden" else 0 <= value < 1)
            if not ok:
                want = "a positive integer" if key == "hidden" else "a probability in [0, 1)"
                raise UserError(f"--model_conf {key}={value!r}: expects {want}")

    def prepare_data(self):
        from textbox_like.data.mnist import ensure_mnist
        self.data_dir = ensure_mnist(self.cfg.data.data)

    def build_dataset(self, split):
        from textbox_like.data.mnist import FILES, MNISTDataset, ensure_mnist, load_split
        if split not in FILES:
            raise UserError(f"MNIST has no split {split!r}; use one of: {', '.join(FILES)}")
        if not hasattr(self, "data_dir"):
            self.data_dir = ensure_mnist(self.cfg.data.data)
        return MNISTDataset(*load_split(self.data_dir, split))

    def build_model(self):
        from textbox_like.models.mnist_cnn import MNISTNet
        if self.cfg.model.checkpointing:
            import sys
            print("note: --checkpointing (activation checkpointing) has no use for mnist's 1.2M-parameter CNN, "
                  "whose activations are small; ignored", file=sys.stderr)
        return MNISTNet(**{**MODEL_OPTIONS, **self.cfg.model.model_conf})

    def model_conf_defaults(self):
        return dict(MODEL_OPTIONS)

    def loss(self, model, batch):
        import torch.nn.functional as F
        log_probs = model(batch["image"])
        target = batch["target"]
        loss_sum = F.nll_loss(log_probs.float(), target, reduction="sum")
        correct = (log_probs.argmax(dim=1) == target).sum()
        n = target.shape[0]  # a host number: no tensor from a Python value per step
        return loss_sum, {"loss_sum": loss_sum.detach(), "correct": correct, "nsamples": n}

    def metrics(self, sums):
        n = max(sums.get("nsamples", 0.0), 1.0)
        return {"loss": sums.get("loss_sum", 0.0) / n, "accuracy": sums.get("correct", 0.0) / n}
