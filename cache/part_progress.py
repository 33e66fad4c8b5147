"""Per-part progress record (`progress.json`): which trajectory blocks are done and which shards hold them;
rewritten atomically after each shard is in place (docs/reliability.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_write_json
from .cache_error import CacheError
from .format import FORMAT_VERSION, PARTS_DIR, PROGRESS, part_dirname
from .safe_open import read_bytes
from .records import CacheHeader, Record, ShardRecord, check_version, parts_problem, shard_problem


@dataclass(kw_only=True)
class PartProgress(Record):
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
    shards: list[ShardRecord] = field(default_factory=list)
    complete: bool = False
    header: CacheHeader  # the run's settings, identical in every part
    format_version: int = FORMAT_VERSION

    NESTED = {"header": (CacheHeader, "its header: "), "shards": (ShardRecord, "a shard record: ")}

    @staticmethod
    def path(cache_dir: str | os.PathLike, part: int) -> Path:
        return Path(cache_dir) / PARTS_DIR / part_dirname(part) / PROGRESS

    def save(self, cache_dir: str | os.PathLike) -> None:
        p = self.path(cache_dir, self.part)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(p, self.to_json())

    @classmethod
    def problem(cls, obj, where: str = "") -> str | None:
        problem = super().problem(obj, where) or parts_problem(obj["num_parts"], obj["header"]["prompts"])
        if problem is None and obj["part"] >= obj["num_parts"]:
            problem = f"its part {obj['part']} is not below its field 'num_parts' {obj['num_parts']}"
        if problem is None and any(b >= obj["blocks"] for b in obj["done_blocks"]):
            problem = f"its field 'done_blocks' lists blocks past its {obj['blocks']} blocks"
        return problem

    @classmethod
    def load(cls, cache_dir: str | os.PathLike, part: int) -> PartProgress | None:
        """The part's record, None where it has none; CacheError for one that is not a sound record (`safe_open`,
        `Record.problem`, `shard_problem`)."""
        p, rel = cls.path(cache_dir, part), f"{PARTS_DIR}/{part_dirname(part)}/{PROGRESS}"
        try:
            record = json.loads(read_bytes(cache_dir, rel))
        except FileNotFoundError:
            return None
        except CacheError:
            raise  # a link or a FIFO (`safe_open`): its own line
        except (ValueError, OSError, RecursionError) as e:
            raise CacheError(f"{p} is unreadable ({e}); delete the part folder or rerun with --overwrite") from e
        if isinstance(record, dict):
            check_version(p, record)
        problem = cls.problem(record)
        prog = cls._build(record) if problem is None else None
        problem = problem or shard_problem(prog.shards, cache_dir, prog.num_parts, prog.part)
        if problem is None:
            return prog
        raise CacheError(f"{p}: {problem}; delete {p.parent} and rerun the same `wandistiller teacher-cache` command "
                         "(that part is computed again), or rerun it with --overwrite")


def list_parts(cache_dir: str | os.PathLike) -> list[int]:
    """Part numbers that have a progress record."""
    root = Path(cache_dir) / PARTS_DIR
    if not root.is_dir():
        return []
    return [int(d.name.split("-")[1]) for d in sorted(root.iterdir())
            if d.name.startswith("part-") and (d / PROGRESS).exists()]
