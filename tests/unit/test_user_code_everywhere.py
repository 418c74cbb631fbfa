"""A user's own code reaches every process of every way a run starts (issue
31 items 1, 3 and 5): ``--user-dir`` under torchrun, ``accelerate launch``,
srun's tasks, file:// nodes, Ray trials and multi-seed runs; ``textbox-like
eval``/``export`` on its checkpoint; ``textbox_like.train(task=MyTask)``
with a class of the caller's own, in one process and in two.

One tiny user package (tests/unit/test_user_dir.py's toy task) serves the module;
its __init__ leaves a file per process that imports it, holding that
process's rank, so each test sees which processes imported it."""
from __future__ import annotations

import pytest

from test_user_dir import refusal


def test_an_unregistered_class_whose_name_is_taken_is_one_line():
    import textbox_like
    from textbox_like.core.errors import UserError

    class Clash(textbox_like.Task):
        name = "mnist"

    with pytest.raises(UserError) as raised:
        textbox_like.train({"max_update": 1}, task=Clash)
    line = str(raised.value)
    assert "\n" not in line and line.startswith("task 'mnist' of test_an_unregistered_class_whose_name_is_taken_is_")
    assert "the built-in task MNISTTask (textbox_like/tasks/mnist.py:" in line
    assert line.endswith("has that name; register yours under another name")

BAD_ADD_ARGS = '''from textbox_like import Task, register_task


@register_task("bad_style")
class BadStyle(Task):
    @staticmethod
    def add_args(parser):
        parser.add_argument("--layers", type=int, nargs="+", default=[8])
'''


def test_an_add_args_option_no_setting_can_be_is_one_line(tmp_path, capsys):
    folder = tmp_path / "bad_style"
    folder.mkdir()
    (folder / "__init__.py").write_text(BAD_ADD_ARGS)
    assert refusal(tmp_path, capsys, folder) == (
        f"error: task 'bad_style' ({folder / '__init__.py'}:4): its add_args option --layers has nargs='+', which "
        f"a setting cannot be; declare its options as a frozen dataclass of textbox_like.setting() fields deriving "
        f"from textbox_like.Section, set as options = YourOptions on the class")
