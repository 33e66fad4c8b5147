"""Corrupt caches: each corruption must be named by `cache verify` (exit 1) and make `train-student`
refuse to start (exit 2, one line naming the shard or prompt row) instead of training on a partial or
wrong epoch. Nothing is silent: a corruption that training accepts counts the samples it lost."""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from cache import format as F
from cache.checksum import crc32c

from .check import compare_caches, manifest_problems, temp_files
from .damage import chunk_location, chunk_rows
from .proc import run_cli
from .report import Row
from .workspace import Workspace

TAR_BLOCK = 512


def _manifest(cache: Path) -> dict:
    return json.loads((cache / F.MANIFEST).read_text())


def _edit_manifest(cache: Path, edit: Callable[[dict], None]) -> None:
    m = _manifest(cache)
    edit(m)
    (cache / F.MANIFEST).write_text(json.dumps(m, indent=2))


def _shard(cache: Path, i: int) -> tuple[Path, str]:
    rel = _manifest(cache)["shards"][i]["path"]
    return cache / rel, rel


def _rerecord(cache: Path, rel: str) -> None:
    """Make the manifest agree with the shard's current bytes (as a hand edit or a buggy tool would)."""
    path = cache / rel

    def edit(m):
        for s in m["shards"]:
            if s["path"] == rel:
                s["bytes"], s["crc32c"] = path.stat().st_size, crc32c(path.read_bytes())

    _edit_manifest(cache, edit)


# What the refusal tells the user to do, and the suite then does: delete the named shard and rerun stage one
# (which recomputes just that shard), rerun stage one (which rewrites the manifest from the progress records),
# or rebuild with --overwrite.
DELETE = "delete it and rerun the same `wandistiller teacher-cache` command"
RERUN = "rerun the same `wandistiller teacher-cache` command"
OVERWRITE = "--overwrite"
_SHARD_IN_MESSAGE = re.compile(r"shard (\S+\.tar) ")


# -- corruptions: each returns (what verify must say, what train-student's one line must name, the remedy) ---

def truncated(cache: Path):
    path, rel = _shard(cache, 2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 6 // 10])
    return [f"BAD {rel}:", "truncated"], [rel], DELETE


def flipped_byte(cache: Path):
    path, rel = _shard(cache, 3)
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        member = next(m for m in tar if m.name.endswith(F.EXT_TENSORS))
    header_len = struct.unpack("<Q", data[member.offset_data:member.offset_data + 8])[0]
    data[member.offset_data + 8 + header_len + 100] ^= 0x10  # inside x_t's float data: safetensors still parses
    path.write_bytes(bytes(data))
    return [f"BAD {rel}: crc32c mismatch"], [rel, "checksum"], DELETE


def _drop_member(path: Path) -> str:
    """Rewrite the tar without the second sample's metadata member; returns the dropped name."""
    out = io.BytesIO()
    with tarfile.open(path) as src, tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as dst:
        members = [m for m in src if m.isfile()]
        dropped = [m for m in members if m.name.endswith("." + F.EXT_META)][1].name
        for m in members:
            if m.name != dropped:
                dst.addfile(m, src.extractfile(m))
    path.write_bytes(out.getvalue())
    return dropped


def missing_member(cache: Path):
    path, rel = _shard(cache, 4)
    _drop_member(path)
    return [f"BAD {rel}:"], [rel], DELETE


def missing_member_rerecorded(cache: Path):
    path, rel = _shard(cache, 5)
    key = _drop_member(path).partition(".")[0]
    _rerecord(cache, rel)
    return [f"BAD {rel}: sample {key} has members"], [rel], DELETE


def no_end_of_archive(cache: Path):
    path, rel = _shard(cache, 6)
    data = path.read_bytes()
    end = len(data)
    while end >= TAR_BLOCK and not any(data[end - TAR_BLOCK:end]):
        end -= TAR_BLOCK
    path.write_bytes(data[:end])
    return [f"BAD {rel}:"], [rel], DELETE


def deleted(cache: Path):
    path, rel = _shard(cache, 7)
    path.unlink()
    return [f"BAD {rel}: missing"], [rel, "missing"], RERUN


def unwritten_row(cache: Path):
    """Row 5 of prompts.zarr as if its writer died before it: it reads as the fill values (seq_len -1, zero
    embedding), whatever the store's chunk layout."""
    from cache.prompt_store import open_prompt_store, prompt_store_path

    g = open_prompt_store(prompt_store_path(cache, 0), mode="r+")
    g[F.Z_SEQ_LENS][5] = -1
    g[F.Z_TOKEN_START][5] = -1
    rel = f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROMPTS_ZARR}"
    return [f"BAD {rel}: row 5 (prompt 5) was never written"], [F.PROMPTS_ZARR, "prompt 5"], OVERWRITE


