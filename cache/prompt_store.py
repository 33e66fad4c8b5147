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
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import numcodecs
import numpy as np
import torch
import zarr
from safetensors.torch import load_file

from .errors import CacheError
from .format import (
    NEG_EMBEDS, NEGATIVE, PARTS_DIR, PROMPTS_ZARR, Z_ATTR_TORCH_DTYPE, Z_EMBEDS, Z_FINAL_LATENTS, Z_INIT_NOISE,
    Z_PROMPT_IDX, Z_SEQ_LENS, Z_TEXT, part_dirname, part_prompts, prompt_location, storage_numpy_dtype,
    storage_to_torch, torch_to_storage,
)

UNWRITTEN_SEQ_LEN = -1
# Tokens per chunk of `embeds`: a typical prompt's real tokens fit one or two chunks, the padding none.
EMBED_CHUNK_TOKENS = 64
# Rows per chunk of `seq_lens` and `text`, read whole by their readers (a million prompts would otherwise be
# two million files).
SEQ_LENS_CHUNK = 1 << 16
TEXT_CHUNK = 1 << 12


class ChunkFiles:
    """The chunk files of one numeric zarr v3 array in a local store, read and written directly.

    zarr's own path costs 2-20 ms per chunk (its event loop and codec pipeline), more than reading and
    decoding an A14B prompt's embedding; at 10^4-10^6 prompts that bounds stage two's loader and adds hours
    to stage one. The layout is the zarr v3 spec's, which zarr reads and writes the same way: chunk (i, j, k)
    of a regular grid is the file `c/i/j/k` ("default" chunk keys; `c.i.j.k` with the "." separator, which
    new stores use: a few directories per prompt would be millions at scale) holding the chunk's
    little-endian C-order bytes, zstd-compressed when the array's codecs say so (same codec, same level, so
    the same bytes zarr writes); a missing chunk reads as the fill value, and a chunk holding only the fill
    value is not written (zarr's default, write_empty_chunks=False). `open` returns None for any other
    layout, which callers then read through zarr.
    """

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.shape = tuple(meta["shape"])
        self.chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        self.fill = meta["fill_value"]
        zstd = meta["codecs"][1:]
        self.zstd = numcodecs.Zstd(**zstd[0]["configuration"]) if zstd else None
        self.sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
        self._dirs: set[Path] = set()  # chunk folders known to exist

    @classmethod
    def open(cls, path: str | os.PathLike) -> ChunkFiles | None:
        path = Path(path)
        try:
            meta = json.loads((path / "zarr.json").read_text())
            codecs = [c["name"] for c in meta["codecs"]]
            if (meta["zarr_format"] != 3 or meta["chunk_grid"]["name"] != "regular"
                    or meta["chunk_key_encoding"]["name"] != "default"
                    or meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/") not in "/."
                    or codecs not in (["bytes"], ["bytes", "zstd"])
                    or meta["codecs"][0].get("configuration", {}).get("endian", "little") != "little"
                    or set(meta["codecs"][-1].get("configuration", {})) - {"level", "checksum", "endian"}
                    or meta.get("storage_transformers") or np.dtype(meta["data_type"]).kind not in "iuf"
                    or not isinstance(meta["fill_value"], (int, float))):
                return None
            return cls(path, meta)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None

    def _file(self, idx: tuple[int, ...]) -> Path:
        if self.sep == ".":
            return self.path / ".".join(["c", *map(str, idx)])
        return self.path.joinpath("c", *map(str, idx))

    def read_chunk(self, idx: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray | None:
        """Chunk `idx` (grid coordinates), or None where it was never written (all fill value). An uncompressed
        chunk may be read in part: its first `out.size` elements, straight into `out` (C-contiguous)."""
        try:
            f = open(self._file(idx), "rb", buffering=0)
        except FileNotFoundError:
            return None
        with f:
            if self.zstd is None:
                out = np.empty(self.chunks, dtype=self.dtype) if out is None else out
                view = memoryview(out.reshape(-1)).cast("B")
                if f.readinto(view) != len(view):
                    raise OSError(f"{self._file(idx)} is shorter than a chunk of {self.chunks} {self.dtype}")
                return out
            data = f.read()
        chunk = np.empty(self.chunks, dtype=self.dtype)
        self.zstd.decode(data, out=chunk)
        if out is not None:
            out.reshape(-1)[:] = chunk.reshape(-1)[:out.size]
            return out
        return chunk

    def write_chunk(self, idx: tuple[int, ...], block: np.ndarray) -> None:
        """Write chunk `idx` (a whole chunk, shape `chunks`); a chunk of only the fill value leaves no file."""
        file = self._file(idx)
        if self.fill == 0 and self.dtype.kind in "iu" and block.flags.c_contiguous and block.nbytes % 8 == 0:
            empty = not block.view(np.uint64).any()  # integers: zero iff every bit is, 8 bytes at a time
        else:
            empty = not (block.any() if self.fill == 0 else (block != self.fill).any())
        if empty:
            file.unlink(missing_ok=True)
            return
        data = np.ascontiguousarray(block, dtype=self.dtype)
        data = self.zstd.encode(data) if self.zstd is not None else memoryview(data.reshape(-1)).cast("B")
        if file.parent not in self._dirs:
            file.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(file.parent)
        with open(file, "wb") as f:
            f.write(data)

    def read_row(self, row: int, stop: int | None = None) -> np.ndarray:
        """`array[row, :stop]` (all of the row's second axis by default); the chunks past `stop` are not read."""
        stop = self.shape[1] if stop is None else stop
        c0, c1 = self.chunks[0], self.chunks[1]
        out = np.empty((stop, *self.shape[2:]), dtype=self.dtype)
        for j in range(-(-stop // c1)):
            lo, hi = j * c1, min((j + 1) * c1, stop)
            idx = (row // c0, j, *(0,) * (len(self.shape) - 2))
            if c0 == 1:  # the rows needed are the start of the chunk: read (uncompressed: only) those into place
                got = self.read_chunk(idx, out[lo:hi])
            else:
                chunk = self.read_chunk(idx)
                got = None if chunk is None else out[lo:hi]
                if chunk is not None:
                    got[:] = chunk[row % c0, :hi - lo]
            if got is None:
                out[lo:hi] = self.fill
        return out

    def write_row(self, row: int, values: np.ndarray) -> None:
        """`array[row] = values` for arrays chunked one row at a time (chunks[0] == 1) along whole trailing axes."""
        c1 = self.chunks[1]
        for j in range(-(-self.shape[1] // c1)):
            block = values[j * c1:(j + 1) * c1]
            if len(block) < c1:  # the grid's last chunk reaches past the array: padded with the fill value
                block = np.concatenate([block, np.full((c1 - len(block), *block.shape[1:]), self.fill, block.dtype)])
            self.write_chunk((row, j, *(0,) * (len(self.shape) - 2)), block[None])

    def read_all(self) -> np.ndarray:
        """The whole of a one-dimensional array."""
        c0 = self.chunks[0]
        parts = [self.read_chunk((i,)) for i in range(-(-self.shape[0] // c0))]
        full = [np.full(c0, self.fill, dtype=self.dtype) if c is None else c for c in parts]
        return np.concatenate(full)[:self.shape[0]] if full else np.zeros(0, dtype=self.dtype)

    def rows_whole(self, write: bool = False) -> bool:
        """Whether `read_row` (and with `write`, `write_row`) applies: the axes past the second are whole in
        every chunk (and for writing, one row per chunk)."""
        return (len(self.shape) >= 2 and tuple(self.chunks[2:]) == tuple(self.shape[2:])
                and (not write or self.chunks[0] == 1))


def _chunk_files(g: zarr.Group, name: str) -> ChunkFiles | None:
    """`ChunkFiles` of array `name` of a group opened from a local folder, or None (then zarr's path)."""
    root = getattr(g.store, "root", None)
    return ChunkFiles.open(Path(root) / g.path / name) if root is not None else None


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
    g.create_array(Z_PROMPT_IDX, shape=(n,), dtype="int64", chunks=(max(n, 1),), fill_value=-1)
    g.create_array(Z_TEXT, shape=(n,), dtype=str, chunks=(max(1, min(n, TEXT_CHUNK)),))
    g.create_array(Z_SEQ_LENS, shape=(n,), dtype="int32", chunks=(max(1, min(n, SEQ_LENS_CHUNK)),),
                   fill_value=UNWRITTEN_SEQ_LEN)
    # Embeddings and latents are stored uncompressed: zstd saves 22% of a bf16 embedding and 7% of a float32
    # latent but costs ~2 ms to write and ~1 ms to read per chunk, more than the disk time of the bytes it saves
    # (and stage two reads an embedding per sample); they are a few percent of a cache whose shards dominate.
    flat = {"name": "default", "separator": "."}  # c.i.j.k: one folder per array, not a few per prompt
    emb = g.create_array(Z_EMBEDS, shape=(n, max_len, dim), dtype=storage_numpy_dtype(dtype_name),
                         chunks=(1, min(max_len, EMBED_CHUNK_TOKENS), dim), fill_value=0, compressors=None,
                         chunk_key_encoding=flat)
    emb.attrs[Z_ATTR_TORCH_DTYPE] = dtype_name
    for name in (Z_INIT_NOISE, Z_FINAL_LATENTS):
        g.create_array(name, shape=(n, seeds, *latent_shape), dtype="float32",
                       chunks=(1, seeds, *latent_shape), fill_value=0.0, compressors=None, chunk_key_encoding=flat)
    return g


def open_prompt_store(path: str | os.PathLike, mode: str = "r") -> zarr.Group:
    return zarr.open_group(str(path), mode=mode)


def write_prompt_rows(g: zarr.Group, rows: list[int], prompt_idx: list[int], texts: list[str],
                      embeds: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Write encoded prompts. `embeds` is [b, L, D] zero-padded past each `seq_lens` (as the pipeline pads)."""
    store = torch_to_storage(embeds)
    lens = np.asarray(seq_lens, dtype=np.int32)
    text, seq = g[Z_TEXT], g[Z_SEQ_LENS]  # opened once: zarr re-reads an array's metadata at every g[name]
    for lo, hi in _runs(rows):  # one zarr write per run of consecutive rows
        text[rows[lo]:rows[hi - 1] + 1] = np.asarray(texts[lo:hi], dtype=str)
        seq[rows[lo]:rows[hi - 1] + 1] = lens[lo:hi]
    emb = _chunk_files(g, Z_EMBEDS)
    for j, r in enumerate(rows):
        if emb is not None and emb.rows_whole(write=True):
            emb.write_row(r, store[j])  # the chunks past the prompt's tokens hold only zeros: no file
        else:
            g[Z_EMBEDS][r] = store[j]
    idx = g[Z_PROMPT_IDX]
    all_idx = idx[:]
    all_idx[rows] = prompt_idx
    idx[:] = all_idx


def write_latent_rows(g: zarr.Group, name: str, rows: list[int], seed_idx: list[int], latents: torch.Tensor) -> None:
    """Write per-trajectory latents (`init_noise` or `final_latents`); rows grouped per chunk."""
    files = _chunk_files(g, name)
    arr = files if files is not None and files.rows_whole(write=True) else g[name]
    lat = latents.detach().float().cpu().numpy()
    by_row: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        by_row.setdefault(r, []).append(j)
    for r, js in by_row.items():
        if arr is files:
            # every seed of the row given: nothing of the old chunk survives, so it is not read
            whole = len({seed_idx[j] for j in js}) == files.shape[1]
            cur = np.full(files.shape[1:], files.fill, dtype=np.float32) if whole else files.read_row(r)
        else:
            cur = arr[r]
        for j in js:
            cur[seed_idx[j]] = lat[j]
        if arr is files:
            files.write_row(r, cur)
        else:
            arr[r] = cur


def prompt_row_problems(cache_dir: str | os.PathLike, num_parts: int, prompts: int,
                        final_latents: bool = False) -> list[str]:
    """Every row a reader relies on that is missing or wrong in the parts' stores (empty = sound): rows never
    written (zarr returns the fill value for those), rows holding another prompt, and with `final_latents`
    trajectories whose final latent was never written."""
    problems = []
    for part in range(num_parts):
        path = prompt_store_path(cache_dir, part)
        rel = Path(PARTS_DIR) / part_dirname(part) / PROMPTS_ZARR
        try:
            g = open_prompt_store(path)
            seq, idx = g[Z_SEQ_LENS][:], g[Z_PROMPT_IDX][:]
            final = g[Z_FINAL_LATENTS] if final_latents else None
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
        if final is not None:
            for r in range(len(want)):
                if not np.any(final[r]):
                    problems.append(f"{rel}: final_latents of row {r} (prompt {want[r]}) were never written")
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


def prompt_texts(cache_dir: str | os.PathLike, num_parts: int) -> dict[int, str]:
    """prompt_idx -> text of every prompt the cache's stores hold (rows never written are left out)."""
    out: dict[int, str] = {}
    for part in range(num_parts):
        try:
            g = open_prompt_store(prompt_store_path(cache_dir, part))
            idx, seq, text = g[Z_PROMPT_IDX][:], g[Z_SEQ_LENS][:], g[Z_TEXT][:]
        except Exception as e:  # a missing or unreadable store is a broken cache
            raise CacheError(f"prompt store of part {part} in {cache_dir} is unreadable ({type(e).__name__}); "
                             "run `wandistiller cache verify`") from e
        out.update({int(i): str(t) for i, s, t in zip(idx, seq, text) if s >= 0})
    return dict(sorted(out.items()))


def read_latents(cache_dir: str | os.PathLike, num_parts: int,
                 trajectories: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise and the teacher's final latents of (prompt_idx, seed_idx) pairs, each [N, C, F, H, W]."""
    init, final = [], []
    stores: dict[int, zarr.Group] = {}
    for prompt_idx, seed_idx in trajectories:
        part, row = prompt_location(prompt_idx, num_parts)
        if part not in stores:
            stores[part] = open_prompt_store(prompt_store_path(cache_dir, part))
        init.append(np.asarray(stores[part][Z_INIT_NOISE][row, seed_idx]))
        final.append(np.asarray(stores[part][Z_FINAL_LATENTS][row, seed_idx]))
    return torch.from_numpy(np.stack(init)), torch.from_numpy(np.stack(final))


def negative_embeds(cache_dir: str | os.PathLike) -> torch.Tensor:
    """The negative prompt's embedding [L, D], padded like the prompts'."""
    path = Path(cache_dir) / NEGATIVE
    if not path.is_file():
        raise CacheError(f"{path} is missing; rerun the same `wandistiller teacher-cache` command")
    return load_file(path)[NEG_EMBEDS]


class EmbeddingCache:
    """Bounded LRU over the prompt stores of a cache: prompt_idx -> padded embedding [L, D].

    A prompt's part and row come from `format.prompt_location`. Embeddings are padded with zeros to
    `max_sequence_length` exactly as the teacher's pipeline padded them when it ran (`get`); `get_trimmed`
    gives the real tokens alone and the padded length, for a reader that pads later (an A14B embedding is
    4 MiB padded, ~0.5 MiB trimmed).
    """

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int = 4096):
        self.cache_dir = Path(cache_dir)
        self.num_parts = num_parts
        self.capacity = capacity
        # per part: the embeds array (its chunk files where their layout allows), its dtype name and all its
        # seq_lens, opened once
        self._parts: dict[int, tuple[ChunkFiles | zarr.Array, str, np.ndarray]] = {}
        self._lru: OrderedDict[int, tuple[torch.Tensor, int]] = OrderedDict()

    def _part(self, part: int) -> tuple[ChunkFiles | zarr.Array, str, np.ndarray]:
        if part not in self._parts:
            g = open_prompt_store(prompt_store_path(self.cache_dir, part))
            arr = g[Z_EMBEDS]
            files, lens = _chunk_files(g, Z_EMBEDS), _chunk_files(g, Z_SEQ_LENS)
            self._parts[part] = (files if files is not None and files.rows_whole() else arr,
                                 arr.attrs[Z_ATTR_TORCH_DTYPE], g[Z_SEQ_LENS][:] if lens is None else lens.read_all())
        return self._parts[part]

    def get(self, prompt_idx: int) -> torch.Tensor:
        trimmed, max_len = self.get_trimmed(prompt_idx)
        # Zero padding past the real length, exactly as WanPipeline pads its prompt embeddings.
        out = trimmed.new_zeros(max_len, trimmed.shape[1])
        out[:trimmed.shape[0]] = trimmed
        return out

    def get_trimmed(self, prompt_idx: int) -> tuple[torch.Tensor, int]:
        """(the prompt's real token embeddings [seq_len, D], the length `get` pads them to)."""
        hit = self._lru.get(prompt_idx)
        if hit is None:
            part, row = prompt_location(prompt_idx, self.num_parts)
            arr, dtype_name, seq_lens = self._part(part)
            seq_len = int(seq_lens[row]) if row < len(seq_lens) else UNWRITTEN_SEQ_LEN
            if seq_len < 0:
                raise CacheError(f"prompt {prompt_idx} has no embedding in {self.cache_dir} (row never written); "
                                 "rerun teacher-cache on that cache to complete it")
            # One read per prompt, of the real tokens only: a padded real row is 512 x 4096, mostly zeros.
            rows = arr.read_row(row, seq_len) if isinstance(arr, ChunkFiles) else arr[row, :seq_len]
            hit = (storage_to_torch(rows, dtype_name), arr.shape[1])
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
    [C, F, H, W] float32. One read per prompt (its chunk holds every seed); a trajectory whose final latent was
    never written (all zeros, the fill value) is refused with CacheError."""

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int = 1024):
        self.cache_dir = Path(cache_dir)
        self.num_parts = num_parts
        self.capacity = capacity
        # per part: the array's chunk files where their layout is one row per chunk (read directly: zarr's own
        # path costs milliseconds per chunk), else the zarr array
        self._arrays: dict[int, ChunkFiles | zarr.Array] = {}
        self._lru: OrderedDict[int, torch.Tensor] = OrderedDict()

    def _array(self, part: int) -> ChunkFiles | zarr.Array:
        if part not in self._arrays:
            g = open_prompt_store(prompt_store_path(self.cache_dir, part))
            files = _chunk_files(g, Z_FINAL_LATENTS)
            whole = files is not None and files.chunks[0] == 1 and tuple(files.chunks[1:]) == tuple(files.shape[1:])
            self._arrays[part] = files if whole else g[Z_FINAL_LATENTS]
        return self._arrays[part]

    def get(self, prompt_idx: int, seed_idx: int) -> torch.Tensor:
        hit = self._lru.get(prompt_idx)
        if hit is None:
            part, row = prompt_location(prompt_idx, self.num_parts)
            arr = self._array(part)
            if isinstance(arr, ChunkFiles):
                chunk = arr.read_chunk((row, *(0,) * (len(arr.shape) - 1)))
                values = np.zeros(arr.shape[1:], arr.dtype) if chunk is None else chunk[0]
            else:
                values = arr[row]
            hit = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
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
