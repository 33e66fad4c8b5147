"""crc32c, the one checksum of what the cache holds (the `crc32c` package: hardware instructions, GIL released)."""

from __future__ import annotations

import numpy as np
from crc32c import crc32c as _crc32c


def crc32c(data, crc: int = 0) -> int:
    """crc32c of `data`'s bytes (a numpy array, made C-contiguous if it is not, or a bytes-like object), continuing
    `crc`: `crc32c(b, crc32c(a)) == crc32c(a + b)`."""
    if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return _crc32c(data, crc)
