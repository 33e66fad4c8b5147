"""Per-part prompt store (zarr v3): prompt text, text embeddings, initial noise and final latents.

Each part writes only its own `parts/part-P/prompts.zarr`, so no two processes ever touch the same chunk. Rows never written read back as the fill value: `seq_lens` is filled with -1
so a reader can tell "never written" from "empty", and the part's progress record says which rows and
trajectories are complete.

Sizes at real scale decide the layout: an A14B prompt's embedding is 512x4096 bfloat16 (4 MiB padded, ~60
real tokens typically), so `embeds` is chunked per row and per `EMBED_CHUNK_TOKENS` tokens, and the zero
padding past a prompt's length is never written; `seq_lens` and `text`, read whole, are chunked by many rows.
The numeric arrays are read and written through `ChunkFiles` (the zarr v3 chunk files, directly), not
zarr's own path, which costs more per chunk than decoding it. Stores of the earlier layout (one compressed
chunk per padded row) read the same.

Checksums: every chunk of every array ends in its crc32c (zarr's "crc32c" codec: zarr checks it on its own
reads, `ChunkFiles` on whole-chunk reads), and `row_crc32c/embeds` holds the crc32c of each row's real
tokens, which a reader of those tokens alone (stage two) checks without reading the padding past them
(`PartRows`). A chunk that should exist and does not is an error, never zeros. Stores written before the
checksums read the same, checked for presence only (`cache verify` notes it). What the checks cost at A14B
sizes: `python -m bench.real_size --integrity`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections import OrderedDict
from functools import cached_property
from pathlib import Path

import numcodecs
import numpy as np
import torch
import zarr
from safetensors.torch import load as st_load
from tqdm.auto import tqdm
from zarr.codecs import Crc32cCodec, ZstdCodec

from . import direct_io
from .atomic import run_each, thread_pool, write_behind
from .checksum import crc32c
from .errors import CacheError
from .fanout import Share
from .format import (
    NEG_EMBEDS, NEGATIVE, PARTS_DIR, PROMPTS_ZARR, Z_ATTR_TORCH_DTYPE, Z_EMBEDS, Z_FINAL_LATENTS, Z_INIT_NOISE,
    Z_PROMPT_IDX, Z_ROW_CRC32C, Z_SEQ_LENS, Z_TEXT, part_dirname, part_prompts, prompt_location, storage_numpy_dtype,
    storage_to_torch, torch_to_storage,
)
from .manifest import load_manifest, manifest_path, negative_problem

def _index_key(file: Path, st: os.stat_result) -> tuple:
    """What a kept shard index is kept under: the file and its inode, size and mtime (a file replaced since is
    read again)."""
    return file, st.st_ino, st.st_size, st.st_mtime_ns


class ChunkError(CacheError):
    """A chunk that is not what its array says: `reason` is why ("fails its crc32c", "is shorter ..."). In a
    sharded array `inner` is the chunk's grid index inside the file `path`."""

    def __init__(self, path: Path, reason: str, inner: tuple[int, ...] | None = None):
        self.path, self.reason, self.inner = path, reason, inner
        super().__init__(f"{path}{self._where()} {reason}")

    def _where(self) -> str:
        return "" if self.inner is None else "[" + ",".join(map(str, self.inner)) + "]"

    def named(self) -> str:
        """"<array>/<file>[<chunk>] <reason>", the chunk named inside its store."""
        return f"{self.path.parent.name}/{self.path.name}{self._where()} {self.reason}"

UNWRITTEN_SEQ_LEN = -1
EMBEDS_CRC32C = f"{Z_ROW_CRC32C}/{Z_EMBEDS}"  # crc32c of each row's real tokens (format.Z_ROW_CRC32C)
# Tokens per chunk of `embeds`: a typical prompt's real tokens fit one or two chunks, the padding none.
EMBED_CHUNK_TOKENS = 64
# Rows per chunk of `seq_lens` and `text`, read whole by their readers (a million prompts would otherwise be
# two million files).
SEQ_LENS_CHUNK = 1 << 16
TEXT_CHUNK = 1 << 12
# Rows per file of `embeds`, `init_noise` and `final_latents` (zarr shards, `ChunkFiles`): at A14B sizes ~45 MB
# of embeddings and ~25 MB of latents a file, ~16 files per 1,000 prompts instead of ~3,400.
ROWS_PER_FILE = 64


# An inner chunk a shard file does not hold (zarr's sharding index: offset and length both 2^64 - 1).
NOT_HELD = 2**64 - 1
# Shard indexes kept per array (a few KiB each, read once per file instead of once per row).
INDEXES_KEPT = 256
# Chunk files of at least this many bytes are written past the page cache (embeddings and latents of 64 rows:
# tens of MiB); smaller ones (text, seq_lens) through it.
DIRECT_WRITE_MIN = 1 << 20


def _plain_codecs(codecs: list[dict]) -> bool:
    """Whether a chunk's codecs are ones `ChunkFiles` reads itself: bytes (little-endian), then optionally zstd,
    then optionally crc32c."""
    names = [c["name"] for c in codecs]
    return (names in (["bytes"], ["bytes", "zstd"], ["bytes", "crc32c"], ["bytes", "zstd", "crc32c"])
            and codecs[0].get("configuration", {}).get("endian", "little") == "little"
            and not any(set(c.get("configuration", {})) - {"level", "checksum", "endian"} for c in codecs))


