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


class ShardDigest:
    """The checksum a shard record holds, computed over bytes given in order (`update`): crc32c where the record
    has `S_CRC32C` (and for a record being written: `ShardDigest()`), sha256 where it has only `S_SHA256`."""

    def __init__(self, rec: dict | None = None):
        self.field = F.S_SHA256 if rec is not None and F.S_CRC32C not in rec and F.S_SHA256 in rec else F.S_CRC32C
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
