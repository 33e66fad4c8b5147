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
import threading
import weakref
from collections import OrderedDict

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


# Read buffers of at least this size come from `BUFFERS`; smaller ones from malloc, which reuses its heap.
POOLED_MIN = 256 << 10
# Free buffers `BUFFERS` keeps for reuse, in bytes at most (per process): a grouped epoch's read-ahead holds up to
# two windows of READ_WINDOW_BYTES (stages/train_student/data.py) in flight, and gives them back as they are used.
POOL_BYTES = 512 << 20


class BufferPool:
    """Aligned read buffers, reused. A fresh multi-MB buffer costs a page fault per page the first time it is
    written (the kernel zeroing each page) and an unmap when freed: on the 2-core dev VM a fresh 8 MiB buffer
    fills at ~2 GiB/s against ~11 GiB/s for one already touched, and an epoch of the real-size bench reads
    18 GiB (perf, fresh buffers: the kernel zeroing pages was 7% of the loader's CPU; from the pool ~80% of the
    reads reuse a slab).

    `take(n)` gives an aligned uint8 array of `n` bytes, a view of a slab of the pool (sizes rounded up to a
    quarter of their power of two); the slab returns to the pool when that array and every view of it (numpy
    views, tensors made with torch.frombuffer, memoryviews) are gone, and stays out of it until then, so a
    slab is never handed out twice while its bytes are still used. At most `limit` bytes of free slabs are
    kept; any thread may take and give back."""

    def __init__(self, limit: int = POOL_BYTES):
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}  # size -> free slabs of that size, most recently given last
        self._age: OrderedDict[int, int] = OrderedDict()  # id of each free slab -> its size, least recent first
        self._bytes = 0
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    @staticmethod
    def size_class(n: int) -> int:
        step = max(ALIGN, (1 << (max(n, 1) - 1).bit_length()) // 4)
        return -(-n // step) * step

    def take(self, n: int) -> np.ndarray:
        if n < POOLED_MIN:
            return aligned_empty(n)
        size = self.size_class(n)
        with self._lock:
            slabs = self._free.get(size)
            slab = slabs.pop() if slabs else None
            if slab is not None:
                del self._age[id(slab)]
                self._bytes -= size
        if slab is None:
            slab = aligned_empty(size)
        # an array whose base is a memoryview of the slab, not the slab: numpy collapses a view's base to the
        # array that owns the memory, so views of `out` keep `out` alive, and `out`'s end means theirs
        out = np.frombuffer(memoryview(slab), dtype=np.uint8, count=n)
        weakref.finalize(out, self._give, slab).atexit = False
        return out

    def _give(self, slab: np.ndarray) -> None:
        """Back into the pool; past `limit`, the free slabs given back longest ago are let go of (the sizes in
        demand change: a window's reads, then rows of another length)."""
        with self._lock:
            self._free.setdefault(len(slab), []).append(slab)
            self._age[id(slab)] = len(slab)
            self._bytes += len(slab)
            while self._bytes > self.limit:
                key, size = self._age.popitem(last=False)
                slabs = self._free[size]
                slabs.pop(next(i for i, s in enumerate(slabs) if id(s) == key))
                self._bytes -= size

    def free_bytes(self) -> int:
        return self._bytes

    def _forked(self) -> None:
        """In a forked child: a lock held by another thread at the fork would never be let go of here."""
        self._lock = threading.Lock()
        self._free, self._age, self._bytes = {}, OrderedDict(), 0


BUFFERS = BufferPool()


def pread(fd: int, off: int, n: int) -> tuple[np.ndarray, bool]:
    """(up to `n` bytes of the file on `fd` at `off`, fewer where it ends sooner; whether a direct read was
    refused). From a descriptor opened with O_DIRECT: one read of the aligned blocks that hold the bytes, into an
    aligned buffer, the bytes a view of it. Otherwise, or where the disk refuses that alignment (EINVAL: the
    descriptor is then made buffered, for good), one read into a new buffer (not zeroed: the read fills it)."""
    refused = False  # (buffers from `BUFFERS`: given back to it once the bytes returned, and views of them, are gone)
    if is_direct(fd):
        lo, hi = off - off % ALIGN, -(-(off + n) // ALIGN) * ALIGN
        buf = BUFFERS.take(hi - lo)
        try:
            got = os.preadv(fd, [buf], lo)
            return buf[off - lo:max(off - lo, min(got, off - lo + n))], False
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~FLAG)
        log.info("a direct read was refused (the disk wants another alignment): reading through the page cache")
        refused = True
    buf = BUFFERS.take(n)
    return buf[:os.preadv(fd, [buf], off)], refused