def shard_record_dropped(cache: Path):
    _, rel = _shard(cache, 8)

    def edit(m):
        m["shards"] = [s for s in m["shards"] if s["path"] != rel]
        m["samples"] = sum(s["samples"] for s in m["shards"])

    _edit_manifest(cache, edit)
    return ["the cache is incomplete"], [rel], RERUN


def shard_listed_twice(cache: Path):
    _, rel = _shard(cache, 9)

    def edit(m):
        m["shards"].append(dict(next(s for s in m["shards"] if s["path"] == rel)))
        m["samples"] = sum(s["samples"] for s in m["shards"])

    _edit_manifest(cache, edit)
    return [f"BAD {rel}: sample", "appears in more than one place"], [rel], RERUN


def sample_count_edited(cache: Path):
    _, rel = _shard(cache, 10)
    _edit_manifest(cache, lambda m: m["shards"][10].update({"samples": m["shards"][10]["samples"] - 1}))
    return [f"BAD {rel}:", "manifest says"], [rel], DELETE


def checksum_edited(cache: Path):
    _, rel = _shard(cache, 11)
    _edit_manifest(cache, lambda m: m["shards"][11].update({"crc32c": m["shards"][11]["crc32c"] ^ 1}))
    return [f"BAD {rel}: crc32c mismatch"], [rel, "checksum"], DELETE


def manifest_torn(cache: Path):
    path = cache / F.MANIFEST
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return [F.MANIFEST, "not valid JSON"], [F.MANIFEST, "not valid JSON"], "rerun `wandistiller teacher-cache`"


# -- what stage two and sample/eval read besides the shards: the prompt stores (every chunk ends in its crc32c,
# every row's real tokens have theirs), negative.safetensors (sha256 in the manifest), the manifest itself -------

STORE = f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROMPTS_ZARR}"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_row(cache: Path, name: str, row: int, offset: int) -> None:
    """Flip a byte `offset` bytes into the first bytes of `row` of array `name` of part 0's store (in its chunk, in
    its file)."""
    path, start, _ = chunk_location(cache / STORE, name, row)
    _flip(path, start + offset)


def embeds_flipped(cache: Path):
    _flip_row(cache, F.Z_EMBEDS, 7, 4)  # inside the prompt's first real token
    first = min(chunk_rows(cache / STORE, 7))  # every row sharing the chunk fails; training names the first
    return ([f"BAD {STORE}: embeds of row 7 (prompt 7)", "crc32c"], [F.PROMPTS_ZARR, f"prompt {first}", "crc32c"],
            OVERWRITE)


def final_latents_flipped(cache: Path):
    _flip_row(cache, F.Z_FINAL_LATENTS, 9, 100)
    return ([f"BAD {STORE}: final_latents of row 9 (prompt 9)", "crc32c"],
            [F.PROMPTS_ZARR, "prompt 9", F.Z_FINAL_LATENTS], OVERWRITE)


def embeds_file_deleted(cache: Path):
    (cache / STORE / F.Z_EMBEDS / "c.0.0").unlink()  # the first 4096 tokens (every row here): they would read as zeros
    return ([f"BAD {STORE}: embeds of row 11 (prompt 11): file embeds/c.0.0 is missing"],
            [F.PROMPTS_ZARR, "prompt 0", "embeds/c.0.0 is missing"], OVERWRITE)


def negative_flipped(cache: Path):
    path = cache / F.NEGATIVE
    _flip(path, path.stat().st_size - 5)  # tensor data: safetensors still parses
    return [f"BAD {F.NEGATIVE}: fails its sha256 check"], [F.NEGATIVE, "sha256"], RERUN


def guidance_edited(cache: Path):
    _edit_manifest(cache, lambda m: m.update({"guidance": 7.5}))  # would reach the student's distill.json
    return (["its settings no longer hash to its fingerprint", "guidance is 7.5"], [F.MANIFEST, "guidance is 7.5"],
            RERUN)


def shard_path_escapes(cache: Path):
    """A shard record pointing outside the cache, at a copy of the very shard: its size and checksum agree."""
    _, rel = _shard(cache, 1)
    outside = f"../{cache.name}-escaped.tar"
    shutil.copy(cache / rel, cache.parent / outside[3:])
    _edit_manifest(cache, lambda m: m["shards"][1].update({"path": outside}))
    said = f"shard path {outside!r} is outside the cache folder"
    return [said], [F.MANIFEST, said], RERUN


