"""Where a cache stage one has not finished stands, and what finishes it (`cache info`'s lines, every reader's
refusal), from each part's progress record and stage-one lock: the words live here, `cache/` keeps to the format."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from cache.format import MANIFEST, PARTS_DIR
from cache.part_progress import PartProgress, list_parts
from cache.schema import recorded_steps
from cache.size import human

from . import lock

FINISHED, RUNNING, STOPPED, NOT_STARTED = "finished", "running", "stopped", "not started"


@dataclass
class PartStatus:
    """Where one part stands, from its progress record and its stage-one lock."""

    part: int
    state: str  # FINISHED, RUNNING (a live process holds its lock), STOPPED (neither), NOT_STARTED (no record)
    prompts: int | None = None  # the part's prompts (None: no progress record yet)
    prompts_done: int = 0  # prompts whose every trajectory is in a listed shard
    shards: int = 0
    samples: int = 0
    samples_total: int | None = None
    bytes: int = 0
    holder: dict | None = None  # the lock record (pid, host, since, started, command) of the process writing it


def parts_status(cache_dir: str | os.PathLike) -> tuple[int | None, list[PartStatus]]:
    """(the part count, None without records; the status of each part, and of any other with a record or writer)."""
    records = {p: PartProgress.load(cache_dir, p) for p in list_parts(cache_dir)}
    num_parts = max((r.num_parts for r in records.values()), default=None)
    live = lock.live_writers(cache_dir)
    numbers = sorted(set(range(num_parts or 0)) | set(records) | set(live))
    return num_parts, [_status(p, records.get(p), live.get(p)) for p in numbers]


def _status(part: int, prog: PartProgress | None, writer: dict | None) -> PartStatus:
    if prog is None:
        return PartStatus(part, RUNNING if writer is not None else NOT_STARTED, holder=writer)
    seeds = prog.header.seeds_per_prompt
    total = prog.prompts * seeds * len(recorded_steps(prog.header))
    samples = sum(int(s.samples) for s in prog.shards)
    prompts_done = prog.prompts if prog.complete else _prompts_done(prog, seeds)
    state = FINISHED if prog.complete else RUNNING if writer is not None else STOPPED
    return PartStatus(part, state, prog.prompts, prompts_done, len(prog.shards), samples, total,
                      sum(int(s.bytes) for s in prog.shards), holder=writer if state == RUNNING else None)


def _prompts_done(prog: PartProgress, seeds: int) -> int:
    """Prompts whose every trajectory lies in a done block, from the done blocks alone (whatever counts it claims)."""
    done, size = set(prog.done_blocks), prog.batch_size
    return sum(all(b in done for b in range(r * seeds // size, ((r + 1) * seeds - 1) // size + 1))
               for r in range(prog.prompts))


def describe(s: PartStatus, sizes: bool = False, eta: float | None = None) -> str:
    """One part in words: `part 1: stopped, 3 of 7 prompts, 2 shards` (`sizes`: its samples and bytes too)."""
    text = f"part {s.part}: {s.state}"  # (a part not started has no record, no holder and no ETA)
    if s.prompts is not None:
        text += f", {s.prompts_done} of {s.prompts} prompts, {s.shards} shard{'s' * (s.shards != 1)}"
        if sizes:
            text += f", {s.samples} of {s.samples_total} samples, {human(s.bytes)}"
    if s.holder:
        text += f" (pid {s.holder.get('pid')} on {s.holder.get('host')})"
    return text + (f", ETA {_duration(eta)}" if eta is not None else "")


def unfinished_problem(cache_dir: str | os.PathLike) -> str:
    """Why a cache with parts but no manifest cannot be read yet, naming each unfinished part and how to finish it."""
    num_parts, statuses = parts_status(cache_dir)
    head = f"{cache_dir} has no {MANIFEST}: stage one has not finished there"
    left = [s for s in statuses if s.state != FINISHED]
    if num_parts is not None and left:
        head += (f" ({len(statuses) - len(left)} of {num_parts} part{'s' * (num_parts != 1)} finished; "
                 f"{'; '.join(describe(s, eta=eta_s(cache_dir, s)) for s in left)})")
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


# -- `cache info` ------------------------------------------------------------------------------------------------

def summarize_unfinished(cache_dir: str | os.PathLike) -> dict | None:
    """What `cache info` prints of a cache stage one has not finished; None when it is finished (or no cache)."""
    cache_dir = Path(cache_dir)
    if (cache_dir / MANIFEST).exists() or not (cache_dir / PARTS_DIR).is_dir():
        return None
    num_parts, statuses = parts_status(cache_dir)
    clip = next((r.header.clip() for n in list_parts(cache_dir) if (r := PartProgress.load(cache_dir, n))), {})
    return {"cache": str(cache_dir), "finished": False, "num_parts": num_parts,
            "parts_finished": sum(s.state == FINISHED for s in statuses),
            "samples": sum(s.samples for s in statuses), **clip, "bytes": sum(s.bytes for s in statuses),
            "parts": [asdict(s) | {"eta_s": eta_s(cache_dir, s)} for s in statuses],
            "to_finish": to_finish(num_parts, statuses)}


def eta_s(cache_dir: str | os.PathLike, status: PartStatus) -> float | None:
    """Seconds left for a running part at its shards' rate (first to last: loading the teacher is left out), or None."""
    started = (status.holder or {}).get("started")
    prog = PartProgress.load(cache_dir, status.part) if status.state == RUNNING else None
    if prog is None or not isinstance(started, (int, float)):
        return None
    written = []
    for s in prog.shards:
        try:
            mtime = (Path(cache_dir) / s.path).stat().st_mtime
        except OSError:
            continue
        if mtime >= started:
            written.append((mtime, int(s.samples)))
    written.sort()
    if not written:
        return None
    span = written[-1][0] - written[0][0]  # (> 0: at least two shards)
    rate = (sum(n for _, n in written[1:]) / span if span > 0 else
            sum(n for _, n in written) / max(written[-1][0] - started, 1e-3))
    return (status.samples_total - status.samples) / rate if rate > 0 else None


def lines(info: dict) -> list[str]:
    """`summarize_unfinished`'s dict in words: a head line, a line per part, then how to finish it."""
    out = [f"{info['cache']}: unfinished, {info['parts_finished']} of {info['num_parts']} part(s) finished, "
           f"{info['samples']} samples{frames_words(info)} ({human(info['bytes'])}) so far"]
    for part in info["parts"]:
        status = PartStatus(**{k: v for k, v in part.items() if k != "eta_s"})
        out.append(f"  {describe(status, sizes=True, eta=part['eta_s'])}")
    out.append(f"to finish: {info['to_finish']}")
    return out


def frames_words(info: dict, lead: str = " of ") -> str:
    """`lead` and a video run's clip length as `plan`, `cache info` and `train-student --dry-run` say it, `9 frames (3
    latent)`, from a report holding its frames and latent_frames (`CacheHeader.clip`); '' for an image run."""
    return f"{lead}{info['frames']} frames ({info['latent_frames']} latent)" if info.get("latent_frames") else ""


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
