"""A dangling entry point (issue 51, item 8): an installed distribution whose
``textbox_like.resolve.plugins`` entry point names a module that does not exist (its
package removed or renamed) no longer breaks every command with importlib's
traceback: one warning line names the entry point, its distribution and the
fix, and the command goes on (``--help``, a training run, the other
plugins). A plugin whose own code fails to import still shows that code's
traceback. The distributions are real ``.dist-info`` folders on the
processes' path, as ``pip install`` leaves them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)


def distribution(site, name, entry_point, package_code=None):
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[textbox_like.resolve.plugins]\n{name} = {entry_point}\n")
    if package_code is not None:
        (site / entry_point).mkdir()
        (site / entry_point / "__init__.py").write_text(package_code)


def trainer(site, *args):
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(site)])
    return subprocess.run([sys.executable, str(REPO / "run_hetseq.py"), *map(str, args)], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_a_dangling_entry_point_is_one_warning_and_every_command_goes_on(tmp_path):
    site = tmp_path / "site"
    distribution(site, "badplug", "no_such_module")
    distribution(site, "flatpkg", "flatpkg", "from textbox_like import Scheduler, register_scheduler\n\n\n"
                                             "@register_scheduler('my_flat')\nclass MyFlat(Scheduler):\n    pass\n")
    warning = ("warning: the installed plugin badplug = no_such_module (entry point group textbox_like.resolve.plugins, "
               "from badplug 0.1) names a module that does not exist; skipped: fix that package's entry point, or "
               "uninstall it (pip uninstall badplug)")

    helped = trainer(site, "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert helped.stdout.startswith("usage: ") and "Traceback" not in helped.stderr
    assert [line for line in helped.stderr.splitlines() if line.strip()] == [warning]

    # the other installed plugin still registers, and a run that needs nothing of the dangling one trains
    printed = trainer(site, "--task", "mnist", "--lr_scheduler", "my_flat", "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert yaml.safe_load(printed.stdout)["lr_scheduler"] == "my_flat"
    assert warning in printed.stderr.splitlines()


@pytest.mark.timeout(300)
def test_a_plugin_whose_own_code_fails_to_import_still_shows_its_traceback(tmp_path):
    """Not a dangling entry point: the module exists, an import in its code
    fails. That is the package's bug: its traceback, with the note naming
    the plugin, not a warning that hides it."""
    site = tmp_path / "site"
    distribution(site, "brokenpkg", "brokenpkg", "import a_module_brokenpkg_forgot_to_require\n")
    out = trainer(site, "--help")
    assert out.returncode not in (0, 2), out.stderr[-3000:]
    assert "ModuleNotFoundError: No module named 'a_module_brokenpkg_forgot_to_require'" in out.stderr
    assert "raised while importing the installed plugin brokenpkg = brokenpkg" in out.stderr
    assert "warning: the installed plugin" not in out.stderr
