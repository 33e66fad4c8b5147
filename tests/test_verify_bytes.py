"""`cache verify` covers every byte a stage reads: the prompt stores' chunks and rows (crc32c), the negative
prompt (sha256 in the manifest), the manifest's own settings (against its fingerprint) and its shard paths
(inside the cache). Each corruption is named by `cache verify` (exit 1) and refused by `train-student` with one
line (exit 2); a cache of an older format version is refused whole, in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cache import format as F
from cache.cache_error import CacheError
from cache.manifest import load_manifest
from cache.records import CacheHeader, Manifest, fingerprint
from cache.manifest import negative_embeds
from cache.prompt_store import (
    EmbeddingCache, PartRows, RowCache, open_prompt_store, prompt_store_path, read_latents,
)
from faults.damage import chunk_location, chunk_rows
from cache.reader import open_caches
from pipeline.cli import main
from test_verify import _verify, cache_copy  # noqa: F401  (cache_copy: a fixture, a copy of tiny_cache)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "student-tiny.json")
STORE = f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROMPTS_ZARR}"


def _train(cache: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["train-student", "--cache", str(cache), "--student-config", TINY, "--out",
                                     str(out), "--num-workers", "0", "--max-steps", "2", "--batch-size", "4",
                                     "--device", "cpu", *extra], catch_exceptions=False)


def _refused(r, *needles: str) -> str:
    """train-student ended with exit 2 and one line holding every needle; returns the line."""
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _edit_manifest(cache: Path, edit) -> None:
    m = json.loads((cache / F.MANIFEST).read_text())
    edit(m)
    (cache / F.MANIFEST).write_text(json.dumps(m, indent=2))


def _flip_row(cache: Path, name: str, row: int, offset: int) -> None:
    """Flip a byte `offset` bytes into row `row`'s first bytes of array `name` (in its chunk, in its file)."""
    path, start, _ = chunk_location(prompt_store_path(cache, 0), name, row)
    _flip(path, start + offset)


def _sharing_a_chunk(cache: Path, row: int) -> set[int]:
    return set(chunk_rows(prompt_store_path(cache, 0), row))


# -- the prompt stores ---------------------------------------------------------------------------------

def test_flipped_byte_in_an_embeds_chunk(cache_copy, tmp_path):
    _flip_row(cache_copy, F.Z_EMBEDS, 3, 4)  # inside the first real token
    hit = _sharing_a_chunk(cache_copy, 3)
    r = _verify(cache_copy)
    assert r.exit_code == 1 and f"BAD {STORE}: embeds of row 3 (prompt 3) fail their crc32c" in r.output
    out = r.output
    assert {j for j in range(7) if f"embeds of row {j} (prompt {j}) fail" in out} == hit  # and no other row
    _refused(_train(cache_copy, tmp_path / "out"), F.PROMPTS_ZARR, f"prompt {min(hit)}", "crc32c", "--overwrite")
    assert not (tmp_path / "out" / "student").exists()
    with pytest.raises(CacheError, match=r"embeds of row 3 \(prompt 3\) fail their crc32c"):
        EmbeddingCache(cache_copy, 1, 16).get(3)  # what stage two's and sample's loaders read, checked on every read
    assert all(EmbeddingCache(cache_copy, 1, 16).get(j).abs().sum() > 0 for j in set(range(7)) - hit)


def test_flipped_embeds_byte_past_the_up_front_check_is_caught_when_read(cache_copy, tmp_path):
    """--verify size checks only that every file is there; the flipped token is refused when it is read."""
    _flip_row(cache_copy, F.Z_EMBEDS, 0, 4)
    hit = _sharing_a_chunk(cache_copy, 0)
    r = _train(cache_copy, tmp_path / "out", "--verify", "size", "--max-steps", "8")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]  # after the progress bar's lines
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert any(f"embeds of row {j} (prompt {j}) fail their crc32c" in errors[0] for j in hit), errors[0]
    assert "--overwrite" in errors[0]


def test_flipped_byte_in_a_final_latents_chunk(cache_copy, tmp_path):
    _flip_row(cache_copy, F.Z_FINAL_LATENTS, 2, 100)
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {STORE}: final_latents of row 2 (prompt 2) fail their crc32c" in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.PROMPTS_ZARR, "prompt 2", "final_latents", "--overwrite")
    with pytest.raises(CacheError, match=r"final_latents of row 2 \(prompt 2\)"):
        read_latents(cache_copy, 1, [(2, 0)])  # sample/eval's reader
    with pytest.raises(CacheError, match="crc32c"):  # the segment objective's reader
        RowCache(cache_copy, 1, 4, lambda rows, row: rows.latents(F.Z_FINAL_LATENTS, row))[2]
    assert read_latents(cache_copy, 1, [(1, 0)])[1].abs().sum() > 0


