"""Shard writer: one webdataset tar per shard, written under a temporary name and renamed when complete, so a shard
under its final name is whole; its crc32c is taken over the bytes as written (docs/architecture.md, Write path)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from .atomic import WRITE_BEHIND_BYTES, WriteBehind, drop_behind, fsync_dir
from .checksum import crc32c
from .format import EXT_META, EXT_TENSORS, TMP_SUFFIX, shard_relpath
from .records import ShardRecord
from .schema import check_undeclared


def encode_sample(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, bytes]:
    """Tar members of one sample (without the key): safetensors for tensors, JSON for metadata. The inverse is
    `reader.decode_sample`; tensor names must be declared in schema.py."""
    check_undeclared(tensors)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return {EXT_TENSORS: st_save(tensors), EXT_META: json.dumps(meta, sort_keys=True).encode()}


class _Checksummed:
    """A write-only file that keeps the crc32c and the count of the bytes written through it, and every
    WRITE_BEHIND_BYTES hands them to the disk and drops them from the page cache (`atomic.WriteBehind`)."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")
        self.crc = self.bytes = self._dropped = 0
        self.behind = WriteBehind()

    def write(self, data) -> int:
        self.crc = crc32c(data, self.crc)
        n = self.f.write(data)
        self.bytes += n
        if self.bytes - self._dropped >= WRITE_BEHIND_BYTES:
            self.f.flush()
            self.behind.add(self.f.fileno(), self._dropped, self.bytes - self._dropped)
            self._dropped = self.bytes
        return n

    def tell(self) -> int:
        return self.bytes


class ShardWriter:
    """Write one shard of `part` with number `index`; `close()` makes it visible and returns its record."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, index: int):
        self.part, self.relpath = part, shard_relpath(part, index)
        self.final = Path(cache_dir) / self.relpath
        self.tmp = self.final.with_name(self.final.name + TMP_SUFFIX)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._file = _Checksummed(self.tmp)
        # Not webdataset's TarWriter itself: it writes through tarfile's stream mode, which copies every member in
        # 10 KiB pieces (~1.5x the writer's CPU at A14B sample sizes); a plain tarfile writes each member at once.
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        self._tar.copybufsize = 16 << 20
        self.samples = 0

    @property
    def bytes(self) -> int:
        return self._file.bytes

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Append one sample: the members `encode_sample` makes, in webdataset's order (json, safetensors)."""
        for ext, data in sorted(encode_sample(tensors, meta).items()):
            info = tarfile.TarInfo(f"{key}.{ext}")
            # webdataset's fields; mtime 0: a shard's bytes are a function of its samples (bit-identical caches)
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "bigdata", "bigdata"
            self._tar.addfile(info, io.BytesIO(data))
        self.samples += 1

    def close(self, blocks: list[int]) -> ShardRecord:
        """Finish the tar, fsync, rename into place; return the shard record (holding the part's trajectory
        `blocks`) for progress/manifest."""
        self._tar.close()  # (the end-of-archive blocks, padded to a whole record)
        self._file.f.flush()
        self._file.behind.close()
        drop_behind(self._file.f.fileno())
        self._file.f.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return ShardRecord(path=self.relpath, part=self.part, samples=self.samples, bytes=self.bytes,
                           crc32c=self._file.crc, blocks=blocks)

    def abort(self) -> None:
        """Drop the unfinished shard (on error): nothing half-written stays behind."""
        try:
            self._file.behind.close()
            self._file.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)
