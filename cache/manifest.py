"""manifest.json: the single entry point for readers of a finished cache, plus the fingerprint.

The manifest is written (atomically) only once every part is complete; it aggregates the parts' shard
records. Separate processes (`--part/--num-parts`) each try once their part is complete, so whichever
finishes last writes it. Under torchrun every rank waits at a barrier until all parts are complete, then
rank 0 writes it. Two writers finishing together write identical content to distinct temporary files,
and the rename makes one of them win whole.

Readers take a manifest as untrusted: it is opened through `safe_open` (no link, no FIFO), its fields are checked
against `schema.record_problem` (types, ranges, required keys; every shard path `shards/part-PPPPP-SSSSSS.tar` of
one of its parts) before any is used, so that no reader opens a file outside the cache because the manifest says so,
and a malformed one ends in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from .atomic import atomic_write_bytes, atomic_write_json
from .cache_error import CacheError, UnfinishedCacheError
from .format import (
    F_BYTES, F_CREATED, F_DTYPE, F_FINGERPRINT, F_FORMAT_VERSION, F_LATENT_SHAPE, F_NEGATIVE_SHA256, F_NUM_PARTS,
    F_PARTS, F_PROMPTS, F_REVISION, F_SAMPLE_FIELDS, F_SAMPLES, F_SHARDS, F_STEPS, F_TEACHER, F_TEACHER_PATH,
    FORMAT_VERSION, MANIFEST, NEG_EMBEDS, NEGATIVE, PARTS_DIR, S_BYTES, S_SAMPLES, T_FEATURES, part_dirname,
)
from .part_progress import PartProgress, check_version
from .safe_open import read_bytes
from .schema import declared_fields, record_problem, recorded_steps, sample_bytes, sample_fields
from .size import measured_inputs, project

# Header fields that say where the teacher was found, not what it is: left out of the fingerprint (its content
# enters as `teacher_identity`), so moving the teacher folder does not invalidate a cache.
NOT_FINGERPRINTED = (F_TEACHER, F_REVISION, F_TEACHER_PATH)
# The fields `try_write_manifest` adds around stage one's header: the manifest's own, not settings. Every other
# field of a manifest is a setting, and the settings less NOT_FINGERPRINTED hash to its fingerprint.
MANIFEST_FIELDS = (F_FORMAT_VERSION, F_FINGERPRINT, F_SAMPLE_FIELDS, F_NUM_PARTS, F_SAMPLES, F_BYTES, F_PARTS,
                   F_SHARDS, F_CREATED, F_NEGATIVE_SHA256)
OWN_NEGATIVE = f"{PARTS_DIR}/{part_dirname(0)}/{NEGATIVE}"  # part 0's copy, which the root's is restored from
# What a user told to fix the manifest does (stage one rewrites it from the parts' progress records).
REWRITE = (f"rerun the same `wandistiller teacher-cache` command: it rewrites {MANIFEST} from the parts' progress "
           "records (or restore the manifest)")


def fingerprint(fields: dict) -> str:
    """sha256 over the canonical JSON of everything that changes the cached targets."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def settings_fingerprint(header: dict) -> str:
    """The fingerprint of stage one's header (its settings, `teacher_identity` included)."""
    return fingerprint({k: v for k, v in header.items() if k not in NOT_FINGERPRINTED})


def _sha256(cache_dir: str | os.PathLike, rel: str) -> str | None:
    """sha256 of the cache's file `rel` (opened by `safe_open`), None where it is not there."""
    try:
        return hashlib.sha256(read_bytes(cache_dir, rel)).hexdigest()
    except FileNotFoundError:
        return None


def _settings(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in MANIFEST_FIELDS}


