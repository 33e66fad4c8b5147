"""`cache verify` covers every byte a stage reads: the prompt stores' chunks and rows (crc32c), the negative
prompt (sha256 in the manifest), the manifest's own settings (against its fingerprint) and its shard paths
(inside the cache). Each corruption is named by `cache verify` (exit 1) and refused by `train-student` with one
line (exit 2); stores and manifests written before the checksums still verify, with notes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from cache import format as F
from cache.errors import CacheError
from cache.manifest import MANIFEST_FIELDS, NOT_FINGERPRINTED, fingerprint, load_manifest
from cache.prompt_store import (
    EMBED_CHUNK_TOKENS, TEXT_CHUNK, ChunkFiles, EmbeddingCache, FinalLatentCache, PartRows, negative_embeds,
    prompt_store_path, read_latents,
)
from cache.reader import open_caches
from cache.verify import verify_cache
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


def _chunk(cache: Path, name: str, row: int) -> Path:
    """The chunk file of row `row` of array `name` in the earlier layout (one file per row)."""
    g = zarr.open_group(str(prompt_store_path(cache, 0)), mode="r")
    return cache / STORE / name / ".".join(["c", str(row), *"0" * (g[name].ndim - 1)])


def _flip_row(cache: Path, name: str, row: int, offset: int) -> str:
    """Flip a byte `offset` bytes into row `row`'s first chunk of array `name` (inside its shard file); returns
    how messages name that chunk."""
    files = ChunkFiles.open(prompt_store_path(cache, 0) / name)
    idx = (row, *(0,) * (len(files.shape) - 1))
    path, start, _ = files.location(idx)
    _flip(path, start + offset)
    return files.chunk_name(idx)


# -- the prompt stores ---------------------------------------------------------------------------------

def test_flipped_byte_in_an_embeds_chunk(cache_copy, tmp_path):
    name = _flip_row(cache_copy, F.Z_EMBEDS, 3, 4)  # inside the first real token
    assert name == "embeds/c.0.0.0[3,0,0]"  # the file of rows 0-63, the chunk inside it
    r = _verify(cache_copy)
    assert r.exit_code == 1 and f"BAD {STORE}: embeds of row 3 (prompt 3): {name} fails its crc32c" in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.PROMPTS_ZARR, "prompt 3", "crc32c", "--overwrite")
    assert not (tmp_path / "out" / "student").exists()
    with pytest.raises(CacheError, match=r"embeds of row 3 \(prompt 3\) fail their crc32c"):
        EmbeddingCache(cache_copy, 1).get(3)  # what stage two's and sample's loaders read, checked on every read
    assert EmbeddingCache(cache_copy, 1).get(2).abs().sum() > 0


def test_flipped_embeds_byte_past_the_up_front_check_is_caught_when_read(cache_copy, tmp_path):
    """--verify size checks only that every chunk is there; the flipped token is refused when it is read."""
    _flip_row(cache_copy, F.Z_EMBEDS, 0, 4)
    r = _train(cache_copy, tmp_path / "out", "--verify", "size", "--max-steps", "8")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]  # after the progress bar's lines
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "embeds of row 0 (prompt 0) fail their crc32c" in errors[0] and "--overwrite" in errors[0]


def test_flipped_byte_in_a_final_latents_chunk(cache_copy, tmp_path):
    name = _flip_row(cache_copy, F.Z_FINAL_LATENTS, 2, 100)
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {STORE}: final_latents of row 2 (prompt 2): {name} fails its crc32c" in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.PROMPTS_ZARR, "prompt 2", "final_latents", "--overwrite")
    with pytest.raises(CacheError, match=r"final_latents of row 2 \(prompt 2\)"):
        read_latents(cache_copy, 1, [(2, 0)])  # sample/eval's reader
    with pytest.raises(CacheError, match="crc32c"):
        FinalLatentCache(cache_copy, 1).get(2, 0)  # the segment objective's
    assert read_latents(cache_copy, 1, [(1, 0)])[1].abs().sum() > 0


def test_flipped_byte_in_init_noise_is_named(cache_copy):
    _flip_row(cache_copy, F.Z_INIT_NOISE, 5, 8)
    r = _verify(cache_copy)
    assert r.exit_code == 1 and f"BAD {STORE}: init_noise of row 5 (prompt 5)" in r.output
    with pytest.raises(CacheError, match=r"init_noise of row 5 \(prompt 5\)"):
        read_latents(cache_copy, 1, [(5, 0)])


def test_deleted_embeds_file_is_named_never_zeros(cache_copy, tmp_path):
    (cache_copy / STORE / F.Z_EMBEDS / "c.0.0.0").unlink()  # rows 0-63: every row of this cache
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {STORE}: embeds of row 4 (prompt 4): chunk embeds/c.0.0.0[4,0,0] is missing" in r.output
    line = _refused(_train(cache_copy, tmp_path / "out"), F.PROMPTS_ZARR, "prompt 0", "c.0.0.0[0,0,0] is missing",
                    "--overwrite")
    assert line == _refused(_train(cache_copy, tmp_path / "out2", "--verify", "size"))  # found without reading
    with pytest.raises(CacheError, match=re.escape("c.0.0.0[4,0,0] is missing")):
        EmbeddingCache(cache_copy, 1).get(4)


def test_a_store_without_checksums_verifies_with_a_note_and_still_refuses_a_missing_chunk(cache_copy, tmp_path):
    """A store and manifest as the previous version wrote them: no crc32c codec, no row checksums, no
    teacher_identity or negative_sha256 in the manifest. It verifies (notes, not problems) and reads the same."""
    before = {p: EmbeddingCache(cache_copy, 1).get(p) for p in range(7)}
    _as_previous_version(cache_copy)
    notes: list[str] = []
    assert verify_cache(cache_copy, progress=False, notes=notes) == []
    assert len(notes) == 3 and all("earlier WanDistiller" in n for n in notes), notes
    assert any(F.F_TEACHER_IDENTITY in n for n in notes) and any(F.F_NEGATIVE_SHA256 in n for n in notes)
    assert any(n.startswith(f"{STORE} records no checksums for seq_lens, prompt_idx, text, embeds") for n in notes)
    r = _verify(cache_copy)
    assert r.exit_code == 0 and r.stdout.splitlines() == [f"NOTE {n}" for n in notes] + r.stdout.splitlines()[-1:]
    assert r.stdout.splitlines()[-1].startswith("OK")
    cache = EmbeddingCache(cache_copy, 1)
    assert all(torch.equal(cache.get(p), before[p]) for p in range(7))
    _chunk(cache_copy, F.Z_EMBEDS, 6).unlink()
    assert "embeds of row 6 (prompt 6): chunk embeds/c.6.0.0 is missing" in _verify(cache_copy).output
    with pytest.raises(CacheError, match="c.6.0.0 is missing"):
        EmbeddingCache(cache_copy, 1).get(6)


def _as_previous_version(cache: Path) -> None:
    """Rewrite part 0's store in the layout of the version before the checksums (zarr's default zstd for the
    small arrays, bare chunks for the rest, no row_crc32c group) and drop the manifest fields it did not write."""
    path = prompt_store_path(cache, 0)
    g = zarr.open_group(str(path), mode="r")
    values = {name: g[name][:] for name in g.array_keys()}
    dtype_name = g[F.Z_EMBEDS].attrs[F.Z_ATTR_TORCH_DTYPE]
    shapes = {name: g[name].shape for name in values}
    shutil.rmtree(path)
    old = zarr.open_group(str(path), mode="w")
    n = shapes[F.Z_SEQ_LENS][0]
    old.create_array(F.Z_PROMPT_IDX, shape=(n,), dtype="int64", chunks=(n,), fill_value=-1)
    old.create_array(F.Z_TEXT, shape=(n,), dtype=str, chunks=(min(n, TEXT_CHUNK),))
    old.create_array(F.Z_SEQ_LENS, shape=(n,), dtype="int32", chunks=(n,), fill_value=-1)
    flat = {"name": "default", "separator": "."}
    _, max_len, dim = shapes[F.Z_EMBEDS]
    emb = old.create_array(F.Z_EMBEDS, shape=shapes[F.Z_EMBEDS], dtype=values[F.Z_EMBEDS].dtype,
                           chunks=(1, min(max_len, EMBED_CHUNK_TOKENS), dim), fill_value=0, compressors=None,
                           chunk_key_encoding=flat)
    emb.attrs[F.Z_ATTR_TORCH_DTYPE] = dtype_name
    for name in (F.Z_INIT_NOISE, F.Z_FINAL_LATENTS):
        old.create_array(name, shape=shapes[name], dtype="float32", chunks=(1, *shapes[name][1:]), fill_value=0.0,
                         compressors=None, chunk_key_encoding=flat)
    for name, v in values.items():
        old[name][:] = v
    assert not any("crc32c" in p.read_text() for p in path.rglob("zarr.json"))
    _edit_manifest(cache, lambda m: [m.pop(k) for k in (F.F_TEACHER_IDENTITY, F.F_NEGATIVE_SHA256)])


# -- negative.safetensors ------------------------------------------------------------------------------

def test_flipped_byte_in_the_negative_prompt(cache_copy, tmp_path):
    m = load_manifest(cache_copy)
    assert len(m[F.F_NEGATIVE_SHA256]) == 64
    _flip(cache_copy / F.NEGATIVE, (cache_copy / F.NEGATIVE).stat().st_size - 3)  # tensor data: still parses
    r = _verify(cache_copy)
    assert r.exit_code == 1 and f"BAD {F.NEGATIVE}: fails its sha256 check" in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.NEGATIVE, "sha256", "rerun the same `wandistiller teacher-cache`")
    with pytest.raises(CacheError, match="sha256"):
        negative_embeds(cache_copy)  # sample/eval and stage two's validation


# -- the manifest --------------------------------------------------------------------------------------

def test_edited_guidance_no_longer_hashes_to_the_fingerprint(cache_copy, tmp_path):
    _edit_manifest(cache_copy, lambda m: m.update({F.F_GUIDANCE: 7.5}))
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "its settings no longer hash to its fingerprint" in r.output
    assert "guidance is 7.5 there, 4.0 in parts/part-00000/progress.json" in r.output
    line = _refused(_train(cache_copy, tmp_path / "out"), F.MANIFEST, "guidance is 7.5",
                    "rerun the same `wandistiller teacher-cache` command")
    assert "distill.json" not in line and not (tmp_path / "out" / "student").exists()


def test_a_field_edited_in_both_manifest_and_progress_record_names_the_field_set(cache_copy):
    _edit_manifest(cache_copy, lambda m: m.update({F.F_STEPS: 9}))
    prog = cache_copy / F.PARTS_DIR / F.part_dirname(0) / F.PROGRESS
    rec = json.loads(prog.read_text())
    rec["header"][F.F_STEPS] = 9
    prog.write_text(json.dumps(rec))
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "fingerprinted settings: boundary_ratio, cfg," in r.output and "--overwrite" in r.output


def test_the_fingerprint_is_what_it_was_before_teacher_identity_was_recorded(tiny_cache):
    """Recording teacher_identity in the header does not change the fingerprint: an existing cache stays valid."""
    m = load_manifest(tiny_cache)
    header = json.loads((tiny_cache / F.PARTS_DIR / F.part_dirname(0) / F.PROGRESS).read_text())["header"]
    identity = header.pop(F.F_TEACHER_IDENTITY)
    before = fingerprint({k: v for k, v in header.items() if k not in (F.F_TEACHER, F.F_REVISION, F.F_TEACHER_PATH)}
                         | {"teacher_identity": identity})  # how stage one computed it before
    assert m[F.F_FINGERPRINT] == before and m[F.F_TEACHER_IDENTITY] == identity
    own = set(m) - set(header) - {F.F_TEACHER_IDENTITY}
    assert own == set(MANIFEST_FIELDS) and not own & set(NOT_FINGERPRINTED)  # the rest is settings, hashed


@pytest.mark.parametrize("bad", ["../outside.tar", "/etc/hostname", "shards/../../outside.tar"])
def test_shard_paths_outside_the_cache_are_refused(cache_copy, tmp_path, bad):
    rel = load_manifest(cache_copy)[F.F_SHARDS][0][F.S_PATH]
    if not bad.startswith("/"):  # the same bytes outside: without the check it would verify and train
        shutil.copy(cache_copy / rel, (cache_copy / bad).resolve())
    _edit_manifest(cache_copy, lambda m: m[F.F_SHARDS][0].update({F.S_PATH: bad}))
    needle = f"shard path {bad!r} is outside the cache folder"
    with pytest.raises(CacheError, match="outside the cache folder"):
        open_caches([cache_copy])
    r = _verify(cache_copy)
    assert r.exit_code == 1 and needle in r.output
    _refused(_train(cache_copy, tmp_path / "out"), F.MANIFEST, needle, "rerun the same `wandistiller teacher-cache`")


# -- the checks themselves -----------------------------------------------------------------------------

def test_a_row_whose_chunk_of_zeros_was_never_written_passes_by_its_crc32c(tmp_path):
    """A chunk holding only zeros is not written (zarr's rule): the row's crc32c tells it from a deleted one."""
    from cache.prompt_store import create_prompt_store, write_prompt_rows

    g = create_prompt_store(prompt_store_path(tmp_path, 0), n=2, max_len=8, dim=4, dtype_name="bfloat16", seeds=1,
                            latent_shape=(1, 1, 1, 1))
    emb = torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    emb[1, :3] = torch.randn(3, 4).bfloat16()
    write_prompt_rows(g, [0, 1], [0, 1], ["zeros", "x"], emb, torch.tensor([5, 3]))
    rows = PartRows(tmp_path, 0, 1)
    assert rows.missing_chunk(0) == "embeds/c.0.0.0[0,0,0]"
    assert np.array_equal(rows.trimmed(0), np.zeros((5, 4), np.uint16)) and rows.check(0, False, False) is None
    assert not list(tmp_path.rglob("*.partial"))  # chunks are renamed into place


def test_the_integrity_measurement_runs(tmp_path):
    """bench/real_size.py --integrity, at a few A14B rows: every design it compares reads back what it wrote."""
    from bench.real_size import integrity_costs

    rows = integrity_costs(tmp_path, rows=3, reps=1)
    names = {r["name"] for r in rows}
    assert {"integrity_read_embeds_chosen", "integrity_read_embeds_chunk_crc32c", "integrity_read_embeds_sha256",
            "integrity_read_embeds_zstd_checksum", "integrity_write_embeds_chosen"} <= names
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in rows) and not list(tmp_path.iterdir())
