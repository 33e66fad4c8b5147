"""Atomic file and folder replacement (temporary name, fsync, rename, fsync of the folder), and the page-cache
handling of what writers never read again."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from .format import TMP_SUFFIX


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside `path` durable (or, given a file, the file's contents)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object],
                 before_replace: Callable[[], None] | None = None) -> None:
    """Replace `path` with what `write(f)` writes to a new temporary file beside it (created `O_EXCL | O_NOFOLLOW`:
    never an existing file or a link planted at its name), fsynced and renamed over `path` (a link at `path` is
    replaced, never written through); `before_replace` (fault injection) runs just before the rename."""
    path = Path(path)
    # The pid keeps two writers of the same name (e.g. two parts finishing together) off each other's file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a killed writer's leftover, or a name planted since: unlinked, never opened
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, before_replace: Callable[[], None] | None = None) -> None:
    """Replace `path` with `data` atomically (`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data), before_replace)


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (/proc/self/status), else by setting and
    restoring it (a file another thread creates in between gets 077's modes: more private, never less)."""
    try:
        return int(re.search(r"^Umask:\s*([0-7]+)$", Path("/proc/self/status").read_text(), re.M).group(1), 8)
    except (OSError, AttributeError):  # no /proc, or no Umask line (Linux < 4.7)
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    """Give the file `path`, or every file below the folder `path` (not symlinks), the mode open() gives a new file:
    safetensors creates its files 0600 whatever the umask, shutting colleagues out of shared weights."""
    path = Path(path)
    mode = 0o666 & ~umask()
    files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for f in files:
        if os.lstat(f).st_mode & 0o777 != mode:
            os.chmod(f, mode)


def atomic_write_json(path: str | os.PathLike, obj, before_replace: Callable[[], None] | None = None) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode(), before_replace)


# fsync forces a journal commit per call on ext4 (~1.4 ms each, one at a time); concurrent calls are committed
# together: 3,000 chunk files of 16 KiB took 4.3 s one at a time and 0.19 s from 16 threads (fsync releases
# the GIL).
FSYNC_THREADS = 16


def fsync_paths(paths) -> None:
    """Make `paths` durable: every file, every file below a folder (not symlinks: their parent's fsync holds them),
    then every folder holding one, so that names created, replaced or removed there survive a power loss too."""
    files, dirs = [], set()
    for p in dict.fromkeys(map(Path, paths)):
        dirs.add(p.parent)
        if p.is_symlink() or not p.exists():
            continue
        if p.is_dir():
            for root, _, names in os.walk(p):
                dirs.add(Path(root))
                files += [Path(root, n) for n in names if not os.path.islink(os.path.join(root, n))]
        else:
            files.append(p)
    with ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="fsync") as pool:
        list(pool.map(fsync_dir, files))
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):  # deepest first: each entry, then its holder
        if d.is_dir():
            fsync_dir(d)


def drop_behind(fd: int, upto: int | None = None) -> None:
    """Flush a file written through `fd` and drop its pages from the page cache (DONTNEED frees clean pages only:
    hence the flush first): the whole file, fsynced, or with `upto` its first `upto` bytes, fdatasynced (still being
    written). The page cache then keeps what is read (the teacher's weights under `disk` and `offload`), and writes
    reuse the pages just freed: on a VM whose memory is backed lazily ~350 MiB/s -> ~1.5 GiB/s of writes."""
    (os.fsync if upto is None else os.fdatasync)(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, upto or 0, os.POSIX_FADV_DONTNEED)


# Bytes a writer writes between two hand-overs to `WriteBehind`: large enough that the calls cost nothing next to
# the bytes, small enough that the pages freed are reused at once.
WRITE_BEHIND_BYTES = 64 << 20

# sync_file_range(2) flags (Linux): start writeback of a range without waiting; wait for it.
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
_LIBC = ctypes.CDLL(None, use_errno=True)
# libc's sync_file_range(2) (Linux); None where there is none
_SFR_FN = getattr(_LIBC, "sync_file_range", None) if hasattr(os, "posix_fadvise") else None
if _SFR_FN is not None:
    _SFR_FN.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def _errno_error(*names) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, os.strerror(err), *names)


def _sfr(fd: int, offset: int, nbytes: int, flags: int) -> None:
    if _SFR_FN(fd, offset, nbytes, flags) != 0:
        raise _errno_error()


class WriteBehind:
    """Sends what a writer wrote to the disk while it goes on writing, and drops it from the page cache once there:
    each range handed over (`add`) starts its writeback at once and the range before it is waited for and dropped
    (bench.real_size, A14B sizes: shards 247 -> 274 MiB/s). Not a durability point: whoever records the bytes fsyncs
    them first. Without sync_file_range (not Linux) each range is dropped at once (`drop_behind`)."""

    def __init__(self):
        self._last: tuple[int, int, int, bool] | None = None  # (fd, offset, bytes (0: to the end), fd ours to close)

    def add(self, fd: int, offset: int = 0, nbytes: int = 0, owned: bool = False) -> None:
        """The range [offset, offset + nbytes) of `fd` (nbytes 0: to the end of the file) was written; `owned`: close
        `fd` once its range is dropped."""
        if _SFR_FN is None:
            drop_behind(fd, None if nbytes == 0 else offset + nbytes)
            if owned:
                os.close(fd)
            return
        try:
            _sfr(fd, offset, nbytes, _SFR_WRITE)
        except OSError:
            if owned:
                os.close(fd)
            raise
        self.close()
        self._last = (fd, offset, nbytes, owned)

    def close(self) -> None:
        """Wait for the last range and drop it."""
        if self._last is None:
            return
        fd, offset, nbytes, owned = self._last
        self._last = None
        try:
            _sfr(fd, offset, nbytes, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            if owned:
                os.close(fd)


# renameat2(2)'s RENAME_EXCHANGE swaps two names in one step (Linux >= 3.15; ext4, xfs, btrfs, tmpfs, not NFS).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders `a` and `b` atomically; False where the system or filesystem cannot."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise _errno_error(str(a), None, str(b))


def publish_dir(tmp: str | os.PathLike, dest: str | os.PathLike, before_replace: Callable[[], None] | None = None,
                after_replace: Callable[[], None] | None = None) -> None:
    """Make the complete folder `tmp` appear as `dest`, fsynced, in one rename (an existing `dest` swapped out in one
    step where the filesystem can, else renamed aside first: docs/reliability.md, "What is atomic").
    `before_replace` and `after_replace` (fault injection) run just before the rename and before the old copy goes.
    Every file in it is given the umask's mode first (`honour_umask`), whichever library wrote it."""
    tmp, dest = Path(tmp), Path(dest)
    honour_umask(tmp)
    fsync_paths([tmp])
    if before_replace is not None:
        before_replace()
    old = None
    if dest.exists() or dest.is_symlink():
        if _exchange(tmp, dest):
            old = tmp
        else:
            old = dest.with_name(f"{dest.name}.{os.getpid()}.old{TMP_SUFFIX}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            os.replace(tmp, dest)
    else:
        os.replace(tmp, dest)
    fsync_dir(dest.parent)
    if after_replace is not None:
        after_replace()
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
