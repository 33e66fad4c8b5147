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
from .cache_error import CacheError, FormatVersionError
from .format import F_FORMAT_VERSION, FORMAT_VERSION, PARTS_DIR, PROGRESS, part_dirname
from .safe_open import read_bytes
from .schema import record_problem


def check_version(path: Path, record: dict) -> None:
    """CacheError unless `record` (a manifest or a part's progress record, read from `path`) was written in this
    FORMAT_VERSION: a cache of another version is refused whole, never read in part."""
    version = record.get(F_FORMAT_VERSION)
    if version == FORMAT_VERSION:
        return
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise FormatVersionError(f"{path}: written by an older wandistiller (format {version}); rebuild it with "
                                 "teacher-cache")
    raise FormatVersionError(f"{path}: format {version!r}, this wandistiller reads format {FORMAT_VERSION}; rebuild "
                             "it with teacher-cache, or use the wandistiller that wrote it")


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
        """The part's record, None where it has none; CacheError for one that is not a sound record (`safe_open`,
        `schema.record_problem`)."""
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
        try:
            problem = record_problem(record, "progress", cache_dir)
            if problem is None:
                return cls(**record)
        except TypeError as e:  # a field no record has
            problem = str(e).replace("__init__() ", "")
        raise CacheError(f"{p}: {problem}; delete {p.parent} and rerun the same `wandistiller teacher-cache` command "
                         "(that part is computed again), or rerun it with --overwrite")


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
