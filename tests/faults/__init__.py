"""The fault-tolerance suite: kills, corruption, full disks and bad input, counted.

`python -m tests.faults` (or `make faults`) runs every scenario and prints one table row per kind of
fault: attempts, how many survived, samples lost and samples duplicated. tests/test_faults.py runs the
same scenarios under pytest and asserts that every attempt survived with nothing lost or duplicated.
What the suite checks is written down in docs/reliability.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from . import bad_input, concurrent, corrupt, hostile, sigterm, stage_one, stage_two, trust
from .checkpoint import checkpoint_corruption
from .proc import warm_up
from .report import FAULT_ROWS, Row, render
from .workspace import Workspace

# name -> scenario(workspace, rng) -> rows. Each builds what it needs; the references are shared.
SCENARIOS: dict[str, Callable[[Workspace, random.Random], list[Row]]] = {
    "stage1-kill": lambda ws, rng: [stage_one.named_points(ws), stage_one.random_kills(ws, rng)],
    "stage1-disk": lambda ws, rng: [stage_one.full_disk(ws)],
    "stage2-kill": stage_two.kills,
    "stage2-disk": lambda ws, rng: [stage_two.full_disk(ws)],
    "stage1-sigterm": lambda ws, rng: [sigterm.stage_one(ws, rng)],
    "stage2-sigterm": lambda ws, rng: [sigterm.stage_two(ws, rng)],
    "sigterm-torchrun": lambda ws, rng: [sigterm.torchrun(ws, rng)],
    "checkpoint-corrupt": lambda ws, rng: [checkpoint_corruption(ws)],
    "corrupt": lambda ws, rng: [corrupt.corrupt_caches(ws)],
    "rank-failure": lambda ws, rng: [stage_two.rank_failure(ws)],
    "bad-input": lambda ws, rng: [bad_input.bad_inputs(ws)],
    "config-types": lambda ws, rng: [bad_input.config_types(ws)],
    "concurrent": lambda ws, rng: [concurrent.concurrent_writers(ws)],
    "hostile": lambda ws, rng: hostile.hostile_inputs(ws),
    "hostile-folders": lambda ws, rng: trust.hostile_folders(ws),
}


def run(names: list[str], root: Path, teacher: Path | None = None, seed: int = 0, log=print) -> list[Row]:
    """Run the named scenarios in `root`; returns their rows (the table is `render(rows)`)."""
    ws = Workspace(root, teacher)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    log(f"faults: starting the command server (torch, diffusers imported once): {warm_up():.1f}s")
    rows: list[Row] = []
    for name in names:
        t = time.perf_counter()
        new = SCENARIOS[name](ws, rng)
        rows += new
        log(f"faults: {name}: {sum(r.attempts for r in new)} attempt(s), "
            f"{sum(r.survived for r in new)} survived, {time.perf_counter() - t:.0f}s")
    log(f"faults: {time.perf_counter() - t0:.0f}s in all")
    return rows


__all__ = ["FAULT_ROWS", "SCENARIOS", "Row", "Workspace", "render", "run"]
