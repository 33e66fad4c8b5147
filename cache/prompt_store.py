"""Per-part prompt store (zarr v3 arrays `parts/part-P/prompts.zarr`): prompt text, text embeddings (real tokens
packed end to end) and the per-trajectory arrays schema.py declares (initial noise, final latents, an image-to-video
condition); rows never written read as the fill value (`seq_lens` -1).
Layout and checks: docs/architecture.md, "The cache"."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import zarr
from numcodecs import zstd
from safetensors.torch import load as st_load
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.storage import LocalStore

from .atomic import WriteBehind
from .checksum import crc32c
from .cache_error import CacheError, UnsafeFileError
from .format import (
    DTYPES, EMBED_CHUNK_TOKENS, NO_CONDITION, NEG_EMBEDS, NEGATIVE, PARTS_DIR, PROMPTS_ZARR, ROWS_PER_FILE, TOKENS_PER_FILE,
    Z_ATTR_TORCH_DTYPE, Z_EMBEDS, Z_FINAL_LATENTS, Z_INIT_NOISE, Z_PROMPT_IDX, Z_ROW_CRC32C, Z_SEQ_LENS, Z_TEXT,
    Z_TOKEN_START, part_dirname, prompt_location, storage_numpy_dtype, storage_to_torch,
    torch_to_storage,
)
from .records import _short
from .safe_open import CAPS, open_fd, parse_json, read_bytes
from .schema import TRAJECTORY_FIELDS, trajectory_fields
from .zarr_private import FLAT_KEYS, chunk_file, concurrent_map, default_buffer_prototype

UNWRITTEN_SEQ_LEN = -1
EMBEDS_CRC32C = f"{Z_ROW_CRC32C}/{Z_EMBEDS}"  # crc32c of each row's real tokens (format.Z_ROW_CRC32C)
# Rows per chunk of the small arrays, read whole by their readers (a million prompts would otherwise be two
# million files).
SEQ_LENS_CHUNK = 1 << 16
TEXT_CHUNK = 1 << 12
# Every chunk written holds real data (tokens, noise, latents): zarr's check of each chunk against the fill value
# before storing it (a full compare per chunk, ~40% of the writer's CPU at A14B sizes) would find nothing to skip.
_STORE_ALL = {"write_empty_chunks": True}


def prompt_store_path(cache_dir: str | os.PathLike, part: int) -> Path:
    return Path(cache_dir) / PARTS_DIR / part_dirname(part) / PROMPTS_ZARR


def store_relpath(part: int) -> str:
    """A part's prompt store relative to the cache folder, as messages name it."""
    return f"{PARTS_DIR}/{part_dirname(part)}/{PROMPTS_ZARR}"


def create_prompt_store(path: str | os.PathLike, n: int, max_len: int, dim: int, dtype_name: str, seeds: int,
                        latent_shape: tuple[int, ...], condition: str = NO_CONDITION,
                        condition_shape: tuple[int, ...] | None = None) -> zarr.Group:
    """Create (or truncate) the store of one part holding `n` prompts, with the per-trajectory arrays the schema
    declares for these settings (the header's of the same names)."""
    g = zarr.open_group(str(path), mode="w")
    packed = (ZstdCodec(level=0, checksum=False), Crc32cCodec())  # zarr's default compressor, then the crc32c
    g.create_array(Z_PROMPT_IDX, shape=(n,), dtype="int64", chunks=(max(n, 1),), fill_value=-1, compressors=packed)
    g.create_array(Z_TEXT, shape=(n,), dtype=str, chunks=(max(1, min(n, TEXT_CHUNK)),), compressors=packed)
    small = (max(1, min(n, SEQ_LENS_CHUNK)),)
    g.create_array(Z_SEQ_LENS, shape=(n,), dtype="int32", chunks=small, fill_value=UNWRITTEN_SEQ_LEN,
                   compressors=packed)
    g.create_array(Z_TOKEN_START, shape=(n,), dtype="int64", chunks=small, fill_value=-1, compressors=packed)
    g.create_group(Z_ROW_CRC32C).create_array(Z_EMBEDS, shape=(n,), dtype="int64", chunks=small, fill_value=-1,
                                              compressors=packed)
    # Embeddings and latents are stored uncompressed: zstd saves 22% of a bf16 embedding and 7% of a float32 latent
    # but costs more CPU than the disk time of the bytes it saves; they are a few percent of a cache. `embeds` is as
    # long as every row at its padded length (a bound: what is never written is never stored).
    emb = g.create_array(Z_EMBEDS, shape=(max(1, n * max_len), dim), dtype=storage_numpy_dtype(dtype_name),
                         chunks=(EMBED_CHUNK_TOKENS, dim), shards=(TOKENS_PER_FILE, dim), fill_value=0,
                         compressors=Crc32cCodec(), chunk_key_encoding=FLAT_KEYS)
    emb.attrs[Z_ATTR_TORCH_DTYPE] = dtype_name
    rows, settings = max(1, min(n, ROWS_PER_FILE)), SimpleNamespace(
        latent_shape=latent_shape, condition=condition, condition_shape=condition_shape)
    for f in trajectory_fields(settings):
        one = (seeds, *f.shape(settings))
        g.create_array(f.name, shape=(n, *one), dtype=f.dtype, chunks=(1, *one), shards=(rows, *one), fill_value=0.0,
                       compressors=Crc32cCodec(), chunk_key_encoding=FLAT_KEYS)
    return g


