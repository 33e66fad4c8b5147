"""The one way a reader opens a file of a cache: from the cache folder down, one component at a time, no link
followed, a regular file only, never waited on (docs/architecture.md, "The cache", Untrusted input)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from .cache_error import UnsafeFileError

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder",
          stat.S_IFREG: "a regular file"}


def file_kind(mode: int) -> str:
    """`mode` (an st_mode) in words: "a FIFO", "a symbolic link", "a regular file", ..."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _refuse(cache_dir, parts: tuple[str, ...], st: os.stat_result, folder: bool) -> UnsafeFileError:
    path = Path(cache_dir, *parts)
    if stat.S_ISLNK(st.st_mode):
        return UnsafeFileError(f"{path} is a symbolic link (to {os.readlink(path)}), and a cache's readers never "
                               "follow one: replace the link with a copy of what it points to, or remove it and "
                               "rebuild the cache with the same `wandistiller teacher-cache` command and --overwrite")
    want = "a folder" if folder else "a regular file"
    return UnsafeFileError(f"{path} is {file_kind(st.st_mode)}, not {want}; delete it "
                           "and rerun the same `wandistiller teacher-cache` command (it writes what is missing), or "
                           "rebuild the cache with it and --overwrite")


def open_fd(cache_dir: str | os.PathLike, rel: str) -> int:
    """A read-only descriptor of the regular file CACHE_DIR/`rel` (the caller closes it); FileNotFoundError, or
    UnsafeFileError where `rel` leaves the folder, a component is a link, or it is no regular file."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise UnsafeFileError(f"{rel!r} is not a path inside the cache folder {cache_dir}; rebuild the cache with the "
                              "same `wandistiller teacher-cache` command and --overwrite")
    fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        for i, name in enumerate(parts):
            folder = i < len(parts) - 1
            try:
                nxt = os.open(name, _FLAGS | (os.O_DIRECTORY if folder else 0), dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _refuse(cache_dir, parts[:i + 1], os.lstat(name, dir_fd=fd), folder) from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(cache_dir, parts, st, False)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_bytes(cache_dir: str | os.PathLike, rel: str) -> bytes:
    """The whole of CACHE_DIR/`rel`, opened by `open_fd`."""
    with os.fdopen(open_fd(cache_dir, rel), "rb") as f:
        return f.read()

