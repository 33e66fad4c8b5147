"""On-disk checks the suite runs after every fault: read independently of the code under test (tarfile,
safetensors, zarr, hashlib), so a bug in the reader cannot hide a bug in the writer."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load_np
from safetensors.numpy import load_file as st_load_file_np

from cache import format as F
from cache.checksum import crc32c

# Names of files still being written: ours (`.tmp`) and zarr's own atomic writes (`.<uuid>.partial`).
TEMP_MARKERS = (F.TMP_SUFFIX, ".partial")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: Path, skip: str | None = None) -> str:
    """One hash over every file's relative path, mode and bytes below `root` (and the empty folders); files whose
    name matches the glob `skip` left out."""
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        if skip is not None and p.match(skip):
            continue
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            h.update(f"D {rel}\n".encode())
        elif p.is_file():
            h.update(f"F {rel} {p.stat().st_mode:o} {sha256_file(p)}\n".encode())
        else:
            h.update(f"O {rel}\n".encode())
    return h.hexdigest()


def temp_files(root: Path) -> list[str]:
    """Leftovers of interrupted writes anywhere below `root`."""
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*")
                  if any(m in p.name for m in TEMP_MARKERS))


def read_manifest(cache: Path) -> dict | None:
    p = cache / F.MANIFEST
    return json.loads(p.read_text()) if p.exists() else None


def read_progress(cache: Path) -> dict[int, dict]:
    out = {}
    parts = cache / F.PARTS_DIR
    for d in sorted(parts.iterdir()) if parts.is_dir() else []:
        p = d / F.PROGRESS
        if p.exists():
            out[int(d.name.split("-")[1])] = json.loads(p.read_text())
    return out


def shard_record_problems(cache: Path, rec: dict) -> list[str]:
    path = cache / rec["path"]
    if not path.is_file():
        return [f"{rec['path']} is listed but missing"]
    if path.stat().st_size != rec["bytes"]:
        return [f"{rec['path']} is listed with {rec['bytes']} bytes but has {path.stat().st_size} (partial)"]
    if crc32c(path.read_bytes()) != rec["crc32c"]:
        return [f"{rec['path']} is listed but its crc32c differs (torn or rewritten)"]
    return []


def progress_problems(cache: Path) -> list[str]:
    """After a crash: every shard a progress record lists is whole; a manifest, if any, is consistent."""
    problems = []
    for part, prog in read_progress(cache).items():
        for rec in prog["shards"]:
            problems += shard_record_problems(cache, rec)
        if prog["complete"] and len(prog["done_blocks"]) != prog["blocks"]:
            problems.append(f"part {part} says complete with {len(prog['done_blocks'])}/{prog['blocks']} blocks")
    if (cache / F.MANIFEST).exists():
        problems += manifest_problems(cache)
    return problems


def manifest_problems(cache: Path) -> list[str]:
    """A finished cache: the manifest lists exactly the shards on disk, each whole, and every sample."""
    m = read_manifest(cache)
    if m is None:
        return [f"no {F.MANIFEST}"]
    problems = []
    listed = [s["path"] for s in m["shards"]]
    on_disk = sorted(f"{F.SHARDS_DIR}/{p.name}" for p in (cache / F.SHARDS_DIR).iterdir())
    if sorted(listed) != on_disk:
        unlisted, missing = sorted(set(on_disk) - set(listed)), sorted(set(listed) - set(on_disk))
        problems.append(f"manifest lists {len(listed)} shards, {len(on_disk)} files in {F.SHARDS_DIR}/ "
                        f"(unlisted: {unlisted}, missing: {missing})")
    for rec in m["shards"]:
        problems += shard_record_problems(cache, rec)
    total = sum(s["samples"] for s in m["shards"])
    expected = m["prompts"] * m["seeds_per_prompt"] * m["steps"]
    if not total == m["samples"] == expected:
        problems.append(f"manifest: samples {m['samples']}, its shards hold {total}, expected {expected}")
    prog = read_progress(cache)
    from_parts = sorted(s["path"] for p in prog.values() for s in p["shards"])
    if from_parts != sorted(listed):
        problems.append("manifest and progress records list different shards")
    return problems


def read_samples(cache: Path, problems: list[str] | None = None) -> tuple[dict[str, tuple[dict, dict]], int]:
    """key -> (tensors as numpy, metadata) of every sample the manifest lists; and how many keys repeat.
    A shard or sample that cannot be read is skipped (its samples count as lost) and noted in `problems`."""
    out: dict[str, tuple[dict, dict]] = {}
    dup = 0
    m = read_manifest(cache)
    if m is None:
        if problems is not None:
            problems.append(f"no {F.MANIFEST}: no sample can be read")
        return out, dup
    for rec in m["shards"]:
        members: dict[str, dict[str, bytes]] = {}
        try:
            with tarfile.open(cache / rec["path"]) as tar:
                for info in tar:
                    key, _, ext = info.name.partition(".")
                    members.setdefault(key, {})[ext] = tar.extractfile(info).read()
        except (OSError, tarfile.TarError) as e:
            if problems is not None:
                problems.append(f"{rec['path']} is unreadable ({e})")
            continue
        for key, mem in members.items():
            try:
                sample = (st_load_np(mem[F.EXT_TENSORS]), json.loads(mem[F.EXT_META]))
            except Exception as e:  # noqa: BLE001 - any member that does not decode is a lost sample
                if problems is not None:
                    problems.append(f"{rec['path']}: sample {key} does not decode ({type(e).__name__})")
                continue
            dup += key in out
            out[key] = sample
    return out, dup


def compare_caches(ref: Path, got: Path, ref_samples: dict | None = None) -> tuple[int, int, list[str]]:
    """(samples lost, samples duplicated, other differences) of `got` against the uninterrupted `ref`."""
    a = ref_samples if ref_samples is not None else read_samples(ref)[0]
    problems: list[str] = []
    b, dup = read_samples(got, problems)
    lost = len(set(a) - set(b))
    extra = sorted(set(b) - set(a))
    if extra:
        problems.append(f"{len(extra)} sample(s) that the uninterrupted run does not have, e.g. {extra[0]}")
    differ = [k for k in set(a) & set(b) if a[k][1] != b[k][1] or a[k][0].keys() != b[k][0].keys()
              or any(not np.array_equal(a[k][0][n], b[k][0][n]) for n in a[k][0])]
    if differ:
        problems.append(f"{len(differ)} sample(s) differ from the uninterrupted run, e.g. {sorted(differ)[0]}")
    problems += zarr_differences(ref, got)
    return lost, dup, problems


def zarr_differences(ref: Path, got: Path) -> list[str]:
    import zarr

    problems = []
    for part_dir in sorted((ref / F.PARTS_DIR).iterdir()):
        za = zarr.open_group(str(part_dir / F.PROMPTS_ZARR), mode="r")
        try:
            zb = zarr.open_group(str(got / F.PARTS_DIR / part_dir.name / F.PROMPTS_ZARR), mode="r")
        except Exception as e:  # noqa: BLE001 - a missing store is a difference like any other
            return [f"{part_dir.name}/{F.PROMPTS_ZARR} unreadable: {e}"]
        for name in (F.Z_PROMPT_IDX, F.Z_TEXT, F.Z_SEQ_LENS, F.Z_TOKEN_START, F.Z_EMBEDS, F.Z_INIT_NOISE,
                     F.Z_FINAL_LATENTS):
            if not np.array_equal(za[name][:], zb[name][:]):
                problems.append(f"{part_dir.name}/{F.PROMPTS_ZARR}/{name} differs from the uninterrupted run")
    return problems


def weights_equal(a: Path, b: Path) -> bool:
    """Two safetensors files hold the same tensors, bit for bit."""
    ta, tb = st_load_file_np(str(a)), st_load_file_np(str(b))
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)
