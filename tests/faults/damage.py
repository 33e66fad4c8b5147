"""Where tests and the fault suite damage a prompt store's bytes: the location of a row's first bytes in the file
(zarr shard) that holds them, read from the file's shard index, and the rows a damaged chunk of `embeds` takes
down with it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cache.format import EMBED_CHUNK_TOKENS, Z_EMBEDS, Z_SEQ_LENS, Z_TOKEN_START
from cache.prompt_store import open_prompt_store
from cache.zarr_private import chunk_file


def chunk_location(store: str | os.PathLike, name: str, row: int) -> tuple[Path, int, int] | None:
    """(file, offset, length) of row `row`'s bytes in the first chunk that holds them (for `embeds`, where its first
    token begins in that chunk, up to the chunk's end or the row's), from the file's shard index (C order over the
    file's chunks, then its crc32c); None where nothing of the row is stored. Where tests and the fault suite damage
    a row."""
    g = open_prompt_store(store)
    arr = g[name]
    index, skip, length = row, 0, None
    if name == Z_EMBEDS:
        index, n = int(g[Z_TOKEN_START][row]), int(g[Z_SEQ_LENS][row])
        if index < 0 or n <= 0:
            return None
        token = int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
        skip = (index % arr.chunks[0]) * token
        length = min(n, arr.chunks[0] - index % arr.chunks[0]) * token
    file = Path(store) / chunk_file(arr, index)
    per_file = [s // c for s, c in zip(arr.shards, arr.chunks)]
    n = int(np.prod(per_file))
    try:
        raw = file.read_bytes()[-(16 * n + 4):-4]
    except FileNotFoundError:
        return None
    off, size = (int(v) for v in np.frombuffer(raw, "<u8").reshape(n, 2)[(index % arr.shards[0]) // arr.chunks[0] *
                                                                           (n // per_file[0])])
    return None if off == 2**64 - 1 else (file, off + skip, size - skip if length is None else length)


def chunk_rows(store: str | os.PathLike, row: int) -> list[int]:
    """The rows whose tokens lie in row `row`'s first chunk of `embeds` (rows are packed end to end: a chunk that
    fails its crc32c fails each of them)."""
    g = open_prompt_store(store)
    start, lens, c = g[Z_TOKEN_START][:], g[Z_SEQ_LENS][:], EMBED_CHUNK_TOKENS
    first = start[row] // c
    return [r for r in range(len(lens)) if lens[r] > 0 and start[r] // c <= first <= (start[r] + lens[r] - 1) // c]
