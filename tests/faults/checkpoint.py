"""Stage two with damaged checkpoints: the newest one truncated, emptied, with a flipped byte in its weights,
without its digest record or with an empty trainer state; every checkpoint damaged; and checkpoints of the
previous version (no digest record at all).

One real run is SIGKILLed as its last step begins, leaving two checkpoints; each attempt damages a copy of
that run folder and runs `train-student --resume` in a real process. Read from outside (the warning and
resume lines, the weights with safetensors, the micro-batches of the debug record): a resume past damage
must print one warning line naming the damaged checkpoint and why, resume from the newest sound one (no
optimizer step lost beyond that fallback), end with the uninterrupted run's raw and EMA weights bit for
bit and train exactly the reference's micro-batches from there: none skipped, none twice. With every
checkpoint damaged it must exit 2 with one line naming each and the remedy, and change nothing.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.faults import KILL_AT_ENV

from .check import tree_digest, weights_equal
from .proc import Result, run_cli
from .report import Row
from .stage_two import DEBUG_ENV, WEIGHTS, _batch_accounting, _resumed_from
from .workspace import TRAIN, Workspace

DIGESTS = "digests.json"
LAST = TRAIN["max_steps"]  # the killed run dies as this step begins
# The checkpoints it leaves: every `checkpoint_every` steps before the last, the newest `keep_checkpoints`.
STEPS = list(range(TRAIN["checkpoint_every"], LAST, TRAIN["checkpoint_every"]))[-TRAIN["keep_checkpoints"]:]
NEWEST, OLDER = STEPS[-1], STEPS[-2]


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _flip_tensor_byte(path: Path) -> None:
    """Flip one bit in the middle of a safetensors file's tensor data (past its 8-byte length and JSON header):
    the file still parses, only the data is wrong."""
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[(start + len(data)) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _previous_version(ckpt: Path) -> None:
    """A checkpoint as the version before digest records wrote it: no record, no `digests` key in its state."""
    (ckpt / DIGESTS).unlink()
    state_path = ckpt / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state.pop("digests", None)
    state_path.write_text(json.dumps(state, indent=1) + "\n")


# (what, how, the reason the warning must give); each damages the newest checkpoint only.
DAMAGES: list[tuple[str, Callable[[Path], None], str]] = [
    ("model.safetensors truncated to half", lambda d: _truncate(d / "model.safetensors"),
     "model.safetensors: truncated"),
    ("optimizer.pt emptied", lambda d: _empty(d / "optimizer.pt"), "optimizer.pt: empty"),
    ("a byte flipped in model.safetensors' tensor data", lambda d: _flip_tensor_byte(d / "model.safetensors"),
     "model.safetensors: sha256 mismatch"),
    ("digests.json deleted", lambda d: (d / DIGESTS).unlink(), "digests.json: missing"),
    ("trainer_state.json emptied", lambda d: _empty(d / "trainer_state.json"), "trainer_state.json: empty"),
]


def _killed_run(ws: Workspace) -> tuple[Path | None, str]:
    out = ws.fresh("ckpt-killed")
    r = run_cli(ws.train(out), env={KILL_AT_ENV: f"train_step:{LAST}"})
    found = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []
    if r.code != -9 or found != [_name(s) for s in STEPS]:
        return None, f"the run to damage did not end as planned (checkpoints {found}): {r.describe()}"
    return out, ""


def _copy(ws: Workspace, killed: Path) -> Path:
    out = ws.fresh("ckpt")
    shutil.copytree(killed, out)
    return out


def _resume(ws: Workspace, out: Path) -> tuple[Result, Path]:
    debug = out.with_name(out.name + "-debug")
    return run_cli(ws.train(out) + ["--resume"], env={DEBUG_ENV: str(debug)}), debug


def _check_resumed(ws: Workspace, out: Path, r: Result, debug: Path, expect_from: int) -> tuple[int, int, list[str]]:
    """Lost, duplicated, problems of a resume that should have continued from checkpoint `expect_from`."""
    if r.code != 0:
        return 0, 0, [f"the resume failed: {r.describe()}"]
    problems = []
    start = _resumed_from(r)
    if start != expect_from:
        lost = f"{expect_from - start} optimizer step(s) lost beyond the fallback" if start is not None else "?"
        problems.append(f"resumed from step {start}, the newest sound checkpoint is step {expect_from} ({lost})")
    if "Traceback" in r.out + r.err:
        problems.append("a traceback was printed")
    for name in ("student", "student_ema"):
        if not weights_equal(out / name / WEIGHTS, ws.ref_run / name / WEIGHTS):
            problems.append(f"{name} differs from the uninterrupted run")
    lost, dup, acc = _batch_accounting(ws, debug, start or 0)
    return lost, dup, problems + acc


def _warnings(r: Result) -> list[str]:
    return [ln for ln in (r.out + r.err).splitlines() if "warning:" in ln]


def _damaged_newest(ws: Workspace, row: Row, killed: Path, what: str, damage, reason: str) -> None:
    out = _copy(ws, killed)
    damage(out / "checkpoints" / _name(NEWEST))
    r, debug = _resume(ws, out)
    lost, dup, problems = _check_resumed(ws, out, r, debug, OLDER)
    warnings = _warnings(r)
    want = (f"checkpoint {_name(NEWEST)} is damaged ({reason}", f"; resuming from {_name(OLDER)}")
    if len(warnings) != 1 or want[0] not in warnings[0] or not warnings[0].endswith(want[1]):
        problems.append(f"expected one warning line with {want[0]!r}...{want[1]!r}, got {warnings}")
    row.notes.append(f"{what}: {warnings[0] if warnings else r.describe()}")
    row.record(what, problems, lost, dup)


def _all_damaged(ws: Workspace, row: Row, killed: Path) -> None:
    what = "every checkpoint damaged"
    out = _copy(ws, killed)
    _flip_tensor_byte(out / "checkpoints" / _name(NEWEST) / "model.safetensors")
    _truncate(out / "checkpoints" / _name(OLDER) / "optimizer.pt")

    def state() -> list[str]:
        return [tree_digest(out / "checkpoints")] + [(out / n).read_text() for n in ("metrics.jsonl", "config.json")]

    before = state()
    r, _ = _resume(ws, out)
    problems = []
    if r.code != 2:
        problems.append(f"exit {r.code}, expected 2: {r.describe()}")
    line = r.error_lines[0] if r.error_lines else ""
    if len(r.error_lines) != 1 or "Traceback" in r.err:
        problems.append(f"expected one error line, got {r.err[-600:]!r}")
    for step, why in ((NEWEST, "model.safetensors: sha256 mismatch"), (OLDER, "optimizer.pt: truncated")):
        if f"{_name(step)} ({why}" not in line:
            problems.append(f"the error line does not name {_name(step)} ({why}): {line!r}")
    if "delete the damaged checkpoint folders" not in line:
        problems.append(f"the error line gives no remedy: {line!r}")
    if state() != before:
        problems.append("the refused resume changed the checkpoints, metrics.jsonl or config.json")
    if (out / "student").exists():
        problems.append("a student was saved")
    row.notes.append(f"{what}: {line or r.describe()}")
    row.record(what, problems)


def _previous_version_run(ws: Workspace, row: Row, killed: Path) -> None:
    """Checkpoints written before digests were recorded are not trusted: the resume is refused in one line that
    names each one's missing record, and nothing is changed (0.1 keeps no branch for them)."""
    what = "checkpoints of the previous version (no digest record)"
    out = _copy(ws, killed)
    for step in STEPS:
        _previous_version(out / "checkpoints" / _name(step))

    def state() -> list[str]:
        return [tree_digest(out / "checkpoints")] + [(out / n).read_text() for n in ("metrics.jsonl", "config.json")]

    before = state()
    r, _ = _resume(ws, out)
    line = r.error_lines[0] if r.error_lines else ""
    problems = [] if r.code == 2 else [f"exit {r.code}, expected 2: {r.describe()}"]
    if len(r.error_lines) != 1 or "Traceback" in r.err:
        problems.append(f"expected one error line, got {r.err[-600:]!r}")
    if f"{_name(NEWEST)} (digests.json: missing" not in line:
        problems.append(f"the error line does not name {_name(NEWEST)}'s missing digest record: {line!r}")
    if state() != before or (out / "student").exists():
        problems.append("the refused resume changed the run folder")
    row.notes.append(f"{what}: {line or r.describe()}")
    row.record(what, problems)


def checkpoint_corruption(ws: Workspace) -> Row:
    """The `checkpoint-corrupt` row: a damaged newest checkpoint in every way of DAMAGES, every checkpoint
    damaged, and checkpoints of the previous version."""
    ws.ref_batches  # noqa: B018 - the uninterrupted run, built first
    row = Row("stage 2 checkpoint corruption", min_attempts=len(DAMAGES) + 2)
    t0 = time.perf_counter()
    killed, why = _killed_run(ws)
    if killed is None:
        row.record("the run to damage", [why])
    else:
        for what, damage, reason in DAMAGES:
            _damaged_newest(ws, row, killed, what, damage, reason)
        _all_damaged(ws, row, killed)
        _previous_version_run(ws, row, killed)
    row.wall_s = time.perf_counter() - t0
    return row