def settings_problem(cache_dir: str | os.PathLike, m: dict) -> str | None:
    """Why the manifest's settings do not hash to its fingerprint (a field edited by hand: an edited `guidance`
    would otherwise reach the student's distill.json), naming the fields that differ from the parts' progress
    records and the fix; None when they do."""
    settings, fp = _settings(m), m.get(F_FINGERPRINT)
    if settings_fingerprint(settings) == fp:
        return None
    path = manifest_path(cache_dir)
    try:
        prog = PartProgress.load(cache_dir, 0)
    except CacheError:
        prog = None
    fix = REWRITE
    changed = ""
    if prog is not None:
        rel = PartProgress.path(cache_dir, 0).relative_to(cache_dir).as_posix()
        header = {k: v for k, v in prog.header.items() if k not in MANIFEST_FIELDS}
        diff = sorted(k for k in set(header) | set(settings)
                      if header.get(k, "<absent>") != settings.get(k, "<absent>"))
        if settings_fingerprint(header) != fp:  # the progress record does not match either: nothing to rewrite from
            fix = "rebuild the cache with the same `wandistiller teacher-cache` command and --overwrite"
        elif diff:
            changed = " (" + ", ".join(f"{k} is {_short(settings.get(k, '<absent>'))} there, "
                                       f"{_short(header.get(k, '<absent>'))} in {rel}" for k in diff[:3])
            changed += f", {len(diff) - 3} more)" if len(diff) > 3 else ")"
    if not changed:
        names = sorted(k for k in settings if k not in NOT_FINGERPRINTED)
        changed = f" (one of its {len(names)} fingerprinted settings: {', '.join(names)})"
    return (f"{path}: its settings no longer hash to its fingerprint {str(fp)[:12]}{changed}, so the manifest was "
            f"edited after stage one wrote it; {fix}")


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def check_settings(cache_dir: str | os.PathLike, m: dict) -> None:
    """CacheError with `settings_problem`, if any."""
    problem = settings_problem(cache_dir, m)
    if problem:
        raise CacheError(problem)


def _negative_sha256(cache_dir: Path, written: str) -> str | None:
    """sha256 of the cache's negative.safetensors, as the manifest records it. The root copy is part 0's own
    (written together): a missing root copy, or one that no longer matches what the previous manifest recorded
    while part 0's still does, is restored from part 0's first, so that rerunning stage one repairs it. Part 0's
    copy must still be what part 0's progress record says it wrote (`written`)."""
    root, own = cache_dir / NEGATIVE, cache_dir / PARTS_DIR / part_dirname(0) / NEGATIVE
    try:
        data = read_bytes(cache_dir, OWN_NEGATIVE)
    except FileNotFoundError:
        return _sha256(cache_dir, NEGATIVE)
    sha = hashlib.sha256(data).hexdigest()
    if sha != written:
        raise CacheError(f"{own} changed after stage one wrote it (its progress record says sha256 {written[:12]}); "
                         f"delete {own.parent} and rerun the same `wandistiller teacher-cache` command (that part is "
                         "computed again), or rerun it with --overwrite (the whole cache)")
    try:
        recorded = json.loads(read_bytes(cache_dir, MANIFEST)).get(F_NEGATIVE_SHA256)
    except (OSError, ValueError, AttributeError, RecursionError):  # no previous manifest, a torn one, or a FIFO
        recorded = None
    on_disk = _sha256(cache_dir, NEGATIVE)
    same = on_disk == sha
    if (same and recorded not in (None, sha)) or (on_disk is not None and not same and recorded != sha):
        raise CacheError(f"{root} or {own} changed after stage one wrote them (the manifest recorded sha256 "
                         f"{str(recorded)[:12]}); rebuild the cache with the same `wandistiller teacher-cache` command "
                         "and --overwrite")
    if not same:
        atomic_write_bytes(root, data)
    return sha