class ChunkFiles:
    """The chunks of one numeric zarr v3 array in a local store, read and written directly.

    zarr's own path costs 2-20 ms per chunk (its event loop and codec pipeline), more than reading and
    decoding an A14B prompt's embedding; at 10^4-10^6 prompts that bounds stage two's loader and adds hours
    to stage one. The layout is the zarr v3 spec's, which zarr reads and writes the same way: chunk (i, j, k)
    of a regular grid is the file `c/i/j/k` ("default" chunk keys; `c.i.j.k` with the "." separator, which
    new stores use) holding the chunk's little-endian C-order bytes, zstd-compressed when the array's codecs
    say so (same codec, same level, so the same bytes zarr writes), followed by its crc32c when the codecs end
    in "crc32c"; a missing chunk reads as the fill value, and a chunk holding only the fill value is not
    written (zarr's default, write_empty_chunks=False).

    **Sharded arrays** (zarr's "sharding_indexed" codec, which new stores use for the per-prompt arrays) hold
    many chunks per file: `chunks` is then the inner chunk (one row's 64 tokens, one row's latents) and
    `per_file` how many of them a file holds along each axis; the file is the inner chunks' stored bytes one
    after the other (row-major here; zarr writes Morton order, both read the same), then the index of
    (offset, length) per inner chunk (2^64-1 for one not held) with its own crc32c. Creating a file costs
    ~0.8 ms on this project's CI disk, as much as writing 1 MB: one file per `ROWS_PER_FILE` rows instead
    of one per row and 64 tokens is what keeps stage one's prompt store near the disk's speed
    (bench.real_size). A file is always written whole (`write_chunks` groups a call's chunks per file and
    copies the chunks of rows it is not given from the old file, as stored), under a temporary name renamed
    into place, so a killed writer leaves the old file or the new one, never a torn one. `open` returns None
    for any other layout, which callers then read through zarr.
    """

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.shape = tuple(meta["shape"])
        grid = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = meta["codecs"]
        self.per_file: tuple[int, ...] | None = None  # inner chunks per file along each axis (sharded only)
        self.index_at_end = True
        if codecs[0]["name"] == "sharding_indexed":
            cfg = codecs[0]["configuration"]
            self.chunks = tuple(cfg["chunk_shape"])
            self.per_file = tuple(g // c for g, c in zip(grid, self.chunks))
            self.index_at_end = cfg.get("index_location", "end") == "end"
            codecs = cfg["codecs"]
        else:
            self.chunks = grid
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        self.fill = meta["fill_value"]
        zstd = [c for c in codecs if c["name"] == "zstd"]
        self.zstd = numcodecs.Zstd(**zstd[0]["configuration"]) if zstd else None
        self.crc = codecs[-1]["name"] == "crc32c"  # each chunk ends in the crc32c of what precedes it
        self.nbytes = int(np.prod(self.chunks)) * self.dtype.itemsize  # of a whole chunk, decoded
        self.sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
        self._dirs: set[Path] = set()  # chunk folders known to exist
        self.touched: list[Path] = []  # files written or removed: what a caller fsyncs (atomic.fsync_paths)
        self._indexes: OrderedDict[tuple, np.ndarray] = OrderedDict()  # (file, inode, size, mtime) -> index
        # Read uncompressed chunks with O_DIRECT (`direct_io`; set by a reader of a cache larger than the page
        # cache keeps); cleared where the file system or the disk refuses it.
        self.direct = False
        self._lock = threading.Lock()  # over `_indexes`: rows are read and written on threads

    @classmethod
    def open(cls, path: str | os.PathLike) -> ChunkFiles | None:
        path = Path(path)
        try:
            meta = json.loads((path / "zarr.json").read_text())
            codecs = meta["codecs"]
            grid = meta["chunk_grid"]["configuration"]["chunk_shape"]
            if codecs and codecs[0]["name"] == "sharding_indexed":
                cfg = codecs[0].get("configuration", {})
                index = cfg.get("index_codecs", [])
                if (len(codecs) != 1 or [c["name"] for c in index] != ["bytes", "crc32c"]
                        or index[0].get("configuration", {}).get("endian", "little") != "little"
                        or cfg.get("index_location", "end") not in ("start", "end")
                        or len(cfg["chunk_shape"]) != len(grid) or min(cfg["chunk_shape"]) < 1
                        or any(g % c for g, c in zip(grid, cfg["chunk_shape"])) or not _plain_codecs(cfg["codecs"])):
                    return None
            elif not _plain_codecs(codecs):
                return None
            if (meta["zarr_format"] != 3 or meta["chunk_grid"]["name"] != "regular"
                    or meta["chunk_key_encoding"]["name"] != "default"
                    or meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/") not in "/."
                    or meta.get("storage_transformers") or np.dtype(meta["data_type"]).kind not in "iuf"
                    or not isinstance(meta["fill_value"], (int, float))):
                return None
            return cls(path, meta)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None

    # -- where a chunk is ---------------------------------------------------------------------------------

    def _key(self, idx: tuple[int, ...]) -> tuple[int, ...]:
        """The grid index of the file holding chunk `idx` (the chunk's own, unsharded)."""
        return idx if self.per_file is None else tuple(i // k for i, k in zip(idx, self.per_file))

    def _key_file(self, key: tuple[int, ...]) -> Path:
        if self.sep == ".":
            return self.path / ".".join(["c", *map(str, key)])
        return self.path.joinpath("c", *map(str, key))

    def _file(self, idx: tuple[int, ...]) -> Path:
        return self._key_file(self._key(idx))

    def chunk_name(self, idx: tuple[int, ...]) -> str:
        """"<array>/<file>" (sharded: "<array>/<file>[<chunk's grid index>]"), how messages name a chunk."""
        rel = self._file(idx).relative_to(self.path).as_posix()
        return f"{self.path.name}/{rel}" + ("" if self.per_file is None else "[" + ",".join(map(str, idx)) + "]")

    @cached_property
    def _index_nbytes(self) -> int:
        return 16 * math.prod(self.per_file) + 4  # (offset, length) uint64 per inner chunk, then its crc32c

    def _index(self, fd: int, file: Path) -> np.ndarray:
        """The shard index of the open file `file`, [*per_file, 2] uint64, checked against its crc32c and the
        file's size (ChunkError); kept per (file, inode, size, mtime), so a file replaced is read again."""
        st = os.fstat(fd)
        key = _index_key(file, st)
        with self._lock:
            hit = self._indexes.get(key)
            if hit is not None:
                self._indexes.move_to_end(key)
                return hit
        n = self._index_nbytes
        if st.st_size < n:
            raise ChunkError(file, f"is shorter ({st.st_size} bytes) than its shard index ({n} bytes)")
        raw = self._pread(fd, st.st_size - n if self.index_at_end else 0, n).tobytes()
        if len(raw) != n or crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise ChunkError(file, "has a shard index that fails its crc32c (changed after it was written)")
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(*self.per_file, 2)
        lo, hi = (0, st.st_size - n) if self.index_at_end else (n, st.st_size)
        held = index[..., 0] != NOT_HELD
        if held.any() and ((index[..., 0][held] < lo).any() or (index[..., 1][held] > hi - index[..., 0][held]).any()):
            raise ChunkError(file, "has a shard index pointing past the file's end (truncated?)")
        with self._lock:
            self._indexes[key] = index
            if len(self._indexes) > INDEXES_KEPT:
                self._indexes.popitem(last=False)
        return index

    def _span(self, idx: tuple[int, ...]) -> tuple[int, int, int, Path] | None:
        """(fd, offset, length, file) of chunk `idx`'s stored bytes, or None where it was never written; the
        caller closes fd."""
        file = self._file(idx)
        try:
            fd = self._open(file)
        except FileNotFoundError:
            return None
        try:
            if self.per_file is None:
                return fd, 0, os.fstat(fd).st_size, file
            off, n = (int(v) for v in self._index(fd, file)[tuple(i % k for i, k in zip(idx, self.per_file))])
        except BaseException:
            os.close(fd)
            raise
        if off == NOT_HELD:
            os.close(fd)
            return None
        return fd, off, n, file

    def _open(self, file: Path) -> int:
        if self.zstd is not None:  # (compressed chunks are read whole by offset, never directly)
            return os.open(file, os.O_RDONLY)
        fd, self.direct = direct_io.open_read(file, self.direct)
        return fd

    def _pread(self, fd: int, off: int, n: int) -> np.ndarray:
        """Up to `n` bytes of the open file at `off` (`direct_io.pread`)."""
        buf, refused = direct_io.pread(fd, off, n)
        if refused:
            self.direct = False
        return buf

    def location(self, idx: tuple[int, ...]) -> tuple[Path, int, int] | None:
        """(file, offset, length) of chunk `idx`'s stored bytes (its crc32c included), or None where it was never
        written: where `cache verify`'s messages point, and what tests damage."""
        span = self._span(idx)
        if span is None:
            return None
        os.close(span[0])
        return span[3], span[1], span[2]

    def has_chunk(self, idx: tuple[int, ...]) -> bool:
        """Whether chunk `idx` was written (a stat, or a sharded file's index; no data read)."""
        return self._file(idx).exists() if self.per_file is None else self.location(idx) is not None

    def prefetch_row(self, row: int, stop: int) -> None:
        """Ask the kernel to start reading the chunks `read_row(row, stop)` reads (posix_fadvise WILLNEED): a
        batch's embedding reads then overlap on the disk instead of waiting one after the other. A hint only."""
        for j in range(-(-stop // self.chunks[1])):
            try:
                span = self._span((row // self.chunks[0], j, *(0,) * (len(self.shape) - 2)))
            except (OSError, ChunkError):
                continue  # the read itself says what is wrong
            if span is not None:
                try:
                    os.posix_fadvise(span[0], span[1], span[2], os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(span[0])

    # -- reading ------------------------------------------------------------------------------------------

    def read_chunk(self, idx: tuple[int, ...], out: np.ndarray | None = None, verify: bool = True) -> np.ndarray | None:
        """Chunk `idx` (grid coordinates), or None where it was never written (all fill value). An uncompressed
        chunk may be read in part: its first `out.size` elements, straight into `out` (C-contiguous); its
        checksum is then checked only with `verify` (which reads the rest of the chunk: a caller that checks
        what it read by other means, like `EmbeddingCache`, passes False). ChunkError for a chunk that fails its
        crc32c or is too short."""
        span = self._span(idx)
        if span is None:
            return None
        fd, off, size, file = span
        inner = None if self.per_file is None else idx
        try:
            if self.zstd is None:
                out = np.empty(self.chunks, dtype=self.dtype) if out is None else out
                view = memoryview(out.reshape(-1)).cast("B")
                rest = None
                if len(view) > size:
                    raise ChunkError(file, f"is shorter than a chunk of {self.chunks} {self.dtype}", inner)
                if direct_io.is_direct(fd):  # one aligned read, into place by a copy (and with `verify`, all of it)
                    got = self._pread(fd, off, size if self.crc and verify else len(view))
                    if len(got) < len(view):
                        raise ChunkError(file, f"is shorter than a chunk of {self.chunks} {self.dtype}", inner)
                    view[:] = got[:len(view)]
                    rest = got[len(view):].tobytes()
                elif os.preadv(fd, [view], off) != len(view):
                    raise ChunkError(file, f"is shorter than a chunk of {self.chunks} {self.dtype}", inner)
                if self.crc and verify:
                    if rest is None:  # the chunk past `out`, then its crc32c
                        rest = os.pread(fd, size - len(view), off + len(view))
                    if len(view) + len(rest) != self.nbytes + 4:
                        raise ChunkError(file, f"holds {len(view) + len(rest)} bytes, a chunk is {self.nbytes} + 4",
                                         inner)
                    if crc32c(rest[:-4], crc32c(out)) != int.from_bytes(rest[-4:], "little"):
                        raise ChunkError(file, "fails its crc32c (changed after it was written)", inner)
                return out
            data = os.pread(fd, size, off)
        finally:
            os.close(fd)
        if self.crc:
            if len(data) < 4 or crc32c(data[:-4]) != int.from_bytes(data[-4:], "little"):
                raise ChunkError(file, "fails its crc32c (changed after it was written)", inner)
            data = data[:-4]
        chunk = np.empty(self.chunks, dtype=self.dtype)
        try:
            self.zstd.decode(data, out=chunk)
        except (RuntimeError, ValueError) as e:  # not a zstd frame of this size: corrupt
            raise ChunkError(file, f"does not decode ({e})", inner) from e
        if out is not None:
            out.reshape(-1)[:] = chunk.reshape(-1)[:out.size]
            return out
        return chunk

    def read_row(self, row: int, stop: int | None = None, verify: bool = True,
                 missing: list | None = None) -> np.ndarray:
        """`array[row, :stop]` (all of the row's second axis by default); the chunks past `stop` are not read
        (`verify`: see `read_chunk`). Chunks never written read as the fill value; their grid indices are
        appended to `missing` when it is given."""
        stop = self.shape[1] if stop is None else stop
        c0, c1 = self.chunks[0], self.chunks[1]
        out = np.empty((stop, *self.shape[2:]), dtype=self.dtype)
        for j in range(-(-stop // c1)):
            lo, hi = j * c1, min((j + 1) * c1, stop)
            idx = (row // c0, j, *(0,) * (len(self.shape) - 2))
            if c0 == 1:  # the rows needed are the start of the chunk: read (uncompressed: only) those into place
                got = self.read_chunk(idx, out[lo:hi], verify)
            else:
                chunk = self.read_chunk(idx)
                got = None if chunk is None else out[lo:hi]
                if chunk is not None:
                    got[:] = chunk[row % c0, :hi - lo]
            if got is None:
                out[lo:hi] = self.fill
                if missing is not None:
                    missing.append(idx)
        return out

    def row_runs(self, rows: list[int], stops: list[int], limit: int) -> list[list[int]] | None:
        """Indices into `rows` in runs that one read serves (`read_rows`): rows of one file whose chunks up to
        their `stops` lie one after the other, `limit` bytes a run at most; None where this array is not one
        `read_rows` reads (not sharded one row to a chunk, or compressed). A row whose file or chunks cannot be
        found is a run of its own (its own read says what is wrong)."""
        if self.per_file is None or self.zstd is not None or self.chunks[0] != 1 or not self.rows_whole():
            return None
        by_file: dict[tuple[int, ...], list[int]] = {}
        for k, row in enumerate(rows):
            by_file.setdefault(self.row_file(row), []).append(k)
        runs: list[list[int]] = []
        for key, ks in by_file.items():
            extents = self._row_extents(key, [rows[k] for k in ks], [stops[k] for k in ks])
            cur = None
            for k, (lo, hi) in sorted(zip(ks, extents), key=lambda e: e[1][0]):
                if lo >= 0 and cur is not None and 0 <= lo - cur[1] <= 4096 and hi - cur[0] <= limit:
                    runs[-1].append(k)
                    cur = (cur[0], hi)
                else:
                    runs.append([k])
                    cur = (lo, hi) if lo >= 0 else None
        return runs

    def index_kept(self, row: int) -> bool:
        """Whether the shard index of the file holding row `row` is kept here, so that `row_runs` over that file's
        rows reads nothing (a missing file: nothing to read either)."""
        file = self._key_file(self.row_file(row))
        try:
            key = _index_key(file, os.stat(file))
        except OSError:
            return True
        with self._lock:
            return key in self._indexes

    def row_file(self, row: int) -> tuple[int, ...]:
        """The key of the file holding row `row` (of an array chunked one row at a time, sharded)."""
        return self._key(self._row_chunk(row))

    def _row_chunk(self, row: int) -> tuple[int, ...]:
        """The grid index of row `row`'s first chunk (of an array chunked one row at a time)."""
        return (row, *(0,) * (len(self.shape) - 1))

    def _row_extents(self, key: tuple[int, ...], rows: list[int], stops: list[int]) -> list[tuple[int, int]]:
        """For each of `rows` (of the file `key`): (first byte, end) in the file of the chunks holding its first
        `stop` entries, or (-1, -1) where one is not held, or the file is not there (or not readable)."""
        file = self._key_file(key)
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            return [(-1, -1)] * len(rows)
        try:
            index = self._index(fd, file)
        except (OSError, ChunkError):
            return [(-1, -1)] * len(rows)
        finally:
            os.close(fd)
        out = []
        for row, stop in zip(rows, stops):
            spans = self._row_spans(index, row, stop)
            if spans is None or (np.diff(spans[:, 0]) < 0).any():
                out.append((-1, -1))
            else:
                out.append((int(spans[0, 0]), int(spans[-1, 0] + spans[-1, 1])))
        return out

    def _row_spans(self, index: np.ndarray, row: int, stop: int) -> np.ndarray | None:
        """[(offset, length)] int64 in its file (whose shard index is `index`) of each chunk holding `row`'s
        first `stop` entries, or None where there is none or one is not held."""
        n = -(-stop // self.chunks[1])
        spans = index[row % self.per_file[0], :n].reshape(n, 2).astype(np.int64)
        return None if n == 0 or (spans[:, 0] < 0).any() else spans  # (NOT_HELD reads as -1 in int64)

    def read_rows(self, rows: list[int], stops: list[int]) -> list[np.ndarray | None]:
        """`array[row, :stop]` for each of `rows` (one run of `row_runs`), from one read of the file: like
        `read_row(row, stop, verify=False)`, the chunks' own crc32c not checked (the caller checks what it
        reads); None for a row whose chunks are not all held (the caller reads it by `read_row`). Each row is
        copied out of the read (the chunks of a row are not adjacent in the file: each ends in its crc32c)."""
        file = self._file(self._row_chunk(rows[0]))
        fd = self._open(file)
        try:
            index = self._index(fd, file)
            held = [self._row_spans(index, row, stop) for row, stop in zip(rows, stops)]
            offs = [s[:, 0] for s in held if s is not None]
            if not offs:
                return [None] * len(rows)
            lo = int(min(o.min() for o in offs))
            hi = int(max((s[:, 0] + s[:, 1]).max() for s in held if s is not None))
            buf = self._pread(fd, lo, hi - lo)
        finally:
            os.close(fd)
        row_bytes = int(np.prod(self.chunks[2:])) * self.dtype.itemsize
        out: list[np.ndarray | None] = []
        for stop, spans in zip(stops, held):
            if spans is None or int((spans[:, 0] + spans[:, 1]).max()) - lo > len(buf):
                out.append(None)
                continue
            flat = direct_io.BUFFERS.take(stop * row_bytes)  # (a reused buffer: fresh ones cost page faults)
            data = flat.view(self.dtype).reshape(stop, *self.shape[2:])
            for j, (off, _) in enumerate(spans.tolist()):
                a, b = j * self.chunks[1], min((j + 1) * self.chunks[1], stop)
                flat[a * row_bytes:b * row_bytes] = buf[off - lo:off - lo + (b - a) * row_bytes]
            out.append(data)
        return out

    def read_all(self) -> np.ndarray:
        """The whole of a one-dimensional array."""
        c0 = self.chunks[0]
        parts = [self.read_chunk((i,)) for i in range(-(-self.shape[0] // c0))]
        full = [np.full(c0, self.fill, dtype=self.dtype) if c is None else c for c in parts]
        return np.concatenate(full)[:self.shape[0]] if full else np.zeros(0, dtype=self.dtype)

    def rows_whole(self, write: bool = False) -> bool:
        """Whether `read_row` (and with `write`, `write_row(s)`) applies: the axes past the second are whole in
        every chunk (and for writing, one row per chunk)."""
        return (len(self.shape) >= 2 and tuple(self.chunks[2:]) == tuple(self.shape[2:])
                and (not write or self.chunks[0] == 1))

    # -- writing ------------------------------------------------------------------------------------------

    def _stored(self, block: np.ndarray | None) -> list | None:
        """A chunk's stored bytes as parts of `direct_io.FileWriter.write` (its data, then its crc32c, computed
        as the data is written), or None for a chunk of only the fill value (which is not written)."""
        if block is None:  # known to hold only the fill value
            return None
        if self.fill == 0:
            flat = block.reshape(-1)
            if self.dtype.kind in "iu" and block.flags.c_contiguous and block.nbytes % 8 == 0:
                flat = flat.view(np.uint64)  # integers: zero iff every bit is, 8 bytes at a time
            empty = not (flat[:64].any() or flat.any())  # a real chunk shows it in its first values: not all read
        else:
            empty = not (block != self.fill).any()
        if empty:
            return None
        data = np.ascontiguousarray(block, dtype=self.dtype)
        data = self.zstd.encode(data) if self.zstd is not None else data.reshape(-1).view(np.uint8)
        return [data] + ([direct_io.CRC32C_OF_PREVIOUS] if self.crc else [])

    def _replace(self, file: Path, parts: list | None) -> None:
        """Make `file` hold `parts` (buffers, written in order), or remove it for None. The file is complete
        under a temporary name before it replaces the old one (zarr's own ".partial" suffix, which stage one
        deletes on resume). Files of DIRECT_WRITE_MIN bytes or more are written past the page cache
        (`direct_io.FileWriter`); smaller ones through it, then handed to `write_behind`."""
        self.touched.append(file)
        if not parts:
            file.unlink(missing_ok=True)
            return
        if file.parent not in self._dirs:
            file.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(file.parent)
        nbytes = direct_io.parts_nbytes(parts)
        tmp = file.with_name(f"{file.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            out = direct_io.FileWriter(tmp, direct=nbytes >= DIRECT_WRITE_MIN)
            try:
                out.write(parts)
            except BaseException:
                out.abort()
                raise
            out.close(fsync=False)
            os.replace(tmp, file)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if not out.direct:
            write_behind.add(file, nbytes)  # synced and out of the page cache soon, in the background

    def write_chunk(self, idx: tuple[int, ...], block: np.ndarray | None) -> None:
        """Write chunk `idx` (a whole chunk, shape `chunks`; None: only the fill value, which leaves no chunk)."""
        self.write_chunks({idx: block})

    def write_chunks(self, blocks: dict[tuple[int, ...], np.ndarray | None]) -> None:
        """Write whole chunks, {grid index: block or None}, each file once, files on WRITE_THREADS threads
        (creating a file runs without the GIL). Sharded: a file holds the chunks given and, copied as stored,
        those it held that are not given (read only when some are not)."""
        if self.per_file is None:
            run_each(lambda idx: self._replace(self._file(idx), self._stored(blocks[idx])), list(blocks),
                     WRITE_THREADS)
            return
        by_file: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for idx in blocks:
            by_file.setdefault(self._key(idx), []).append(idx)
        run_each(lambda key: self._write_file(key, {idx: blocks[idx] for idx in by_file[key]}), list(by_file),
                 WRITE_THREADS)

    def _write_file(self, key: tuple[int, ...], given: dict[tuple[int, ...], np.ndarray | None]) -> None:
        """Write the shard file `key` whole: the chunks `given`, and the others it held (copied as stored)."""
        file = self._key_file(key)
        base = tuple(k * p for k, p in zip(key, self.per_file))
        grid = [range(b, min(b + p, -(-s // c))) for b, p, s, c in zip(base, self.per_file, self.shape, self.chunks)]
        kept: dict[tuple[int, ...], bytes] = {}
        if len(given) < math.prod(len(r) for r in grid):  # not every chunk of the file: keep the ones it held
            try:
                fd = os.open(file, os.O_RDONLY)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                try:
                    index = self._index(fd, file)
                    for local in np.ndindex(*self.per_file):
                        idx = tuple(b + i for b, i in zip(base, local))
                        off, n = (int(v) for v in index[local])
                        if idx not in given and off != NOT_HELD:
                            kept[idx] = os.pread(fd, n, off)
                            if len(kept[idx]) != n:
                                raise ChunkError(file, "is shorter than its shard index says", idx)
                finally:
                    os.close(fd)
        index = np.full((*self.per_file, 2), NOT_HELD, dtype="<u8")
        parts, pos = [], 0 if self.index_at_end else self._index_nbytes
        for local in np.ndindex(*self.per_file):
            idx = tuple(b + i for b, i in zip(base, local))
            stored = self._stored(given[idx]) if idx in given else ([kept[idx]] if idx in kept else None)
            if not stored:
                continue
            n = direct_io.parts_nbytes(stored)
            index[local] = (pos, n)
            parts += stored
            pos += n
        if parts:
            raw = index.tobytes()
            head = [raw, crc32c(raw).to_bytes(4, "little")]
            parts = parts + head if self.index_at_end else head + parts
        self._replace(file, parts or None)

    def _row_blocks(self, row: int, values: np.ndarray, stop: int | None) -> dict:
        """The chunks of row `row` holding `values` (chunks wholly past `stop`: None, the fill value)."""
        c1, tail = self.chunks[1], (0,) * (len(self.shape) - 2)
        out = {}
        for j in range(-(-self.shape[1] // c1)):
            if stop is not None and j * c1 >= stop:
                out[(row, j, *tail)] = None
                continue
            block = values[j * c1:(j + 1) * c1]
            if len(block) < c1:  # the grid's last chunk reaches past the array: padded with the fill value
                block = np.concatenate([block, np.full((c1 - len(block), *block.shape[1:]), self.fill, block.dtype)])
            out[(row, j, *tail)] = block[None]
        return out

    def write_rows(self, rows: list[int], values, stops: list[int] | None = None) -> None:
        """`array[rows[k]] = values[k]` for arrays chunked one row at a time (chunks[0] == 1) along whole trailing
        axes, in one `write_chunks` (each file written once). With `stops`, the values of row k from `stops[k]` on
        are the fill value by the caller's word (the zero padding past a prompt's tokens, which no reader
        reads): chunks wholly past it are not written."""
        blocks: dict = {}
        for k, r in enumerate(rows):
            blocks.update(self._row_blocks(r, values[k], None if stops is None else stops[k]))
        self.write_chunks(blocks)

    def write_row(self, row: int, values: np.ndarray, stop: int | None = None) -> None:
        """`write_rows` of one row."""
        self.write_rows([row], [values], None if stop is None else [stop])


def _chunk_files(g: zarr.Group, name: str) -> ChunkFiles | None:
    """`ChunkFiles` of array `name` of a group opened from a local folder, or None (then zarr's path)."""
    root = getattr(g.store, "root", None)
    return ChunkFiles.open(Path(root) / g.path / name) if root is not None else None


# Threads that write a call's rows of chunk files (2-4 threads: ~1.5x the files a second of one on ext4 here).
WRITE_THREADS = 4


def _has(g: zarr.Group, name: str) -> bool:
    """Whether the store holds array `name` (a path inside it)."""
    try:
        g[name]
    except KeyError:
        return False
    return True


def _read_all(g: zarr.Group, name: str) -> np.ndarray:
    """The whole of one-dimensional array `name`, through its chunk files where their layout allows."""
    files = _chunk_files(g, name)
    return files.read_all() if files is not None and len(files.shape) == 1 else g[name][:]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) position ranges of `rows` whose values are consecutive and ascending."""
    out, lo = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[j - 1] + 1:
            out.append((lo, j))
            lo = j
    return out


def prompt_store_path(cache_dir: str | os.PathLike, part: int) -> Path:
    return Path(cache_dir) / PARTS_DIR / part_dirname(part) / PROMPTS_ZARR


def create_prompt_store(path: str | os.PathLike, n: int, max_len: int, dim: int, dtype_name: str,
                        seeds: int, latent_shape: tuple[int, ...]) -> zarr.Group:
    """Create (or truncate) the store of one part holding `n` prompts."""
    g = zarr.open_group(str(path), mode="w")
    # zarr's default compressor for these, then every chunk's crc32c (zarr checks it on every read)
    packed = (ZstdCodec(level=0, checksum=False), Crc32cCodec())
    g.create_array(Z_PROMPT_IDX, shape=(n,), dtype="int64", chunks=(max(n, 1),), fill_value=-1, compressors=packed)
    g.create_array(Z_TEXT, shape=(n,), dtype=str, chunks=(max(1, min(n, TEXT_CHUNK)),), compressors=packed)
    g.create_array(Z_SEQ_LENS, shape=(n,), dtype="int32", chunks=(max(1, min(n, SEQ_LENS_CHUNK)),),
                   fill_value=UNWRITTEN_SEQ_LEN, compressors=packed)
    g.create_group(Z_ROW_CRC32C).create_array(Z_EMBEDS, shape=(n,), dtype="int64",
                                              chunks=(max(1, min(n, SEQ_LENS_CHUNK)),), fill_value=-1,
                                              compressors=packed)
    # Embeddings and latents are stored uncompressed: zstd saves 22% of a bf16 embedding and 7% of a float32
    # latent but costs ~2 ms to write and ~1 ms to read per chunk, more than the disk time of the bytes it saves
    # (and stage two reads an embedding per sample); they are a few percent of a cache whose shards dominate.
    flat = {"name": "default", "separator": "."}  # c.i.j.k: one folder per array, not a few per prompt
    # A crc32c costs ~20 us per chunk (bench.real_size --integrity), zstd's checksum its compression.
    # Each row's chunks (its embedding per EMBED_CHUNK_TOKENS tokens, its latents) are inner chunks of zarr
    # shards of ROWS_PER_FILE rows: one file per 64 rows (see `ChunkFiles`).
    rows = max(1, min(n, ROWS_PER_FILE))
    tokens = min(max_len, EMBED_CHUNK_TOKENS)
    emb = g.create_array(Z_EMBEDS, shape=(n, max_len, dim), dtype=storage_numpy_dtype(dtype_name),
                         chunks=(1, tokens, dim), shards=(rows, -(-max_len // tokens) * tokens, dim), fill_value=0,
                         compressors=Crc32cCodec(), chunk_key_encoding=flat)
    emb.attrs[Z_ATTR_TORCH_DTYPE] = dtype_name
    for name in (Z_INIT_NOISE, Z_FINAL_LATENTS):
        g.create_array(name, shape=(n, seeds, *latent_shape), dtype="float32", chunks=(1, seeds, *latent_shape),
                       shards=(rows, seeds, *latent_shape), fill_value=0.0, compressors=Crc32cCodec(),
                       chunk_key_encoding=flat)
    return g


def open_prompt_store(path: str | os.PathLike, mode: str = "r") -> zarr.Group:
    return zarr.open_group(str(path), mode=mode)


PENDING_FILES = 2  # files of rows `PromptRowWriter` writes at once


class PromptRowWriter:
    """Writes one part's encoded prompts as the text encoder makes them, a batch at a time (`add`), in memory
    that does not grow with the prompt count: a batch's real tokens are kept (never the padding past them, 4 MiB
    of an A14B prompt) only until every row of their file (`ROWS_PER_FILE` rows) has come, then that file is
    written once. The small arrays (text, seq_lens, the rows' crc32c, prompt_idx: tens of bytes a prompt) are
    written once, by `close`, which also writes the files not complete yet. Until `close` returns the rows are
    not all there: stage one's progress record says `encoded` only after it (a killed run encodes again)."""

    def __init__(self, g: zarr.Group):
        self.g = g
        emb = _chunk_files(g, Z_EMBEDS)
        self.emb = emb if emb is not None and emb.rows_whole(write=True) else None  # None: zarr's path
        self.n = int(g[Z_SEQ_LENS].shape[0])
        self.per_file = emb.per_file[0] if self.emb is not None and emb.per_file else 1
        self._pending: dict[int, dict[int, np.ndarray]] = {}  # file -> row -> the row's real tokens
        self._small: dict[int, tuple[int, str, int, int]] = {}  # row -> (prompt_idx, text, seq_len, crc32c)
        self._writing: list = []  # files being written in the background, oldest first

    def add(self, rows: list[int], prompt_idx: list[int], texts: list[str], embeds: torch.Tensor,
            seq_lens: torch.Tensor) -> None:
        """Rows `rows` of the store: `embeds` is [b, L, D] zero-padded past each `seq_lens` (as the pipeline pads)."""
        store = torch_to_storage(embeds)
        lens = np.asarray(seq_lens, dtype=np.int32)
        for j, r in enumerate(rows):
            tokens = np.array(store[j, :lens[j]])  # a copy: the batch is the caller's
            self._small[r] = (int(prompt_idx[j]), str(texts[j]), int(lens[j]), crc32c(tokens))
            if self.emb is None:
                self.g[Z_EMBEDS][r] = store[j]
                continue
            f = r // self.per_file
            self._pending.setdefault(f, {})[r] = tokens
            if len(self._pending[f]) == min(self.per_file, self.n - f * self.per_file):
                self._write(self._pending.pop(f))

    def _write(self, tokens: dict[int, np.ndarray]) -> None:
        """Write a file's rows in the background while the next batches are encoded and added (the tokens are
        this writer's copies): PENDING_FILES files at a time, on as many threads (one file's gaps, such as its
        start and its last write, are the other's disk time); an error is raised here or by `close`."""
        self._wait(PENDING_FILES - 1)
        rows = sorted(tokens)  # the chunks past a prompt's tokens hold only zeros: not written
        self._writing.append(thread_pool(PENDING_FILES, "prompt-rows").submit(
            self.emb.write_rows, rows, [tokens[r] for r in rows], [len(tokens[r]) for r in rows]))

    def _wait(self, left: int = 0) -> None:
        """Until at most `left` files are being written."""
        while len(self._writing) > left:
            self._writing.pop(0).result()

    def close(self) -> None:
        for f in sorted(self._pending):
            self._write(self._pending[f])
        self._pending = {}
        self._wait()
        if not self._small:
            return
        rows = sorted(self._small)
        idx_, texts, lens, crcs = (list(v) for v in zip(*(self._small[r] for r in rows)))
        text, seq = self.g[Z_TEXT], self.g[Z_SEQ_LENS]  # opened once: zarr re-reads metadata at every g[name]
        for lo, hi in _runs(rows):  # one zarr write per run of consecutive rows
            text[rows[lo]:rows[hi - 1] + 1] = np.asarray(texts[lo:hi], dtype=str)
            seq[rows[lo]:rows[hi - 1] + 1] = np.asarray(lens[lo:hi], dtype=np.int32)
        if _has(self.g, EMBEDS_CRC32C):  # (a store of an earlier layout has none)
            _write_values(self.g, EMBEDS_CRC32C, rows, crcs)
        arr = self.g[Z_PROMPT_IDX]
        all_idx = arr[:]
        all_idx[rows] = idx_
        arr[:] = all_idx
        self._small = {}


def write_prompt_rows(g: zarr.Group, rows: list[int], prompt_idx: list[int], texts: list[str],
                      embeds: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Write encoded prompts at once (`PromptRowWriter`). `embeds` is [b, L, D] zero-padded past each `seq_lens`."""
    writer = PromptRowWriter(g)
    writer.add(rows, prompt_idx, texts, embeds, seq_lens)
    writer.close()


def _write_values(g: zarr.Group, name: str, rows: list[int], values) -> None:
    """`array[rows] = values` for a one-dimensional array: one read and write per chunk touched."""
    files = _chunk_files(g, name)
    values = np.asarray(values)
    if files is None or len(files.shape) != 1:
        arr = g[name]
        for lo, hi in _runs(rows):
            arr[rows[lo]:rows[hi - 1] + 1] = values[lo:hi]
        return
    c0 = files.chunks[0]
    by_chunk: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        by_chunk.setdefault(r // c0, []).append(j)
    for i, js in by_chunk.items():
        cur = files.read_chunk((i,))
        cur = np.full(c0, files.fill, dtype=files.dtype) if cur is None else cur
        for j in js:
            cur[rows[j] % c0] = values[j]
        files.write_chunk((i,), cur)


def write_latent_rows(g: zarr.Group, name: str, rows: list[int], seed_idx: list[int],
                      latents: torch.Tensor) -> list[Path]:
    """Write per-trajectory latents (`init_noise` or `final_latents`); rows grouped per chunk. Returns what to
    fsync before anything records them as written (`atomic.fsync_paths`): the chunk files, or for a store of an
    earlier layout (written through zarr) the array's folder."""
    files = _chunk_files(g, name)
    arr = files if files is not None and files.rows_whole(write=True) else g[name]
    lat = latents.detach().float().cpu().numpy()
    by_row: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        by_row.setdefault(r, []).append(j)

    def row(r: int) -> np.ndarray:
        js = by_row[r]
        seeds = [seed_idx[j] for j in js]
        if arr is files and seeds == list(range(files.shape[1])) and js == list(range(js[0], js[0] + len(js))):
            return lat[js[0]:js[0] + len(js)]  # every seed, in order, side by side: the caller's memory, no copy
        if arr is files:
            # every seed of the row given: nothing of the old chunk survives, so it is not read
            whole = len({seed_idx[j] for j in js}) == files.shape[1]
            cur = np.empty(files.shape[1:], dtype=np.float32) if whole else files.read_row(r)
        else:
            cur = arr[r]
        for j in js:
            cur[seed_idx[j]] = lat[j]
        return cur

    if arr is files:
        files.write_rows(list(by_row), [row(r) for r in by_row])  # each file written once
        return files.touched
    for r in by_row:
        arr[r] = row(r)
    root = getattr(g.store, "root", None)
    return [Path(root) / g.path / name] if root is not None else []


# What is wrong with one prompt row, as bits: stage two's ranks each check a share of the rows and sum them.
ROW_EMBEDS_MISSING = 1  # the row, or a chunk of its real tokens, was never written (it would read as zeros)
ROW_EMBEDS_CHECKSUM = 2  # the row's real tokens (or a chunk of them) fail their crc32c, or have none recorded
ROW_FINAL_CHECKSUM = 4  # the row's final latents fail their chunk's crc32c
ROW_NOISE_CHECKSUM = 8  # the row's initial noise fails its chunk's crc32c
ROW_LATENT_UNWRITTEN = 16  # a trajectory's initial noise or final latent was never written (zeros)
ROW_UNREADABLE = 32  # the row's store or arrays do not open or read

REBUILD = "rebuild the cache with the same `wandistiller teacher-cache` command and --overwrite"


def store_relpath(part: int) -> str:
    """A part's prompt store relative to the cache folder, as messages name it."""
    return f"{PARTS_DIR}/{part_dirname(part)}/{PROMPTS_ZARR}"


def damaged_part(cache_dir: str | os.PathLike, part: int, what: str) -> CacheError:
    """Stage one resuming a part whose own files fail their checks (`what`: which and how): the one line, with
    the two ways to rebuild it. A part cannot be patched row by row: its rows are encoded in one pass."""
    part_dir = Path(cache_dir) / PARTS_DIR / part_dirname(part)
    return CacheError(f"part {part} of {cache_dir} is damaged: {what}; delete {part_dir} and rerun the same "
                      "`wandistiller teacher-cache` command (that part is computed again), or rerun it with "
                      "--overwrite (the whole cache)")


class RowError(CacheError):
    """A prompt row that is not what stage one wrote: `bit` (ROW_*) says what, `detail` says it in words
    ("embeds of row 5 (prompt 5) fail their crc32c ...")."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, bit: int, detail: str):
        super().__init__(f"prompt store {Path(cache_dir) / store_relpath(part)}: {detail}; run `wandistiller cache "
                         f"verify` and {REBUILD}")
        self.bit, self.detail = bit, detail


def _has_crc(g: zarr.Group, name: str) -> bool:
    """Whether each chunk of array `name` ends in its crc32c (stores written before the checksums: no)."""
    codecs = g[name].metadata.to_dict()["codecs"]
    if codecs[-1]["name"] == "sharding_indexed":  # the chunks inside each file
        codecs = codecs[-1]["configuration"]["codecs"]
    return codecs[-1]["name"] == "crc32c"


class PartRows:
    """One part's prompt store, opened for reading rows that are checked against what stage one recorded: a row's
    real tokens against their crc32c (`row_crc32c/embeds`, read without the padding past them), its latents
    against their chunk's crc32c; a chunk holding real tokens that does not exist is an error, never zeros. Each
    array opens on first use. Stores written before the checksums are read with the presence checks alone."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, num_parts: int, direct: bool = False):
        self.cache_dir, self.part, self.num_parts = Path(cache_dir), part, num_parts
        self.direct = direct  # read the chunk files with O_DIRECT (`ChunkFiles.direct`)
        self.g = open_prompt_store(prompt_store_path(cache_dir, part))
        self._latents: dict[str, ChunkFiles | zarr.Array] = {}

    def where(self, row: int) -> str:
        return f"row {row} (prompt {row * self.num_parts + self.part})"

    def error(self, bit: int, detail: str) -> RowError:
        return RowError(self.cache_dir, self.part, bit, detail)

    def has(self, name: str) -> bool:
        return _has(self.g, name)

    @cached_property
    def seq_lens(self) -> np.ndarray:
        return _read_all(self.g, Z_SEQ_LENS)

    @cached_property
    def embeds(self) -> ChunkFiles | zarr.Array:
        files = _chunk_files(self.g, Z_EMBEDS)
        if files is None or not files.rows_whole():
            return self.g[Z_EMBEDS]
        files.direct = self.direct
        return files

    @cached_property
    def dtype_name(self) -> str:
        return self.g[Z_EMBEDS].attrs[Z_ATTR_TORCH_DTYPE]

    @cached_property
    def crcs(self) -> np.ndarray | None:
        """crc32c of each row's real tokens (-1: none recorded), or None for a store written before them."""
        return _read_all(self.g, EMBEDS_CRC32C) if self.has(EMBEDS_CRC32C) else None

    @property
    def max_len(self) -> int:
        return int(self.embeds.shape[1])

    def unchecked(self) -> list[str]:
        """What this store records no checksums for (written before them): arrays, and the real tokens' crc32c."""
        out = [n for n in (Z_SEQ_LENS, Z_PROMPT_IDX, Z_TEXT, Z_EMBEDS, Z_INIT_NOISE, Z_FINAL_LATENTS)
               if self.has(n) and not _has_crc(self.g, n)]
        return out + ([EMBEDS_CRC32C] if self.crcs is None else [])

    def prefetch(self, row: int) -> None:
        """Start reading the row's real tokens from disk (see `ChunkFiles.prefetch_row`)."""
        seq_len = int(self.seq_lens[row]) if row < len(self.seq_lens) else -1
        if seq_len > 0 and isinstance(self.embeds, ChunkFiles) and hasattr(os, "posix_fadvise"):
            self.embeds.prefetch_row(row, seq_len)

    def trimmed(self, row: int, verify: bool = False) -> np.ndarray:
        """The row's real tokens [seq_len, D] (storage dtype), checked against their crc32c; with `verify` the
        whole chunks are read and each checked against its own crc32c too (the padding past the tokens
        included). RowError naming the row, or the missing or damaged chunk."""
        seq_len = int(self.seq_lens[row]) if row < len(self.seq_lens) else UNWRITTEN_SEQ_LEN
        if seq_len < 0:
            raise self.error(ROW_EMBEDS_MISSING, f"embeds of {self.where(row)} were never written")
        arr, missing = self.embeds, []
        try:
            if isinstance(arr, ChunkFiles):
                c1 = arr.chunks[1]
                stop = min(arr.shape[1], -(-seq_len // c1) * c1) if verify else seq_len
                data = arr.read_row(row, stop, verify=verify, missing=missing)[:seq_len]
            else:
                data = np.asarray(arr[row, :seq_len])
        except ChunkError as e:
            raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)}: {e.named()}") from e
        except ValueError as e:  # zarr's own check of a chunk's crc32c
            raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)} do not read ({e})") from e
        digest = None if self.crcs is None else int(self.crcs[row])
        if digest is not None and digest >= 0 and crc32c(data) == digest:
            return data  # (a chunk of zeros is not written: missing chunks are fine when the crc32c agrees)
        if missing:
            raise self.error(ROW_EMBEDS_MISSING, f"embeds of {self.where(row)}: chunk {arr.chunk_name(missing[0])} "
                                                 "is missing (it would read as zeros)")
        if digest is None:
            return data
        if digest < 0:
            raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)} have no crc32c recorded")
        raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)} fail their crc32c (changed after stage "
                                              "one wrote them)")

    def trimmed_runs(self, rows: list[int], limit: int) -> list[list[int]]:
        """`rows` in runs that one `trimmed_many` call reads with one request (consecutive rows of one file of the
        store, `limit` bytes at most); each row a run of its own where the store is not laid out so."""
        arr = self.embeds
        stops = [max(int(self.seq_lens[r]), 0) if r < len(self.seq_lens) else 0 for r in rows]
        runs = arr.row_runs(rows, stops, limit) if isinstance(arr, ChunkFiles) else None
        return [[r] for r in rows] if runs is None else [[rows[k] for k in run] for run in runs]

    def file_groups(self, rows: list[int]) -> list[tuple[list[int], bool]]:
        """`rows` by the file of the store that holds them, each group with whether `trimmed_runs` over it reads
        nothing (the file's shard index is kept, or the store is not laid out in such files)."""
        arr = self.embeds
        if not isinstance(arr, ChunkFiles) or arr.per_file is None:
            return [(rows, True)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in rows:
            groups.setdefault(arr.row_file(r), []).append(r)
        return [(g, arr.index_kept(g[0])) for g in groups.values()]

    def trimmed_many(self, rows: list[int]) -> list[np.ndarray | None]:
        """`trimmed(row)` for each of `rows` (a run of `trimmed_runs`) from one read of the run's chunks, each
        row's real tokens checked against their crc32c; None for a row that does not check or whose chunks are not
        all there (its caller reads it by `trimmed`, which returns it or says what is wrong)."""
        arr = self.embeds
        if len(rows) < 2 or not isinstance(arr, ChunkFiles) or self.crcs is None:
            return [None] * len(rows)
        stops = [int(self.seq_lens[r]) if r < len(self.seq_lens) else -1 for r in rows]
        try:
            got = arr.read_rows(rows, [max(s, 0) for s in stops])
        except (OSError, ChunkError):
            return [None] * len(rows)
        return [data if data is not None and stop > 0 and 0 <= int(self.crcs[row]) == crc32c(data) else None
                for row, stop, data in zip(rows, stops, got)]

    def missing_chunk(self, row: int) -> str | None:
        """The first chunk holding real tokens of a written row that does not exist (a stat per chunk, nothing
        read), or None."""
        arr, seq_len = self.embeds, int(self.seq_lens[row])
        if not isinstance(arr, ChunkFiles) or seq_len <= 0:
            return None
        for j in range(-(-seq_len // arr.chunks[1])):
            idx = (row, j, *(0,) * (len(arr.shape) - 2))
            try:
                held = arr.has_chunk(idx)
            except ChunkError as e:  # a damaged shard index
                raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)}: {e.named()}") from e
            if not held:
                return arr.chunk_name(idx)
        return None

    def _latent_array(self, name: str) -> ChunkFiles | zarr.Array:
        if name not in self._latents:
            files = _chunk_files(self.g, name)
            whole = files is not None and files.chunks[0] == 1 and tuple(files.chunks[1:]) == tuple(files.shape[1:])
            if whole:
                files.direct = self.direct
            self._latents[name] = files if whole else self.g[name]
        return self._latents[name]

    def latents(self, name: str, row: int) -> np.ndarray:
        """Every seed of the row's `name` (init_noise or final_latents), float32 [seeds, C, F, H, W], checked
        against its chunk's crc32c (RowError); a seed never written reads as zeros (the caller decides)."""
        arr = self._latent_array(name)
        bit = ROW_FINAL_CHECKSUM if name == Z_FINAL_LATENTS else ROW_NOISE_CHECKSUM
        try:
            if isinstance(arr, ChunkFiles):
                chunk = arr.read_chunk((row, *(0,) * (len(arr.shape) - 1)))
                return np.zeros(arr.shape[1:], np.float32) if chunk is None else chunk[0]
            return np.asarray(arr[row], dtype=np.float32)
        except ChunkError as e:
            raise self.error(bit, f"{name} of {self.where(row)}: {e.named()}") from e
        except ValueError as e:  # zarr's own check of a chunk's crc32c
            raise self.error(bit, f"{name} of {self.where(row)} do not read ({e})") from e

    def latent(self, name: str, row: int, seed: int) -> np.ndarray:
        """One trajectory's `name` [C, F, H, W], checked; RowError where it was never written (zeros)."""
        values = self.latents(name, row)
        if not 0 <= seed < len(values) or not values[seed].any():
            raise self.error(ROW_LATENT_UNWRITTEN, f"{name} of {self.where(row)} seed {seed} were never written")
        return values[seed]

    def check(self, row: int, checksums: bool, final: bool) -> RowError | None:
        """The first problem of what stage two reads of a written row, or None: its real tokens (with `checksums`
        read and checked against their crc32c; without, their chunks looked for), and with `final` its final
        latents against their chunk's crc32c."""
        try:
            if checksums or self.missing_chunk(row) is not None:  # (a missing chunk of zeros: the crc32c decides)
                self.trimmed(row)
            if final:
                self.latents(Z_FINAL_LATENTS, row)
        except RowError as e:
            return e
        return None


def prompt_row_problems(cache_dir: str | os.PathLike, num_parts: int, prompts: int, final_latents: bool = False,
                        checksums: bool = False, notes: list[str] | None = None, progress: bool = False) -> list[str]:
    """Every row a reader relies on that is missing or wrong in the parts' stores (empty = sound): rows never
    written (zarr returns the fill value for those), rows holding another prompt, and with `final_latents`
    trajectories whose final latent was never written. With `checksums` every byte of every row is read and
    checked: each chunk against its crc32c, each row's real tokens against theirs, no chunk of them missing, no
    initial noise unwritten (`cache verify`). What a store records no checksums for goes to `notes`."""
    problems = []
    for part in range(num_parts):
        rel = store_relpath(part)
        try:
            g = open_prompt_store(prompt_store_path(cache_dir, part))
            seq, idx = g[Z_SEQ_LENS][:], g[Z_PROMPT_IDX][:]
            if checksums:
                g[Z_TEXT][:]  # zarr checks each chunk's crc32c
            rows = PartRows(cache_dir, part, num_parts)
            if final_latents:
                g[Z_FINAL_LATENTS]
        except Exception as e:  # a missing or unreadable store, whatever zarr raises for it
            problems.append(f"{rel}: unreadable ({type(e).__name__}: {e})")
            continue
        want = part_prompts(part, prompts, num_parts)
        if len(seq) != len(want):
            problems.append(f"{rel}: {len(seq)} rows, expected {len(want)}")
            continue
        for r in np.flatnonzero(seq < 0):
            problems.append(f"{rel}: row {r} (prompt {want[r]}) was never written")
        for r in np.flatnonzero(idx != np.asarray(want)):
            problems.append(f"{rel}: row {r} holds prompt_idx {idx[r]}, expected {want[r]}")
        if checksums and notes is not None and (unchecked := rows.unchecked()):
            notes.append(f"{rel} records no checksums for {', '.join(unchecked)} (written by an earlier WanDistiller): "
                         "those were checked for presence only")
        if not (checksums or final_latents):
            continue
        for r in tqdm(range(len(want)), desc=f"verify {rel}", unit="row", disable=not progress):
            names = ([Z_INIT_NOISE] if checksums and seq[r] >= 0 else []) + ([Z_FINAL_LATENTS] if final_latents else [])
            try:
                if checksums and seq[r] >= 0:
                    rows.trimmed(r, verify=True)
                for name in names:
                    values = rows.latents(name, r)
                    unwritten = [s for s in range(len(values)) if not values[s].any()]
                    if len(unwritten) == len(values):
                        problems.append(f"{rel}: {name} of row {r} (prompt {want[r]}) were never written")
                    elif unwritten:
                        problems.append(f"{rel}: {name} of row {r} (prompt {want[r]}) seed(s) "
                                        f"{','.join(map(str, unwritten))} were never written")
            except RowError as e:
                problems.append(f"{rel}: {e.detail}")
    return problems


def check_prompt_rows(cache_dir: str | os.PathLike, num_parts: int, prompts: int) -> None:
    """CacheError naming the first problem of `prompt_row_problems`: training must not discover a missing row
    thousands of steps in."""
    problems = prompt_row_problems(cache_dir, num_parts, prompts)
    if problems:
        more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CacheError(f"prompt store of {cache_dir}: {problems[0]}{more}, yet the part is marked complete (the "
                         "store was damaged); rebuild the cache with the same `wandistiller teacher-cache` command "
                         "and --overwrite")


def row_check_flags(cache_dir: str | os.PathLike, num_parts: int, prompts: int, rank: int = 0, world: int = 1,
                    checksums: bool = True) -> np.ndarray:
    """int64 [prompts]: for each prompt this rank checks (prompt % world == rank; 0 for the others), the ROW_*
    bit of the first problem of what stage two reads of its row (`PartRows.check`: its real tokens, and with
    `checksums` their crc32c and the final latents' too). Summed over the ranks, every prompt is checked once;
    rows never written are left to `check_prompt_rows`."""
    flags = np.zeros(prompts, dtype=np.int64)
    parts: dict[int, tuple[PartRows, bool]] = {}
    for p in range(rank, prompts, world):
        part, row = prompt_location(p, num_parts)
        try:  # nothing escapes on one rank alone: the others would wait for it in the sum
            if part not in parts:
                rows = PartRows(cache_dir, part, num_parts)
                parts[part] = (rows, checksums and rows.has(Z_FINAL_LATENTS))
            rows, final = parts[part]
            if row < len(rows.seq_lens) and rows.seq_lens[row] >= 0:
                err = rows.check(row, checksums, final)
                flags[p] = 0 if err is None else err.bit
        except Exception:  # whatever zarr raises for a store it cannot read: named by `row_flags_problem`
            flags[p] = ROW_UNREADABLE
    return flags


def row_flags_problem(cache_dir: str | os.PathLike, num_parts: int, flags: np.ndarray,
                      checksums: bool = True) -> str | None:
    """The one-line message for `row_check_flags` summed over the ranks: its first bad prompt, checked again for
    the words (every rank finds the same), the count of the others and the fix; None if every row is sound."""
    bad = np.flatnonzero(flags)
    if not len(bad):
        return None
    p = int(bad[0])
    part, row = prompt_location(p, num_parts)
    try:
        rows = PartRows(cache_dir, part, num_parts)
        err = rows.check(row, checksums, checksums and rows.has(Z_FINAL_LATENTS))
        detail = err.detail if err is not None else f"row {row} (prompt {p}) failed its check"
    except Exception as e:  # whatever zarr raises for a store it cannot read
        detail = f"row {row} (prompt {p}) does not read ({type(e).__name__}: {e})"
    more = f" ({len(bad) - 1} more prompt(s) also fail)" if len(bad) > 1 else ""
    return (f"prompt store {Path(cache_dir) / store_relpath(part)}: {detail}{more}; {REBUILD} (`wandistiller cache "
            "verify` lists every problem)")


def prompt_texts(cache_dir: str | os.PathLike, num_parts: int) -> dict[int, str]:
    """prompt_idx -> text of every prompt the cache's stores hold (rows never written are left out)."""
    out: dict[int, str] = {}
    for part in range(num_parts):
        try:
            g = open_prompt_store(prompt_store_path(cache_dir, part))
            idx, seq, text = g[Z_PROMPT_IDX][:], g[Z_SEQ_LENS][:], g[Z_TEXT][:]
        except Exception as e:  # a missing or unreadable store (or a chunk failing its crc32c) is a broken cache
            raise CacheError(f"prompt store of part {part} in {cache_dir} is unreadable ({type(e).__name__}); "
                             "run `wandistiller cache verify`") from e
        out.update({int(i): str(t) for i, s, t in zip(idx, seq, text) if s >= 0})
    return dict(sorted(out.items()))


def read_latents(cache_dir: str | os.PathLike, num_parts: int,
                 trajectories: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise and the teacher's final latents of (prompt_idx, seed_idx) pairs, each [N, C, F, H, W], checked
    against their crc32c; RowError for one never written or damaged."""
    init, final = [], []
    stores: dict[int, PartRows] = {}
    for prompt_idx, seed_idx in trajectories:
        part, row = prompt_location(prompt_idx, num_parts)
        if part not in stores:
            stores[part] = PartRows(cache_dir, part, num_parts)
        init.append(stores[part].latent(Z_INIT_NOISE, row, seed_idx))
        final.append(stores[part].latent(Z_FINAL_LATENTS, row, seed_idx))
    return torch.from_numpy(np.stack(init)), torch.from_numpy(np.stack(final))


def part_negative(cache_dir: str | os.PathLike, part: int, sha256: str | None) -> torch.Tensor:
    """Part `part`'s own negative prompt embedding [L, D], which stage one reads on resume, checked against the
    sha256 its progress record holds (a record from before it: that it decodes); CacheError (`damaged_part`)."""
    rel = f"{PARTS_DIR}/{part_dirname(part)}/{NEGATIVE}"
    try:
        data = (Path(cache_dir) / rel).read_bytes()
    except FileNotFoundError:
        raise damaged_part(cache_dir, part, f"{rel} is missing") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise damaged_part(cache_dir, part, f"{rel} fails its sha256 check (changed after stage one wrote it)")
    try:
        return st_load(data)[NEG_EMBEDS]
    except Exception as e:  # any parse failure (or a file without the tensor) is corruption
        raise damaged_part(cache_dir, part, f"{rel} does not decode ({type(e).__name__})") from e


def negative_embeds(cache_dir: str | os.PathLike) -> torch.Tensor:
    """The negative prompt's embedding [L, D], padded like the prompts'; CacheError if the file is not the one
    the manifest recorded."""
    path = Path(cache_dir) / NEGATIVE
    if not path.is_file():
        raise CacheError(f"{path} is missing; rerun the same `wandistiller teacher-cache` command")
    if manifest_path(cache_dir).exists():
        problem = negative_problem(cache_dir, load_manifest(cache_dir))
        if problem:
            raise CacheError(problem)
    return st_load(path.read_bytes())[NEG_EMBEDS]


class EmbeddingCache:
    """Bounded LRU over the prompt stores of a cache: prompt_idx -> padded embedding [L, D].

    A prompt's part and row come from `format.prompt_location`. Embeddings are padded with zeros to
    `max_sequence_length` exactly as the teacher's pipeline padded them when it ran (`get`); `get_trimmed`
    gives the real tokens alone and the padded length, for a reader that pads later (an A14B embedding is
    4 MiB padded, ~0.5 MiB trimmed). Every read is checked (`PartRows.trimmed`): CacheError for a row that is
    missing, has a missing chunk or fails its crc32c, never zeros.

    One thread owns it: the LRU, the parts and the reads started by `submit` are touched by that thread alone;
    the pool's threads only run `_load` (a read of a `PartRows` already opened and warmed, returning its result).
    """

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int = 4096, direct: bool = False):
        self.cache_dir = Path(cache_dir)
        self.direct = direct  # read with O_DIRECT (`ChunkFiles.direct`)
        self.num_parts = num_parts
        self.capacity = capacity
        self._parts: dict[int, PartRows] = {}  # per part: its arrays, opened once
        self._lru: OrderedDict[int, tuple[torch.Tensor, int]] = OrderedDict()
        self._pending: dict = {}  # prompt_idx -> concurrent.futures.Future of `_load`'s result (`submit`)

    def _part(self, part: int) -> PartRows:
        if part not in self._parts:
            self._parts[part] = PartRows(self.cache_dir, part, self.num_parts, self.direct)
        return self._parts[part]

    def get(self, prompt_idx: int) -> torch.Tensor:
        trimmed, max_len = self.get_trimmed(prompt_idx)
        # Zero padding past the real length, exactly as WanPipeline pads its prompt embeddings.
        out = trimmed.new_zeros(max_len, trimmed.shape[1])
        out[:trimmed.shape[0]] = trimmed
        return out

    def submit(self, pool, prompt_idx: int) -> None:
        """Start reading this prompt's embedding in a thread of `pool` (a concurrent.futures.Executor) unless it
        is in memory or on its way; `get_trimmed` takes the result (or raises its error). The part is opened and
        its lazily read arrays (`seq_lens`, `embeds`, `crcs`, `dtype_name`) are read here, in the owner's
        thread, so the pool's threads share nothing that they would fill in."""
        if prompt_idx in self._lru or prompt_idx in self._pending:
            return
        part, row = prompt_location(prompt_idx, self.num_parts)
        rows = self._part(part)
        rows.seq_lens, rows.embeds, rows.crcs, rows.dtype_name  # (each computed once, here)
        self._pending[prompt_idx] = pool.submit(self._load, prompt_idx, rows, row)

    def submit_many(self, pool, prompts: list[int], limit: int = 16 << 20) -> None:
        """`submit` for each of `prompts`, in reads of consecutive rows of the store (`PartRows.trimmed_runs`,
        `limit` bytes at most a read): a window's prompts, which a grouped epoch takes in runs of consecutive rows,
        read in a few large requests instead of one each. One task per read, through `pool`'s `submit`."""
        want: dict[int, list[int]] = {}
        for p in dict.fromkeys(prompts):
            if p not in self._lru and p not in self._pending:
                part, row = prompt_location(p, self.num_parts)
                want.setdefault(part, []).append(row)
        for part, rows in want.items():
            store = self._part(part)
            store.seq_lens, store.embeds, store.crcs, store.dtype_name, store.max_len  # (each computed once, here)
            for group, known in store.file_groups(sorted(rows)):
                if not known:
                    # the runs need the file's shard index, which is read in the pool, not here: a small read
                    # waits behind the large ones in flight (3 s of a 10 s A14B epoch spent so, bench.real_size)
                    fut = pool.submit(self._load_group, store, group, part, limit)
                    for k, row in enumerate(group):
                        self._pending[row * self.num_parts + part] = Share(fut, k)
                    continue
                for run in store.trimmed_runs(group, limit):
                    if len(run) == 1:
                        prompt = run[0] * self.num_parts + part
                        self._pending[prompt] = pool.submit(self._load, prompt, store, run[0])
                        continue
                    fut = pool.submit(self._load_run, store, run, part)
                    for k, row in enumerate(run):
                        self._pending[row * self.num_parts + part] = Share(fut, k)

    def _load_group(self, store: PartRows, rows: list[int], part: int, limit: int) -> list:
        """`_load_run` over each run of `rows` (`trimmed_runs`, its file's shard index read here), in the order
        of `rows`."""
        got = {}
        for run in store.trimmed_runs(rows, limit):
            got.update(zip(run, self._load_run(store, run, part)))
        return [got[r] for r in rows]

    def _load_run(self, store: PartRows, run: list[int], part: int) -> list:
        """What `_load` returns or raises for each row of `run`, from one read of the run (`trimmed_many`); a row
        that does not check there is read by `_load` itself, whose error is then its entry."""
        out = []
        for row, value in zip(run, store.trimmed_many(run)):
            if value is not None:
                out.append((storage_to_torch(value, store.dtype_name), store.max_len))
                continue
            try:
                out.append(self._load(row * self.num_parts + part, store, row))
            except BaseException as e:  # (without this frame: its list holds the other rows' results)
                out.append(e.with_traceback(None))
        return out

    def forget(self, cancel: bool = True) -> None:
        """Drop the reads `submit` started, those not begun cancelled unless not `cancel` (in a forked child: the
        parent's futures are not to be touched); `get_trimmed` reads again."""
        for fut in self._pending.values() if cancel else ():
            fut.cancel()
        self._pending.clear()

    def _load(self, prompt_idx: int, rows: PartRows, row: int) -> tuple[torch.Tensor, int]:
        """The read behind `get_trimmed` (any thread: it only reads)."""
        if row >= len(rows.seq_lens) or rows.seq_lens[row] < 0:
            raise CacheError(f"prompt {prompt_idx} has no embedding in {self.cache_dir} (row never written); "
                             "rerun teacher-cache on that cache to complete it")
        # One read per prompt, of the real tokens only: a padded real row is 512 x 4096, mostly zeros.
        return storage_to_torch(rows.trimmed(row), rows.dtype_name), rows.max_len

    def get_trimmed(self, prompt_idx: int) -> tuple[torch.Tensor, int]:
        """(the prompt's real token embeddings [seq_len, D], the length `get` pads them to)."""
        hit = self._lru.get(prompt_idx)
        if hit is None:
            fut = self._pending.pop(prompt_idx, None)
            if fut is not None:
                hit = fut.result()  # what `_load` returned, or its error raised here
            else:
                part, row = prompt_location(prompt_idx, self.num_parts)
                hit = self._load(prompt_idx, self._part(part), row)
            self._lru[prompt_idx] = hit
            if len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        else:
            self._lru.move_to_end(prompt_idx)
        return hit


def final_latents_problem(cache_dir: str | os.PathLike, num_parts: int, seeds: int,
                          latent_shape: tuple[int, ...]) -> str | None:
    """Why the cache's prompt stores cannot serve final latents (no `final_latents` array, or one of another
    shape), or None. Reads array metadata only; a trajectory whose latent was never written is caught when it
    is read (`FinalLatentCache`) and by `cache verify`."""
    want = (int(seeds), *(int(v) for v in latent_shape))
    for part in range(num_parts):
        path = prompt_store_path(cache_dir, part)
        try:
            arr = open_prompt_store(path)[Z_FINAL_LATENTS]
        except Exception as e:  # a missing store or array, whatever zarr raises for it
            return f"{path} has no {Z_FINAL_LATENTS} array ({type(e).__name__})"
        if tuple(arr.shape[1:]) != want:
            return f"{path}/{Z_FINAL_LATENTS} is {list(arr.shape[1:])} per prompt, expected {list(want)}"
    return None


class FinalLatentCache:
    """Bounded LRU over the prompt stores of a cache: (prompt_idx, seed_idx) -> the teacher's final latent
    [C, F, H, W] float32. One read per prompt (its chunk holds every seed), checked against its crc32c; a
    trajectory whose final latent was never written (all zeros, the fill value) is refused with CacheError.
    One thread owns it, as an `EmbeddingCache`: `submit` starts a read in a pool's thread, `get` takes it."""

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int = 1024, direct: bool = False):
        self.cache_dir = Path(cache_dir)
        self.direct = direct  # read with O_DIRECT (`ChunkFiles.direct`)
        self.num_parts = num_parts
        self.capacity = capacity
        self._parts: dict[int, PartRows] = {}
        self._lru: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._pending: dict = {}  # prompt_idx -> concurrent.futures.Future of `_load`'s result (`submit`)

    def _part(self, part: int) -> PartRows:
        if part not in self._parts:
            self._parts[part] = PartRows(self.cache_dir, part, self.num_parts, self.direct)
        return self._parts[part]

    def submit(self, pool, prompt_idx: int) -> None:
        """Start reading this prompt's final latents in a thread of `pool` (a concurrent.futures.Executor) unless
        they are in memory or on their way; `get` takes them. The part and its array are opened here, in the
        owner's thread."""
        if prompt_idx in self._lru or prompt_idx in self._pending:
            return
        part, row = prompt_location(prompt_idx, self.num_parts)
        rows = self._part(part)
        rows._latent_array(Z_FINAL_LATENTS)  # opened once, here: the pool's threads only read it
        self._pending[prompt_idx] = pool.submit(self._load, rows, row)

    def forget(self, cancel: bool = True) -> None:
        """Drop the reads `submit` started (see `EmbeddingCache.forget`); `get` reads again."""
        for fut in self._pending.values() if cancel else ():
            fut.cancel()
        self._pending.clear()

    @staticmethod
    def _load(rows: PartRows, row: int) -> torch.Tensor:
        """The read behind `get` (any thread: it only reads)."""
        return torch.from_numpy(np.ascontiguousarray(rows.latents(Z_FINAL_LATENTS, row), dtype=np.float32))

    def get(self, prompt_idx: int, seed_idx: int) -> torch.Tensor:
        hit = self._lru.get(prompt_idx)
        if hit is None:
            fut = self._pending.pop(prompt_idx, None)
            if fut is not None:
                hit = fut.result()  # what `_load` returned, or its error raised here
            else:
                part, row = prompt_location(prompt_idx, self.num_parts)
                hit = self._load(self._part(part), row)
            self._lru[prompt_idx] = hit
            if len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        else:
            self._lru.move_to_end(prompt_idx)
        latent = hit[seed_idx]
        if not bool(latent.any()):
            raise CacheError(f"the final latent of prompt {prompt_idx} seed {seed_idx} was never written in "
                             f"{self.cache_dir}; run `wandistiller cache verify` and rebuild the cache")
        return latent
