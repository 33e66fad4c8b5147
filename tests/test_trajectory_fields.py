"""The prompt store's per-trajectory arrays follow their declarations (cache/schema.py TRAJECTORY_FIELDS): an
image-to-video condition is one declaration that the header turns on, which the store creates, writes and reads
back, its checks compare with the manifest and the size arithmetic counts; a cache without one keeps its bytes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from zarr.codecs import Crc32cCodec

from cache import format as F
from cache.prompt_store import (
    PartRows, PromptRowWriter, create_prompt_store, open_prompt_store, prompt_store_path, read_latents,
    write_latent_rows,
)
from cache.records import CacheHeader, Manifest
from cache.schema import trajectory_fields
from cache.size import project, prompt_bytes
from cache.store_checks import prompt_row_problems, store_problem
from cache.verify import verify_cache
from cache.zarr_private import FLAT_KEYS
from conftest import sample_header


def add_trajectories(g, name, rows, values):
    """Every seed of `rows`' per-trajectory array `name`, values [b, seeds, *shape], as stage one writes them."""
    seeds = values.shape[1]
    return write_latent_rows(g, name, [r for r in rows for _ in range(seeds)], list(range(seeds)) * len(rows),
                             values.flatten(0, 1))

COND = [5, 1, 8, 8]  # a concat condition: the mask's channels and the image latent's, of the latent's size


def test_the_condition_is_written_into_the_header_only_when_set():
    plain, cond = sample_header(), sample_header(condition="concat", condition_shape=COND)
    assert "condition" not in plain.to_json() and "condition_shape" not in plain.to_json()
    assert plain.settings_fingerprint() == CacheHeader.from_json(plain.to_json()).settings_fingerprint()
    assert CacheHeader.from_json(plain.to_json()).condition == "none"  # an old manifest reads as "none"
    assert cond.to_json()["condition"] == "concat" and cond.to_json()["condition_shape"] == COND
    assert CacheHeader.from_json(json.loads(json.dumps(cond.to_json()))) == cond
    assert cond.settings_fingerprint() != plain.settings_fingerprint()
    assert [f.name for f in trajectory_fields(plain)] == [F.Z_INIT_NOISE, F.Z_FINAL_LATENTS]
    assert [f.name for f in trajectory_fields(cond)] == [F.Z_INIT_NOISE, F.Z_FINAL_LATENTS, F.Z_CONDITION]


@pytest.mark.parametrize("edit,needle", [
    ({"condition": "image"}, "'condition' is 'image', expected one of none, concat, first_frame"),
    ({"condition": "concat"}, "'condition' and 'condition_shape' disagree"),
    ({"condition_shape": COND}, "'condition' and 'condition_shape' disagree"),
    ({"condition": "first_frame", "condition_shape": [4, 0]}, "'condition_shape' is [4, 0], expected a list of sizes"),
])
def test_a_wrong_condition_is_refused_in_one_line(edit, needle):
    with pytest.raises(ValueError, match="condition") as e:
        CacheHeader.from_json(sample_header().to_json() | edit)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_condition_round_trips_through_the_store(tmp_path):
    n, seeds, latent = 3, 2, (4, 1, 8, 8)
    path = prompt_store_path(tmp_path, 0)
    g = create_prompt_store(path, n, 6, 4, "bfloat16", seeds, latent, "concat", tuple(COND))
    cond = torch.randn(n, seeds, *COND, generator=torch.Generator().manual_seed(0))
    writer = PromptRowWriter(g)
    written = add_trajectories(g, F.Z_CONDITION, [2, 0], cond[[2, 0]])
    add_trajectories(g, F.Z_CONDITION, [1], cond[[1]])
    writer.close()
    assert all(p.is_file() for p in written)
    z = open_prompt_store(path)
    assert z[F.Z_CONDITION].shape == (n, seeds, *COND) and np.array_equal(z[F.Z_CONDITION][:], cond.numpy())
    rows = PartRows(tmp_path, 0, 1)
    assert all(np.array_equal(rows.latents(F.Z_CONDITION, r), cond[r].numpy()) for r in range(n))
    (got,) = read_latents(tmp_path, 1, [(1, 1), (0, 0)], names=(F.Z_CONDITION,))
    assert torch.equal(got, cond[[1, 0], [1, 0]])
    plain = create_prompt_store(prompt_store_path(tmp_path / "plain", 0), n, 6, 4, "bfloat16", seeds, latent)
    assert F.Z_CONDITION not in plain and F.Z_FINAL_LATENTS in plain
    assert F.Z_CONDITION not in PartRows(tmp_path / "plain", 0, 1)._latents


