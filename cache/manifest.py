"""manifest.json: the single entry point for readers of a finished cache, written atomically by whichever part
finishes last (rank 0 under torchrun); read as untrusted input, checked whole (`records`) before any field is used.
See docs/architecture.md, "The cache"."""

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
from .format import FORMAT_VERSION, MANIFEST, NEG_EMBEDS, NEGATIVE, PARTS_DIR, T_FEATURES, part_dirname
from .part_progress import PartProgress
from .records import CacheHeader, Manifest, PartEntry, TeacherLora, check_version, shard_problem
from .safe_open import read_bytes
from .schema import declared_fields, recorded_steps, sample_bytes, sample_fields
from .size import measured_inputs, project

OWN_NEGATIVE = f"{PARTS_DIR}/{part_dirname(0)}/{NEGATIVE}"  # part 0's copy, which the root's is restored from
# What a user told to fix the manifest does (stage one rewrites it from the parts' progress records).
REWRITE = (f"rerun the same `wandistiller teacher-cache` command: it rewrites {MANIFEST} from the parts' progress "
           "records (or restore the manifest)")


def _sha256(cache_dir: str | os.PathLike, rel: str) -> str | None:
    """sha256 of the cache's file `rel` (opened by `safe_open`), None where it is not there."""
    try:
        return hashlib.sha256(read_bytes(cache_dir, rel)).hexdigest()
    except FileNotFoundError:
        return None


def settings_problem(cache_dir: str | os.PathLike, m: Manifest) -> str | None:
    """Why the manifest's settings do not hash to its fingerprint (a field edited by hand: an edited `guidance`
    would otherwise reach the student's distill.json), naming the fields that differ from the parts' progress
    records and the fix; None when they do."""
    settings, fp = m.settings(), m.fingerprint
    if m.settings_fingerprint() == fp:
        return None
    try:
        prog = PartProgress.load(cache_dir, 0)
    except CacheError:
        prog = None
    fix, changed = REWRITE, ""
    if prog is not None:
        rel = PartProgress.path(cache_dir, 0).relative_to(cache_dir).as_posix()
        header = prog.header.settings()
        diff = sorted(k for k in set(header) | set(settings)
                      if header.get(k, "<absent>") != settings.get(k, "<absent>"))
        if prog.header.settings_fingerprint() != fp:  # nor does the progress record: nothing to rewrite from
            fix = "rebuild the cache with the same `wandistiller teacher-cache` command and --overwrite"
        elif diff:
            changed = " (" + ", ".join(f"{k} is {_short(settings.get(k, '<absent>'))} there, "
                                       f"{_short(header.get(k, '<absent>'))} in {rel}" for k in diff[:3])
            changed += f", {len(diff) - 3} more)" if len(diff) > 3 else ")"
    if not changed:
        names = sorted(k for k in settings if k not in CacheHeader.NOT_FINGERPRINTED)
        changed = f" (one of its {len(names)} fingerprinted settings: {', '.join(names)})"
    return (f"{manifest_path(cache_dir)}: its settings no longer hash to its fingerprint {fp[:12]}{changed}, so the "
            f"manifest was edited after stage one wrote it; {fix}")


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


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
        recorded = Manifest.from_json(json.loads(read_bytes(cache_dir, MANIFEST))).negative_sha256
    except (OSError, ValueError, RecursionError):  # no previous manifest, a torn or foreign one, or a FIFO
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


def negative_problem(cache_dir: str | os.PathLike, m: Manifest, relative: bool = False) -> str | None:
    """Why the cache's negative.safetensors is not the file the manifest recorded (missing, or another sha256),
    with the fix (the file named relative to the cache with `relative`); None when it is."""
    cache_dir = Path(cache_dir)
    recorded, on_disk = m.negative_sha256, _sha256(cache_dir, NEGATIVE)
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
    if manifest_path(cache_dir).exists() and (problem := negative_problem(cache_dir, load_manifest(cache_dir))):
        raise CacheError(problem)
    return st_load(data)[NEG_EMBEDS]


