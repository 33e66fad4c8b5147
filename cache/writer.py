"""Shard writer: one webdataset tar per shard, written under a temporary name and renamed when complete.

The rename is the last thing that happens to a shard, so a shard that exists under its final name is
whole; anything still ending in `.tmp` after a crash is an orphan that its own part deletes on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import webdataset as wds
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .atomic import fsync_dir
from .format import EXT_META, EXT_TENSORS, S_BYTES, S_PART, S_PATH, S_SAMPLES, S_SHA256, TMP_SUFFIX, shard_relpath


def encode_sample(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, bytes]:
    """Tar members of one sample (without the key): safetensors for tensors, JSON for metadata."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return {EXT_TENSORS: st_save(tensors), EXT_META: json.dumps(meta, sort_keys=True).encode()}


def decode_sample(members: dict[str, bytes]) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of `encode_sample`."""
    return st_load(members[EXT_TENSORS]), json.loads(members[EXT_META])


class _HashingFile:
    """File wrapper that hashes and counts what passes through, so the shard is never read back."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.discard = False  # set on abort: late flushes of the tar stream go nowhere

    def write(self, data) -> int:
        if self.discard:
            return len(data)
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.bytes


class ShardWriter:
    """Write one shard of `part` with number `index`; `close()` makes it visible and returns its record."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, index: int):
        self.cache_dir = Path(cache_dir)
        self.part = part
        self.relpath = shard_relpath(part, index)
        self.final = self.cache_dir / self.relpath
        self.tmp = self.final.with_name(self.final.name + TMP_SUFFIX)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")
        self._hf = _HashingFile(self._f)
        # mtime=0: the same samples give byte-identical shards (and sha256) on every run.
        self._tar = wds.TarWriter(self._hf, mtime=0, encoder=False)
        self.samples = 0
        self.keys: list[str] = []

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._tar.write({"__key__": key, **encode_sample(tensors, meta)})
        self.samples += 1
        self.keys.append(key)

    def close(self) -> dict:
        """Finish the tar, fsync, rename into place; return the shard record for progress/manifest."""
        self._tar.close()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return {S_PATH: self.relpath, S_PART: self.part, S_SAMPLES: self.samples,
                S_BYTES: self._hf.bytes, S_SHA256: self._hf.sha.hexdigest()}

    def abort(self) -> None:
        """Drop the unfinished shard (on error): nothing half-written stays behind."""
        self._hf.discard = True
        try:
            self._tar.close()
            self._f.close()
        except OSError:
            pass  # the disk that failed the write may fail the close too; the file goes either way
        finally:
            self.tmp.unlink(missing_ok=True)
