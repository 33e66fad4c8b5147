"""cache/reader.py: the shard index, random-access reads, refusal of bad caches; and stage two's exact epoch
partition over them (stages/train_student/epoch.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from cache import format as F
from cache.cache_error import CacheError
from cache.manifest import load_manifest
from cache.reader import (
    SHARD_MEMBERS, SHARD_CHECKSUM, SHARD_SIZE, CacheIndex, SampleReader, ShardError, empty_table,
    fill_table, open_caches, scan_shard, shard_list,
)
from cache.reader import decode_sample
from stages.train_student.epoch import EpochPlan


def build_index(dirs, checksum=True) -> CacheIndex:
    caches = open_caches(list(dirs))
    table = empty_table(caches)
    for sid, (ci, d, rec, first) in enumerate(shard_list(caches)):
        fill_table(table, sid, ci, first, scan_shard(d, rec, checksum))
    return CacheIndex(caches, table)


@pytest.fixture
def cache_copy(tiny_cache, tmp_path) -> Path:
    """A private copy of the tiny cache that a test may damage."""
    return Path(shutil.copytree(tiny_cache, tmp_path / "cache"))


def _streamed(cache_dir: Path) -> dict[str, tuple[dict, dict]]:
    """Every sample as webdataset's streaming reader sees it."""
    m = json.loads((cache_dir / F.MANIFEST).read_text())
    urls = [str(cache_dir / s["path"]) for s in m["shards"]]
    out = {}
    for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        out[s["__key__"]] = decode_sample({F.EXT_TENSORS: s[F.EXT_TENSORS], F.EXT_META: s[F.EXT_META]})
    return out


@pytest.mark.parametrize("checksum", [True, False])
def test_index_reads_every_sample_as_webdataset_does(tiny_cache, checksum):
    index = build_index([tiny_cache], checksum)
    streamed = _streamed(tiny_cache)
    m = json.loads((tiny_cache / F.MANIFEST).read_text())
    assert len(index) == m["samples"] == len(streamed) == 28
    reader = SampleReader(index, max_open=1)  # forces reopening: descriptors are evicted and reopened
    for row in reversed(range(len(index))):  # random access, not stream order
        tensors, meta = reader.read(row)
        want_t, want_m = streamed[index.key(row)]
        assert meta == want_m
        assert set(tensors) == set(want_t)
        for k in tensors:
            assert torch.equal(tensors[k], want_t[k])
    reader.close()


@pytest.mark.parametrize("n,world,batch,accum", [
    (28, 1, 4, 1), (28, 2, 3, 1), (28, 3, 2, 2), (21, 2, 2, 2), (29, 4, 3, 3), (7, 2, 3, 1), (1, 1, 1, 1),
])
def test_partition_is_exact(n, world, batch, accum):
    plan = EpochPlan(n, world, batch, accum)
    one = EpochPlan(n, 1, batch * world, accum)  # one process, same global batch
    assert plan.steps == one.steps and plan.micro_steps == one.micro_steps
    for epoch in range(2):
        perm = plan.order(seed=3, epoch=epoch)
        assert sorted(perm.tolist()) == list(range(n))
        seen = [[] for _ in range(world)]
        for step in range(plan.steps):
            step_total = 0
            for micro in plan.micro_range(step):
                parts = [plan.positions(micro, r) for r in range(world)]
                union = np.sort(np.concatenate(parts))
                # the micro-step's union over ranks is the one-process batch
                assert union.tolist() == one.positions(micro, 0).tolist()
                for r in range(world):
                    seen[r] += perm[parts[r]].tolist()
                step_total += len(union)
            assert step_total == plan.step_samples(step)
        flat = [k for s in seen for k in s]
        assert len(flat) == len(set(flat)) == n  # disjoint, and the union is the epoch
        assert [len(s) for s in seen] == [len(range(r, plan.n, plan.world)) for r in range(world)]
        assert sum(plan.step_samples(s) for s in range(plan.steps)) == n


def test_order_is_a_function_of_seed_and_epoch():
    plan = EpochPlan(100, 2, 4)
    assert np.array_equal(plan.order(0, 1), EpochPlan(100, 4, 7).order(0, 1))  # not of world or batch
    assert not np.array_equal(plan.order(0, 0), plan.order(0, 1))
    assert not np.array_equal(plan.order(0, 0), plan.order(1, 0))


def test_flipped_byte_fails_the_checksum_but_not_the_size_check(cache_copy):
    rec = load_manifest(cache_copy).shards[1]
    path = cache_copy / rec.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    scan_shard(cache_copy, rec, checksum=False)  # same size, headers intact
    with pytest.raises(ShardError) as e:
        scan_shard(cache_copy, rec, checksum=True)
    assert e.value.code == SHARD_CHECKSUM and rec.path in str(e.value) and "checksum" in str(e.value)


def test_truncated_shard_and_wrong_count_are_refused(cache_copy):
    rec = load_manifest(cache_copy).shards[0]
    path = cache_copy / rec.path
    full = path.read_bytes()
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(ShardError) as e:
        scan_shard(cache_copy, rec, checksum=False)
    assert e.value.code == SHARD_SIZE and rec.path in str(e.value)
    path.write_bytes(full)
    lying = dataclasses.replace(rec, samples=rec.samples + 1)
    with pytest.raises(ShardError) as e:
        scan_shard(cache_copy, lying, checksum=True)
    assert e.value.code == SHARD_MEMBERS and "manifest says" in str(e.value)


def test_open_caches_refuses_missing_empty_twice_and_mixed(tiny_cache, cache_copy, tmp_path):
    with pytest.raises(CacheError, match="does not exist"):
        open_caches([tmp_path / "nope"])
    with pytest.raises(CacheError, match="given twice"):
        open_caches([tiny_cache, Path(str(tiny_cache) + "/.")])
    other = Path(shutil.copytree(tiny_cache, tmp_path / "other"))
    m = json.loads((other / F.MANIFEST).read_text())
    m["fingerprint"] = "0" * 64
    (other / F.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CacheError, match="different settings"):
        open_caches([tiny_cache, other])
    m.update({"shards": [], "samples": 0})
    (other / F.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CacheError, match="holds no samples"):
        open_caches([other])


def test_two_copies_of_one_cache_give_each_sample_once(tiny_cache, cache_copy):
    index = build_index([tiny_cache, cache_copy])
    assert len(index) == 28 and index.duplicates == 28
    assert len({index.key(r) for r in range(len(index))}) == 28


def test_reader_decodes_safetensors_as_safetensors_does():
    """SampleReader decodes tensor members itself, as views of the buffer it read (safetensors' load copies
    each tensor out): the same tensors as safetensors' own load, and ValueError for a malformed member."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from cache.reader import _tensors_in

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 4, generator=g).bfloat16(), "b": torch.randn(2, 1, 5, generator=g),
               "c": torch.arange(6, dtype=torch.int64).view(2, 3), "d": torch.zeros(0, 4, dtype=torch.float16),
               "e": torch.tensor(2.5), "f": torch.tensor([True, False])}
    data = st_save(tensors)
    got, want = _tensors_in(bytearray(data)), st_load(data)
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    bad = bytearray(data)
    bad[8:8 + 2] = b"[["  # the header is no longer JSON
    for member in (bad, bytearray(data[:-4]), bytearray(b"\xff" * 8)):
        with pytest.raises(ValueError):
            _tensors_in(member)
