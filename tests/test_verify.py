"""`cache verify` finds what went wrong with a cache and names it."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from cache import format as F
from pipeline.cli import main


@pytest.fixture
def cache_copy(tiny_cache, tmp_path):
    dst = tmp_path / "cache"
    shutil.copytree(tiny_cache, dst)
    return dst


def _verify(path):
    return CliRunner().invoke(main, ["cache", "verify", str(path)], catch_exceptions=False)


def _first_shard(cache):
    m = json.loads((cache / F.MANIFEST).read_text())
    return cache / m["shards"][0]["path"], m["shards"][0]["path"]


def test_sound_cache_verifies(tiny_cache):
    r = _verify(tiny_cache)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("OK")


def test_truncated_shard(cache_copy):
    path, rel = _first_shard(cache_copy)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {rel}:" in r.output and "truncated" in r.output


def test_flipped_byte_inside_tensor_data(cache_copy):
    path, rel = _first_shard(cache_copy)
    data = bytearray(path.read_bytes())
    # the last bytes of the first sample's safetensors member are float data: the tar still parses
    i = data.index(b"x_t") + 600
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {rel}: crc32c mismatch" in r.output


def test_deleted_shard_and_missing_negative(cache_copy):
    path, rel = _first_shard(cache_copy)
    path.unlink()
    (cache_copy / F.NEGATIVE).unlink()
    r = _verify(cache_copy)
    assert r.exit_code == 1
    assert f"BAD {rel}: missing" in r.output and f"BAD {F.NEGATIVE}: missing" in r.output


def test_manifest_edited_by_hand(cache_copy):
    m = json.loads((cache_copy / F.MANIFEST).read_text())
    m["shards"][1]["samples"] += 1
    (cache_copy / F.MANIFEST).write_text(json.dumps(m))
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "manifest says" in r.output


def test_unwritten_zarr_row(cache_copy):
    from cache.prompt_store import open_prompt_store, prompt_store_path

    g = open_prompt_store(prompt_store_path(cache_copy, 0), mode="r+")
    g[F.Z_SEQ_LENS][2] = -1
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "row 2 (prompt 2) was never written" in r.output


def test_not_a_cache(tmp_path):
    r = _verify(tmp_path)
    assert r.exit_code == 2 and "has no manifest.json and no parts/: it is not a cache" in r.output


def test_an_unfinished_cache_is_named_not_verified(cache_copy):
    (cache_copy / F.MANIFEST).unlink()
    r = _verify(cache_copy)
    assert r.exit_code == 2 and "stage one has not finished there" in r.output and "BAD" not in r.output
