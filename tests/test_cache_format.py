"""Unit tests of the cache contract: names, storage codecs, shard writer, progress, manifest, fingerprint."""

from __future__ import annotations

import dataclasses
import json
import tarfile

import numpy as np
import pytest
import torch

from cache import format as F
from cache.atomic import atomic_write_json
from cache.checksum import crc32c
from cache.cache_error import CacheError
from cache.manifest import load_manifest, try_write_manifest
from cache.records import ShardRecord, fingerprint
from cache.part_progress import PartProgress, list_parts
from cache.prompt_store import EmbeddingCache, create_prompt_store, prompt_store_path
from cache.reader import decode_sample
from cache.writer import ShardWriter
from conftest import sample_header as header, write_prompt_rows


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
    return w, w.close([0])


def _samples(n=3):
    g = torch.Generator().manual_seed(0)
    return [(F.sample_key(i, 0, 1), {F.T_X_T: torch.randn(4, 1, 2, 2, generator=g).bfloat16(),
                                     F.T_TARGET: torch.randn(4, 1, 2, 2, generator=g)},
             {F.M_PROMPT_IDX: i, F.M_SEED_IDX: 0, F.M_STEP: 1, F.M_TIMESTEP: 999.0}) for i in range(n)]


def test_shard_writer_round_trip_and_record(tmp_path):
    samples = _samples()
    w, rec = _write_shard(tmp_path, samples)
    path = tmp_path / rec.path
    assert path.exists() and not w.tmp.exists()
    data = path.read_bytes()
    assert rec.bytes == len(data)
    assert rec.crc32c == crc32c(data)
    assert rec.samples == 3
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
    assert (tmp_path / "a" / a.path).read_bytes() == (tmp_path / "b" / b.path).read_bytes()
    assert a.crc32c == b.crc32c


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
                        samples_per_shard=4, complete=complete, shards=list(shards), header=header())


def test_manifest_waits_for_every_part_and_aggregates(tmp_path):
    rec = ShardRecord(path="shards/part-00000-000000.tar", part=0, samples=4, bytes=100, crc32c=0, blocks=[0])
    _progress(0, 2, shards=[rec]).save(tmp_path)
    assert try_write_manifest(tmp_path, 2) is None  # part 1 missing
    _progress(1, 2, complete=False).save(tmp_path)
    assert try_write_manifest(tmp_path, 2) is None  # part 1 incomplete
    _progress(1, 2, shards=[dataclasses.replace(rec, path="shards/part-00001-000000.tar", part=1)]).save(tmp_path)
    m = try_write_manifest(tmp_path, 2)
    assert m.samples == 8 and m.bytes == 200 and len(m.shards) == 2 and m.steps == 4
    assert load_manifest(tmp_path) == m and m.fingerprint == "f" * 64
    assert list_parts(tmp_path) == [0, 1]


def test_manifest_refuses_parts_with_different_fingerprints(tmp_path):
    _progress(0, 2).save(tmp_path)
    _progress(1, 2, fp="e" * 64).save(tmp_path)
    with pytest.raises(CacheError, match="different settings"):
        try_write_manifest(tmp_path, 2)


@pytest.mark.parametrize("content,match", [
    (None, "has no manifest.json"), ("{not json", "not valid JSON"), ('{"format_version": 99}', "format 99"),
    ('{"format_version": 1}', r"written by an older wandistiller \(format 1\); rebuild it with teacher-cache"),
    ("{}", r"written by an older wandistiller \(format None\)|format None")])
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
    assert int(g["seq_lens"][2]) == 3
    assert int(g["seq_lens"][1]) == -1  # never written: readers can tell
    cache = EmbeddingCache(tmp_path, num_parts=3, capacity=1)
    assert torch.equal(cache.get(7), emb[1])  # prompt 7 -> part 1, row 2
    with pytest.raises(ValueError, match="never written"):
        cache.get(4)  # part 1 row 1


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_shard_bytes_are_webdatasets(tmp_path, n):
    """ShardWriter writes its tars with tarfile, not through tarfile's stream mode: the bytes are webdataset's
    TarWriter's for the same samples."""
    import io

    import webdataset as wds

    from cache.writer import encode_sample

    g = torch.Generator().manual_seed(1)
    samples = [(F.sample_key(i, 0, k), {F.T_X_T: torch.randn(4, 1, 6, 10, generator=g).bfloat16(),
                                        F.T_TARGET: torch.randn(4, 1, 3, 5, generator=g)},
                {F.M_PROMPT_IDX: i, F.M_SEED_IDX: 0, F.M_STEP: k, F.M_TIMESTEP: 999.0 - k})
               for i in range(4) for k in range(2)][:n]
    _, rec = _write_shard(tmp_path, samples)
    buf = io.BytesIO()
    ref = wds.TarWriter(buf, mtime=0, encoder=False)
    for key, tensors, meta in samples:
        ref.write({"__key__": key, **encode_sample(tensors, meta)})
    ref.close()
    assert (tmp_path / rec.path).read_bytes() == buf.getvalue()


