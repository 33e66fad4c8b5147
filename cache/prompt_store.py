"""Per-part prompt store (zarr v3): prompt text, text embeddings, initial noise and final latents.

Each part writes only its own `parts/part-P/prompts.zarr`, one chunk per prompt row, so no two processes
ever touch the same chunk. Rows never written read back as the fill value: `seq_lens` is filled with -1
so a reader can tell "never written" from "empty", and the part's progress record says which rows and
trajectories are complete.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import zarr

from .errors import CacheError
from .format import (
    PARTS_DIR, PROMPTS_ZARR, Z_ATTR_TORCH_DTYPE, Z_EMBEDS, Z_FINAL_LATENTS, Z_INIT_NOISE, Z_PROMPT_IDX,
    Z_SEQ_LENS, Z_TEXT, part_dirname, storage_numpy_dtype, storage_to_torch, torch_to_storage,
)

UNWRITTEN_SEQ_LEN = -1


def prompt_store_path(cache_dir: str | os.PathLike, part: int) -> Path:
    return Path(cache_dir) / PARTS_DIR / part_dirname(part) / PROMPTS_ZARR


def create_prompt_store(path: str | os.PathLike, n: int, max_len: int, dim: int, dtype_name: str,
                        seeds: int, latent_shape: tuple[int, ...]) -> zarr.Group:
    """Create (or truncate) the store of one part holding `n` prompts."""
    g = zarr.open_group(str(path), mode="w")
    g.create_array(Z_PROMPT_IDX, shape=(n,), dtype="int64", chunks=(max(n, 1),), fill_value=-1)
    g.create_array(Z_TEXT, shape=(n,), dtype=str, chunks=(1,))
    g.create_array(Z_SEQ_LENS, shape=(n,), dtype="int32", chunks=(1,), fill_value=UNWRITTEN_SEQ_LEN)
    emb = g.create_array(Z_EMBEDS, shape=(n, max_len, dim), dtype=storage_numpy_dtype(dtype_name),
                         chunks=(1, max_len, dim), fill_value=0)
    emb.attrs[Z_ATTR_TORCH_DTYPE] = dtype_name
    for name in (Z_INIT_NOISE, Z_FINAL_LATENTS):
        g.create_array(name, shape=(n, seeds, *latent_shape), dtype="float32",
                       chunks=(1, seeds, *latent_shape), fill_value=0.0)
    return g


def open_prompt_store(path: str | os.PathLike, mode: str = "r") -> zarr.Group:
    return zarr.open_group(str(path), mode=mode)


def write_prompt_rows(g: zarr.Group, rows: list[int], prompt_idx: list[int], texts: list[str],
                      embeds: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Write encoded prompts. `embeds` is [b, L, D] zero-padded past each `seq_lens` (as the pipeline pads)."""
    store = torch_to_storage(embeds)
    for j, r in enumerate(rows):
        g[Z_TEXT][r] = texts[j]
        g[Z_EMBEDS][r] = store[j]
        g[Z_SEQ_LENS][r] = int(seq_lens[j])
    idx = g[Z_PROMPT_IDX]
    all_idx = idx[:]
    all_idx[rows] = prompt_idx
    idx[:] = all_idx


def write_latent_rows(g: zarr.Group, name: str, rows: list[int], seed_idx: list[int], latents: torch.Tensor) -> None:
    """Write per-trajectory latents (`init_noise` or `final_latents`); rows grouped per chunk."""
    arr = g[name]
    lat = latents.detach().float().cpu().numpy()
    by_row: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        by_row.setdefault(r, []).append(j)
    for r, js in by_row.items():
        cur = arr[r]
        for j in js:
            cur[seed_idx[j]] = lat[j]
        arr[r] = cur


