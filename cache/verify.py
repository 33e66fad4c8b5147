"""`cache verify`: re-hash every shard and check what the manifest promises, sample by sample.

safetensors is not a checksum: a flipped bit inside tensor data still parses. The sha256 of each shard
(recorded while it was written) catches that; the member walk catches truncation and missing members.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from . import format as F
from .errors import CacheError
from .manifest import load_manifest
from .prompt_store import open_prompt_store, prompt_store_path
from .writer import decode_sample

_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_shard(cache_dir: Path, rec: dict, m: dict, seen: set[str]) -> list[str]:
    rel = rec[F.S_PATH]
    path = cache_dir / rel
    if not path.is_file():
        return [f"{rel}: missing"]
    problems = []
    size = path.stat().st_size
    if size != rec[F.S_BYTES]:
        problems.append(f"{rel}: {size} bytes on disk, manifest says {rec[F.S_BYTES]} (truncated or replaced)")
    elif _sha256(path) != rec[F.S_SHA256]:
        problems.append(f"{rel}: sha256 mismatch (content changed after it was written)")
    shape, dtype = list(m[F.F_LATENT_SHAPE]), m[F.F_DTYPE]
    members: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                key, _, ext = info.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(info).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        return problems + [f"{rel}: unreadable tar ({e})"]
    if len(members) != rec[F.S_SAMPLES]:
        problems.append(f"{rel}: {len(members)} samples, manifest says {rec[F.S_SAMPLES]}")
    for key, mem in members.items():
        if set(mem) != {F.EXT_TENSORS, F.EXT_META}:
            problems.append(f"{rel}: sample {key} has members {sorted(mem)}, expected json and safetensors")
            continue
        try:
            tensors, meta = decode_sample(mem)
        except Exception as e:  # any parse failure of a member is corruption
            problems.append(f"{rel}: sample {key} does not decode ({type(e).__name__}: {e})")
            continue
        for name in (F.T_X_T, F.T_TARGET):
            t = tensors.get(name)
            if t is None:
                problems.append(f"{rel}: sample {key} lacks tensor {name}")
            elif list(t.shape) != shape or F.DTYPE_NAMES.get(t.dtype) != dtype:
                problems.append(f"{rel}: sample {key} {name} is {F.DTYPE_NAMES.get(t.dtype)} {list(t.shape)}, "
                                f"expected {dtype} {shape}")
        try:
            if F.parse_key(key) != (meta[F.M_PROMPT_IDX], meta[F.M_SEED_IDX], meta[F.M_STEP]):
                problems.append(f"{rel}: sample {key} metadata names another sample")
        except (ValueError, KeyError) as e:
            problems.append(f"{rel}: sample {key} has bad key or metadata ({e})")
        if key in seen:
            problems.append(f"{rel}: sample {key} appears in more than one place")
        seen.add(key)
    return problems


def verify_cache(cache_dir: str | os.PathLike, progress: bool = True) -> list[str]:
    """All problems found in the cache (empty list = sound)."""
    cache_dir = Path(cache_dir)
    try:
        m = load_manifest(cache_dir)
    except CacheError as e:
        return [str(e)]
    problems: list[str] = []
    seen: set[str] = set()
    for rec in tqdm(m[F.F_SHARDS], desc="verify shards", unit="shard", disable=not progress):
        problems += _check_shard(cache_dir, rec, m, seen)
    total = sum(r[F.S_SAMPLES] for r in m[F.F_SHARDS])
    if total != m[F.F_SAMPLES]:
        problems.append(f"{F.MANIFEST}: samples {m[F.F_SAMPLES]} but its shards hold {total}")
    expected = m[F.F_PROMPTS] * m[F.F_SEEDS_PER_PROMPT] * m[F.F_STEPS]
    if total != expected:
        problems.append(f"{F.MANIFEST}: {total} samples listed, {expected} expected "
                        f"(prompts x seeds x steps); the cache is incomplete")
    if not (cache_dir / F.NEGATIVE).is_file():
        problems.append(f"{F.NEGATIVE}: missing")
    n_parts = m[F.F_NUM_PARTS]
    for part in range(n_parts):
        path = prompt_store_path(cache_dir, part)
        rel = path.relative_to(cache_dir)
        try:
            g = open_prompt_store(path)
            seq = g[F.Z_SEQ_LENS][:]
            idx = g[F.Z_PROMPT_IDX][:]
            final = g[F.Z_FINAL_LATENTS]
        except Exception as e:  # missing or unreadable store
            problems.append(f"{rel}: unreadable ({type(e).__name__}: {e})")
            continue
        want = np.arange(part, m[F.F_PROMPTS], n_parts)
        if len(seq) != len(want):
            problems.append(f"{rel}: {len(seq)} rows, expected {len(want)}")
            continue
        for r in np.flatnonzero(seq < 0):
            problems.append(f"{rel}: row {r} (prompt {want[r]}) was never written")
        for r in np.flatnonzero(idx != want):
            problems.append(f"{rel}: row {r} holds prompt_idx {idx[r]}, expected {want[r]}")
        for r in range(len(want)):
            if not np.any(final[r]):
                problems.append(f"{rel}: final_latents of row {r} (prompt {want[r]}) were never written")
    return problems
