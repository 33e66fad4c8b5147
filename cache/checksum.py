"""Checksums of what the cache holds: crc32c of prompt-store chunks, rows and shards, sha256 of older shards.

crc32c comes from the `crc32c` package where it is installed (hardware crc32c instructions, ~9 GiB/s a core on
the dev VM, and it lets go of the GIL: threads checksum side by side), otherwise from `google_crc32c`, which
zarr's own crc32c codec uses (~4.4 GiB/s there, holding the GIL). Both give the same values.

A shard's record holds the crc32c of its bytes (`S_CRC32C`); caches written before it hold their sha256
(`S_SHA256`), which is checked as before. sha256 runs ~1.05 GiB/s a core there, so it cost more than the disk
write of the shard it covered (bench/real_size.py); what the record guards against is a shard changed after it
was written (a bad disk, a bad copy, a stray write), which crc32c detects as zarr's chunk checksums do.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from . import format as F

try:
    from crc32c import crc32c as _crc32c_of  # (the package of that name: hardware, GIL released)

    def _crc32c_extend(crc: int, data) -> int:
        return _crc32c_of(data, crc)
except ImportError:  # pragma: no cover - exercised where only zarr's dependency is installed
    from google_crc32c import extend as _crc32c_extend


def crc32c(data, crc: int = 0) -> int:
    """crc32c of `data`'s bytes (a numpy array, made C-contiguous if it is not, or a bytes-like object),
    continuing `crc`: the checksum zarr's "crc32c" codec appends to a chunk."""
    if not isinstance(data, (bytes, np.ndarray)):
        data = np.frombuffer(data, dtype=np.uint8)
    elif isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return _crc32c_extend(crc, data)


# crc32c's polynomial, bit-reflected (as the register shifts right).
_POLY = 0x82F63B78


def _times(mat: list[int], vec: int) -> int:
    """A 32x32 matrix over GF(2) (its columns as ints) times a 32-bit vector."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _compose(a: list[int], b: list[int]) -> list[int]:
    return [_times(a, col) for col in b]


@functools.lru_cache(maxsize=8)
def _zeros_tables(nbytes: int) -> tuple[list[int], ...]:
    """What appending `nbytes` zero bytes does to a crc32c register (a linear map: zlib's crc32_combine
    construction), as four 256-entry tables, one per byte of the register. ~30 ms to build in Python, then a
    crc is moved past `nbytes` in four lookups."""
    op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        op = _compose(op, op)  # 2, 4, 8 bits: one zero byte
    result = [1 << n for n in range(32)]  # identity
    while nbytes:
        if nbytes & 1:
            result = _compose(op, result)
        nbytes >>= 1
        if nbytes:
            op = _compose(op, op)
    return tuple([_times(result, b << (8 * j)) for b in range(256)] for j in range(4))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of A followed by B from crc1 = crc32c(A), crc2 = crc32c(B) and B's length: lets pieces of a file
    be checksummed apart, on several threads, and the whole file's crc32c follow without reading it again."""
    t = _zeros_tables(len2)
    return t[0][crc1 & 255] ^ t[1][(crc1 >> 8) & 255] ^ t[2][(crc1 >> 16) & 255] ^ t[3][crc1 >> 24] ^ crc2


class ShardDigest:
    """The checksum shard record `rec` holds, computed over bytes given in order (`update`): crc32c where the
    record has `S_CRC32C`, sha256 where it has only `S_SHA256` (a cache written before)."""

    def __init__(self, rec: dict):
        self.field = F.S_SHA256 if F.S_CRC32C not in rec and F.S_SHA256 in rec else F.S_CRC32C
        self._sha = hashlib.sha256() if self.field == F.S_SHA256 else None
        self._crc = 0

    @property
    def name(self) -> str:
        return "sha256" if self._sha is not None else "crc32c"

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = crc32c(data, self._crc)

    def value(self):
        """What the record holds: the crc32c as an int, or the sha256 as hex."""
        return self._sha.hexdigest() if self._sha is not None else self._crc

    def matches(self, rec: dict) -> bool:
        return rec.get(self.field) == self.value()
