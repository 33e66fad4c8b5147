"""`cache verify`: check every byte a stage reads against what stage one recorded.

safetensors is not a checksum: a flipped bit inside tensor data still parses. The checksum of each shard
(its crc32c, recorded while it was written; its sha256 in caches written before: `checksum.ShardDigest`)
catches that; the member walk catches truncation and missing members,
and each sample is checked against the declared schema (schema.py), as stage two's reader checks it. The
manifest's settings must hash to its fingerprint and its shard paths stay inside the cache; negative.safetensors
must match the sha256 the manifest records; every chunk of the prompt stores must match its crc32c, every row's
real tokens theirs, and no chunk holding them may be missing (`prompt_store.prompt_row_problems`). What a cache
written by an earlier WanDistiller records no checksum for is a note, not a problem.
"""

from __future__ import annotations

import logging
import os
import tarfile
from pathlib import Path

from safetensors.torch import load as st_load
from tqdm.auto import tqdm

from . import format as F
from .errors import CacheError
from .features import read_projection
from .manifest import load_manifest, negative_problem, settings_checkable, settings_problem
from .prompt_store import prompt_row_problems
from .reader import ShardStream, decode_sample
from .schema import recorded_steps, sample_problems

log = logging.getLogger(__name__)


def _check_shard(cache_dir: Path, rec: dict, m: dict, seen: set[str]) -> list[str]:
    rel = rec[F.S_PATH]
    path = cache_dir / rel
    if not path.is_file():
        return [f"{rel}: missing"]
    problems = []
    size = path.stat().st_size
    if size != rec[F.S_BYTES]:
        problems.append(f"{rel}: {size} bytes on disk, manifest says {rec[F.S_BYTES]} (truncated or replaced)")
    stream, count = ShardStream(cache_dir, rec), 0
    try:
        for members in stream:
            count += 1
            key = members["__key__"]
            found = {k for k in members if not k.startswith("__")}
            if found != {F.EXT_TENSORS, F.EXT_META}:
                problems.append(f"{rel}: sample {key} has members {sorted(found)}, expected json and safetensors")
                continue
            try:
                tensors, meta = decode_sample(members)
            except Exception as e:  # any parse failure of a member is corruption
                problems.append(f"{rel}: sample {key} does not decode ({type(e).__name__}: {e})")
                continue
            problems += [f"{rel}: {p}" for p in sample_problems(key, tensors, meta, m)]
            if key in seen:
                problems.append(f"{rel}: sample {key} appears in more than one place")
            seen.add(key)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        return problems + [f"{rel}: unreadable tar ({e})"]
    if size == rec[F.S_BYTES] and not stream.digest.matches(rec):
        problems.append(f"{rel}: {stream.digest.name} mismatch (content changed after it was written)")
    if count != rec[F.S_SAMPLES]:
        problems.append(f"{rel}: {count} samples, manifest says {rec[F.S_SAMPLES]}")
    return problems


def verify_cache(cache_dir: str | os.PathLike, progress: bool = True, notes: list[str] | None = None) -> list[str]:
    """All problems found in the cache (empty list = sound). What the cache records no checksum for (written by an
    earlier WanDistiller) is appended to `notes`, or logged as a warning ("NOTE ...") when `notes` is None."""
    cache_dir = Path(cache_dir)
    said = [] if notes is None else notes
    try:
        problems = _verify(cache_dir, progress, said)
    finally:
        if notes is None:
            for n in said:
                log.warning(f"NOTE {n}")
    return problems


def _verify(cache_dir: Path, progress: bool, notes: list[str]) -> list[str]:
    try:
        m = load_manifest(cache_dir)  # (refuses shard paths outside the cache)
    except CacheError as e:
        return [str(e)]
    problems: list[str] = []
    if not settings_checkable(m):
        notes.append(f"{F.MANIFEST} records no {F.F_TEACHER_IDENTITY} (written by an earlier WanDistiller): its "
                     "settings were not checked against its fingerprint")
    elif (problem := settings_problem(cache_dir, m)) is not None:
        problems.append(problem)
    seen: set[str] = set()
    for rec in tqdm(m[F.F_SHARDS], desc="verify shards", unit="shard", disable=not progress):
        problems += _check_shard(cache_dir, rec, m, seen)
    total = sum(r[F.S_SAMPLES] for r in m[F.F_SHARDS])
    if total != m[F.F_SAMPLES]:
        problems.append(f"{F.MANIFEST}: samples {m[F.F_SAMPLES]} but its shards hold {total}")
    expected = m[F.F_PROMPTS] * m[F.F_SEEDS_PER_PROMPT] * len(recorded_steps(m))
    if total != expected:
        problems.append(f"{F.MANIFEST}: {total} samples listed, {expected} expected "
                        f"(prompts x seeds x recorded steps); the cache is incomplete")
    problems += _check_negative(cache_dir, m, notes)
    if m.get(F.F_RECORD_FEATURES):
        try:
            read_projection(cache_dir, m.get(F.F_FEATURE_PROJECTION_SHA256))
        except CacheError as e:
            problems.append(f"{F.FEATURE_PROJECTION}: {e}")
    return problems + prompt_row_problems(cache_dir, m[F.F_NUM_PARTS], m[F.F_PROMPTS], final_latents=True,
                                          checksums=True, notes=notes, progress=progress)


def _check_negative(cache_dir: Path, m: dict, notes: list[str]) -> list[str]:
    path = cache_dir / F.NEGATIVE
    if not path.is_file():
        return [f"{F.NEGATIVE}: missing"]
    problem = negative_problem(cache_dir, m, relative=True)
    if problem is not None:
        return [problem]
    if F.F_NEGATIVE_SHA256 not in m:
        notes.append(f"{F.MANIFEST} records no {F.F_NEGATIVE_SHA256} (written by an earlier WanDistiller): "
                     f"{F.NEGATIVE} was checked to decode only")
    try:
        if F.NEG_EMBEDS not in st_load(path.read_bytes()):
            return [f"{F.NEGATIVE}: holds no {F.NEG_EMBEDS!r} tensor"]
    except Exception as e:  # any parse failure is corruption
        return [f"{F.NEGATIVE}: does not decode ({type(e).__name__}: {e})"]
    return []