def manifest_path(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / MANIFEST


def negative_problem(cache_dir: str | os.PathLike, m: dict, relative: bool = False) -> str | None:
    """Why the cache's negative.safetensors is not the file the manifest recorded (missing, or another sha256),
    with the fix (the file named relative to the cache with `relative`); None when it is."""
    cache_dir = Path(cache_dir)
    recorded, on_disk = m.get(F_NEGATIVE_SHA256), _sha256(cache_dir, NEGATIVE)
    if on_disk is not None and on_disk == recorded:
        return None
    what = "is missing" if on_disk is None else "fails its sha256 check (changed after stage one wrote it)"
    name = f"{NEGATIVE}:" if relative else str(cache_dir / NEGATIVE)
    own = _sha256(cache_dir, OWN_NEGATIVE)
    if own is not None and (on_disk is None or own == recorded):  # what `_negative_sha256` restores
        fix = f"rerun the same `wandistiller teacher-cache` command: it restores it from {OWN_NEGATIVE}"
    else:
        fix = "rebuild the cache with the same `wandistiller teacher-cache` command and --overwrite"
    return f"{name} {what}; {fix}"


def negative_embeds(cache_dir: str | os.PathLike) -> torch.Tensor:
    """The negative prompt's embedding [L, D], padded like the prompts'; CacheError if the file is not the one the
    manifest recorded."""
    try:
        data = read_bytes(cache_dir, NEGATIVE)
    except FileNotFoundError:
        raise CacheError(f"{Path(cache_dir) / NEGATIVE} is missing; rerun the same `wandistiller teacher-cache` "
                         "command") from None
    if manifest_path(cache_dir).exists():
        problem = negative_problem(cache_dir, load_manifest(cache_dir))
        if problem:
            raise CacheError(problem)
    return st_load(data)[NEG_EMBEDS]


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
        F_SAMPLE_FIELDS: declared_fields(parts[0].header),
        F_NUM_PARTS: num_parts,
        F_SAMPLES: sum(s[S_SAMPLES] for s in shards),
        F_BYTES: sum(s[S_BYTES] for s in shards),
        F_PARTS: [{"part": p.part, "prompts": p.prompts, "blocks": p.blocks} for p in parts],
        F_SHARDS: shards,
        F_CREATED: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    negative = _negative_sha256(Path(cache_dir), parts[0].negative_sha256)
    if negative is not None:
        manifest[F_NEGATIVE_SHA256] = negative
    atomic_write_json(manifest_path(cache_dir), manifest, before_replace)
    return manifest


def load_manifest(cache_dir: str | os.PathLike) -> dict:
    """Read and sanity-check a finished cache's manifest; CacheError with a remedy otherwise."""
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise CacheError(f"cache directory {cache_dir} does not exist; create it with `wandistiller teacher-cache`")
    path = manifest_path(cache_dir)
    if not os.path.lexists(path):
        if not (cache_dir / PARTS_DIR).is_dir():
            raise CacheError(f"{cache_dir} has no {MANIFEST} and no {PARTS_DIR}/: it is not a cache; pass the "
                             "CACHE_DIR that `wandistiller teacher-cache --out` wrote")
        raise UnfinishedCacheError(cache_dir, f"{cache_dir} has no {MANIFEST}: stage one has not finished there "
                                   "(rerun the same `wandistiller teacher-cache` command to complete it)")
    try:
        m = json.loads(read_bytes(cache_dir, MANIFEST))
    except CacheError:
        raise  # a link or a FIFO (`safe_open`)
    except (ValueError, RecursionError) as e:  # (JSON, UTF-8)
        raise CacheError(f"{path} is not valid JSON ({e}); rerun `wandistiller teacher-cache` to rewrite it") from e
    if not isinstance(m, dict):
        raise CacheError(f"{path} is not a manifest (a JSON object); rerun `wandistiller teacher-cache` to rewrite it")
    check_version(path, m)
    problem = record_problem(m, "manifest", cache_dir)  # a reader never opens a file outside the cache because of it
    if problem is not None:
        raise CacheError(f"{path}: {problem}; {REWRITE}")
    return m


def summarize(cache_dir: str | os.PathLike, prompts: int | None = None) -> dict:
    """What `cache info` prints: sizes and settings of a finished cache, and its bytes projected for `prompts`
    prompts (default: its own) of the same kind (`cache.size`)."""
    m = load_manifest(cache_dir)
    inputs = measured_inputs(cache_dir, m)
    own = project(m, int(m[F_PROMPTS]), int(m[F_NUM_PARTS]), **inputs)
    projected = own if prompts is None else project(m, prompts, int(m[F_NUM_PARTS]), **inputs)
    return {
        "cache": str(cache_dir), F_SAMPLES: m[F_SAMPLES], F_SHARDS: len(m[F_SHARDS]), F_PROMPTS: m.get(F_PROMPTS),
        F_STEPS: m.get(F_STEPS), F_LATENT_SHAPE: m.get(F_LATENT_SHAPE), F_BYTES: m.get(F_BYTES),
        F_FINGERPRINT: m[F_FINGERPRINT], F_TEACHER: m.get(F_TEACHER), F_DTYPE: m.get(F_DTYPE),
        F_NUM_PARTS: m[F_NUM_PARTS], "seeds_per_prompt": m.get("seeds_per_prompt"),
        "timesteps": m.get("timesteps"), "experts": m.get("experts"), F_SAMPLE_FIELDS: list(sample_fields(m)),
        # tensor bytes of one sample, and without the recorded teacher features (what they cost)
        "tensor_bytes_per_sample": sample_bytes(m),
        "tensor_bytes_per_sample_without_features": sample_bytes(m, [f for f in sample_fields(m) if f != T_FEATURES]),
        "recorded_steps": list(recorded_steps(m)),
        # on disk: a sample in its shard (tar and safetensors headers included), a prompt in its prompt store
        # (embedding chunks + initial noise + final latents), and the files of neither (manifest, metadata)
        "bytes_per_sample": own.sample_bytes, "bytes_per_prompt": round(own.prompt_bytes),
        "fixed_bytes": own.fixed_bytes, "total_bytes": own.total,
        "projected_prompts": projected.prompts, "projected_samples": projected.samples,
        "projected_bytes": projected.total,
    }
