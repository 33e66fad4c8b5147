"""Stage one's output directory: refuse what is not a cache, clear on --overwrite, tidy what a crash left.

Only names the cache owns are ever deleted (cache/format.py defines them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cache import format as F
from cache.format import LOCKS_DIR
from cache.manifest import manifest_path
from cache.progress import PartProgress
from pipeline.errors import UserError
from pipeline.runtime import print0

# What a cache directory may hold: anything else means --out is someone else's folder.
CACHE_ENTRIES = {F.MANIFEST, F.PARTS_DIR, F.SHARDS_DIR, F.NEGATIVE, F.FEATURE_PROJECTION, F.RESOLVED_CONFIG, "offload",
                 LOCKS_DIR}


def refuse_foreign(out: Path) -> None:
    """One clear error unless `out` is new, empty, or a cache (checked without writing: `--dry-run` too)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if p.name not in CACHE_ENTRIES and not p.name.endswith(F.TMP_SUFFIX)]
        if foreign:
            raise UserError(f"output {out} is not empty and is not a WanDistiller cache (found {foreign[0]!r}); "
                            "choose a new or empty directory")


def check_out_dir(out: Path) -> None:
    """A new, empty, or cache directory we can write to; else one clear error."""
    refuse_foreign(out)
    try:
        (out / F.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}{F.TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output directory {out} ({e.strerror}); choose a writable --out") from e


def clear(out: Path, part: int | None) -> None:
    """Remove cache files: all of them (part None) or one part's. Only names the cache owns are touched."""
    manifest_path(out).unlink(missing_ok=True)
    if part is None:
        for name in (F.PARTS_DIR, F.SHARDS_DIR, "offload"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / F.NEGATIVE).unlink(missing_ok=True)
        (out / F.FEATURE_PROJECTION).unlink(missing_ok=True)
        (out / F.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        return
    shutil.rmtree(out / F.PARTS_DIR / F.part_dirname(part), ignore_errors=True)
    for f in (out / F.SHARDS_DIR).glob(f"part-{part:05d}-*"):
        f.unlink()


def drop_orphans(out: Path, prog: PartProgress, owns_root: bool) -> None:
    """Delete what a crash of this part left half done: its shards that progress does not list (temporary,
    or renamed just before the crash) and the temporary files of its atomic writes (progress record,
    negative embedding, zarr chunks). Root files (manifest, negative) only when no other part writes
    them meanwhile (`owns_root`): a part on another node may be renaming its manifest right now."""
    listed = {s[F.S_PATH] for s in prog.shards}
    for f in (out / F.SHARDS_DIR).glob(f"part-{prog.part:05d}-*"):
        if f"{F.SHARDS_DIR}/{f.name}" not in listed:
            f.unlink()
    part_dir = out / F.PARTS_DIR / F.part_dirname(prog.part)
    stale = [*part_dir.glob(f"*{F.TMP_SUFFIX}"), *(part_dir / F.PROMPTS_ZARR).rglob("*.partial")]
    if owns_root:
        stale += [*out.glob(f"{F.MANIFEST}.*{F.TMP_SUFFIX}"), *out.glob(f"{F.NEGATIVE}.*{F.TMP_SUFFIX}")]
    for f in stale:
        f.unlink(missing_ok=True)


def forget_lost_shards(out: Path, prog: PartProgress) -> None:
    """Shards this part lists that are gone or have another size (deleted to be rebuilt, as `cache verify` and
    stage two advise for a corrupt shard): forget them and their blocks, so this run computes them again.
    Only existence and size are checked here (a stat per shard); `cache verify` re-checksums."""
    lost = [s for s in prog.shards
            if not (out / s[F.S_PATH]).is_file() or (out / s[F.S_PATH]).stat().st_size != s[F.S_BYTES]]
    if not lost:
        return
    blocks = {b for s in lost for b in s[F.S_BLOCKS]}
    more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
    print0(f"part {prog.part}: shard {lost[0][F.S_PATH]}{more} missing or damaged; recomputing {len(blocks)} block(s)")
    manifest_path(out).unlink(missing_ok=True)  # it lists them; rewritten once every part is complete again
    prog.shards = [s for s in prog.shards if s not in lost]
    prog.done_blocks = sorted(set(prog.done_blocks) - blocks)
    prog.complete = False
    prog.save(out)


def next_shard_index(prog: PartProgress) -> int:
    """One past the highest shard number of the part (not the count: a recomputed shard gets a new name)."""
    return 1 + max((int(Path(s[F.S_PATH]).stem.rsplit("-", 1)[1]) for s in prog.shards), default=-1)