def test_the_size_arithmetic_counts_the_condition_as_stored(tmp_path):
    plain = sample_header(prompts=3, seeds_per_prompt=2)
    cond = sample_header(prompts=3, seeds_per_prompt=2, condition="concat", condition_shape=COND)
    assert prompt_bytes(cond) - prompt_bytes(plain) == 2 * np.prod(COND) * 4 + 4
    g = create_prompt_store(prompt_store_path(tmp_path, 0), 3, 32, 32, "float32", 2, (4, 1, 8, 8), "concat",
                            tuple(COND))
    writer = PromptRowWriter(g)
    add_trajectories(g, F.Z_CONDITION, [0, 1, 2], torch.randn(3, 2, *COND))
    writer.close()
    stored = sum(p.stat().st_size for p in (prompt_store_path(tmp_path, 0) / F.Z_CONDITION).iterdir()
                 if p.name != "zarr.json")
    sizes = [project(h, 3, batch_size=1, samples_per_shard=4) for h in (plain, cond)]
    assert sizes[1].store_bytes - sizes[0].store_bytes == stored


def _with_condition(cache, shape):
    """The cache's manifest says it holds a concat condition of COND (fingerprint made to agree), and its store a
    condition array of `shape` per trajectory, every trajectory's written."""
    m = json.loads((cache / F.MANIFEST).read_text()) | {"condition": "concat", "condition_shape": COND}
    m["fingerprint"] = Manifest.from_json(m).settings_fingerprint()
    (cache / F.MANIFEST).write_text(json.dumps(m))
    g = open_prompt_store(prompt_store_path(cache, 0), mode="r+")
    rows, seeds = m["prompts"], m["seeds_per_prompt"]
    one = (seeds, *shape)
    g.create_array(F.Z_CONDITION, shape=(rows, *one), dtype="float32", chunks=(1, *one),
                   shards=(min(rows, F.ROWS_PER_FILE), *one), fill_value=0.0, compressors=Crc32cCodec(),
                   chunk_key_encoding=FLAT_KEYS)
    writer = PromptRowWriter(g)
    add_trajectories(g, F.Z_CONDITION, list(range(rows)), torch.rand(rows, *one) + 0.5)
    writer.close()


def test_verify_accepts_a_cache_with_or_without_a_condition_and_refuses_one_of_another_shape(tiny_cache, tmp_path):
    m = Manifest.from_json(json.loads((tiny_cache / F.MANIFEST).read_text()))
    assert m.num_parts == 1 and m.condition == "none" and store_problem(tiny_cache, m) is None
    good, bad = tmp_path / "good", tmp_path / "bad"
    for dst, shape in ((good, COND), (bad, [5, 1, 8, 4])):
        shutil.copytree(tiny_cache, dst)
        _with_condition(dst, shape)
    assert verify_cache(good, progress=False) == []
    problems = verify_cache(bad, progress=False)
    assert len(problems) == 1 and f"{F.Z_CONDITION} is float32 [7, 1, 5, 1, 8, 4]" in problems[0]
    assert "[7, 1, 5, 1, 8, 8]" in problems[0]
    # a manifest saying a condition of a store without one, and a condition row damaged
    lacking = Manifest.from_json(json.loads((good / F.MANIFEST).read_text()))
    assert f"lacks its condition array ({F.Z_CONDITION})" in store_problem(tiny_cache, lacking)
    chunk = prompt_store_path(good, 0) / F.Z_CONDITION / "c.0.0.0.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    found = prompt_row_problems(good, 1, m.prompts, checksums=True)
    assert any(f"{F.Z_CONDITION} of row 0 (prompt 0) fail their crc32c" in p for p in found), found
