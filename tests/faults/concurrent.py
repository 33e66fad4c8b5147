"""Two writers on one output folder: the second is refused (exit 2, one line naming the holder's lock), the first
is untouched and ends with exactly the uninterrupted result; a lock left by a SIGKILLed writer blocks no one.

The first writer is paused with SIGSTOP in the middle of its work (fault point `stop`), so the second always
starts while the first holds its lock, whatever the machine's speed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from pipeline.faults import KILL_AT_ENV

from .check import compare_caches, manifest_problems, temp_files, weights_equal
from .proc import Result, Running, run_cli, start_cli
from .report import Row
from .workspace import Workspace

WEIGHTS = "diffusion_pytorch_model.safetensors"


def _paused(first: Running, timeout_s: float = 300.0) -> list[str]:
    deadline = time.time() + timeout_s
    while not first.is_stopped():
        if not first.process.is_alive() or time.time() > deadline:
            return [f"the first writer never paused: {first.wait(1).describe()}"]
        time.sleep(0.05)
    return []


def _refused(second: Result, first: Running, lock_name: str) -> list[str]:
    if second.code != 2 or len(second.error_lines) != 1 or "Traceback" in second.err:
        return [f"the second writer was not refused with one line: {second.describe()}"]
    line = second.error_lines[0]
    if f"pid {first.pid}" not in line or lock_name not in line:
        return [f"the refusal does not name the holder (pid {first.pid}, {lock_name}): {line}"]
    return []


def _two_writers(row: Row, label: str, first_argv: list, second_argv: list, pause: str, lock_name: str,
                 check) -> None:
    first = start_cli(first_argv, env={KILL_AT_ENV: pause})
    problems = _paused(first)
    if not problems:
        second = run_cli(second_argv)
        problems += _refused(second, first, lock_name)
        row.notes.append(f"{label}: {second.error_lines[0] if second.error_lines else second.describe()}")
    os.kill(first.pid, signal.SIGCONT)  # also when it never paused: a no-op then
    r = first.wait()
    if r.code != 0:
        row.record(label, problems + [f"the first writer did not finish: {r.describe()}"])
        return
    lost, dup, more = check()
    row.record(label, problems + more, lost, dup)


def _cache_check(ws: Workspace, out: Path):
    def check():
        problems = manifest_problems(out) + [f"temporary file left: {t}" for t in temp_files(out)]
        if (out / "locks" / "part-00000.lock").exists():
            problems.append("the lock file was left behind by a run that finished")
        lost, dup, diff = compare_caches(ws.ref_cache, out, ws.ref_samples)
        return lost, dup, problems + diff
    return check


def _run_check(ws: Workspace, out: Path):
    def check():
        problems = [f"{n} differs from the uninterrupted run" for n in ("student", "student_ema")
                    if not weights_equal(out / n / WEIGHTS, ws.ref_run / n / WEIGHTS)]
        return 0, 0, problems
    return check


def concurrent_writers(ws: Workspace) -> Row:
    row = Row("concurrent writers on one --out", min_attempts=4)
    t0 = time.perf_counter()
    ws.ref_samples  # noqa: B018 - the references, built before the clock of each attempt
    lock1 = "locks/part-00000.lock"
    out = ws.fresh("two-writers")
    _two_writers(row, "stage 1: the same command twice", ws.stage_one(out), ws.stage_one(out), "mid_shard:1:stop",
                 lock1, _cache_check(ws, out))
    out = ws.fresh("two-writers-shards")
    _two_writers(row, "stage 1: a second run with other --samples-per-shard", ws.stage_one(out),
                 ws.stage_one(out, samples_per_shard=6), "mid_shard:1:stop", lock1, _cache_check(ws, out))
    # A writer SIGKILLed while holding its lock leaves the lock file: the rerun must take it at once.
    out = ws.fresh("stale-lock")
    r = run_cli(ws.stage_one(out), env={KILL_AT_ENV: "mid_shard:1"})
    problems = [] if r.killed and (out / lock1).exists() else [f"the kill did not land holding the lock: {r.describe()}"]
    r = run_cli(ws.stage_one(out))
    if r.code != 0:
        row.record("stage 1: rerun after a SIGKILL left the lock file", problems + [f"refused: {r.describe()}"])
    else:
        lost, dup, more = _cache_check(ws, out)()
        row.record("stage 1: rerun after a SIGKILL left the lock file", problems + more, lost, dup)
    ws.ref_run  # noqa: B018
    out = ws.fresh("two-trainers")
    _two_writers(row, "stage 2: a second run (--resume) on the same run folder", ws.train(out),
                 ws.train(out) + ["--resume"], "train_step:2:stop", "writer.lock", _run_check(ws, out))
    row.wall_s = time.perf_counter() - t0
    return row
