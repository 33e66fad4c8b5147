"""Reads and writes past the page cache (O_DIRECT): stage two's loader on caches larger than the page cache can
keep, and the writers of what stage one never reads back (shards, prompt-store files).

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

Writes (`FileWriter`): a file written once, front to back, and not read again by its writer gains nothing from
the page cache and pays for it: the kernel copies every byte into it, then writes it back and evicts it. On the
2-core dev VM 25.8 GiB written through the page cache (1 MiB writes, then fsync) took 21-36 s, and with O_DIRECT
(8 MiB writes from one aligned buffer) 9-16 s (bench/real_size.py, the raw baselines, over a day).
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

from .atomic import WRITE_BEHIND_BYTES, drop_behind, thread_pool
from .checksum import crc32c, crc32c_combine

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


# A direct write goes out in pieces of this size (the raw baseline's requests), `WRITE_DEPTH` of them in flight
# while the next is filled: a piece takes ~3.5 ms to write on the dev VM, ~1.3 ms to fill.
WRITE_PIECE = 8 << 20
WRITE_DEPTH = 2


def open_write(path: os.PathLike | str, direct: bool) -> tuple[int, bool]:
    """(`path` created or truncated, open for writing, whether with O_DIRECT): as `open_read`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and FLAG:
        try:
            return os.open(path, flags | FLAG, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info(f"{path} cannot be opened with O_DIRECT: writing through the page cache")
    return os.open(path, flags, 0o644), False


# A part of `FileWriter.write` that stands for the crc32c of the part before it (4 bytes, little-endian: zarr's
# "crc32c" codec), computed as that part is written, while its bytes are still in the CPU's cache.
CRC32C_OF_PREVIOUS = object()


def parts_nbytes(parts) -> int:
    """Bytes `FileWriter.write(parts)` writes."""
    return sum(4 if p is CRC32C_OF_PREVIOUS else memoryview(p).nbytes for p in parts)


def _as_bytes(part) -> np.ndarray:
    """A bytes-like object or C-contiguous array as a flat uint8 array over the same memory."""
    if part is CRC32C_OF_PREVIOUS:
        return part
    if isinstance(part, np.ndarray):
        return part.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8)


