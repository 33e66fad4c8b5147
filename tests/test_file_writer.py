"""direct_io.FileWriter: the bytes and checksum written past the page cache are the bytes given, whichever way
they go (O_DIRECT, through the page cache, a disk refusing the alignment midway); a disk error reaches the
caller; shard records hold the crc32c of their file, and caches whose records hold a
sha256 (written before) are checked as before."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import cache.direct_io as D
from cache import format as F
from cache.checksum import ShardDigest, crc32c, crc32c_combine
from cache.reader import SHARD_CHECKSUM, ShardError, scan_shard
from cache.verify import verify_cache
from cache.writer import ShardWriter


def _parts(rng: np.random.Generator, total: int, pieces: int = 9) -> tuple[bytes, list]:
    """Random bytes cut at random places into bytes, arrays and memoryviews, some parts followed by
    CRC32C_OF_PREVIOUS; and the bytes they make."""
    data = rng.integers(0, 256, total, dtype=np.uint8)
    parts, expected = [], []
    for i, p in enumerate(np.split(data, sorted(rng.integers(0, total + 1, pieces - 1)))):
        parts.append([bytes(p), p, memoryview(p.tobytes())][i % 3])
        expected.append(p.tobytes())
        if i % 2:
            parts.append(D.CRC32C_OF_PREVIOUS)
            expected.append(crc32c(p.tobytes()).to_bytes(4, "little"))
    return b"".join(expected), parts


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 64 KiB: many writes in flight in a small test."""
    monkeypatch.setattr(D, "WRITE_PIECE", 64 << 10)
    monkeypatch.setattr(D, "WRITE_BEHIND_BYTES", 96 << 10)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 64 << 10, (64 << 10) + 7, 1_000_003])
def test_bytes_and_crc_are_what_was_given(tmp_path, small_pieces, direct, total):
    rng = np.random.default_rng(total)
    expected, parts = _parts(rng, total)
    w = D.FileWriter(tmp_path / "f", direct=direct, checksum=True)
    for i in range(0, len(parts), 3):  # several calls
        w.write(parts[i:i + 3])
    w.close()
    assert (tmp_path / "f").read_bytes() == expected
    assert w.bytes == len(expected) == D.parts_nbytes(parts) and w.crc == crc32c(expected)
    assert w.direct == (direct and D.FLAG != 0)  # (tmp_path's file system takes O_DIRECT)


def test_a_refused_direct_write_goes_on_through_the_page_cache(tmp_path, small_pieces, monkeypatch):
    """A disk that wants another alignment refuses the direct writes (EINVAL) after the open succeeded: the
    pieces in flight and all after them are written buffered, the file's bytes and crc32c the same."""
    real = D._write_all
    refused = []

    def refusing(fd, parts, offset=None):
        if D.is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, parts, offset)

    monkeypatch.setattr(D, "_write_all", refusing)
    expected, parts = _parts(np.random.default_rng(1), 700_001)
    w = D.FileWriter(tmp_path / "f", checksum=True)
    w.write(parts)
    w.close()
    assert refused and not w.direct
    assert (tmp_path / "f").read_bytes() == expected and w.crc == crc32c(expected)


def test_no_direct_io_on_the_file_system_writes_buffered(tmp_path, monkeypatch):
    """Where the open with O_DIRECT fails (EINVAL: tmpfs, some network file systems), the file is written
    through the page cache."""
    real = os.open

    def no_direct(path, flags, *a):
        if flags & D.FLAG:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(D.os, "open", no_direct)
    expected, parts = _parts(np.random.default_rng(2), 300_000)
    w = D.FileWriter(tmp_path / "f", checksum=True)
    w.write(parts)
    w.close()
    assert not w.direct and (tmp_path / "f").read_bytes() == expected and w.crc == crc32c(expected)


