"""Stage two under faults: SIGKILL during training and while a checkpoint is written, a full disk under
checkpoint writing, and one rank failing under torchrun.

Each kill is followed by `--resume`; the run must end with exactly the uninterrupted run's weights (raw
and EMA, bit for bit), resume from the newest *complete* checkpoint (never a half-written one), and train
on exactly the micro-batches the uninterrupted run trained on from there: none skipped, none twice.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from pipeline.faults import KILL_AT_ENV

from .check import tree_digest, weights_equal
from .proc import ROOT, Result, run_cli, small_filesystem
from .report import Row
from .workspace import STUDENT_CONFIG, TRAIN, Workspace, flags

DEBUG_ENV = "WANDISTILLER_DEBUG_DIR"
CKPT_FILES = ("model.safetensors", "ema.safetensors", "optimizer.pt", "trainer_state.json")
WEIGHTS = "diffusion_pytorch_model.safetensors"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _complete_checkpoints(out: Path) -> tuple[list[int], list[str]]:
    """Steps of the checkpoints a resume may pick (final name), and problems: a final name on a partial one."""
    steps, problems = [], []
    root = out / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        m = _STEP_DIR.match(d.name)
        if not m:
            continue  # a temporary folder: never picked
        missing = [f for f in CKPT_FILES if not (d / f).is_file()]
        if missing:
            problems.append(f"checkpoint {d.name} has its final name but lacks {missing}")
        else:
            steps.append(int(m.group(1)))
    return steps, problems


def _resumed_from(r: Result) -> int | None:
    m = re.search(r"resuming from \S+ \(step (\d+),", r.out + r.err)
    return int(m.group(1)) if m else (0 if "starting from step 0" in r.out + r.err else None)


def _batch_accounting(ws: Workspace, debug: Path, start: int) -> tuple[int, int, list[str]]:
    """Lost / duplicated samples of the resumed run's micro-batches against the uninterrupted run's from `start`."""
    got = json.loads((debug / "rank-0.json").read_text())["micro_batches"]
    want = ws.ref_batches[start:]
    problems = [] if len(got) == len(want) else [f"{len(got)} micro-batches after the resume, expected {len(want)}"]
    lost = dup = 0
    for g, w in zip(got, want):
        lost += sum((Counter(w) - Counter(g)).values())
        dup += sum((Counter(g) - Counter(w)).values())
    lost += sum(len(w) for w in want[len(got):])
    return lost, dup, problems


def _resume_and_compare(ws: Workspace, out: Path, expect_from: int | None) -> tuple[int, int, list[str], str]:
    debug = out.with_name(out.name + "-debug")
    r = run_cli(ws.train(out) + ["--resume"], env={DEBUG_ENV: str(debug)})
    if r.code != 0:
        return 0, 0, [f"the resume failed: {r.describe()}"], ""
    problems = []
    start = _resumed_from(r)
    note = f"resumed from step {start}"
    if start is None or (expect_from is not None and start != expect_from):
        problems.append(f"resumed from step {start}, the newest complete checkpoint is step {expect_from}")
    for name in ("student", "student_ema"):
        if not weights_equal(out / name / WEIGHTS, ws.ref_run / name / WEIGHTS):
            problems.append(f"{name} differs from the uninterrupted run")
    lost, dup, acc = _batch_accounting(ws, debug, start or 0)
    return lost, dup, problems + acc, note


def _attempt(ws: Workspace, row: Row, label: str, env: dict | None = None, kill_after_s: float | None = None,
             fsize: int | None = None, expect_code: int = -9, out: Path | None = None, space_back=None) -> None:
    out = out or ws.fresh("train")
    r = run_cli(ws.train(out), env=env, kill_after_s=kill_after_s, fsize=fsize)
    if r.code == 0 and kill_after_s is not None:
        row.notes.append(f"{label}: the run finished first (not counted)")
        return
    problems = []
    if r.code != expect_code:
        problems.append(f"exit {r.code}, expected {expect_code}: {r.describe()}")
    if expect_code == 2:
        if len(r.error_lines) != 1 or "--resume" not in r.error_lines[0] or "Traceback" in r.err:
            problems.append(f"expected one error line saying to rerun with --resume, got {r.err[-600:]!r}")
        row.notes.append(f"{label}: {r.error_lines[0] if r.error_lines else r.describe()}")
    steps, partial = _complete_checkpoints(out)
    problems += partial
    if (out / "student").exists():  # student/ is renamed in last: only a kill after the final save may leave it
        unfinished = [n for n in ("student_ema", "distill.json", "loss.png") if not (out / n).exists()]
        if unfinished or r.code != -9 or kill_after_s is None:
            problems.append(f"a student was saved although the run did not finish (missing: {unfinished})")
        else:
            row.notes.append(f"{label}: the kill landed after the student was saved")
    if space_back is not None:
        space_back()
    lost, dup, final, note = _resume_and_compare(ws, out, max(steps, default=0))
    row.notes.append(f"{label}: {note}, checkpoints complete before the resume: {steps}")
    row.record(label, problems + final, lost, dup)


def kills(ws: Workspace, rng: random.Random) -> list[Row]:
    ws.ref_batches  # noqa: B018 - the uninterrupted run, built first
    train = Row("stage 2 SIGKILL during training", min_attempts=2)
    ckpt = Row("stage 2 SIGKILL while checkpointing", min_attempts=3)
    t0 = time.perf_counter()
    # steps 5 and 14: mid-epoch after the step-3 checkpoint, and in the second epoch after step 12's.
    for step in (5, 14):
        _attempt(ws, train, f"SIGKILL as step {step} begins", env={KILL_AT_ENV: f"train_step:{step}"})
    _attempt(ws, train, "SIGKILL at a random time",
             kill_after_s=rng.uniform(0.4, 0.9) * ws.ref_run_wall_s)
    train.wall_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # weights written but not the rest; complete but not renamed; renamed but older ones not yet pruned.
    for spec in ("in_checkpoint:2", "before_checkpoint_rename:1", "after_checkpoint_rename:3"):
        _attempt(ws, ckpt, f"SIGKILL at {spec}", env={KILL_AT_ENV: spec})
    ckpt.wall_s = time.perf_counter() - t0
    return [train, ckpt]


def full_disk(ws: Workspace) -> Row:
    row = Row("stage 2 full disk at a checkpoint", min_attempts=3)
    t0 = time.perf_counter()
    ckpt = sorted((ws.ref_run / "checkpoints").iterdir())[-1]
    size = (ckpt / "model.safetensors").stat().st_size
    # The kernel's own error: the first checkpoint's weights cannot be written (file-size limit).
    _attempt(ws, row, f"file-size limit {size // 2} B", fsize=size // 2, expect_code=2)
    # ... or the optimizer state, twice the weights' size (torch.save reports no errno of its own).
    _attempt(ws, row, f"file-size limit {size * 3 // 2} B", fsize=size * 3 // 2, expect_code=2)
    # The disk fills up between the second checkpoint's files: the first one stays the newest complete.
    _attempt(ws, row, "ENOSPC at before_checkpoint_rename:2", env={KILL_AT_ENV: "before_checkpoint_rename:2:enospc"},
             expect_code=2)
    # A real filesystem that holds one checkpoint but not two, grown afterwards (needs root; else skipped).
    mnt = ws.fresh("tmpfs")
    with small_filesystem(mnt, "700k") as grow:
        if grow is None:
            row.notes.append("small filesystem: cannot mount a tmpfs here (not root); skipped")
        else:
            _attempt(ws, row, "tmpfs of 700 kB filling up", out=mnt / "run", expect_code=2,
                     space_back=lambda: grow("8m"))
    row.wall_s = time.perf_counter() - t0
    return row


# -- one rank fails under torchrun ---------------------------------------------------------------------

def _torchrun(ws: Workspace, out: Path, fail_at: str) -> tuple[subprocess.CompletedProcess, float]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "pipeline.cli", "train-student", "--cache", str(ws.ref_cache), "--student-config",
            str(STUDENT_CONFIG), "--out", str(out),
            *flags(**(TRAIN | dict(batch_size=2, max_steps=50, checkpoint_every=0)))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "WANDISTILLER_FAIL_AT": fail_at}
    env.pop(KILL_AT_ENV, None)
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return proc, time.perf_counter() - t0


def rank_failure(ws: Workspace) -> Row:
    """One rank raises at a chosen step: the job ends (every rank) within 60 s, non-zero, and each failing
    rank's cause is printed by that rank exactly once (torchrun's own summary may quote it again)."""
    row = Row("rank failure under torchrun", min_attempts=2)
    t0 = time.perf_counter()
    cases = [("1:2:oom", 1, "error: out of memory in train-student"),
             ("0:3", 0, "error: RuntimeError: injected failure")]
    for fail_at, rank, cause in cases:
        out = ws.fresh("torchrun")
        before = tree_digest(ws.ref_cache)
        proc, wall = _torchrun(ws, out, fail_at)
        output = proc.stdout + proc.stderr
        problems = []
        if proc.returncode == 0:
            problems.append("torchrun exited 0")
        if wall > 60:
            problems.append(f"the job took {wall:.0f}s to end")
        # Lines the failing rank printed itself (torchrun's summary indents or wraps what it quotes).
        own = [ln for ln in output.splitlines() if ln.startswith(f"[rank {rank}] {cause}")]
        if len(own) != 1:
            problems.append(f"the cause is printed {len(own)} times by rank {rank}, expected once: {output[-3000:]}")
        if fail_at.endswith("oom") and not ("memory: peak host RSS" in output
                                            and "--gradient-checkpointing" in output):
            problems.append(f"the out-of-memory line gives no memory figures or remedy: {output[-3000:]}")
        if (out / "student").exists():
            problems.append("a student was saved")
        if tree_digest(ws.ref_cache) != before:
            problems.append("the cache changed")
        row.record(f"rank {rank} fails ({fail_at}) in {wall:.0f}s", problems)
    row.wall_s = time.perf_counter() - t0
    return row
