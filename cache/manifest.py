"""manifest.json: the single entry point for readers of a finished cache, plus the fingerprint.

The manifest is written (atomically) only once every part is complete; it aggregates the parts' shard
records. Separate processes (`--part/--num-parts`) each try once their part is complete, so whichever
finishes last writes it. Under torchrun every rank waits at a barrier until all parts are complete, then
rank 0 writes it. Two writers finishing together write identical content to distinct temporary files,
and the rename makes one of them win whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from .atomic import atomic_write_json
from .errors import CacheError
from .format import (
    F_BYTES, F_CREATED, F_FINGERPRINT, F_FORMAT_VERSION, F_NUM_PARTS, F_PARTS, F_SAMPLE_FIELDS, F_SAMPLES, F_SHARDS,
    FORMAT_VERSION, MANIFEST, S_BYTES, S_SAMPLES,
)
from .progress import PartProgress
from .schema import declared_fields, sample_bytes, sample_fields


def fingerprint(fields: dict) -> str:
    """sha256 over the canonical JSON of everything that changes the cached targets."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_path(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / MANIFEST


def try_write_manifest(cache_dir: str | os.PathLike, num_parts: int,
                       before_replace: Callable[[], None] | None = None) -> dict | None:
    """Write the manifest if all `num_parts` parts are complete; return it, or None if some part is not.
    `before_replace` (fault injection) runs when its temporary file is complete, just before the rename."""
    parts = []
    for p in range(num_parts):
        prog = PartProgress.load(cache_dir, p)
        if prog is None or not prog.complete:
            return None
        parts.append(prog)
    fps = {p.fingerprint for p in parts}
    if len(fps) != 1:
        raise CacheError(f"parts of {cache_dir} were made with different settings (fingerprints "
                         f"{sorted(f[:12] for f in fps)}); rerun the odd part with --overwrite")
    shards = [s for p in parts for s in p.shards]
    manifest = {
        F_FORMAT_VERSION: FORMAT_VERSION,
        F_FINGERPRINT: parts[0].fingerprint,
        **parts[0].header,
        F_SAMPLE_FIELDS: parts[0].header.get(F_SAMPLE_FIELDS) or declared_fields(parts[0].header),
        F_NUM_PARTS: num_parts,
        F_SAMPLES: sum(s[S_SAMPLES] for s in shards),
        F_BYTES: sum(s[S_BYTES] for s in shards),
        F_PARTS: [{"part": p.part, "prompts": p.prompts, "blocks": p.blocks} for p in parts],
        F_SHARDS: shards,
        F_CREATED: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(manifest_path(cache_dir), manifest, before_replace)
    return manifest


def load_manifest(cache_dir: str | os.PathLike) -> dict:
    """Read and sanity-check a finished cache's manifest; CacheError with a remedy otherwise."""
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise CacheError(f"cache directory {cache_dir} does not exist; create it with `wandistiller teacher-cache`")
    path = manifest_path(cache_dir)
    if not path.exists():
        raise CacheError(f"{cache_dir} has no {MANIFEST}: stage one has not finished there "
                         "(rerun the same `wandistiller teacher-cache` command to complete it)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheError(f"{path} is not valid JSON ({e}); rerun `wandistiller teacher-cache` to rewrite it") from e
    if not isinstance(m, dict) or m.get(F_FORMAT_VERSION) != FORMAT_VERSION:
        raise CacheError(f"{path} has format_version {m.get(F_FORMAT_VERSION) if isinstance(m, dict) else None}, "
                         f"this WanDistiller reads {FORMAT_VERSION}; rebuild the cache with this version")
    for key in (F_FINGERPRINT, F_SHARDS, F_SAMPLES, F_NUM_PARTS):
        if key not in m:
            raise CacheError(f"{path} lacks the field {key!r}; rebuild the cache with `wandistiller teacher-cache`")
    return m


def summarize(cache_dir: str | os.PathLike) -> dict:
    """What `cache info` prints: sizes and settings of a finished cache."""
    from .format import F_DTYPE, F_LATENT_SHAPE, F_PROMPTS, F_STEPS, F_TEACHER, T_FEATURES

    m = load_manifest(cache_dir)
    return {
        "cache": str(cache_dir), F_SAMPLES: m[F_SAMPLES], F_SHARDS: len(m[F_SHARDS]), F_PROMPTS: m.get(F_PROMPTS),
        F_STEPS: m.get(F_STEPS), F_LATENT_SHAPE: m.get(F_LATENT_SHAPE), F_BYTES: m.get(F_BYTES),
        F_FINGERPRINT: m[F_FINGERPRINT], F_TEACHER: m.get(F_TEACHER), F_DTYPE: m.get(F_DTYPE),
        F_NUM_PARTS: m[F_NUM_PARTS], "seeds_per_prompt": m.get("seeds_per_prompt"),
        "timesteps": m.get("timesteps"), "experts": m.get("experts"), F_SAMPLE_FIELDS: list(sample_fields(m)),
        # tensor bytes of one sample, and without the recorded teacher features (what they cost)
        "tensor_bytes_per_sample": sample_bytes(m),
        "tensor_bytes_per_sample_without_features": sample_bytes(m, [f for f in sample_fields(m) if f != T_FEATURES]),
    }
