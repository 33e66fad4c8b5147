"""Stage one under torchrun (two CPU processes, gloo): a failing rank ends the job with its one line, printed
once by itself, quoted in torchrun's summary, and the exit code of the table (pipeline/errors.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cache import format as F
from conftest import ROOT, TEST_PROMPTS, TINY_CACHE_ARGS
from pipeline.faults import KILL_AT_ENV

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def torchrun(teacher: Path, prompts: Path, out: Path, env_extra: dict) -> tuple[subprocess.CompletedProcess, float]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "pipeline.cli", "teacher-cache", "--teacher", str(teacher), "--prompts", str(prompts),
            "--out", str(out), "--placement", "cpu"]
    for k, v in TINY_CACHE_ARGS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **env_extra}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return proc, time.time() - t0


def _own_lines(output: str, rank: int, cause: str) -> list[str]:
    # torchrun's summary quotes the line indented ("traceback : [rank R] ..."): only a rank's own line starts it.
    return [ln for ln in output.splitlines() if ln.startswith(f"[rank {rank}] error: {cause}")]


def test_a_rank_without_prompts_ends_the_job_with_its_line_and_exit_2(tiny_teacher, tmp_path):
    """Rank 1 of 2 gets no prompt of a one-prompt file (a user error) while rank 0 computes its part."""
    prompts = tmp_path / "one.txt"
    prompts.write_text(TEST_PROMPTS[0] + "\n")
    proc, wall = torchrun(tiny_teacher, prompts, tmp_path / "cache", {})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert wall < 90, f"the job took {wall:.0f}s to end"
    assert len(_own_lines(output, 1, "part 1 of 2 gets no prompt")) == 1, output[-3000:]
    assert "traceback : [rank 1] error: part 1 of 2 gets no prompt" in output, output[-3000:]
    assert "exitcode  : 2" in output
    assert "stages/teacher_cache" not in output, output[-3000:]  # no rank's traceback (torchrun has its own)
    assert not (tmp_path / "cache" / F.MANIFEST).exists()


def test_an_unexpected_exception_keeps_its_traceback_and_reaches_the_summary(tiny_teacher, tmp_path):
    """A bug (here: a malformed fault-injection setting, a ValueError at the first fault point after the prompts
    are encoded) on both ranks: each prints its traceback and `error: ValueError: ...` once, exit 1, and
    torchrun's summary carries the traceback instead of its generic "To enable traceback" hint."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(TEST_PROMPTS) + "\n")
    proc, _ = torchrun(tiny_teacher, prompts, tmp_path / "cache", {KILL_AT_ENV: "nowhere:1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Each rank that reached the fault point prints the error once. torchrun SIGTERMs the other ranks as soon as
    # one fails, so a rank still encoding then (a busy machine) never gets there; its summary entry says so (143:
    # it stopped on the SIGTERM; -15: it got it before the stage installed its handler).
    summary = output.split("Failures:")[-1]
    printed = {r: len(_own_lines(output, r, f"ValueError: {KILL_AT_ENV}='nowhere:1'")) for r in (0, 1)}
    assert sorted(set(printed.values()) - {0}) == [1], output[-3000:]
    for rank, n in printed.items():
        assert n == 1 or re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\n\s*exitcode\s*: (-15|143)", summary), \
            output[-3000:]
    assert "exitcode  : 1" in output and "To enable traceback" not in output, output[-3000:]
    assert "stages/teacher_cache/make_cache.py" in output.split("Root Cause")[1]  # the rank's traceback, quoted
