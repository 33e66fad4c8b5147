"""Shard writer: one webdataset tar per shard, written under a temporary name and renamed when complete.

The rename is the last thing that happens to a shard, so a shard that exists under its final name is
whole; anything still ending in `.tmp` after a crash is an orphan that its own part deletes on resume.
"""

from __future__ import annotations

import functools
import json
import os
import tarfile
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from .atomic import fsync_dir
from .direct_io import FileWriter
from .format import EXT_META, EXT_TENSORS, S_BYTES, S_CRC32C, S_PART, S_PATH, S_SAMPLES, TMP_SUFFIX, shard_relpath
from .schema import check_undeclared


def encode_sample(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, bytes]:
    """Tar members of one sample (without the key): safetensors for tensors, JSON for metadata. The inverse is
    `reader.decode_sample`; tensor names must be declared in schema.py."""
    check_undeclared(tensors)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return {EXT_TENSORS: st_save(tensors), EXT_META: json.dumps(meta, sort_keys=True).encode()}


# The tar layout webdataset's TarWriter(mtime=0, encoder=False) gives, byte for byte: tarfile's default (PAX)
# headers with these owner fields, members of a sample in sorted extension order, each padded to a block,
# two zero blocks at the end and zeros up to a whole record. Written here directly: tarfile's stream mode
# copies every member through 16 KiB Python-level chunks, which at A14B sample sizes (~400 KiB) costs more
# than the disk write itself.
_TAR_MODE = 0o444
_TAR_OWNER = "bigdata"


def _tarinfo_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, _TAR_MODE
    info.uname = info.gname = _TAR_OWNER
    return info.tobuf(tarfile.DEFAULT_FORMAT, tarfile.ENCODING, "surrogateescape")


# The header's name field and its checksum field (six octal digits, NUL; a space follows), as tarfile lays them.
_NAME_END, _CHKSUM, _CHKSUM_END = 100, 148, 155


@functools.lru_cache(maxsize=256)
def _header_template(name_len: int, size: int) -> tuple[bytes, int] | None:
    """tarfile's header for a name of `name_len` "a"s and `size`, and its checksum less those "a"s; None where
    the header is not one plain block (a PAX extended header: never for the short ASCII keys of a cache)."""
    buf = _tarinfo_header("a" * name_len, size)
    if len(buf) != tarfile.BLOCKSIZE:
        return None
    return buf, int(buf[_CHKSUM:_CHKSUM_END - 1], 8) - ord("a") * name_len


def _tar_header(name: str, size: int) -> bytes:
    """tarfile's header block for member `name` of `size` bytes, byte for byte: a template per (name length,
    size) with the name and checksum put in (~35 us a header through TarInfo.tobuf, two per sample)."""
    raw = name.encode("ascii") if name.isascii() else b""
    tmpl = _header_template(len(raw), size) if 0 < len(raw) < _NAME_END else None
    if tmpl is None:
        return _tarinfo_header(name, size)
    buf, base = tmpl
    return b"".join((raw, buf[len(raw):_CHKSUM], b"%06o\0" % (base + sum(raw)), buf[_CHKSUM_END:]))


def _padding(n: int, unit: int = tarfile.BLOCKSIZE) -> bytes:
    return bytes(-n % unit)


class _TensorMember:
    """The `<key>.safetensors` member as a list of buffers: a header, then each tensor's own memory.

    safetensors' `save` lays a file out as its JSON header followed by every tensor's bytes back to back, in
    an order fixed by the names, dtypes and shapes; it copies each tensor twice on the way (~0.5 ms for an
    A14B sample, more than writing it). The header of a layout is taken from one real `save` and checked to
    be exactly that (contiguous, nothing else); the samples after it reuse it with the tensors' memory, so
    the member's bytes are `save`'s, byte for byte. Any layout that does not check falls back to `save`.
    """

    def __init__(self):
        self._layouts: dict[tuple, tuple[bytes, list[str]] | None] = {}

    def parts(self, tensors: dict[str, torch.Tensor]) -> list:
        sig = tuple((k, v.dtype, tuple(v.shape)) for k, v in sorted(tensors.items()))
        if sig in self._layouts:
            layout = self._layouts[sig]
            if layout is None:
                return [st_save(tensors)]
            header, order = layout
            return [header] + [memoryview(tensors[k].reshape(-1).view(torch.uint8).numpy()) for k in order]
        data = st_save(tensors)
        self._layouts[sig] = self._layout(data, tensors)
        return [data]

    @staticmethod
    def _layout(data: bytes, tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[str]] | None:
        n = int.from_bytes(data[:8], "little")
        head = json.loads(data[8:8 + n])
        spans = sorted((tuple(v["data_offsets"]), k) for k, v in head.items() if k != "__metadata__")
        pos = 0
        for (start, end), k in spans:
            t = tensors.get(k)
            if t is None or start != pos or end - start != t.numel() * t.element_size():
                return None
            pos = end
        if 8 + n + pos != len(data) or set(tensors) != {k for _, k in spans}:
            return None
        return data[:8 + n], [k for _, k in spans]


class ShardWriter:
    """Write one shard of `part` with number `index`; `close()` makes it visible and returns its record.

    The bytes are checksummed (crc32c) and written past the page cache (`direct_io.FileWriter`); the tensors
    given to `write` are copied by the time it returns."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, index: int):
        self.cache_dir = Path(cache_dir)
        self.part = part
        self.relpath = shard_relpath(part, index)
        self.final = self.cache_dir / self.relpath
        self.tmp = self.final.with_name(self.final.name + TMP_SUFFIX)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._file = FileWriter(self.tmp, checksum=True)
        self.samples = 0
        self.keys: list[str] = []
        self._tensors = _TensorMember()

    @property
    def bytes(self) -> int:
        return self._file.bytes

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Append one sample: the members `encode_sample` makes, in webdataset's order (json, safetensors)."""
        check_undeclared(tensors)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        members = {EXT_META: [json.dumps(meta, sort_keys=True).encode()], EXT_TENSORS: self._tensors.parts(tensors)}
        parts = []
        for ext in sorted(members):
            size = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in members[ext])
            parts += [_tar_header(f"{key}.{ext}", size), *members[ext], _padding(size)]
        self._file.write(parts)
        self.samples += 1
        self.keys.append(key)

    def close(self) -> dict:
        """Finish the tar, fsync, rename into place; return the shard record for progress/manifest."""
        end = bytes(2 * tarfile.BLOCKSIZE)
        self._file.write([end, _padding(self.bytes + len(end), tarfile.RECORDSIZE)])
        self._file.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return {S_PATH: self.relpath, S_PART: self.part, S_SAMPLES: self.samples,
                S_BYTES: self.bytes, S_CRC32C: self._file.crc}

    def abort(self) -> None:
        """Drop the unfinished shard (on error): nothing half-written stays behind."""
        try:
            self._file.abort()
        finally:
            self.tmp.unlink(missing_ok=True)