def _write_all(fd: int, parts: list, offset: int) -> None:
    """All of `parts` written at `offset` (pwritev): a short write goes on where it stopped."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class FileWriter:
    """A new file written front to back (`write`, then `close`), past the page cache where the file system
    allows it, optionally checksummed (`crc`: the crc32c of every byte written, once `close` returns).

    Direct (O_DIRECT): the parts given are copied into aligned buffers of WRITE_PIECE bytes; each full one is
    checksummed and written whole on a thread of the `direct-write` pool while the next fills, at most
    WRITE_DEPTH in flight (the pieces' crc32c are combined in order: `checksum.crc32c_combine`); `close` writes
    the last one padded to a whole block and truncates the file to its length. A disk that refuses the
    alignment (EINVAL at a write) gets the same bytes through the page cache from then on.
    Buffered (`direct=False`, or a file system without O_DIRECT): the parts are written as they are (writev),
    and every WRITE_BEHIND_BYTES flushed and dropped from the page cache in the background
    (`atomic.drop_behind`): pages the writer would otherwise leave to the kernel's writeback.

    The copying is the caller's (one thread writes a file): handing the parts to a thread of the writer's own
    cost more than the copy, on 2 cores (a shard's samples, ~20 per piece, each crossing threads while the
    caller holds the GIL: 0.65-0.70 of the raw write against 0.78-0.98 copied in line, twice the CPU)."""

    def __init__(self, path: os.PathLike | str, direct: bool = True, checksum: bool = False):
        self.path = path
        self.fd, self.direct = open_write(path, direct)
        self.bytes = 0  # given so far
        self.crc = 0 if checksum else None
        self._written = 0  # bytes in pieces handed to a write thread, or written, so far
        self._buf: np.ndarray | None = None  # the piece being filled (direct)
        self._fill = 0
        self._padded = False  # the last piece went out padded: the file is truncated to its length
        self._flight: list[tuple] = []  # (future, piece, offset, length) of direct writes in flight
        self._behind_at, self._behind = 0, None  # buffered: bytes handed to the write-behind, its job

    def write(self, parts: list) -> None:
        """Append `parts` (bytes-like objects, C-contiguous numpy arrays, or CRC32C_OF_PREVIOUS), in order."""
        parts = [_as_bytes(p) for p in parts]
        self.bytes += parts_nbytes(parts)
        prev = None
        for i, src in enumerate(parts):
            if src is CRC32C_OF_PREVIOUS:
                src = parts[i] = _crc_bytes(prev)
            prev, pos = src, 0
            while pos < len(src):
                if not self.direct:  # (a direct write was refused: the rest goes through the page cache)
                    rest = parts[i + 1:]
                    if rest and rest[0] is CRC32C_OF_PREVIOUS:
                        rest[0] = _crc_bytes(src)
                    self._buffered([src[pos:], *rest])
                    return
                if self._buf is None:
                    self._buf = BUFFERS.take(WRITE_PIECE)
                n = min(len(src) - pos, WRITE_PIECE - self._fill)
                self._buf[self._fill:self._fill + n] = src[pos:pos + n]
                self._fill += n
                pos += n
                if self._fill == WRITE_PIECE:
                    self._submit()

    def close(self, fsync: bool = True) -> None:
        """Write what is left, wait for every write, (`fsync`) make the file durable, close it. Raises the first
        error of any write (the file then closed, as by `abort`)."""
        try:
            if self._buf is not None and self._fill:
                self._submit(final=True)
            self._buf = None
            while self._flight:
                self._reap()
            self._wait_behind()
            if self._padded:
                os.ftruncate(self.fd, self._written)  # the last piece's padding
            if fsync:
                drop_behind(self.fd)  # (fsync; then out of the page cache, what went through it)
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = None

    def abort(self) -> None:
        """Stop writing and close the file, whatever state it is in (errors of the writes in flight dropped)."""
        for job in [f for f, *_ in self._flight] + [self._behind]:
            try:
                if job is not None:
                    job.result()
            except OSError:
                pass  # the disk failed: the file goes anyway
        self._flight, self._behind = [], None
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass  # the disk that failed the write may fail the close too
            self.fd = None

    def _submit(self, final: bool = False) -> None:
        """The filled piece to a write thread (`final`: the last, padded to a whole block), once fewer than
        WRITE_DEPTH are in flight."""
        while len(self._flight) >= WRITE_DEPTH:
            self._reap()
        buf, n, self._buf, self._fill = self._buf, self._fill, None, 0
        if not self.direct:  # refused by the write just reaped
            self._buffered([buf[:n]])
            return
        size = n
        if final and n % ALIGN:
            size, self._padded = n + (-n % ALIGN), True
            buf[n:size] = 0
        job = thread_pool(4, "direct-write").submit(self._write_piece, buf, n, size, self._written)
        self._flight.append((job, buf, self._written, n))
        self._written += n

    def _write_piece(self, buf: np.ndarray, n: int, size: int, offset: int) -> int | None:
        """(On a write thread.) The piece's crc32c, then the piece written; returns the crc32c."""
        crc = crc32c(buf[:n]) if self.crc is not None else None
        _write_all(self.fd, [buf[:size]], offset)
        return crc

    def _reap(self) -> None:
        """Wait for the oldest direct write and take its crc32c in; one the disk refused (EINVAL: it wants
        another alignment) is written again through the page cache, as is everything after it."""
        fut, buf, offset, n = self._flight.pop(0)
        try:
            crc = fut.result()
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            if self.direct:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~FLAG)
                log.info(f"{self.path}: a direct write was refused (the disk wants another alignment): writing "
                         "through the page cache")
                self.direct = False
            crc = crc32c(buf[:n]) if self.crc is not None else None
            _write_all(self.fd, [buf[:n]], offset)
        if self.crc is not None:
            self.crc = crc32c_combine(self.crc, crc, n)

    def _buffered(self, parts: list) -> None:
        while self._flight:  # (the pieces before these, in order: their crc32c first)
            self._reap()
        parts = [_crc_bytes(parts[i - 1]) if p is CRC32C_OF_PREVIOUS else p for i, p in enumerate(parts)]
        if self.crc is not None:
            for p in parts:
                self.crc = crc32c(p, self.crc)
        _write_all(self.fd, parts, self._written)
        self._written += sum(len(p) for p in parts)
        if self._written - self._behind_at >= WRITE_BEHIND_BYTES:
            # flushed and out of the page cache in the background while the writes go on (atomic.drop_behind)
            self._wait_behind()
            self._behind_at = self._written
            self._behind = thread_pool(1, "write-behind-file").submit(drop_behind, self.fd, self._behind_at)

    def _wait_behind(self) -> None:
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.result()


def _crc_bytes(data) -> np.ndarray:
    return np.frombuffer(crc32c(data).to_bytes(4, "little"), dtype=np.uint8)
