"""Reads past the page cache (O_DIRECT), for stage two's loader on caches larger than the page cache can keep.

Stage two reads a cache in a random order. Where the cache is larger than half of the machine's memory
(`wanted`), an epoch does not stay in the page cache for the next, and the kernel's work of buffered random
reads (filling the page cache, evicting from it, with several reading threads contending) costs several times
the CPU of direct reads: on the 2-core dev VM, 400 KB reads of A14B-sized shards with 4 threads cost 0.3 CPU-s
per GiB direct and 0.9-1.9 buffered, the page cache full. A smaller cache is read through the page cache, which
then serves its next epochs from memory.

O_DIRECT wants offsets, lengths and buffer addresses aligned to the disk's logical block size: `read` reads
the aligned blocks that hold a span, into an aligned buffer, and returns the span as a view. A file system
without O_DIRECT refuses the open (EINVAL), a disk with a larger block the read (EINVAL): callers then go on
with buffered reads (`open_read`, `pread`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

import numpy as np

# Offsets, lengths and buffer addresses of direct reads are multiples of this (logical blocks are 512 or 4096
# bytes on the disks in use; 4096 serves both, at the cost of at most 8 KiB read beyond a span).
ALIGN = 4096
FLAG = getattr(os, "O_DIRECT", 0)

log = logging.getLogger(__name__)


def wanted(nbytes: int) -> bool:
    """Whether a cache whose loader reads `nbytes` in an epoch is read with O_DIRECT: the OS has it and the
    bytes exceed half of this machine's memory."""
    if not FLAG:
        return False
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return False
    return nbytes > memory // 2


def open_read(path: os.PathLike | str, direct: bool) -> tuple[int, bool]:
    """(`path` opened read-only, whether with O_DIRECT): with it if `direct` and the file system has it (EINVAL
    otherwise: opened buffered, and said once in the log by a caller that then stops asking)."""
    if direct:
        try:
            return os.open(path, os.O_RDONLY | FLAG), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info(f"{path} cannot be opened with O_DIRECT: reading through the page cache")
    return os.open(path, os.O_RDONLY), False


def is_direct(fd: int) -> bool:
    return bool(FLAG) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & FLAG)


def aligned_empty(n: int) -> np.ndarray:
    """An uninitialised uint8 buffer of `n` bytes whose address is a multiple of ALIGN (what O_DIRECT reads into
    and writes from)."""
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    return raw[-raw.ctypes.data % ALIGN:][:n]


def pread(fd: int, off: int, n: int) -> tuple[np.ndarray, bool]:
    """(up to `n` bytes of the file on `fd` at `off`, fewer where it ends sooner; whether a direct read was
    refused). From a descriptor opened with O_DIRECT: one read of the aligned blocks that hold the bytes, into an
    aligned buffer, the bytes a view of it. Otherwise, or where the disk refuses that alignment (EINVAL: the
    descriptor is then made buffered, for good), one read into a new buffer (not zeroed: the read fills it)."""
    refused = False
    if is_direct(fd):
        lo, hi = off - off % ALIGN, -(-(off + n) // ALIGN) * ALIGN
        buf = aligned_empty(hi - lo)
        try:
            got = os.preadv(fd, [buf], lo)
            return buf[off - lo:max(off - lo, min(got, off - lo + n))], False
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~FLAG)
        log.info("a direct read was refused (the disk wants another alignment): reading through the page cache")
        refused = True
    buf = np.empty(n, dtype=np.uint8)
    return buf[:os.preadv(fd, [buf], off)], refused