def test_a_store_is_plain_zarr_in_files_of_rows(tmp_path, monkeypatch):
    """The prompt store is zarr's own arrays: what stage one's writers put in reads back through zarr alone; the
    rows' real tokens packed end to end in files of TOKENS_PER_FILE tokens (the padding past each prompt's tokens
    never stored: the files are exactly what cache/size.py counts), latents in files of ROWS_PER_FILE rows (zarr
    shards), given seed by seed and merged into their row."""
    import cache.prompt_store as PS
    from cache.prompt_store import PartRows, open_prompt_store, write_latent_rows
    from cache.size import embeds_bytes
    from faults.damage import chunk_location

    monkeypatch.setattr(PS, "ROWS_PER_FILE", 4)  # 6 rows: two files per latent array, the second one partly filled
    monkeypatch.setattr(PS, "TOKENS_PER_FILE", 128)
    monkeypatch.setattr(F, "TOKENS_PER_FILE", 128)
    n, L, D = 6, 150, 8
    g0 = torch.Generator().manual_seed(2)
    lens = torch.tensor([1, 64, 65, 150, 0, 70], dtype=torch.int32)
    emb = torch.zeros(n, L, D, dtype=torch.bfloat16)
    for i in range(n):
        emb[i, :lens[i]] = torch.randn(int(lens[i]), D, generator=g0).bfloat16()
    lat = torch.randn(n, 2, 4, 1, 2, 3, generator=g0)
    order = [3, 0, 1, 2, 5, 4]
    path = prompt_store_path(tmp_path, 0)
    g = create_prompt_store(path, n, L, D, "bfloat16", 2, (4, 1, 2, 3))
    write_prompt_rows(g, order, [10 + r for r in order], [f"t{r}" for r in order], emb[order], lens[order])
    write_latent_rows(g, F.Z_FINAL_LATENTS, [0, 0, 2, 5], [0, 1, 1, 0], lat[[0, 0, 2, 5], [0, 1, 1, 0]])
    written = write_latent_rows(g, F.Z_FINAL_LATENTS, [2], [0], lat[2, 0][None])  # row 2's other seed: merged
    assert [p.name for p in written] == ["c.0.0.0.0.0.0"] and all(p.is_file() for p in written)
    z = open_prompt_store(path)
    # the rows' tokens one after another, in the order they came: 350 real tokens in three files of 128
    assert z[F.Z_TOKEN_START][:].tolist() == [150, 151, 215, 0, 350, 280]
    store = F.torch_to_storage(emb)
    packed = np.concatenate([store[r, :lens[r]] for r in order])
    assert np.array_equal(z[F.Z_EMBEDS][:len(packed)], packed) and not z[F.Z_EMBEDS][len(packed):].any()
    assert z[F.Z_EMBEDS].shards == (128, D) and z[F.Z_EMBEDS].chunks == (64, D)
    files = sorted(p for p in (path / F.Z_EMBEDS).iterdir() if p.name != "zarr.json")
    assert [p.name for p in files] == ["c.0.0", "c.1.0", "c.2.0"]
    assert sum(p.stat().st_size for p in files) == embeds_bytes(header(text_dim=D, dtype="bfloat16"), 350)
    assert z[F.Z_SEQ_LENS][:].tolist() == lens.tolist() and z[F.Z_PROMPT_IDX][:].tolist() == [10 + r for r in range(n)]
    assert z[F.Z_TEXT][:].tolist() == [f"t{r}" for r in range(n)]
    final = z[F.Z_FINAL_LATENTS][:]
    for r, s in [(0, 0), (0, 1), (2, 1), (5, 0), (2, 0)]:
        assert np.array_equal(final[r, s], lat[r, s].numpy()), (r, s)
    assert not final[1].any() and not final[5, 1].any()  # never given: zeros, as zarr's fill value
    assert chunk_location(path, F.Z_EMBEDS, 4) is None  # an empty prompt: nothing stored
    for r in range(4):  # where each row's first token is, in its chunk, in its file
        file, off, length = chunk_location(path, F.Z_EMBEDS, r)
        first = store[r, :length // (2 * D)].tobytes()
        assert length == min(int(lens[r]), 64 - int(z[F.Z_TOKEN_START][r]) % 64) * 2 * D
        assert file.read_bytes()[off:off + length] == first, r
    cache, rows = EmbeddingCache(tmp_path, num_parts=1, capacity=16), PartRows(tmp_path, 0, 1, whole_files=True)
    assert all(torch.equal(cache.get(r), emb[r]) for r in range(n) if lens[r] > 0)
    assert all(np.array_equal(rows.trimmed(r), store[r, :lens[r]]) for r in range(n))
    assert np.array_equal(rows.padded([2, 2, 3]), store[[2, 2, 3]])


def test_prompt_rows_fed_in_batches_write_each_file_once_and_read_the_same(tmp_path, monkeypatch):
    """Stage one's way (`PromptRowWriter`, the text encoder's batches, in any order): a file of TOKENS_PER_FILE
    tokens is written once, when it is full (or at close); every row reads the same as from a store written at
    once; the small arrays appear at close."""
    import cache.prompt_store as PS

    monkeypatch.setattr(PS, "TOKENS_PER_FILE", 64)  # one chunk a file
    n, L, D = 10, 20, 8
    g0 = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 7, 8, 20, 3, 9, 16, 2, 5, 11], dtype=torch.int32)  # 82 tokens
    emb = torch.zeros(n, L, D, dtype=torch.bfloat16)
    for i in range(n):
        emb[i, :lens[i]] = torch.randn(int(lens[i]), D, generator=g0).bfloat16()
    texts = [f"prompt {i}" for i in range(n)]
    once = create_prompt_store(prompt_store_path(tmp_path / "once", 0), n, L, D, "bfloat16", 1, (4, 1, 2, 2))
    write_prompt_rows(once, list(range(n)), list(range(n)), texts, emb, lens)
    fed = create_prompt_store(prompt_store_path(tmp_path / "fed", 0), n, L, D, "bfloat16", 1, (4, 1, 2, 2))
    folder = prompt_store_path(tmp_path / "fed", 0) / F.Z_EMBEDS
    writer = PS.PromptRowWriter(fed)
    for batch in ([4, 5, 6], [0, 1], [7, 2, 3], [8]):  # out of order, which no encoder does: 71 tokens
        writer.add(batch, batch, [texts[i] for i in batch], emb[batch], lens[batch])
    files = sorted(p.name for p in folder.iterdir() if p.name.startswith("c."))
    assert files == ["c.0.0"] and int(fed[F.Z_SEQ_LENS][0]) == -1  # the first 64 tokens; no small array yet
    writer.add([9], [9], [texts[9]], emb[[9]], lens[[9]])
    writer.close()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("c.")) == ["c.0.0", "c.1.0"]
    for name in (F.Z_SEQ_LENS, F.Z_TEXT, F.Z_PROMPT_IDX, PS.EMBEDS_CRC32C):
        assert np.array_equal(fed[name][:], once[name][:]), name
    for cache in (EmbeddingCache(tmp_path / "fed", 1, 16), EmbeddingCache(tmp_path / "once", 1, 16)):
        assert all(torch.equal(cache.get(i), emb[i]) for i in range(n))


def test_a_damaged_shard_index_is_named_not_read_as_zeros(tmp_path):
    """A file's index that fails its crc32c is an error naming the row, for a reader and for a writer that would
    merge the file's other rows (zarr reads the index, checks its crc32c)."""
    from cache.prompt_store import PartRows, write_latent_rows

    g = create_prompt_store(prompt_store_path(tmp_path, 0), n=3, max_len=6, dim=4, dtype_name="bfloat16", seeds=1,
                            latent_shape=(4, 1, 2, 2))
    write_latent_rows(g, F.Z_FINAL_LATENTS, [0, 1], [0, 0], torch.randn(2, 4, 1, 2, 2))
    path = prompt_store_path(tmp_path, 0) / F.Z_FINAL_LATENTS / "c.0.0.0.0.0.0"
    data = bytearray(path.read_bytes())
    data[-10] ^= 1  # inside the index
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"final_latents of row 1 \(prompt 1\) fail their crc32c"):
        PartRows(tmp_path, 0, 1).latents(F.Z_FINAL_LATENTS, 1)
    with pytest.raises(ValueError, match="checksum"):
        write_latent_rows(g, F.Z_FINAL_LATENTS, [2], [0], torch.randn(1, 4, 1, 2, 2))  # would merge rows 0-1
