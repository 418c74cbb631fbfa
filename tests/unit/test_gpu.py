"""Every CUDA path once, on a real GPU (issue 24). Marked ``cuda`` and
skipped where torch sees no GPU; ``scripts/gpu-check.sh`` runs them
(``pytest -m cuda tests/integration/test_gpu_processes.py``) with tests/unit/test_cuda_paths.py, and the
GPU benchmarks, and writes a report.

The tests drive the real command line (run_hetseq.py subprocesses) or the
Trainer as cli.main builds it (where a fault is injected), and check effects:
the device the run used (its start line, or the parameters' device), finite
losses, skipped updates not counted, bitwise-equal resumes. Never timings.
Helpers and fixtures come from the CPU tests of the same paths: conftest.py,
test_faults.py (NaN batches), test_resume.py (kill -9 and resume),
test_bert_train.py (tiny BERT shards), test_compile.py."""
from __future__ import annotations

import importlib.util
import json

from conftest import REPO


def test_gpu_check_report_from_results(tmp_path):
    """The report of a GPU run, from test counts (junit XML) and bench figures."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="4">'
                   '<testcase classname="tests.test_gpu" name="a"/>'
                   '<testcase classname="tests.test_gpu" name="b"><failure message="x"/></testcase>'
                   '<testcase classname="tests.test_gpu" name="c"><skipped message="s"/></testcase>'
                   '<testcase classname="tests.test_gpu" name="d"><error message="e"/></testcase>'
                   '</testsuite></testsuites>')
    counts = gc.junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["errors"]) == (1, 1, 1, 1)
    assert counts["failed_names"] == ["tests.test_gpu::b", "tests.test_gpu::d"]
    figures = {"plain_samples_per_s": 900.0, "trainer_samples_per_s": 880.0, "plain_tokens_per_s": 115200.0,
               "trainer_tokens_per_s": 112640.0, "plain_mfu": 0.41, "trainer_mfu": 0.4, "peak_bf16_tflops": 989.0,
               "peak_source": "table by GPU name", "plain_peak_mem_gib": 9.5, "trainer_peak_mem_gib": 9.8,
               "batch": 32, "seq_length": 128, "updates": 100, "warmup": 10, "rounds": 3}
    report = {"status": "failed", "summary": "Tests: 1 passed, 2 failed, 1 skipped.", "commit": "abc",
              "versions": {"torch": "2.11.0", "gpus": ["NVIDIA H100 80GB HBM3"], "driver": "580.1"},
              "packages": {"missing": ["hyperopt"], "wheels": "/w", "installed": ["hyperopt"], "install_failed": {}},
              "tests": {"tests/integration/test_gpu_processes.py -m cuda": counts},
              "benchmarks": [{"name": "bert-base bf16, eager", "ok": True, "figures": figures},
                             {"name": "bert-base bf16, --compile", "ok": False, "error": "boom"}]}
    gc.write_report(tmp_path / "out", report)
    md = (tmp_path / "out" / "gpu-report.md").read_text()
    assert "| GPU | NVIDIA H100 80GB HBM3 |" in md and "| driver | 580.1 |" in md
    assert "| tests/integration/test_gpu_processes.py -m cuda | 1 | 1 | 1 | 1 |" in md and "failed in tests/integration/test_gpu_processes.py -m cuda: tests.test_gpu::b" in md
    assert "| bert-base bf16, eager | trainer | 880.0 | 112640.0 | - | 40.0% | 9.8 |" in md
    assert "| bert-base bf16, --compile | failed: boom |" in md and "installed from /w: hyperopt" in md
    assert json.loads((tmp_path / "out" / "gpu-report.json").read_text())["tests"]["tests/integration/test_gpu_processes.py -m cuda"] == counts
