"""Unit tests of the cache contract: names, storage codecs, shard writer, progress, manifest, fingerprint."""

from __future__ import annotations

import hashlib
import json
import tarfile

import pytest
import torch

from cache import format as F
from cache.atomic import atomic_write_json
from cache.errors import CacheError
from cache.manifest import fingerprint, load_manifest, try_write_manifest
from cache.progress import PartProgress, list_parts
from cache.prompt_store import EmbeddingCache, create_prompt_store, prompt_store_path, read_embeds, write_prompt_rows
from cache.writer import ShardWriter, decode_sample


def test_sample_key_round_trip():
    key = F.sample_key(1234, 7, 39)
    assert key == "p00001234_s07_k039"
    assert F.parse_key(key) == (1234, 7, 39)
    with pytest.raises(ValueError):
        F.parse_key("not-a-key")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_storage_codec_keeps_bits(dtype):
    t = torch.randn(3, 5).to(dtype)
    back = F.storage_to_torch(F.torch_to_storage(t), F.DTYPE_NAMES[dtype])
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def _write_shard(root, samples):
    w = ShardWriter(root, part=0, index=0)
    for key, tensors, meta in samples:
        w.write(key, tensors, meta)
    return w, w.close()


def _samples(n=3):
    g = torch.Generator().manual_seed(0)
    return [(F.sample_key(i, 0, 1), {F.T_X_T: torch.randn(4, 1, 2, 2, generator=g).bfloat16(),
                                     F.T_TARGET: torch.randn(4, 1, 2, 2, generator=g)},
             {F.M_PROMPT_IDX: i, F.M_SEED_IDX: 0, F.M_STEP: 1, F.M_TIMESTEP: 999.0}) for i in range(n)]


def test_shard_writer_round_trip_and_record(tmp_path):
    samples = _samples()
    w, rec = _write_shard(tmp_path, samples)
    path = tmp_path / rec[F.S_PATH]
    assert path.exists() and not w.tmp.exists()
    data = path.read_bytes()
    assert rec[F.S_BYTES] == len(data)
    assert rec[F.S_SHA256] == hashlib.sha256(data).hexdigest()
    assert rec[F.S_SAMPLES] == 3
    with tarfile.open(path) as tar:
        names = tar.getnames()
        members = {n: tar.extractfile(n).read() for n in names}
    assert names == [f"{k}.{ext}" for k, _, _ in samples for ext in (F.EXT_META, F.EXT_TENSORS)]
    for key, tensors, meta in samples:
        got_t, got_m = decode_sample({ext: members[f"{key}.{ext}"] for ext in (F.EXT_META, F.EXT_TENSORS)})
        assert got_m == meta
        for name, t in tensors.items():
            assert got_t[name].dtype == t.dtype and torch.equal(got_t[name], t)


def test_shard_bytes_are_reproducible(tmp_path):
    _, a = _write_shard(tmp_path / "a", _samples())
    _, b = _write_shard(tmp_path / "b", _samples())
    assert a[F.S_SHA256] == b[F.S_SHA256]


def test_aborted_shard_leaves_nothing(tmp_path):
    w = ShardWriter(tmp_path, part=2, index=5)
    key, tensors, meta = _samples(1)[0]
    w.write(key, tensors, meta)
    w.abort()
    assert list((tmp_path / F.SHARDS_DIR).iterdir()) == []


def test_atomic_json_never_leaves_tmp(tmp_path):
    p = tmp_path / "x.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]


def test_fingerprint_is_canonical_and_sensitive():
    a = fingerprint({"steps": 4, "guidance": 4.0, "teacher": {"x": "1"}})
    assert a == fingerprint({"teacher": {"x": "1"}, "guidance": 4.0, "steps": 4})
    assert a != fingerprint({"steps": 5, "guidance": 4.0, "teacher": {"x": "1"}})
    assert len(a) == 64


def _progress(part, num_parts, fp="f" * 64, complete=True, shards=()):
    return PartProgress(part=part, num_parts=num_parts, fingerprint=fp, prompts=1, blocks=1, batch_size=1,
                        complete=complete, shards=list(shards), header={F.F_STEPS: 4, F.F_PROMPTS: 2})


def test_manifest_waits_for_every_part_and_aggregates(tmp_path):
    rec = {F.S_PATH: "shards/part-00000-000000.tar", F.S_PART: 0, F.S_SAMPLES: 4, F.S_BYTES: 100, F.S_SHA256: "0"}
    _progress(0, 2, shards=[rec]).save(tmp_path)
    assert try_write_manifest(tmp_path, 2) is None  # part 1 missing
    _progress(1, 2, complete=False).save(tmp_path)
    assert try_write_manifest(tmp_path, 2) is None  # part 1 incomplete
    _progress(1, 2, shards=[dict(rec, path="shards/part-00001-000000.tar", part=1)]).save(tmp_path)
    m = try_write_manifest(tmp_path, 2)
    assert m[F.F_SAMPLES] == 8 and m[F.F_BYTES] == 200 and len(m[F.F_SHARDS]) == 2 and m[F.F_STEPS] == 4
    assert load_manifest(tmp_path)[F.F_FINGERPRINT] == "f" * 64
    assert list_parts(tmp_path) == [0, 1]


def test_manifest_refuses_parts_with_different_fingerprints(tmp_path):
    _progress(0, 2).save(tmp_path)
    _progress(1, 2, fp="e" * 64).save(tmp_path)
    with pytest.raises(CacheError, match="different settings"):
        try_write_manifest(tmp_path, 2)


@pytest.mark.parametrize("content,match", [(None, "has no manifest.json"), ("{not json", "not valid JSON"),
                                           ('{"format_version": 99}', "format_version 99")])
def test_load_manifest_errors_name_the_fix(tmp_path, content, match):
    if content is not None:
        (tmp_path / F.MANIFEST).write_text(content)
    with pytest.raises(CacheError, match=match):
        load_manifest(tmp_path)


def test_prompt_store_round_trip_bf16_and_unwritten_rows(tmp_path):
    path = prompt_store_path(tmp_path, 1)
    g = create_prompt_store(path, n=3, max_len=6, dim=4, dtype_name="bfloat16", seeds=1, latent_shape=(4, 1, 2, 2))
    emb = torch.zeros(2, 6, 4, dtype=torch.bfloat16)
    emb[:, :3] = torch.randn(2, 3, 4).bfloat16()
    write_prompt_rows(g, [0, 2], [1, 7], ["a", "b"], emb, torch.tensor([3, 3]))
    e, n = read_embeds(g, 2)
    assert n == 3 and e.dtype == torch.bfloat16 and torch.equal(e, emb[1])
    assert read_embeds(g, 1)[1] == -1  # never written: readers can tell
    cache = EmbeddingCache(tmp_path, num_parts=3, capacity=1)
    assert torch.equal(cache.get(7), emb[1])  # prompt 7 -> part 1, row 2
    with pytest.raises(ValueError, match="never written"):
        cache.get(4)  # part 1 row 1