# What stage one writes (`create_prompt_store`), node by node: the codec chain of each array, and the data types a
# store's zarr.json may declare (`text` strings, the rest one of the number types stage one writes, which
# `store_checks.store_problem` compares with the manifest's). A store from elsewhere could name any codec or data type
# zarr and numcodecs have (pickle among them): a node declaring another is refused before a chunk of it is read.
_PACKED = ("bytes", "zstd", "crc32c")
_SHARDED = (("sharding_indexed", ("bytes", "crc32c"), ("bytes", "crc32c")),)
_ARRAYS = {Z_PROMPT_IDX: _PACKED, Z_SEQ_LENS: _PACKED, Z_TOKEN_START: _PACKED, EMBEDS_CRC32C: _PACKED,
           Z_TEXT: ("vlen-utf8", "zstd", "crc32c"), Z_EMBEDS: _SHARDED} | dict.fromkeys(TRAJECTORY_FIELDS, _SHARDED)
_NUMBERS = ("int32", "int64", *dict.fromkeys(storage_numpy_dtype(d) for d in DTYPES))
_GROUPS = ("", Z_ROW_CRC32C)
_META = "zarr.json"
# No chunk of a packed array decodes to more than a prompt file may hold (CAPS["prompts"]): `text`'s hold prompts of
# one, and the largest other, `prompt_idx` of a part of 10^8 prompts, is 800 MB.
_CHUNK_CAP = CAPS["prompts"]


def _chain(codecs) -> tuple:
    """The names of a zarr.json's codecs, a shard's own chains nested (as `_ARRAYS` lists them)."""
    out = []
    for c in codecs:
        name, conf = (c, {}) if isinstance(c, str) else (c["name"], c.get("configuration") or {})
        out.append((name, _chain(conf["codecs"]), _chain(conf["index_codecs"])) if name == "sharding_indexed" else name)
    return tuple(out)


def _said(chain: tuple) -> str:
    return ", ".join(c if isinstance(c, str) else f"{c[0]} of {_said(c[1])}" for c in chain)


