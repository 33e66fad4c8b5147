"""zarr's internals the prompt store relies on, in one place: the layout of its chunk keys (which file holds a row)
and two helpers zarr does not export, read in the zarr versions CHECKED names (tests/test_private_adapters.py)."""

from __future__ import annotations

import zarr
from zarr.core.buffer.core import default_buffer_prototype
from zarr.core.common import concurrent_map

__all__ = ["CHECKED", "FLAT_KEYS", "chunk_file", "concurrent_map", "default_buffer_prototype"]

CHECKED = ("3.1",)  # zarr major.minor versions this layout was read in
# Chunk keys "c.i.j.k": one folder per array, not a few per prompt
FLAT_KEYS = {"name": "default", "separator": "."}


def chunk_file(arr: zarr.Array, index: int) -> str:
    """"<array>/<file>": the file (zarr shard) of `arr`, created with `chunk_key_encoding=FLAT_KEYS`, that holds its
    entry `index` along the first axis (a row of the latents, a token of `embeds`)."""
    return f"{arr.basename}/" + ".".join(["c", str(index // int(arr.shards[0])), *"0" * (arr.ndim - 1)])