CORRUPTIONS = {
    "truncated shard": truncated,
    "flipped byte in tensor data": flipped_byte,
    "missing tar member": missing_member,
    "missing tar member, manifest re-recorded": missing_member_rerecorded,
    "missing end-of-archive blocks": no_end_of_archive,
    "shard deleted": deleted,
    "zarr row never written": unwritten_row,
    "manifest edited: shard record dropped": shard_record_dropped,
    "manifest edited: shard listed twice": shard_listed_twice,
    "manifest edited: sample count": sample_count_edited,
    "manifest edited: checksum": checksum_edited,
    "manifest torn (half written by hand)": manifest_torn,
    "zarr embeds: byte flipped": embeds_flipped,
    "zarr final_latents: byte flipped": final_latents_flipped,
    "zarr embeds: file deleted": embeds_file_deleted,
    "negative.safetensors: byte flipped": negative_flipped,
    "manifest edited: guidance": guidance_edited,
    "manifest edited: shard path outside the cache (../)": shard_path_escapes,
}


def _trained_keys(debug: Path) -> list[str]:
    rec = debug / "rank-0.json"
    return [k for b in json.loads(rec.read_text())["micro_batches"] for k in b] if rec.exists() else []


def _repair(ws: Workspace, cache: Path, remedy: str, message: str) -> list[str]:
    """Do what the refusal said; the cache must then equal the uninterrupted one and verify clean."""
    if remedy == DELETE:
        m = _SHARD_IN_MESSAGE.search(message)
        if m is None:
            return [f"the message names no shard to delete: {message}"]
        Path(m.group(1)).unlink(missing_ok=True)
    r = run_cli(ws.stage_one(cache) + (["--overwrite"] if remedy == OVERWRITE else []))
    if r.code != 0:
        return [f"following the remedy failed: {r.describe()}"]
    v = run_cli(["cache", "verify", cache])
    lost, dup, diff = compare_caches(ws.ref_cache, cache, ws.ref_samples)
    problems = diff + manifest_problems(cache) + [f"temporary file left: {t}" for t in temp_files(cache)]
    if v.code != 0:
        problems.append(f"cache verify still fails after the remedy: {v.describe()}")
    if lost or dup:
        problems.append(f"after the remedy: {lost} sample(s) lost, {dup} duplicated")
    return problems


def corrupt_caches(ws: Workspace) -> Row:
    row = Row("corrupt cache", min_attempts=len(CORRUPTIONS))
    t0 = time.perf_counter()
    for name, corrupt in CORRUPTIONS.items():
        cache = ws.fresh("corrupt")
        shutil.copytree(ws.ref_cache, cache)
        verify_needles, train_needles, remedy = corrupt(cache)
        problems = []
        v = run_cli(["cache", "verify", cache])
        if v.code != 1 or not all(n in v.out + v.err for n in verify_needles):
            problems.append(f"cache verify does not say {verify_needles}: {v.describe()}")
        out, debug = ws.fresh("corrupt-run"), ws.fresh("corrupt-debug")
        t = run_cli(ws.train(out, cache=cache, epochs=1, checkpoint_every=0),
                    env={"WANDISTILLER_DEBUG_DIR": str(debug)})
        lost = dup = 0
        if t.code == 0:
            trained = _trained_keys(debug)
            lost = len(set(ws.ref_samples) - set(trained))
            dup = len(trained) - len(set(trained))
            problems.append(f"train-student trained on it ({len(set(trained))} distinct samples)")
        elif t.code != 2 or len(t.error_lines) != 1 or "Traceback" in t.err \
                or not all(n in t.error_lines[0] for n in train_needles + [remedy]):
            problems.append(f"train-student does not refuse with one line naming {train_needles} and the remedy "
                            f"{remedy!r}: {t.describe()}")
        if (out / "student").exists() or (out / "checkpoints").exists():
            problems.append("train-student wrote a student or checkpoints")
        said = [ln for ln in v.out.splitlines() if ln.startswith("BAD")][:1] + t.error_lines[:1]
        row.notes.append(f"{name}: " + " | ".join(said))
        if t.code == 2 and t.error_lines:
            problems += _repair(ws, cache, remedy, t.error_lines[0])
        row.record(name, problems, lost, dup)
    row.wall_s = time.perf_counter() - t0
    return row
