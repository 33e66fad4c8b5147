"""Per-part progress record: which trajectory blocks are done and which shards hold them.

`progress.json` is rewritten atomically after each shard is renamed into place, so every shard it lists
exists and is complete, and every block it calls done is inside a listed shard. A crash between the
rename and the rewrite leaves an unlisted shard, which the part's next run deletes and recomputes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .atomic import atomic_write_json
from .errors import CacheError, FormatVersionError
from .format import (
    F_FORMAT_VERSION, F_SEEDS_PER_PROMPT, FORMAT_VERSION, MANIFEST, PARTS_DIR, PROGRESS, S_BYTES, S_PATH, S_SAMPLES,
    part_dirname,
)
from .lock import LOCKS_DIR, holder
from .schema import recorded_steps


def check_version(path: Path, record: dict) -> None:
    """CacheError unless `record` (a manifest or a part's progress record, read from `path`) was written in this
    FORMAT_VERSION: a cache of another version is refused whole, never read in part."""
    version = record.get(F_FORMAT_VERSION)
    if version == FORMAT_VERSION:
        return
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise FormatVersionError(f"{path}: written by an older wandistiller (format {version}); rebuild it with teacher-cache")
    raise FormatVersionError(f"{path}: format {version!r}, this wandistiller reads format {FORMAT_VERSION}; rebuild it with "
                     "teacher-cache, or use the wandistiller that wrote it")


@dataclass
class PartProgress:
    """State of one part; see module docstring for the invariants."""

    part: int
    num_parts: int
    fingerprint: str
    prompts: int  # prompts in this part
    blocks: int  # trajectory blocks in this part
    batch_size: int  # trajectories per block: block ids mean nothing under another batch size
    samples_per_shard: int  # where shards close
    encoded: bool = False  # every prompt row of prompts.zarr written (and fsynced)
    negative_sha256: str | None = None  # of the part's negative.safetensors, written with it (None: not encoded yet)
    done_blocks: list[int] = field(default_factory=list)
    shards: list[dict] = field(default_factory=list)
    complete: bool = False
    header: dict = field(default_factory=dict)  # the run's manifest fields, identical in every part
    format_version: int = FORMAT_VERSION

    @staticmethod
    def path(cache_dir: str | os.PathLike, part: int) -> Path:
        return Path(cache_dir) / PARTS_DIR / part_dirname(part) / PROGRESS

    def save(self, cache_dir: str | os.PathLike) -> None:
        p = self.path(cache_dir, self.part)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(p, asdict(self))

    @classmethod
    def load(cls, cache_dir: str | os.PathLike, part: int) -> PartProgress | None:
        p = cls.path(cache_dir, part)
        if not p.exists():
            return None
        try:
            record = json.loads(p.read_text())
            if isinstance(record, dict):
                check_version(p, record)
            return cls(**record)
        except (json.JSONDecodeError, TypeError) as e:
            raise CacheError(f"{p} is unreadable ({e}); delete the part folder or rerun with --overwrite") from e


def list_parts(cache_dir: str | os.PathLike) -> list[int]:
    """Part numbers that have a progress record."""
    root = Path(cache_dir) / PARTS_DIR
    if not root.is_dir():
        return []
    parts = []
    for d in sorted(root.iterdir()):
        if d.name.startswith("part-") and (d / PROGRESS).exists():
            parts.append(int(d.name.split("-")[1]))
    return parts


# -- where an unfinished cache stands: `cache info`, and the refusal of every reader ------------------------------

FINISHED, RUNNING, STOPPED, NOT_STARTED = "finished", "running", "stopped", "not started"


@dataclass
class PartStatus:
    """Where one part stands, from its progress record and its stage-one lock (`lock.holder`: a live writer)."""

    part: int
    state: str  # FINISHED, RUNNING (a live process holds its lock), STOPPED (neither), NOT_STARTED (no record)
    prompts: int | None = None  # the part's prompts (None: no progress record yet)
    prompts_done: int = 0  # prompts whose every trajectory is in a listed shard
    shards: int = 0
    samples: int = 0
    samples_total: int | None = None
    bytes: int = 0
    eta_s: float | None = None  # running parts, from the shards their process wrote since it started
    holder: dict | None = None  # the lock record (pid, host, since, command) of the process writing it


def parts_status(cache_dir: str | os.PathLike) -> tuple[int | None, list[PartStatus]]:
    """(the run's part count, or None when no part has a record; the status of every part of that count and of any
    other part that has a record or a live writer)."""
    cache_dir = Path(cache_dir)
    records = {p: PartProgress.load(cache_dir, p) for p in list_parts(cache_dir)}
    counts = {r.num_parts for r in records.values()}
    num_parts = max(counts) if counts else None
    live = {}
    for path in sorted((cache_dir / LOCKS_DIR).glob("part-*.lock")):
        record = holder(path)
        if record is not None:
            live[int(path.stem.split("-")[1])] = record
    numbers = sorted(set(range(num_parts or 0)) | set(records) | set(live))
    return num_parts, [_status(cache_dir, p, records.get(p), live.get(p)) for p in numbers]


def _status(cache_dir: Path, part: int, prog: PartProgress | None, writer: dict | None) -> PartStatus:
    if prog is None:
        return PartStatus(part, RUNNING if writer is not None else NOT_STARTED, holder=writer)
    seeds = int(prog.header.get(F_SEEDS_PER_PROMPT, 1))
    total = prog.prompts * seeds * len(recorded_steps(prog.header))
    samples = sum(int(s[S_SAMPLES]) for s in prog.shards)
    done = set(prog.done_blocks)
    prompts_done = prog.prompts if prog.complete else sum(
        all((r * seeds + s) // prog.batch_size in done for s in range(seeds)) for r in range(prog.prompts))
    state = FINISHED if prog.complete else RUNNING if writer is not None else STOPPED
    status = PartStatus(part, state, prog.prompts, prompts_done, len(prog.shards), samples, total,
                        sum(int(s[S_BYTES]) for s in prog.shards), holder=writer if state == RUNNING else None)
    if state == RUNNING:
        status.eta_s = _eta(cache_dir, prog, writer, total - samples)
    return status


def _eta(cache_dir: Path, prog: PartProgress, writer: dict, left: int) -> float | None:
    """Seconds to write `left` more samples at the rate of the shards this process wrote since it started (between
    its first shard and its last: loading the teacher before the first does not count), or None before a shard."""
    started = writer.get("started")
    if not isinstance(started, (int, float)):
        return None
    written = []
    for s in prog.shards:
        try:
            mtime = (cache_dir / s[S_PATH]).stat().st_mtime
        except OSError:
            continue
        if mtime >= started:
            written.append((mtime, int(s[S_SAMPLES])))
    written.sort()
    if not written:
        return None
    span = written[-1][0] - written[0][0]
    if len(written) > 1 and span > 0:
        rate = sum(n for _, n in written[1:]) / span
    else:
        rate = sum(n for _, n in written) / max(written[-1][0] - started, 1e-3)
    return left / rate if rate > 0 else None


def describe(s: PartStatus, sizes: bool = False) -> str:
    """One part in words: `part 1: stopped, 3 of 7 prompts, 2 shards` (with `sizes`: its samples and bytes too)."""
    if s.state == NOT_STARTED:
        return f"part {s.part}: not started"
    text = f"part {s.part}: {s.state}"
    if s.prompts is not None:
        text += f", {s.prompts_done} of {s.prompts} prompts, {s.shards} shard{'s' * (s.shards != 1)}"
        if sizes:
            from .size import human  # (size.py reads progress records: imported here, not at load)

            text += f", {s.samples} of {s.samples_total} samples, {human(s.bytes)}"
    if s.holder:
        text += f" (pid {s.holder.get('pid')} on {s.holder.get('host')})"
    if s.eta_s is not None:
        text += f", ETA {_duration(s.eta_s)}"
    return text


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def unfinished_problem(cache_dir: str | os.PathLike) -> str:
    """Why a cache with parts but no manifest cannot be read yet, naming each unfinished part and how to finish it:
    what every reader (stage two, `cache verify`, eval) says instead of reading it."""
    num_parts, statuses = parts_status(cache_dir)
    head = f"{cache_dir} has no {MANIFEST}: stage one has not finished there"
    left = [s for s in statuses if s.state != FINISHED]
    if num_parts is not None and left:
        head += (f" ({len(statuses) - len(left)} of {num_parts} part{'s' * (num_parts != 1)} finished; "
                 f"{'; '.join(map(describe, left))})")
    elif num_parts is not None:
        head += f" (all {num_parts} parts are finished, the manifest is not written yet)"
    return f"{head}; {to_finish(num_parts, statuses)}"


def to_finish(num_parts: int | None, statuses: list[PartStatus]) -> str:
    """What finishes a cache whose parts stand as `statuses`: wait for the live ones, rerun the others."""
    rerun = "rerun the same `wandistiller teacher-cache` command"
    left = [s for s in statuses if s.state != FINISHED]
    if num_parts is None:
        return f"{rerun} to start it"
    if not left:
        return f"{rerun} (any part's) to write the manifest"
    idle = [s.part for s in left if s.state != RUNNING]
    if not idle:
        return f"wait for {'it' if len(left) == 1 else 'them'} (`wandistiller cache info` shows the ETA)"
    if num_parts == 1:
        return f"{rerun} to finish it"
    which = (f"--part {idle[0]} --num-parts {num_parts}" if len(idle) == 1 else
             f"--part P --num-parts {num_parts} for P in {', '.join(map(str, idle))}")
    return f"{rerun} with {which} (or the same torchrun, or SLURM array task) to finish it"