def test_flipped_byte_in_init_noise_is_named(cache_copy):
    _flip_row(cache_copy, F.Z_INIT_NOISE, 5, 8)
    r = _verify(cache_copy)
    assert r.exit_code == 1 and f"BAD {STORE}: init_noise of row 5 (prompt 5)" in r.output
    with pytest.raises(CacheError, match=r"init_noise of row 5 \(prompt 5\)"):
        read_latents(cache_copy, 1, [(5, 0)])


def test_deleted_embeds_file_is_named_never_zeros(cache_copy, tmp_path):
    (cache_copy / STORE / F.Z_EMBEDS / "c.0.0").unlink()  # its first 4096 tokens: every row of this cache
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {STORE}: embeds of row 4 (prompt 4): file embeds/c.0.0 is missing" in r.output
    line = _refused(_train(cache_copy, tmp_path / "out"), F.PROMPTS_ZARR, "prompt 0", "embeds/c.0.0 is missing",
                    "--overwrite")
    assert line == _refused(_train(cache_copy, tmp_path / "out2", "--verify", "size"))  # found without reading
    with pytest.raises(CacheError, match="embeds/c.0.0 is missing"):
        EmbeddingCache(cache_copy, 1, 16).get(4)


def test_a_lost_chunk_inside_a_file_is_never_read_as_zeros(cache_copy):
    """An inner chunk the file's index no longer holds reads as zeros through zarr: the row's crc32c refuses it."""
    from cache.checksum import crc32c

    g = open_prompt_store(prompt_store_path(cache_copy, 0))
    arr = g[F.Z_EMBEDS]
    n = int(np.prod([s // c for s, c in zip(arr.shards, arr.chunks)]))
    path = cache_copy / STORE / F.Z_EMBEDS / "c.0.0"
    data = bytearray(path.read_bytes())
    index = np.frombuffer(bytes(data[-(16 * n + 4):-4]), "<u8").reshape(n, 2).copy()
    index[int(g[F.Z_TOKEN_START][2]) // arr.chunks[0]] = 2**64 - 1  # row 2's first chunk: not held
    data[-(16 * n + 4):] = index.tobytes() + crc32c(index.tobytes()).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"embeds of row 2 \(prompt 2\) fail their crc32c"):
        EmbeddingCache(cache_copy, 1, 16).get(2)
    assert "embeds of row 2 (prompt 2) fail their crc32c" in _verify(cache_copy).output


@pytest.mark.parametrize("record", ["manifest", "progress"])
def test_a_cache_of_an_older_format_is_refused_in_one_line(cache_copy, tmp_path, record):
    """Format 1 (before this version's bytes): refused whole, by every reader and by a resume, never read in part."""
    path = cache_copy / (F.MANIFEST if record == "manifest" else f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROGRESS}")
    rec = json.loads(path.read_text())
    rec["format_version"] = 1
    path.write_text(json.dumps(rec))
    said = "written by an older wandistiller (format 1); rebuild it with teacher-cache"
    if record == "manifest":
        with pytest.raises(CacheError, match=said.replace("(", r"\(").replace(")", r"\)")):
            open_caches([cache_copy])
        _refused(_train(cache_copy, tmp_path / "out"), said)
        r = _verify(cache_copy)
        assert r.exit_code == 2 and said in r.stderr and "Traceback" not in r.stderr
    else:
        from cache.part_progress import PartProgress
        with pytest.raises(CacheError, match="format 1"):
            PartProgress.load(cache_copy, 0)


# -- negative.safetensors ------------------------------------------------------------------------------

def test_flipped_byte_in_the_negative_prompt(cache_copy, tmp_path):
    m = load_manifest(cache_copy)
    assert len(m.negative_sha256) == 64
    _flip(cache_copy / F.NEGATIVE, (cache_copy / F.NEGATIVE).stat().st_size - 3)  # tensor data: still parses
    r = _verify(cache_copy)
    assert r.exit_code == 1 and f"BAD {F.NEGATIVE}: fails its sha256 check" in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.NEGATIVE, "sha256", "rerun the same `wandistiller teacher-cache`")
    with pytest.raises(CacheError, match="sha256"):
        negative_embeds(cache_copy)  # sample/eval and stage two's validation


# -- the manifest --------------------------------------------------------------------------------------

def test_edited_guidance_no_longer_hashes_to_the_fingerprint(cache_copy, tmp_path):
    _edit_manifest(cache_copy, lambda m: m.update({"guidance": 7.5}))
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "its settings no longer hash to its fingerprint" in r.output
    assert "guidance is 7.5 there, 4.0 in parts/part-00000/progress.json" in r.output
    line = _refused(_train(cache_copy, tmp_path / "out"), F.MANIFEST, "guidance is 7.5",
                    "rerun the same `wandistiller teacher-cache` command")
    assert "distill.json" not in line and not (tmp_path / "out" / "student").exists()


def test_a_field_edited_in_both_manifest_and_progress_record_names_the_field_set(cache_copy):
    _edit_manifest(cache_copy, lambda m: m.update({"steps": 9}))
    prog = cache_copy / F.PARTS_DIR / F.part_dirname(0) / F.PROGRESS
    rec = json.loads(prog.read_text())
    rec["header"]["steps"] = 9
    prog.write_text(json.dumps(rec))
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "fingerprinted settings: boundary_ratio, cfg," in r.output and "--overwrite" in r.output


def test_the_fingerprint_hashes_the_header_less_where_the_teacher_was_found(tiny_cache):
    """The fingerprint is the sha256 of stage one's header (its progress record's, `teacher_identity` included)
    less the teacher's name, revision, folder and shape; every other field of the manifest is the manifest's own."""
    m = load_manifest(tiny_cache)
    header = json.loads((tiny_cache / F.PARTS_DIR / F.part_dirname(0) / F.PROGRESS).read_text())["header"]
    # (the shape's config: teacher_identity; teacher_lora_paths, where the LoRAs fused into it were: absent here)
    not_hashed = ("teacher", "revision", "teacher_path", "teacher_shape", "teacher_lora_paths")
    assert m.fingerprint == fingerprint({k: v for k, v in header.items() if k not in not_hashed})
    assert set(CacheHeader.NOT_FINGERPRINTED) == set(not_hashed) and m.header().to_json() == header
    own = set(m.to_json()) - set(header)
    assert own == {f.name for f in dataclasses.fields(Manifest)} - {f.name for f in dataclasses.fields(CacheHeader)}


@pytest.mark.parametrize("bad", ["../outside.tar", "/etc/hostname", "shards/../../outside.tar"])
def test_shard_paths_outside_the_cache_are_refused(cache_copy, tmp_path, bad):
    rel = load_manifest(cache_copy).shards[0].path
    if not bad.startswith("/"):  # the same bytes outside: without the check it would verify and train
        shutil.copy(cache_copy / rel, (cache_copy / bad).resolve())
    _edit_manifest(cache_copy, lambda m: m["shards"][0].update({"path": bad}))
    needle = f"shard path {bad!r} is outside the cache folder"
    with pytest.raises(CacheError, match="outside the cache folder"):
        open_caches([cache_copy])
    r = _verify(cache_copy)
    assert r.exit_code == 1 and needle in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.MANIFEST, needle, "rerun the same `wandistiller teacher-cache`")


# -- the checks themselves -----------------------------------------------------------------------------

def test_a_row_of_zero_tokens_reads_as_written(tmp_path):
    """Real tokens that are all zeros are stored like any others (every chunk written is kept) and pass the row's
    crc32c: zeros are never taken for a lost chunk, nor a lost chunk for zeros."""
    from cache.prompt_store import create_prompt_store
    from conftest import write_prompt_rows

    g = create_prompt_store(prompt_store_path(tmp_path, 0), n=2, max_len=8, dim=4, dtype_name="bfloat16", seeds=1,
                            latent_shape=(1, 1, 1, 1))
    emb = torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    emb[1, :3] = torch.randn(3, 4).bfloat16()
    write_prompt_rows(g, [0, 1], [0, 1], ["zeros", "x"], emb, torch.tensor([5, 3]))
    rows = PartRows(tmp_path, 0, 1)
    assert chunk_location(prompt_store_path(tmp_path, 0), F.Z_EMBEDS, 0) is not None  # stored
    assert np.array_equal(rows.trimmed(0), np.zeros((5, 4), np.uint16))
    assert rows.check(0, checksums=False) is None and rows.problems(0, "store", 0)[0].endswith("were never written")
    assert not list(tmp_path.rglob("*.partial"))  # files are renamed into place
