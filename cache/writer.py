"""Shard writer: one webdataset tar per shard, written under a temporary name and renamed when complete.

The rename is the last thing that happens to a shard, so a shard that exists under its final name is
whole; anything still ending in `.tmp` after a crash is an orphan that its own part deletes on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from .atomic import fsync_dir
from .format import EXT_META, EXT_TENSORS, S_BYTES, S_PART, S_PATH, S_SAMPLES, S_SHA256, TMP_SUFFIX, shard_relpath
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


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, _TAR_MODE
    info.uname = info.gname = _TAR_OWNER
    return info.tobuf(tarfile.DEFAULT_FORMAT, tarfile.ENCODING, "surrogateescape")


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
    """Write one shard of `part` with number `index`; `close()` makes it visible and returns its record."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, index: int):
        self.cache_dir = Path(cache_dir)
        self.part = part
        self.relpath = shard_relpath(part, index)
        self.final = self.cache_dir / self.relpath
        self.tmp = self.final.with_name(self.final.name + TMP_SUFFIX)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._sha = hashlib.sha256()
        self.bytes = 0
        self.samples = 0
        self.keys: list[str] = []
        self._tensors = _TensorMember()

    def _put(self, parts: list[bytes]) -> None:
        """Append `parts` to the shard, hashed as they go, in one writev: no copy into a buffer."""
        views = [memoryview(b).cast("B") for b in parts]
        for v in views:
            self._sha.update(v)
        self.bytes += sum(len(v) for v in views)
        views = [v for v in views if len(v)]
        while views:
            n = os.writev(self._fd, views)
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if views:
                views[0] = views[0][n:]

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Append one sample: the members `encode_sample` makes, in webdataset's order (json, safetensors)."""
        check_undeclared(tensors)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        members = {EXT_META: [json.dumps(meta, sort_keys=True).encode()], EXT_TENSORS: self._tensors.parts(tensors)}
        parts = []
        for ext in sorted(members):
            size = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in members[ext])
            parts += [_tar_header(f"{key}.{ext}", size), *members[ext], _padding(size)]
        self._put(parts)
        self.samples += 1
        self.keys.append(key)

    def close(self) -> dict:
        """Finish the tar, fsync, rename into place; return the shard record for progress/manifest."""
        end = bytes(2 * tarfile.BLOCKSIZE)
        self._put([end, _padding(self.bytes + len(end), tarfile.RECORDSIZE)])
        os.fsync(self._fd)
        os.close(self._fd)
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return {S_PATH: self.relpath, S_PART: self.part, S_SAMPLES: self.samples,
                S_BYTES: self.bytes, S_SHA256: self._sha.hexdigest()}

    def abort(self) -> None:
        """Drop the unfinished shard (on error): nothing half-written stays behind."""
        try:
            os.close(self._fd)
        except OSError:
            pass  # the disk that failed the write may fail the close too; the file goes either way
        finally:
            self.tmp.unlink(missing_ok=True)
