"""Stage one under faults: SIGKILL at named points and at random times, full disks and write errors.

Kills are chained in one cache folder, as on a cluster that preempts the same job again and again: each
run resumes what the killed one left. After every kill the folder must already be sound (every shard a
progress record lists is whole, nothing finished is dropped); after the last, a plain rerun must give
exactly the uninterrupted cache (same keys, equal tensors, same prompt store, a manifest that lists
exactly the shards on disk, no temporary file left).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from pipeline.faults import KILL_AT_ENV

from .check import compare_caches, manifest_problems, progress_problems, read_progress, temp_files
from .proc import run_cli, small_filesystem
from .report import Row
from .workspace import Workspace

POINTS = ("after_encode_rows", "mid_shard", "after_rename", "before_progress", "in_manifest")
# One chain through every named point; the counts make each run finish a shard or two before dying.
NAMED = ["after_encode_rows:1", "mid_shard:1", "after_rename:1", "before_progress:1", "mid_shard:2",
         "after_rename:2", "before_progress:3", "in_manifest:1"]


def _finished(cache: Path) -> dict[str, str]:
    """Shards the progress records call done: path -> checksum."""
    return {s["path"]: s["crc32c"] for p in read_progress(cache).values() for s in p["shards"]}


def _final_checks(ws: Workspace, out: Path) -> tuple[int, int, list[str]]:
    r = run_cli(ws.stage_one(out))
    if r.code != 0:
        return 0, 0, [f"the resume failed: {r.describe()}"]
    problems = manifest_problems(out) + [f"temporary file left: {t}" for t in temp_files(out)]
    lost, dup, diff = compare_caches(ws.ref_cache, out, ws.ref_samples)
    return lost, dup, problems + diff


def kill_chain(ws: Workspace, row: Row, plan: list[tuple[str, str | float]]) -> None:
    """Run stage one into one folder once per planned kill ("point:n" or a delay in seconds), then resume."""
    out = ws.fresh("killed")
    attempts: list[tuple[str, list[str]]] = []
    kept: dict[str, str] = {}
    for kind, what in plan:
        if kind == "point":
            r = run_cli(ws.stage_one(out), env={KILL_AT_ENV: what})
            label = f"SIGKILL at {what}"
        else:
            r = run_cli(ws.stage_one(out), kill_after_s=what)
            label = f"SIGKILL after {what:.2f}s"
        if not r.killed:
            if r.code == 0:
                row.notes.append(f"{label}: the run finished first (not counted)")
                continue
            attempts.append((label, [f"the run ended with exit {r.code} instead: {r.describe()}"]))
            continue
        problems = progress_problems(out)
        now = _finished(out)
        dropped = [p for p, sha in kept.items() if now.get(p) != sha]
        if dropped:
            problems.append(f"finished shard(s) dropped or rewritten: {dropped}")
        kept = now
        attempts.append((label, problems))
    lost, dup, final = _final_checks(ws, out)
    for label, problems in attempts:
        row.record(label, problems + final)
    # Lost and duplicated samples are a property of the chain's one final cache: count them once.
    row.lost += lost
    row.duplicated += dup
    if (lost or dup) and not final:
        row.failures.append(f"chain {[w for _, w in plan]}: {lost} lost, {dup} duplicated")


def named_points(ws: Workspace) -> Row:
    row = Row("stage 1 SIGKILL at named points", min_attempts=len(NAMED))
    t0 = time.perf_counter()
    kill_chain(ws, row, [("point", p) for p in NAMED])
    row.wall_s = time.perf_counter() - t0
    return row


def random_kills(ws: Workspace, rng: random.Random) -> Row:
    """Kills at random (point, count) pairs chained in one folder, then at random times, each of those in a
    fresh folder (a killed run leaves little work, so a second random delay would mostly land too late)."""
    row = Row("stage 1 SIGKILL at random moments", min_attempts=6)
    t0 = time.perf_counter()
    plan: list[tuple[str, str | float]] = [("point", f"{rng.choice(POINTS[1:4])}:{rng.randint(1, 2)}")
                                           for _ in range(5)]
    kill_chain(ws, row, plan + [("point", "in_manifest:1")])
    ws.ref_cache  # noqa: B018 - its wall time is the span the delays are drawn from
    for _ in range(3):
        kill_chain(ws, row, [("delay", rng.uniform(0.2, 1.0) * ws.ref_cache_wall_s)])
    row.wall_s = time.perf_counter() - t0
    return row


# -- full disks and write errors -----------------------------------------------------------------------

def _disk_attempt(ws: Workspace, row: Row, label: str, out: Path, first, resume=None,
                  says: str = "rerun the same command") -> None:
    """`first()` runs stage one into `out` under a full disk: it must stop with one line (containing `says`), exit
    2, nothing partial listed, no temporary file; then (space back) a plain rerun must give the uninterrupted
    cache."""
    r = first()
    problems = []
    if r.code != 2:
        problems.append(f"exit {r.code}, expected 2: {r.describe()}")
    errors = r.error_lines
    if len(errors) != 1 or says not in errors[0]:
        problems.append(f"expected one error line saying {says!r}, got {errors or r.err[-500:]!r}")
    if "Traceback" in r.err:
        problems.append("a traceback was printed")
    if out.exists():
        problems += progress_problems(out)
        problems += [f"temporary file left after the error: {t}" for t in temp_files(out)]
    if resume is not None:
        resume()
    lost, dup, final = _final_checks(ws, out)
    row.notes.append(f"{label}: {errors[0] if errors else r.describe()}")
    row.record(label, problems + final, lost, dup)


def _no_space(ws: Workspace, row: Row, spec: str) -> None:
    out = ws.fresh("enospc")
    _disk_attempt(ws, row, f"ENOSPC at {spec}", out,
                  lambda: run_cli(ws.stage_one(out), env={KILL_AT_ENV: f"{spec}:enospc"}))


def _file_size_limit(ws: Workspace, row: Row, limit: int) -> None:
    out = ws.fresh("efbig")
    _disk_attempt(ws, row, f"file-size limit {limit} B", out, lambda: run_cli(ws.stage_one(out), fsize=limit))


def full_disk(ws: Workspace) -> Row:
    row = Row("stage 1 full disk / write error", min_attempts=7)
    t0 = time.perf_counter()
    # The real kernel error: a file-size limit hits the first progress record (2 kB) or the first shard.
    for limit in (2_000, 30_000):
        _file_size_limit(ws, row, limit)
    # ENOSPC where a disk fills up between two files: at each step of a shard's life, and in the manifest.
    for spec in ("after_encode_rows:1", "mid_shard:3", "after_rename:2", "before_progress:1", "in_manifest:1"):
        _no_space(ws, row, spec)
    # A real small filesystem, smaller than the run's projected bytes: refused before anything is computed (the
    # projection is an upper bound, so a disk that passes it does not fill up; the kernel's own errors mid-run are
    # the file-size limits above), then grown and rerun (needs root to mount; else skipped).
    mnt = ws.fresh("tmpfs")
    with small_filesystem(mnt, "320k") as grow:
        if grow is None:
            row.notes.append("small filesystem: cannot mount a tmpfs here (not root); skipped")
        else:
            out = mnt / "cache"
            _disk_attempt(ws, row, "tmpfs of 320 kB, smaller than the run", out, lambda: run_cli(ws.stage_one(out)),
                          resume=lambda: grow("8m"), says="free space")
    row.wall_s = time.perf_counter() - t0
    return row
