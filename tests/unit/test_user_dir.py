"""A user's own components from outside the package: ``--user-dir DIR``
(``user_dir`` in YAML) and the entry-point group ``textbox_like.resolve.plugins``
(textbox_like/resolve/plugins.py). The user's package is written into tmp_path,
outside the repository, using only the public names of ``textbox_like``,
and every run starts in another directory than the repository's."""
from __future__ import annotations

import textwrap

from textbox_like.optim import OPTIMIZERS

from conftest import run_main


USER_TASK = textwrap.dedent('''
    from dataclasses import dataclass

    from textbox_like import BatchDataset, Section, Task, register_task, setting


    @dataclass(frozen=True)
    class ToyOptions(Section):
        toy_width: int = setting(8, "hidden width of the toy model", type=int)
        toy_samples: int = setting(64, "samples in each split", type=int)


    class Points(BatchDataset):
        def __init__(self, n, seed):
            import torch
            self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
            self.y = (self.x.sum(1) > 0).long()

        def __len__(self):
            return len(self.y)

        def get_batch(self, indices):
            import torch
            i = torch.as_tensor(indices, dtype=torch.long)
            return {"x": self.x[i], "y": self.y[i]}


    @register_task("toy", dataclass=ToyOptions)
    class ToyTask(Task):
        metric_names = ("loss", "accuracy")

        def build_dataset(self, split):
            return Points(self.cfg.task_options.toy_samples, seed=0 if split == "train" else 1)

        def build_model(self):
            import torch
            width = self.cfg.task_options.toy_width
            return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))

        def loss(self, model, batch):
            import torch.nn.functional as F
            logits = model(batch["x"])
            loss = F.cross_entropy(logits, batch["y"], reduction="sum")
            correct = (logits.argmax(1) == batch["y"]).sum()
            return loss, {"loss_sum": loss.detach(), "correct": correct, "nsamples": len(batch["y"])}

        def metrics(self, sums):
            n = max(sums.get("nsamples", 0.0), 1.0)
            return {"loss": sums.get("loss_sum", 0.0) / n, "accuracy": sums.get("correct", 0.0) / n}
''')

CLASH = '''from textbox_like import Task, register_task


@register_task("mnist")
class MyMNIST(Task):
    pass
'''

WRONG_KIND = '''from textbox_like import register_optimizer


@register_optimizer("my_adam")
class MyAdam:
    pass
'''


def refusal(tmp_path, capsys, user_dir):
    assert run_main(["--user-dir", user_dir, "--print_config"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_missing_folder_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert refusal(tmp_path, capsys, missing) == (
        f"error: --user-dir {missing}: no such directory; give the folder of your components, a Python package "
        f"(a folder with an __init__.py that imports your modules)")


def test_a_folder_without_init_py_is_one_line(tmp_path, capsys):
    folder = tmp_path / "loose"
    folder.mkdir()
    (folder / "task.py").write_text("raise RuntimeError('never imported')\n")
    assert refusal(tmp_path, capsys, folder) == (
        f"error: --user-dir {folder} is not a Python package: it has no __init__.py; add {folder / '__init__.py'} "
        f"importing your modules (e.g. 'from . import my_task')")


def test_a_builtin_name_taken_names_both_files(tmp_path, capsys):
    folder = tmp_path / "clashing"
    folder.mkdir()
    (folder / "__init__.py").write_text(CLASH)
    line = refusal(tmp_path, capsys, folder)
    assert line.startswith(f"error: task 'mnist' of MyMNIST ({folder / '__init__.py'}:4) is registered already: "
                           f"the built-in task MNISTTask (textbox_like/tasks/mnist.py:")
    assert line.endswith("has that name; register yours under another name")


def test_a_class_of_the_wrong_kind_is_one_line(tmp_path, capsys):
    folder = tmp_path / "wrong_kind"
    folder.mkdir()
    (folder / "__init__.py").write_text(WRONG_KIND)
    assert refusal(tmp_path, capsys, folder) == (
        f"error: optimizer 'my_adam' ({folder / '__init__.py'}:4): MyAdam is not a subclass of "
        f"textbox_like.OptimizerSpec; derive it from textbox_like.OptimizerSpec")
    assert "my_adam" not in OPTIMIZERS


def test_a_folder_named_like_another_module_is_one_line(tmp_path, capsys):
    folder = tmp_path / "json"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    line = refusal(tmp_path, capsys, folder)
    assert line.startswith(f"error: --user-dir {folder}: its name 'json' is that of another module (")
    assert line.endswith("), which it would hide; rename the folder")
