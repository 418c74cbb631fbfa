"""A user task whose loss() returns a loss per sample (``reduction="none"``,
issue 51 item 6) is one line naming its loss() and the shape, exit 2, before
any step: not autograd's traceback. The task is found with --user-dir, in a
folder outside the repository; the trainer's main runs in-process."""
from __future__ import annotations

import textwrap

import pytest

from conftest import refusal_in_process

TASK = textwrap.dedent('''
    import torch

    from textbox_like import Task, register_task


    @register_task("per_sample_loss")
    class PerSampleLoss(Task):
        metric_names = ("loss",)

        def build_dataset(self, split):
            from torch.utils.data import TensorDataset
            x = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))
            return TensorDataset(x, (x.sum(1) > 0).long())

        def build_model(self):
            return torch.nn.Linear(3, 2)

        def loss(self, model, batch):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction=REDUCTION)
            return loss, {"loss_sum": loss.detach().sum(), "nsamples": len(y)}

        def metrics(self, sums):
            return {"loss": sums.get("loss_sum", 0.0) / max(sums.get("nsamples", 0.0), 1.0)}
''')


@pytest.mark.parametrize("reduction, code", [("none", 2), ("sum", 0)])
def test_a_loss_per_sample_is_one_line_naming_the_tasks_loss_and_its_shape(tmp_path, capfd, reduction, code):
    package = tmp_path / f"loss_{reduction}"
    package.mkdir()
    (package / "__init__.py").write_text(TASK.replace("REDUCTION", repr(reduction))
                                         .replace('"per_sample_loss"', f'"per_sample_loss_{reduction}"'))
    out = refusal_in_process(["--user-dir", package, "--task", f"per_sample_loss_{reduction}", "--max-sentences", 8,
                              "--max-update", 2, "--save-dir", tmp_path / "run", "--log-format", "none", "--cpu"],
                             capfd)
    assert out.returncode == code, out.stderr[-3000:]
    if code:
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert lines[-1] == (
            f"error: loss_none.PerSampleLoss.loss() returned a loss of shape [8], not one number: return the sum "
            f"over the batch (e.g. reduction='sum', or .sum() of a per-sample loss) and the samples or tokens it "
            f"covers in its stats, which the trainer divides by"), out.stderr[-3000:]
        assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
        assert "Traceback" not in out.stderr


def test_an_empty_dataset_of_a_task_without_data_names_the_task_not_data_none(tmp_path, capfd):
    package = tmp_path / "empty_task"
    package.mkdir()
    (package / "__init__.py").write_text(TASK.replace("REDUCTION", "'sum'")
                                         .replace('"per_sample_loss"', '"empty_data"')
                                         .replace("torch.randn(24, 3,", "torch.randn(0, 3,"))
    out = refusal_in_process(["--user-dir", package, "--task", "empty_data", "--max-sentences", 8, "--max-update", 2,
                              "--save-dir", tmp_path / "run", "--log-format", "none", "--cpu"], capfd)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: the 'train' split of task empty_data (PerSampleLoss.build_dataset('train') returned an empty "
        "dataset) holds no samples"), out.stderr[-3000:]
