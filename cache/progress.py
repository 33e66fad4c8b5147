"""Per-part progress record: which trajectory blocks are done and which shards hold them.

`progress.json` is rewritten atomically after each shard is renamed into place, so every shard it lists
exists and is complete, and every block it calls done is inside a listed shard. A crash between the
rename and the rewrite leaves an unlisted shard, which the part's next run deletes and recomputes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .atomic import atomic_write_json
from .errors import CacheError, FormatVersionError
from .format import F_FORMAT_VERSION, FORMAT_VERSION, LOCKS_DIR, PARTS_DIR, PROGRESS, part_dirname


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


# -- who writes a part now: read by `cache info` and by every reader's refusal of an unfinished cache -------------

def live_writers(cache_dir: str | os.PathLike) -> dict[int, dict]:
    """{part: the lock record of the live process writing it}, for each stage-one lock in LOCKS_DIR held now."""
    live = {}
    for path in sorted((Path(cache_dir) / LOCKS_DIR).glob("part-*.lock")):
        record = live_writer(path)
        if record is not None:
            live[int(path.stem.split("-")[1])] = record
    return live


def live_writer(path: str | os.PathLike) -> dict | None:
    """The record of the live process holding the stage-one lock `path` (pid, host, since, started, command, as
    pipeline/lock.py writes it; {} if not written yet), or None when no process holds it: a lock file a killed writer
    left behind is not a live run. Probed with a shared flock taken and dropped at once (which sees holders on other
    NFS clients too), never by the file's existence or a pid, which say nothing across hosts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)  # dropped at once: a writer that meets it retries (pipeline/lock.py)
        return None
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        try:
            record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        except ValueError:
            record = {}
        return record if isinstance(record, dict) else {}
    finally:
        os.close(fd)
