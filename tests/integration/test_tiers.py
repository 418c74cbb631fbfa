"""The two tiers hold: tests/conftest.py, in a suite of its own run by pytest as
a developer runs it, fails a test of tests/unit that starts a process, refuses
at collection a test of tests/unit marked slow, and marks every test of
tests/integration slow, so -m "not slow" is tests/unit."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import TESTS, clean_env

STARTS_A_PROCESS = textwrap.dedent('''
    import subprocess, sys

    def test_starts_a_process_but_catches_the_refusal():
        try:
            subprocess.run([sys.executable, "-c", "pass"])
        except Exception:
            pass

    def test_in_process():
        assert sum(range(4)) == 6
''')

STARTS_ONE_TOO = textwrap.dedent('''
    import subprocess, sys

    def test_starts_a_process():
        assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
''')

MARKED_SLOW = textwrap.dedent('''
    import pytest

    @pytest.mark.slow
    def test_marked_slow():
        pass
''')


def suite(root: Path, **files) -> Path:
    (root / "tests" / "unit").mkdir(parents=True)
    (root / "tests" / "integration").mkdir()
    shutil.copy(TESTS / "conftest.py", root / "tests" / "conftest.py")
    for name, text in files.items():
        tier, module = name.split("__")
        (root / "tests" / tier / f"{module}.py").write_text(text)
    return root


def pytest_in(root: Path, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(root), *args, "tests"], cwd=root, env=clean_env(),
                          capture_output=True, text=True, timeout=240)


def test_a_unit_test_that_starts_a_process_fails_and_integration_is_the_slow_tier(tmp_path):
    root = suite(tmp_path, unit__test_a=STARTS_A_PROCESS, integration__test_b=STARTS_ONE_TOO)
    fast = pytest_in(root, "-m", "not slow")
    assert fast.returncode == 1, fast.stdout[-3000:]
    assert "1 failed, 1 passed, 1 deselected" in fast.stdout, fast.stdout[-3000:]
    assert "this test tried to start a process" in fast.stdout, fast.stdout[-3000:]
    assert "and went on: move it to tests/integration" in fast.stdout, fast.stdout[-3000:]
    slow = pytest_in(root, "-m", "slow")
    assert slow.returncode == 0 and "1 passed, 2 deselected" in slow.stdout, slow.stdout[-3000:]


def test_a_test_marked_slow_in_unit_is_refused_at_collection(tmp_path):
    root = suite(tmp_path, unit__test_a=MARKED_SLOW)
    out = pytest_in(root)
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-3000:]   # pytest's usage error
    assert "move them to tests/integration: tests/unit/test_a.py::test_marked_slow" in out.stdout + out.stderr