def test_a_disk_error_reaches_the_caller(tmp_path, small_pieces, monkeypatch):
    def full(fd, parts, offset=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(D, "_write_all", full)
    w = D.FileWriter(tmp_path / "f")
    with pytest.raises(OSError) as e:
        for _ in range(50):
            w.write([bytes(100 << 10)])
        w.close()
    assert e.value.errno == errno.ENOSPC
    w.abort()
    assert w.fd is None


def test_crc32c_combine():
    """The crc32c of A + B from those of A and B and B's length (how a file's pieces, checksummed apart on the
    write threads, give the file's)."""
    rng = np.random.default_rng(5)
    for la, lb in [(0, 0), (1, 0), (0, 1), (7, 4097), (100, 1 << 20), (3, 999_999)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert crc32c_combine(crc32c(a), crc32c(b), lb) == crc32c(a + b)


def _samples(n: int = 40):
    g = torch.Generator().manual_seed(0)
    return [(F.sample_key(i, 0, 0), {F.T_X_T: torch.randn(4, 1, 32, 32, generator=g).bfloat16(),
                                     F.T_TARGET: torch.randn(4, 1, 32, 32, generator=g)}, {F.M_PROMPT_IDX: i})
            for i in range(n)]


def test_shard_record_holds_the_files_crc32c(tmp_path, small_pieces):
    """Over many pieces (several writes in flight), and after an abort."""
    w = ShardWriter(tmp_path, part=0, index=9)
    w.write(*_samples(1)[0])
    w.abort()
    assert not list(tmp_path.rglob("*.tar*"))
    w = ShardWriter(tmp_path, part=0, index=0)
    for s in _samples(300):
        w.write(*s)
    rec = w.close()
    data = (tmp_path / rec[F.S_PATH]).read_bytes()
    assert rec[F.S_BYTES] == len(data) and rec[F.S_CRC32C] == crc32c(data) and len(data) % 10240 == 0


def test_a_cache_whose_records_hold_sha256_is_checked_by_it(tiny_cache, tmp_path):
    """A cache written before shards were checksummed with crc32c records each shard's sha256: `cache verify`
    and stage two's scan check that, and a changed byte still fails."""
    import shutil

    cache = tmp_path / "old"
    shutil.copytree(tiny_cache, cache)
    m = json.loads((cache / F.MANIFEST).read_text())
    for rec in m[F.F_SHARDS]:
        rec[F.S_SHA256] = hashlib.sha256((cache / rec[F.S_PATH]).read_bytes()).hexdigest()
        del rec[F.S_CRC32C]
    (cache / F.MANIFEST).write_text(json.dumps(m, indent=2))
    assert verify_cache(cache, progress=False) == []
    rec = m[F.F_SHARDS][0]
    assert ShardDigest(rec).name == "sha256"
    scan_shard(cache, rec, checksum=True)
    path = cache / rec[F.S_PATH]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError) as e:
        scan_shard(cache, rec, checksum=True)
    assert e.value.code == SHARD_CHECKSUM
    assert any(f"{rec[F.S_PATH]}: sha256 mismatch" in p for p in verify_cache(cache, progress=False))


def test_prompt_store_files_written_direct_read_back(tmp_path, monkeypatch):
    """Chunk files past DIRECT_WRITE_MIN go through O_DIRECT (the last piece padded, the file truncated to
    its length): zarr reads them back and their chunks' crc32c (computed as written) check."""
    import cache.prompt_store as PS

    monkeypatch.setattr(PS, "DIRECT_WRITE_MIN", 1)
    g = PS.create_prompt_store(PS.prompt_store_path(tmp_path, 0), 5, 20, 8, "bfloat16", 1, (4, 1, 2, 2))
    lat = torch.randn(5, 4, 1, 2, 2)
    PS.write_latent_rows(g, F.Z_FINAL_LATENTS, list(range(5)), [0] * 5, lat[:, None])
    got = np.asarray(PS.open_prompt_store(PS.prompt_store_path(tmp_path, 0))[F.Z_FINAL_LATENTS][:])
    assert np.array_equal(got[:, 0], lat.numpy())
    files = list(Path(PS.prompt_store_path(tmp_path, 0), F.Z_FINAL_LATENTS).rglob("c*"))
    assert files and all(f.stat().st_size % 4096 for f in files)  # (not left padded)