def check_prompt_rows(cache_dir: str | os.PathLike, num_parts: int, prompts: int) -> None:
    """CacheError naming the store and prompt if any part's store lacks a row stage two will read: training
    must not discover it thousands of steps in (zarr returns the fill value for a row never written)."""
    for part in range(num_parts):
        path = prompt_store_path(cache_dir, part)
        try:
            g = open_prompt_store(path)
            seq, idx = g[Z_SEQ_LENS][:], g[Z_PROMPT_IDX][:]
        except Exception as e:  # a missing or unreadable store, whatever zarr raises for it
            raise CacheError(f"prompt store {path} is unreadable ({type(e).__name__}: {e}); rebuild the cache "
                             "with the same `wandistiller teacher-cache` command and --overwrite") from e
        want = list(range(part, prompts, num_parts))
        bad = [r for r in range(len(want)) if r >= len(seq) or seq[r] < 0 or idx[r] != want[r]]
        if bad:
            r = bad[0]
            more = f" ({len(bad) - 1} more row(s) too)" if len(bad) > 1 else ""
            raise CacheError(f"prompt store {path}: row {r} (prompt {want[r]}) was never written{more}, yet the "
                             "part is marked complete (the store was damaged); rebuild the cache with the same "
                             "`wandistiller teacher-cache` command and --overwrite")


def read_embeds(g: zarr.Group, row: int) -> tuple[torch.Tensor, int]:
    """Padded embedding [L, D] of one row and its real length (-1 if never written)."""
    arr = g[Z_EMBEDS]
    return storage_to_torch(arr[row], arr.attrs[Z_ATTR_TORCH_DTYPE]), int(g[Z_SEQ_LENS][row])


class EmbeddingCache:
    """Bounded LRU over the prompt stores of a cache: prompt_idx -> padded embedding [L, D].

    Prompt `i` lives in part `i % num_parts`, row `i // num_parts`. Embeddings are padded with zeros to
    `max_sequence_length` exactly as the teacher's pipeline padded them when it ran.
    """

    def __init__(self, cache_dir: str | os.PathLike, num_parts: int, capacity: int = 4096):
        self.cache_dir = Path(cache_dir)
        self.num_parts = num_parts
        self.capacity = capacity
        # per part: the embeds array handle, its dtype name and all its seq_lens, opened once
        self._parts: dict[int, tuple[zarr.Array, str, np.ndarray]] = {}
        self._lru: OrderedDict[int, tuple[torch.Tensor, int]] = OrderedDict()

    def _part(self, part: int) -> tuple[zarr.Array, str, np.ndarray]:
        if part not in self._parts:
            g = open_prompt_store(prompt_store_path(self.cache_dir, part))
            arr = g[Z_EMBEDS]
            self._parts[part] = (arr, arr.attrs[Z_ATTR_TORCH_DTYPE], g[Z_SEQ_LENS][:])
        return self._parts[part]

    def get(self, prompt_idx: int) -> torch.Tensor:
        hit = self._lru.get(prompt_idx)
        if hit is None:
            arr, dtype_name, seq_lens = self._part(prompt_idx % self.num_parts)
            row = prompt_idx // self.num_parts
            seq_len = int(seq_lens[row]) if row < len(seq_lens) else UNWRITTEN_SEQ_LEN
            if seq_len < 0:
                raise CacheError(f"prompt {prompt_idx} has no embedding in {self.cache_dir} (row never written); "
                                 "rerun teacher-cache on that cache to complete it")
            # One read per prompt, of the real tokens only: a padded real row is 512 x 4096, mostly zeros.
            hit = (storage_to_torch(arr[row, :seq_len], dtype_name), arr.shape[1])
            self._lru[prompt_idx] = hit
            if len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        else:
            self._lru.move_to_end(prompt_idx)
        trimmed, max_len = hit
        # Zero padding past the real length, exactly as WanPipeline pads its prompt embeddings.
        return torch.cat([trimmed, trimmed.new_zeros(max_len - trimmed.shape[0], trimmed.shape[1])])
