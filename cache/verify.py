"""`cache verify`: check every byte a stage reads against what stage one recorded (docs/architecture.md, "The
cache", Checksums). safetensors is not a checksum: a flipped bit inside tensor data still parses."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from safetensors.torch import load as st_load
from tqdm.auto import tqdm

from . import format as F
from .cache_error import CacheError, FormatVersionError, UnsafeFileError
from .feature_projection import read_projection
from .manifest import load_manifest, negative_problem, settings_problem
from .reader import ShardStream, decode_sample
from .safe_open import open_fd, read_bytes
from .schema import recorded_steps, sample_problems
from .store_checks import count_problem, prompt_row_problems, store_problem


def _check_shard(cache_dir: Path, rec: dict, m: dict, seen: set[str]) -> list[str]:
    rel = rec.path
    try:  # (a link or a FIFO: UnsafeFileError, the whole cache refused)
        fd = open_fd(cache_dir, rel)
    except FileNotFoundError:
        return [f"{rel}: missing"]
    size = os.fstat(fd).st_size
    os.close(fd)
    problems = [] if size == rec.bytes else [f"{rel}: {size} bytes on disk, manifest says {rec.bytes} (truncated or "
                                             "replaced)"]
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
    except UnsafeFileError:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        return problems + [f"{rel}: unreadable tar ({e})"]
    if size == rec.bytes and not stream.matches():
        problems.append(f"{rel}: crc32c mismatch (content changed after it was written)")
    if count != rec.samples:
        problems.append(f"{rel}: {count} samples, manifest says {rec.samples}")
    return problems


def verify_cache(cache_dir: str | os.PathLike, progress: bool = True) -> list[str]:
    """All problems found in the cache (empty list = sound): every file of this format version has its checksum."""
    cache_dir = Path(cache_dir)
    try:
        m = load_manifest(cache_dir)  # (refuses shard paths outside the cache)
    except (FormatVersionError, UnsafeFileError):
        raise  # not a problem of this cache's bytes: another version, or links and FIFOs, refused whole (exit 2)
    except CacheError as e:
        return [str(e)]
    if problem := count_problem(cache_dir, m):  # nothing of it can be checked against the manifest: refused whole
        raise CacheError(problem)
    store = store_problem(cache_dir, m)  # (the rows of a store of another shape are not read: terabytes)
    problems = [p for p in [settings_problem(cache_dir, m), store] if p is not None]
    seen: set[str] = set()
    for rec in tqdm(m.shards, desc="verify shards", unit="shard", disable=not progress):
        problems += _check_shard(cache_dir, rec, m, seen)
    total = sum(r.samples for r in m.shards)
    if total != m.samples:
        problems.append(f"{F.MANIFEST}: samples {m.samples} but its shards hold {total}")
    expected = m.prompts * m.seeds_per_prompt * len(recorded_steps(m))
    if total != expected:
        problems.append(f"{F.MANIFEST}: {total} samples listed, {expected} expected "
                        f"(prompts x seeds x recorded steps); the cache is incomplete")
    problems += _check_negative(cache_dir, m)
    if m.record_features:
        try:
            read_projection(cache_dir, m.feature_projection_sha256)
        except CacheError as e:
            problems.append(f"{F.FEATURE_PROJECTION}: {e}")
    if store is None:
        problems += prompt_row_problems(cache_dir, m.num_parts, m.prompts, checksums=True, progress=progress)
    return problems


def _check_negative(cache_dir: Path, m: dict) -> list[str]:
    try:
        data = read_bytes(cache_dir, F.NEGATIVE)
    except FileNotFoundError:
        return [f"{F.NEGATIVE}: missing"]
    if (problem := negative_problem(cache_dir, m, relative=True)) is not None:
        return [problem]
    try:
        if F.NEG_EMBEDS not in st_load(data):
            return [f"{F.NEGATIVE}: holds no {F.NEG_EMBEDS!r} tensor"]
    except Exception as e:  # any parse failure is corruption
        return [f"{F.NEGATIVE}: does not decode ({type(e).__name__}: {e})"]
    return []
