"""`make gpu-check`: what someone holding a GPU for ten minutes runs, as is.

1. The whole suite with the GPU visible (the `gpu` tests run; `-n auto --dist loadfile` when pytest-xdist is
   installed), into LOGS/suite.log and LOGS/suite.xml.
2. The benchmarks on CUDA (`python -m bench.run_all --only NAME --device cuda`), one at a time in the order below
   and each only while the time budget lasts, their rows merged into bench/results-cuda.json, each log into
   LOGS/bench-NAME.log.

The whole fits 9 minutes on one H100/H200 (--budget-s). It installs nothing and needs no network: a machine
without a GPU, or without a package the project needs, is told so in one line (exit 2). Exit 1 when a test or a
benchmark failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (benchmark, its flags): GPU-sized, most wanted first. placements_a14b: the offload/disk rows at A14B widths;
# stage_two: the student's rates; real_size: A14B-sized samples through the writer and loader (4000 prompts ran
# in ~1 minute on an H200); the others are the CPU suite's figures again on CUDA.
BENCHES = [
    ("placements_a14b", []),
    ("teacher_speed", []),  # issue 45: each speed option's step at A14B width and its drift, fidelity on shapes
    ("stage_two", []),
    ("real_size", ["--real-size-args=--prompts 2000 --steps 3 --reps 1"]),
    ("stage_one", []),
    ("online", []),
]
SUITE_SHARE = 0.7  # of the budget, at most, for the suite (336 s with 8 workers on an H200 box of 16 cores)


def missing() -> str | None:
    """One line naming what this machine lacks for the check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed in this Python (" + sys.executable + ")"
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA GPU is visible to torch {torch.__version__} ({built}); run it on a machine with a GPU"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"] + ["wandistiller"]
    absent = []
    for spec in wanted:
        name = re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]
        try:
            md.version(name)
        except md.PackageNotFoundError:
            absent.append(name)
    if absent:
        how = "; the project itself: pip install -e . --no-deps" if "wandistiller" in absent else ""
        return (f"missing packages: {', '.join(absent)} (this check installs nothing: install them from wheels "
                f"into {sys.executable}'s environment{how})")
    return None


def run(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run `cmd` in the repository with its output in `log`; (exit code or None past `timeout_s`, seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false"))
        try:
            code = p.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            code = None
    return code, time.perf_counter() - t0


def suite_counts(xml: Path) -> str:
    if not xml.is_file():
        return "no JUnit file"
    suites = ET.parse(xml).getroot()
    s = suites if suites.tag == "testsuite" else suites.find("testsuite")
    total, failed, errors, skipped = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return f"{total - failed - errors - skipped} passed, {failed + errors} failed, {skipped} skipped"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", type=Path, default=ROOT / "runs" / "gpu-check", help="Log folder.")
    ap.add_argument("--budget-s", type=float, default=540.0, help="Seconds for the whole check.")
    ap.add_argument("--no-suite", action="store_true", help="Only the benchmarks.")
    args = ap.parse_args(argv)
    problem = missing()
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    import torch

    args.logs.mkdir(parents=True, exist_ok=True)
    t_end = time.perf_counter() + args.budget_s
    print(f"gpu-check on {torch.cuda.get_device_name(0)} (torch {torch.__version__}), logs in {args.logs}",
          flush=True)
    lines, bad = [], False
    if not args.no_suite:
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=-ra --strict-markers", "-p", "no:cacheprovider",
               f"--junitxml={args.logs / 'suite.xml'}"]
        try:
            md.version("pytest-xdist")
            cmd += ["-n", "auto", "--dist", "loadfile"]
        except md.PackageNotFoundError:
            lines.append("suite: pytest-xdist not installed, one process")
        code, took = run(cmd, args.logs / "suite.log", args.budget_s * SUITE_SHARE)
        done = "did not finish in its share of the budget" if code is None else f"exit {code}"
        lines.append(f"suite: {suite_counts(args.logs / 'suite.xml')} ({done}, {took:.0f} s) -> {args.logs}/suite.log")
        bad |= code != 0
        print(lines[-1], flush=True)
    out = ROOT / "bench" / "results-cuda.json"
    for name, flags in BENCHES:
        left = t_end - time.perf_counter()
        if left < 30:
            lines.append(f"bench {name}: not run, the budget is spent")
            continue
        cmd = [sys.executable, "-m", "bench.run_all", "--only", name, "--device", "cuda", "--out", str(out), *flags]
        code, took = run(cmd, args.logs / f"bench-{name}.log", left)
        done = "stopped at the budget's end" if code is None else f"exit {code}"
        lines.append(f"bench {name}: {done}, {took:.0f} s -> {args.logs}/bench-{name}.log")
        bad |= code not in (0, None)
        print(lines[-1], flush=True)
    lines.append(f"results: {out}")
    (args.logs / "summary.txt").write_text("\n".join(lines) + "\n")
    print(lines[-1])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