def try_write_manifest(cache_dir: str | os.PathLike, num_parts: int,
                       before_replace: Callable[[], None] | None = None) -> Manifest | None:
    """Write the manifest if all `num_parts` parts are complete (else None); `before_replace`: fault injection."""
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
    manifest = Manifest(
        **vars(parts[0].header), format_version=FORMAT_VERSION, fingerprint=parts[0].fingerprint,
        sample_fields=declared_fields(parts[0].header), num_parts=num_parts, samples=sum(s.samples for s in shards),
        bytes=sum(s.bytes for s in shards), parts=[PartEntry(part=p.part, prompts=p.prompts, blocks=p.blocks)
                                                   for p in parts], shards=shards,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        negative_sha256=_negative_sha256(Path(cache_dir), parts[0].negative_sha256))
    atomic_write_json(manifest_path(cache_dir), manifest.to_json(), before_replace)
    return manifest


def load_manifest(cache_dir: str | os.PathLike) -> Manifest:
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
        obj = json.loads(read_bytes(cache_dir, MANIFEST))
    except CacheError:
        raise  # a link or a FIFO (`safe_open`)
    except (ValueError, RecursionError) as e:  # (JSON, UTF-8)
        raise CacheError(f"{path} is not valid JSON ({e}); rerun `wandistiller teacher-cache` to rewrite it") from e
    if not isinstance(obj, dict):
        raise CacheError(f"{path} is not a manifest (a JSON object); rerun `wandistiller teacher-cache` to rewrite it")
    check_version(path, obj)
    problem = Manifest.problem(obj)
    m = Manifest.from_json(obj) if problem is None else None
    problem = problem or shard_problem(m.shards, cache_dir, m.num_parts)
    if problem is not None:
        raise CacheError(f"{path}: {problem}; {REWRITE}")
    return m


def summarize(cache_dir: str | os.PathLike, prompts: int | None = None, m: Manifest | None = None) -> dict:
    """What `cache info` prints: a finished cache's sizes and settings, its bytes projected for `prompts` prompts
    (`m`: its manifest, when the caller has loaded it)."""
    m = m or load_manifest(cache_dir)
    inputs = measured_inputs(cache_dir, m)
    own = project(m, m.prompts, m.num_parts, **inputs)
    projected = own if prompts is None else project(m, prompts, m.num_parts, **inputs)
    fields = sample_fields(m)
    return {
        "cache": str(cache_dir), "samples": m.samples, "shards": len(m.shards), "prompts": m.prompts,
        "steps": m.steps, "latent_shape": m.latent_shape, **m.clip(), "bytes": m.bytes, "fingerprint": m.fingerprint,
        "teacher": m.teacher, "dtype": m.dtype, **({"numerics": m.numerics} if m.numerics else {}),
        "num_parts": m.num_parts, "seeds_per_prompt": m.seeds_per_prompt,
        "timesteps": m.timesteps, "experts": m.experts, "sample_fields": list(fields),
        **({"condition": f"{m.condition}, {m.condition_shape} per trajectory"} if m.condition_shape else {}),
        **({"teacher_loras": TeacherLora.describe(m.teacher_loras)} if m.teacher_loras else {}),
        # tensor bytes of one sample, and without the recorded teacher features (what they cost)
        "tensor_bytes_per_sample": sample_bytes(m),
        "tensor_bytes_per_sample_without_features": sample_bytes(m, [f for f in fields if f != T_FEATURES]),
        "recorded_steps": list(recorded_steps(m)),
        # on disk: a sample in its shard (tar and safetensors headers included), a prompt in its prompt store
        # (embedding chunks + its trajectories' arrays), and the files of neither (manifest, metadata)
        "bytes_per_sample": own.sample_bytes, "bytes_per_prompt": round(own.prompt_bytes),
        "fixed_bytes": own.fixed_bytes, "total_bytes": own.total,
        "projected_prompts": projected.prompts, "projected_samples": projected.samples,
        "projected_bytes": projected.total,
    }