def _frame_size(data: bytes) -> int | None:
    """The content size a zstd frame's header declares (RFC 8878, 3.1.1.1), None where it declares none."""
    if len(data) < 6 or data[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = data[4]
    start = 5 + (not fhd & 0x20) + (0, 1, 2, 4)[fhd & 3]
    n = (1 if fhd & 0x20 else 0, 2, 4, 8)[fhd >> 6]
    value = int.from_bytes(data[start:start + n], "little")
    return None if n == 0 or len(data) < start + n else value + 256 if n == 2 else value


class _ReadStore(LocalStore):
    """zarr's LocalStore, read-only, opening every file it reads through `safe_open` from the cache folder down: no
    link followed out of the cache, no FIFO waited on. Every zarr.json is checked before zarr reads it (format 3, the
    data type and codecs stage one writes, `_ARRAYS`), no file is read past what a chunk file of its array holds, and
    a chunk of the zstd-packed arrays is inflated into a buffer of its chunk's size before zarr decodes it: a 30-byte
    chunk claiming 2^31 strings, or gigabytes of zeros, is refused, not allocated."""

    def __init__(self, path: Path):
        super().__init__(path, read_only=True)
        # a prompt store's own cache folder (CACHE/parts/part-P/prompts.zarr), else the folder holding it
        self.base = path.parents[2] if path.parent.parent.name == PARTS_DIR else path.parent
        self.rel = path.relative_to(self.base).as_posix()
        self._chunks: dict[str, tuple[int, int, int]] = {}  # array -> (bytes a file may hold, values a chunk, itemsize)

    def _refuse(self, what: str) -> UnsafeFileError:
        return UnsafeFileError(f"prompt store {self.root}: {what}; nothing of it was decoded (the store was not "
                               f"written by WanDistiller, or was changed since); {REBUILD}")

    def _node(self, name: str, data: bytes) -> None:
        """Refuse the zarr.json of node `name` unless it is one stage one writes; note its chunks' bounds."""
        meta = parse_json(data, self.root / name / _META)
        kind = "group" if name in _GROUPS else "array" if name in _ARRAYS else None
        if kind is None or not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != kind:
            raise self._refuse(f"{name or 'its root'}/{_META} is not a zarr format 3 {kind or 'node'} as stage one "
                               "writes it")
        if kind == "group":
            if meta.get("consolidated_metadata") is not None:
                raise self._refuse(f"{name or 'its root'}/{_META} holds consolidated metadata, which stage one "
                                   "never writes")
            return
        chain, dtypes = _ARRAYS[name], ("string",) if name == Z_TEXT else _NUMBERS
        try:
            found, dtype = _chain(meta["codecs"]), meta["data_type"]
        except (KeyError, TypeError, AttributeError):
            found = dtype = None
        if found != chain or dtype not in dtypes or meta.get("storage_transformers"):
            codecs = _said(found) if found is not None else "codecs it does not name plainly"
            raise self._refuse(f"its {name} array declares data type {_short(dtype)} and codecs {codecs}, where "
                               f"stage one writes {' or '.join(dtypes)} with {_said(chain)}")
        try:
            per_file = math.prod(int(d) for d in meta["chunk_grid"]["configuration"]["chunk_shape"])
            per_chunk = (math.prod(int(d) for d in meta["codecs"][0]["configuration"]["chunk_shape"])
                         if chain == _SHARDED else per_file)
        except (KeyError, TypeError, ValueError):
            raise self._refuse(f"its {name} array declares no chunk shape of whole numbers") from None
        size = 0 if name == Z_TEXT else np.dtype(dtype).itemsize
        # a file holds its values, each chunk's crc32c and a shard's index; zstd adds at most 1/128 and a few bytes
        cap = (_CHUNK_CAP if name == Z_TEXT else per_file * size + (per_file // max(per_chunk, 1) + 1) * 20 + 4
               if chain == _SHARDED else per_file * size + per_file * size // 128 + 1024)
        self._chunks[name] = (cap, per_chunk, size)

    def _array(self, key: str) -> str:
        name = next((n for n in _ARRAYS if key.startswith(n + "/")), None)
        if name is None:
            raise self._refuse(f"{key} is no file stage one writes")
        if name not in self._chunks:  # (zarr reads an array's zarr.json first: this store's copy in another process)
            self._read(f"{name}/{_META}", default_buffer_prototype(), None)
        if name not in self._chunks:
            raise self._refuse(f"{key} is a chunk of an array without its {_META}")
        return name

    def _inflate(self, name: str, key: str, data: bytes) -> None:
        """Refuse a chunk of a zstd-packed array that would decode to other than its chunk: its frame must declare
        the chunk's size (`text`'s: within _CHUNK_CAP), and is inflated into a buffer of that size (a frame claiming
        more, or a second one, fails), and `text`'s string count must be the chunk's length. A chunk failing its
        crc32c is damage, not this: zarr's own check names it."""
        if len(data) < 4 or crc32c(data[:-4]) != int.from_bytes(data[-4:], "little"):
            return
        _, per_chunk, size = self._chunks[name]
        declared = _frame_size(data[:-4])
        n = per_chunk * size if size else declared
        try:
            # (no zstd block, 4 bytes at least, decodes to more than 128 KiB: a frame claiming more is not allocated)
            if n is None or declared != n or not 4 <= n <= min(_CHUNK_CAP, len(data) << 15):
                raise ValueError(n)
            out = zstd.decompress(data[:-4], bytearray(n))
        except Exception:  # what numcodecs raises for a frame larger than the buffer, or not a zstd frame
            raise self._refuse(f"{key} does not decode to the {per_chunk:,} values of one chunk of its array") from None
        if not size and (count := int.from_bytes(out[:4], "little")) != per_chunk:
            raise self._refuse(f"{key} claims {count:,} strings, where a chunk of its array holds {per_chunk:,}")

    def _read(self, key: str, prototype, byte_range):
        node = key[:-len(_META)].rstrip("/") if key == _META or key.endswith("/" + _META) else None
        array = None if node is not None else self._array(key)
        try:
            fd = open_fd(self.base, f"{self.rel}/{key}")
        except (FileNotFoundError, NotADirectoryError):
            if node is not None and any((self.root / node / v2).exists() for v2 in (".zgroup", ".zarray")):
                raise self._refuse(f"{node or 'it'} is a zarr format 2 store (.zgroup, .zarray), where stage one "
                                   "writes format 3, the only one read") from None
            return None  # (zarr: a chunk never written reads as the fill value)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            start, n = 0, size  # (no byte_range: the whole file)
            if isinstance(byte_range, RangeByteRequest):
                start, n = byte_range.start, byte_range.end - byte_range.start
            elif isinstance(byte_range, OffsetByteRequest):
                start = byte_range.offset
            elif isinstance(byte_range, SuffixByteRequest):
                start = max(0, size - byte_range.suffix)
            cap = CAPS["config"] if array is None else self._chunks[array][0]
            if min(n, size - start) > cap:
                raise self._refuse(f"{key} is {size:,} bytes, more than the {cap:,} such a file holds")
            f.seek(start)
            data = f.read(n if n >= 0 else -1)
        if node is not None:
            self._node(node, data)
        elif byte_range is None and _ARRAYS[array] != _SHARDED:
            self._inflate(array, key, data)
        return prototype.buffer.from_bytes(data)

    def get_sync(self, key, *, prototype=None, byte_range=None):
        return self._read(key, prototype or default_buffer_prototype(), byte_range)

    async def get(self, key, prototype=None, byte_range=None):
        return await asyncio.to_thread(self._read, key, prototype or default_buffer_prototype(), byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        return await concurrent_map([(k, prototype, r) for k, r in key_ranges],
                                    lambda *a: asyncio.to_thread(self._read, *a))


def open_prompt_store(path: str | os.PathLike, mode: str = "r") -> zarr.Group:
    """A part's prompt store, zarr format 3 alone; read-only (`mode` "r") every file is opened by `safe_open` and
    checked by `_ReadStore` before zarr decodes it."""
    if mode == "r":
        return zarr.open_group(store=_ReadStore(Path(path)), mode="r", zarr_format=3, use_consolidated=False)
    return zarr.open_group(str(path), mode=mode, zarr_format=3, use_consolidated=False)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) position ranges of `rows` (sorted) whose values are consecutive."""
    out, lo = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[j - 1] + 1:
            out.append((lo, j))
            lo = j
    return out


class PromptRowWriter:
    """Writes one part's encoded prompts a batch at a time (`add`): each row's real tokens go to a buffer of one file
    (TOKENS_PER_FILE tokens), written whole when full; `close` writes the last file and the small arrays. Until
    `close` returns the rows are not all there: stage one records `encoded` only after it."""

    def __init__(self, g: zarr.Group):
        self.g = g
        self.emb = g[Z_EMBEDS].with_config(_STORE_ALL)
        self.per_file = int(self.emb.shards[0])
        self._buf = np.zeros((self.per_file, self.emb.shape[1]), dtype=self.emb.dtype)
        self._base = self._fill = 0  # the buffer holds tokens [_base, _base + _fill)
        self._behind = WriteBehind()  # each file sent to the disk while the next one fills
        self._small: dict[int, tuple[int, str, int, int, int]] = {}  # row -> (prompt_idx, text, seq_len, start, crc)

    def add(self, rows: list[int], prompt_idx: list[int], texts: list[str], embeds: torch.Tensor,
            seq_lens: torch.Tensor) -> None:
        """Rows `rows` of the store: `embeds` is [b, L, D] zero-padded past each `seq_lens` (as the pipeline pads)."""
        store = torch_to_storage(embeds)
        lens = np.asarray(seq_lens, dtype=np.int32)
        for j, r in enumerate(rows):
            tokens = store[j, :lens[j]]
            self._small[r] = (int(prompt_idx[j]), str(texts[j]), int(lens[j]), self._base + self._fill,
                              crc32c(np.ascontiguousarray(tokens)))
            while len(tokens):
                k = min(len(tokens), self.per_file - self._fill)
                self._buf[self._fill:self._fill + k] = tokens[:k]
                self._fill, tokens = self._fill + k, tokens[k:]
                if self._fill == self.per_file:
                    self._write()

    def _write(self) -> None:
        """The buffer into its file: one zarr write of whole chunks, but for the last file's last chunk."""
        if self._fill:
            self.emb[self._base:self._base + self._fill] = self._buf[:self._fill]
            _drop(self.g, [chunk_file(self.emb, self._base)], self._behind)
        self._base, self._fill = self._base + self.per_file, 0

    def close(self) -> None:
        self._write()
        self._behind.close()
        if not self._small:
            return
        rows = sorted(self._small)
        columns = [np.asarray(v) for v in zip(*(self._small[r] for r in rows))]
        for name, values in zip((Z_PROMPT_IDX, Z_TEXT, Z_SEQ_LENS, Z_TOKEN_START, EMBEDS_CRC32C), columns):
            arr = self.g[name]
            for lo, hi in _runs(rows):  # one zarr write per run of consecutive rows
                arr[rows[lo]:rows[hi - 1] + 1] = values[lo:hi].astype(arr.dtype) if name != Z_TEXT else values[lo:hi]
        self._small = {}


def write_latent_rows(g: zarr.Group, name: str, rows: list[int], seed_idx: list[int], latents: torch.Tensor,
                      behind: WriteBehind | None = None) -> list[Path]:
    """Write per-trajectory latents (`init_noise` or `final_latents`), one zarr write per run of consecutive rows (a
    row some of whose seeds are not given is read first). Returns the files written, which the caller fsyncs before
    recording them (`atomic.fsync_paths`); each is dropped from the page cache at once, or handed to `behind` (the
    encode phase's initial noise: the writer 279 / 259 -> 296 / 303 MiB/s, `bench.real_size`)."""
    arr = g[name].with_config(_STORE_ALL)
    lat = latents.detach().float().cpu().numpy()
    given: dict[int, dict[int, int]] = {}  # row -> seed -> index into `lat`
    for j, (r, s) in enumerate(zip(rows, seed_idx)):
        given.setdefault(int(r), {})[int(s)] = j
    order = sorted(given)
    seeds = int(arr.shape[1])
    for lo, hi in _runs(order):
        span = order[lo:hi]
        first = given[span[0]][0] if 0 in given[span[0]] else -1
        if first >= 0 and all(given[r] == {s: first + k * seeds + s for s in range(seeds)} for k, r in enumerate(span)):
            block = lat[first:first + len(span) * seeds].reshape(len(span), *arr.shape[1:])  # in order: no copy
        else:
            whole = all(len(given[r]) == seeds for r in span)
            block = np.empty((len(span), *arr.shape[1:]), np.float32) if whole else arr[span[0]:span[-1] + 1]
            for k, r in enumerate(span):
                for s, j in given[r].items():
                    block[k, s] = lat[j]
        arr[span[0]:span[-1] + 1] = block
    return _drop(g, dict.fromkeys(chunk_file(arr, r) for r in order), behind)


def _drop(g: zarr.Group, files, behind: WriteBehind | None = None) -> list[Path]:
    """Hand the store's just-written `files` ("<array>/<file>") to `behind` (else drop them here); their paths."""
    root = Path(str(g.store.root)) / g.path
    paths = [root / f for f in files]
    own = behind or WriteBehind()
    for p in paths:
        own.add(os.open(p, os.O_RDONLY), owned=True)
    if behind is None:
        own.close()
    return paths


# What is wrong with one prompt row, as bits: stage two's ranks each check a share of the rows and sum them.
ROW_EMBEDS_MISSING = 1  # the row, or a chunk of its real tokens, was never written (it would read as zeros)
ROW_EMBEDS_CHECKSUM = 2  # the row's real tokens (or a chunk of them) fail their crc32c
ROW_FINAL_CHECKSUM = 4  # the row's final latents fail their chunk's crc32c
ROW_NOISE_CHECKSUM = 8  # the row's initial noise (or condition) fails its chunk's crc32c
ROW_LATENT_UNWRITTEN = 16  # a trajectory's initial noise or final latent was never written (zeros)
ROW_UNREADABLE = 32  # the row's store or arrays do not open or read

REBUILD = "rebuild the cache with the same `wandistiller teacher-cache` command and --overwrite"


def damaged_part(cache_dir: str | os.PathLike, part: int, what: str) -> CacheError:
    """Stage one resuming a part whose own files fail their checks (`what`): a part cannot be patched row by row
    (its rows are encoded in one pass), so the line names the two ways to rebuild it."""
    part_dir = Path(cache_dir) / PARTS_DIR / part_dirname(part)
    return CacheError(f"part {part} of {cache_dir} is damaged: {what}; delete {part_dir} and rerun the same "
                      "`wandistiller teacher-cache` command (that part is computed again), or rerun it with "
                      "--overwrite (the whole cache)")


class RowError(CacheError):
    """A prompt row that is not what stage one wrote: `bit` (ROW_*) says what, `detail` says it in words."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, bit: int, detail: str):
        super().__init__(f"prompt store {Path(cache_dir) / store_relpath(part)}: {detail}; run `wandistiller cache "
                         f"verify` and {REBUILD}")
        self.bit, self.detail = bit, detail


def damage(e: Exception) -> str:
    """How a zarr read that raised `e` failed, in our words: never zarr's or a codec's own, which may advise a setting
    that decodes what no cache holds (numcodecs': unpickling)."""
    return ("fail their crc32c (changed after stage one wrote them)" if "checksum" in str(e) else "are missing"
            if isinstance(e, (FileNotFoundError, KeyError)) else f"do not decode ({type(e).__name__})")


def _values(name: str) -> cached_property:
    """A `PartRows` property: every value of the store's array `name`, read on first use."""
    return cached_property(lambda self: self.g[name][:])


class PartRows:
    """One part's prompt store, its rows read checked (docs/architecture.md, "The cache"); each array opens on first
    use. With `whole_files` (the in-order checks) a row is served from its whole file, read in one zarr call and kept
    until another file is asked for; a file that does not read is read again row by row, naming the rows."""

    def __init__(self, cache_dir: str | os.PathLike, part: int, num_parts: int, whole_files: bool = False):
        self.cache_dir, self.part, self.num_parts, self.whole_files = Path(cache_dir), part, num_parts, whole_files
        self.g = open_prompt_store(prompt_store_path(cache_dir, part))
        self._file: dict[str, tuple[int, int, np.ndarray]] = {}  # array -> (first entry, end, its entries)

    def where(self, row: int) -> str:
        return f"row {row} (prompt {row * self.num_parts + self.part})"

    def error(self, bit: int, detail: str) -> RowError:
        return RowError(self.cache_dir, self.part, bit, detail)

    seq_lens, token_start, crcs = _values(Z_SEQ_LENS), _values(Z_TOKEN_START), _values(EMBEDS_CRC32C)
    embeds: zarr.Array = cached_property(lambda self: self.g[Z_EMBEDS])
    dtype_name: str = cached_property(lambda self: self.embeds.attrs[Z_ATTR_TORCH_DTYPE])
    max_len: int = cached_property(lambda self: int(self.embeds.shape[0]) // max(1, len(self.seq_lens)))
    # the per-trajectory arrays the store holds (`store_checks.store_problem` checks them against the manifest)
    _latents: dict = cached_property(lambda self: {n: a for n in TRAJECTORY_FIELDS if (a := self.g.get(n)) is not None})

    def _read(self, arr: zarr.Array, lo: int, hi: int) -> np.ndarray:
        """arr[lo:hi] (entries along the first axis), from the whole file(s) holding them where `whole_files`."""
        if not self.whole_files:
            return arr[lo:hi]
        held = self._file.get(arr.basename)
        if held is None or not held[0] <= lo <= hi <= held[1]:
            per_file = int(arr.shards[0])
            first, end = lo // per_file * per_file, min(-(-hi // per_file) * per_file, int(arr.shape[0]))
            try:
                self._file[arr.basename] = held = (first, end, arr[first:end])
            except UnsafeFileError:
                raise
            except (ValueError, OSError):  # a damaged file: the rows' own reads say which rows it concerns
                self._file.pop(arr.basename, None)
                return arr[lo:hi]
        return held[2][lo - held[0]:hi - held[0]]

    def trimmed(self, row: int) -> np.ndarray:
        """The row's real tokens [seq_len, D] (storage dtype), every chunk read checked against its crc32c and the
        tokens against theirs; RowError naming the row otherwise."""
        seq_len = int(self.seq_lens[row]) if row < len(self.seq_lens) else UNWRITTEN_SEQ_LEN
        start = int(self.token_start[row]) if seq_len >= 0 else -1
        if seq_len < 0 or start < 0:
            raise self.error(ROW_EMBEDS_MISSING, f"embeds of {self.where(row)} were never written")
        try:
            data = self._read(self.embeds, start, start + seq_len)
        except UnsafeFileError:
            raise
        except (ValueError, OSError) as e:  # zarr's check of a chunk's (or a shard index's) crc32c
            raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)} {damage(e)}") from e
        digest = int(self.crcs[row])
        if digest < 0:
            raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)} have no crc32c recorded")
        if crc32c(np.ascontiguousarray(data)) != digest:
            if (gone := self.missing_file(row)) is not None:
                raise self.error(ROW_EMBEDS_MISSING, f"embeds of {self.where(row)}: {gone}")
            raise self.error(ROW_EMBEDS_CHECKSUM, f"embeds of {self.where(row)} fail their crc32c (changed after "
                                                  "stage one wrote them, or a chunk of them lost)")
        return data

    def missing_file(self, row: int) -> str | None:
        """"file embeds/<file> is missing (...)" where a file of row `row`'s tokens does not exist (a stat), or None."""
        start, n = int(self.token_start[row]), int(self.seq_lens[row])
        per_file = int(self.embeds.shards[0])
        for first in range(start // per_file * per_file, start + n, per_file):
            rel = chunk_file(self.embeds, first)
            if not (prompt_store_path(self.cache_dir, self.part) / rel).exists():
                return f"file {rel} is missing (it would read as zeros)"
        return None

    def latents(self, name: str, row: int) -> np.ndarray:
        """Every seed of the row's per-trajectory array `name` (schema.TRAJECTORY_FIELDS), float32 [seeds, *shape],
        checked against its chunk's crc32c (RowError); a seed never written reads as zeros (the caller decides)."""
        bit = ROW_FINAL_CHECKSUM if name == Z_FINAL_LATENTS else ROW_NOISE_CHECKSUM
        try:
            return self._read(self._latents[name], row, row + 1)[0]
        except UnsafeFileError:
            raise
        except (ValueError, OSError) as e:
            raise self.error(bit, f"{name} of {self.where(row)} {damage(e)}") from e

    def latent(self, name: str, row: int, seed: int) -> np.ndarray:
        """One trajectory's `name` [C, F, H, W], checked; RowError where it was never written (zeros)."""
        values = self.latents(name, row)
        if not 0 <= seed < len(values) or not values[seed].any():
            raise self.error(ROW_LATENT_UNWRITTEN, f"{name} of {self.where(row)} seed {seed} were never written")
        return values[seed]

    def padded(self, rows: list[int]) -> np.ndarray:
        """[len(rows), max_len, D] (storage dtype): the rows' real tokens zero-padded as the pipeline pads them, in one
        zarr call; unchecked against the rows' crc32c (zarr checks each chunk's), for stage one, which wrote them."""
        starts, lens = self.token_start[rows], self.seq_lens[rows]
        if (starts < 0).any() or (lens < 0).any():
            raise self.error(ROW_EMBEDS_MISSING, f"embeds of {self.where(rows[int(np.argmin(lens))])} were never "
                                                 "written")
        lo, hi = int(starts.min()), int((starts + lens).max())
        tokens = self.embeds[lo:hi] if hi > lo else np.zeros((0, self.embeds.shape[1]), self.embeds.dtype)
        out = np.zeros((len(rows), self.max_len, self.embeds.shape[1]), dtype=self.embeds.dtype)
        for j, (s, n) in enumerate(zip(starts - lo, lens)):
            out[j, :n] = tokens[s:s + n]
        return out

    def check(self, row: int, checksums: bool) -> RowError | None:
        """The first problem of what stage two reads of a written row, or None: with `checksums` its real tokens and
        final latents, read and checked; without, that the file of its tokens is there."""
        if not checksums:
            gone = self.missing_file(row)
            return None if gone is None else self.error(ROW_EMBEDS_MISSING, f"embeds of {self.where(row)}: {gone}")
        try:
            self.trimmed(row)
            self.latents(Z_FINAL_LATENTS, row)
        except RowError as e:
            return e
        return None

    def problems(self, row: int, rel: str, prompt: int) -> list[str]:
        """Everything wrong with a written row (`cache verify`): its tokens, and every trajectory's arrays read,
        checked and written."""
        try:
            self.trimmed(row)
            out = []
            for name in self._latents:
                values = self.latents(name, row)
                unwritten = [s for s in range(len(values)) if not values[s].any()]
                if len(unwritten) == len(values):
                    out.append(f"{rel}: {name} of row {row} (prompt {prompt}) were never written")
                elif unwritten:
                    out.append(f"{rel}: {name} of row {row} (prompt {prompt}) seed(s) "
                               f"{','.join(map(str, unwritten))} were never written")
            return out
        except RowError as e:
            return [f"{rel}: {e.detail}"]


def prompt_texts(cache_dir: str | os.PathLike, num_parts: int) -> dict[int, str]:
    """prompt_idx -> text of every prompt the cache's stores hold (rows never written are left out)."""
    out: dict[int, str] = {}
    for part in range(num_parts):
        try:
            g = open_prompt_store(prompt_store_path(cache_dir, part))
            idx, seq, text = g[Z_PROMPT_IDX][:], g[Z_SEQ_LENS][:], g[Z_TEXT][:]
        except UnsafeFileError:
            raise
        except Exception as e:  # a missing or unreadable store (or a chunk failing its crc32c) is a broken cache
            raise CacheError(f"prompt store of part {part} in {cache_dir} is unreadable ({type(e).__name__}); "
                             "run `wandistiller cache verify`") from e
        out.update({int(i): str(t) for i, s, t in zip(idx, seq, text) if s >= 0})
    return dict(sorted(out.items()))


def read_latents(cache_dir: str | os.PathLike, num_parts: int, trajectories: list[tuple[int, int]],
                 names: tuple[str, ...] = (Z_INIT_NOISE, Z_FINAL_LATENTS)) -> tuple[torch.Tensor, ...]:
    """The per-trajectory arrays `names` (default: initial noise, final latents) of (prompt_idx, seed_idx) pairs,
    each [N, *shape], checked (RowError)."""
    out: list[list[np.ndarray]] = [[] for _ in names]
    stores: dict[int, PartRows] = {}
    for prompt_idx, seed_idx in trajectories:
        part, row = prompt_location(prompt_idx, num_parts)
        if part not in stores:
            stores[part] = PartRows(cache_dir, part, num_parts)
        for values, name in zip(out, names):
            values.append(stores[part].latent(name, row, seed_idx))
    return tuple(torch.from_numpy(np.stack(values)) for values in out)


def part_negative(cache_dir: str | os.PathLike, part: int, sha256: str) -> torch.Tensor:
    """Part `part`'s own negative prompt embedding [L, D], which stage one reads on resume, checked against the sha256
    its progress record holds; CacheError (`damaged_part`)."""
    rel = f"{PARTS_DIR}/{part_dirname(part)}/{NEGATIVE}"
    try:
        data = read_bytes(cache_dir, rel)
    except FileNotFoundError:
        raise damaged_part(cache_dir, part, f"{rel} is missing") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise damaged_part(cache_dir, part, f"{rel} fails its sha256 check (changed after stage one wrote it)")
    try:
        return st_load(data)[NEG_EMBEDS]
    except Exception as e:  # any parse failure (or a file without the tensor) is corruption
        raise damaged_part(cache_dir, part, f"{rel} does not decode ({type(e).__name__})") from e


class RowCache:
    """Bounded LRU over the prompt stores of a cache: prompt_idx -> what `read(rows, row)` makes of the prompt's row
    (`rows` its part's `PartRows`, opened on first use, so that a forked loader worker opens its own)."""

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int, read: Callable):
        self.cache_dir, self.num_parts, self.capacity, self.read = Path(cache_dir), num_parts, capacity, read
        self._parts: dict[int, PartRows] = {}
        self._lru: OrderedDict = OrderedDict()

    def __getitem__(self, prompt_idx: int):
        hit = self._lru.get(prompt_idx)
        if hit is not None:
            self._lru.move_to_end(prompt_idx)
            return hit
        part, row = prompt_location(prompt_idx, self.num_parts)
        if part not in self._parts:
            self._parts[part] = PartRows(self.cache_dir, part, self.num_parts)
        hit = self._lru[prompt_idx] = self.read(self._parts[part], row)
        if len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return hit


def _trimmed(rows: PartRows, row: int) -> tuple[torch.Tensor, int]:
    if row >= len(rows.seq_lens) or rows.seq_lens[row] < 0:
        raise rows.error(ROW_EMBEDS_MISSING, f"embeds of {rows.where(row)} were never written (rerun teacher-cache "
                                             "on that cache to complete it)")
    return storage_to_torch(rows.trimmed(row), rows.dtype_name), rows.max_len


class EmbeddingCache(RowCache):
    """prompt_idx -> its embedding, the one LRU of embeddings that readers keep (`capacity` prompts), each read
    checked (`PartRows.trimmed`). `get` pads it with zeros as the teacher's pipeline did; `cache[prompt_idx]` gives
    the real tokens [seq_len, D] and the padded length, for a reader that pads later (A14B: 4 MiB padded, ~0.5 MiB
    trimmed)."""

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int):
        super().__init__(cache_dir, num_parts, capacity, _trimmed)

    def get(self, prompt_idx: int) -> torch.Tensor:
        trimmed, max_len = self[prompt_idx]
        out = trimmed.new_zeros(max_len, trimmed.shape[1])  # zeros past the real length, as WanPipeline pads
        out[:trimmed.shape[0]] = trimmed
        return out
