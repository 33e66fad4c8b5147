"""One writer per output: an exclusive `flock` on a lock file, held for the life of the writing process; stage one
locks each part (`locks/part-NNNNN.lock`), stage two its run folder (rank 0): docs/reliability.md, "One writer per
output folder" and "Folders someone else handed over"."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
import sys
import time
from pathlib import Path

from cache.format import LOCKS_DIR
from cache.safe_open import file_kind

from .user_error import UserError

RUN_LOCK = "writer.lock"  # stage two: in the run folder
PROBE_RETRIES = 4  # 50 ms apart: how long a writer waits out a liveness probe (`live_writer`)
_PART_LOCK = re.compile(r"part-(\d{1,9})\.lock")  # the names `part_lock_path` gives; anything else in locks/ is no lock


class UnsafeFile(UserError):
    """A path where we expect a plain file of ours holds something else (a link, a FIFO, a folder, a hard link)."""


def open_regular(path: str | os.PathLike, flags: int, what: str = "lock file", mode: int = 0o644,
                 single_link: bool = True) -> int:
    """os.open(`path`, `flags`) that neither follows a link nor blocks, returning the fd only for a regular file
    (with `single_link`: one whose bytes have no other name), else UnsafeFile. lstat first, so that a FIFO or a
    device is never opened; fstat after, for the instant between the two. Other OSErrors pass through."""
    path = Path(path)

    def refuse(kind: str) -> UnsafeFile:
        return UnsafeFile(f"{what} {path} is {kind}, not a file WanDistiller wrote; delete it (nothing was read or "
                          "written through it) and rerun")

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    else:
        if not stat.S_ISREG(st.st_mode):
            raise refuse(file_kind(st.st_mode))
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:  # replaced since the lstat
        if e.errno == errno.ELOOP:
            raise refuse("a symbolic link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a socket, a FIFO without reader; a folder
            raise refuse("a folder" if e.errno == errno.EISDIR else "a FIFO or socket") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (single_link and st.st_nlink != 1):
        os.close(fd)
        if stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{what} {path} has {st.st_nlink} hard links: its bytes are another file's too, which "
                             "the lock record would overwrite; delete it (nothing was written to it) and rerun")
        raise refuse(file_kind(st.st_mode))
    return fd


def read_head(path: str | os.PathLike, n: int) -> bytes:
    """The first `n` bytes of the regular file `path`, opened by `open_regular`; b"" where none can be read."""
    try:
        fd = open_regular(path, os.O_RDONLY, what="file", single_link=False)
        try:
            return os.pread(fd, n, 0)
        finally:
            os.close(fd)
    except (OSError, UnsafeFile):
        return b""


def _check_locks_dir(folder: Path) -> bool:
    """Whether the folder of stage-one locks exists; UnsafeFile when it is a link or anything else but a folder."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(f"{folder} is {file_kind(st.st_mode)}, not the cache's folder of lock files; remove it "
                         "(nothing was written through it) and rerun")
    return True


def part_lock_path(cache_dir: str | os.PathLike, part: int) -> Path:
    return Path(cache_dir) / LOCKS_DIR / f"part-{part:05d}.lock"


# This process's locks: (fd, the folder acquire created, removed on release if left empty).
_HELD: dict[Path, tuple[int, Path | None]] = {}


def acquire(path: str | os.PathLike, what: str) -> None:
    """Hold the exclusive lock `path` for `what` ("part 0 of cache /x") until `release` or exit, or refuse it."""
    path = Path(path).absolute()
    if path in _HELD:
        return
    made_dir = None
    while True:
        try:
            # Stage one's lock folder is the cache's own `locks/`, never a link; stage two's is --out, which may be one.
            exists = _check_locks_dir(path.parent) if path.parent.name == LOCKS_DIR else path.parent.is_dir()
            if not exists:
                made_dir = path.parent
                path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_regular(path, os.O_RDWR | os.O_CREAT)  # UnsafeFile (a UserError) passes through
        except OSError as e:
            raise UserError(f"cannot write to {path.parent} ({e.strerror}); choose a writable --out") from e
        if not _lock_exclusive(fd):
            holder = _describe_holder(fd)
            os.close(fd)
            raise UserError(f"{what} is being written by another process ({holder}; lock {path}); "
                            "wait for it to finish, or use another --out") from None
        try:
            held, there = os.fstat(fd), os.lstat(path)
            same = (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder released and removed it between our open and our lock: try again
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "started": time.time(),  # (for `cache info`'s rate: what this holder wrote since it started)
              "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _HELD[path] = (fd, made_dir)


def _lock_exclusive(fd: int) -> bool:
    """Take the exclusive flock on `fd`, or False when another process holds it; retried for a moment, because
    `live_writer`'s probe holds a shared lock for microseconds, which must not pass for a writer."""
    for attempt in range(PROBE_RETRIES + 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
        if attempt < PROBE_RETRIES:
            time.sleep(0.05)
    return False


def release(path: str | os.PathLike) -> None:
    """Give up the lock `path` if held, unlinked before unlocking (so no one locks a file about to vanish)."""
    path = Path(path).absolute()
    if path not in _HELD:
        return
    fd, made_dir = _HELD.pop(path)
    path.unlink(missing_ok=True)
    os.close(fd)
    if made_dir is not None:
        with contextlib.suppress(OSError):  # (kept when not empty)
            made_dir.rmdir()


def _record(fd: int) -> dict:
    """The holder's record, read through the fd the lock was probed with (never the path again: it may be replaced)."""
    try:
        rec = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        rec = {}
    return rec if isinstance(rec, dict) else {}


def _describe_holder(fd: int) -> str:
    rec = _record(fd)
    if not rec:
        return "its record is not written yet"
    who = f"pid {rec.get('pid')} on {rec.get('host')} since {rec.get('since')}"
    if rec.get("command"):
        who += f", `{rec['command']}`"
    if rec.get("host") != socket.gethostname():
        who += (f"; if {rec.get('host')} is down, its lock lapses when its NFS lease expires (about 90 s), "
                "then rerun")
    return who


# -- who writes a part now: read by `cache info` and by every reader's refusal of an unfinished cache -------------

def live_writers(cache_dir: str | os.PathLike) -> dict[int, dict]:
    """{part: the lock record of the live process writing it}, for each stage-one lock in LOCKS_DIR held now."""
    folder = Path(cache_dir) / LOCKS_DIR
    try:
        if not _check_locks_dir(folder):
            return {}
        names = sorted(os.listdir(folder))
    except (UnsafeFile, OSError):  # a link to elsewhere or no folder at all: no writer can hold a lock in it
        return {}
    locks = [(int(m.group(1)), folder / name) for name in names if (m := _PART_LOCK.fullmatch(name))]
    return {part: record for part, path in locks if (record := live_writer(path)) is not None}


def live_writer(path: str | os.PathLike) -> dict | None:
    """The record `acquire` wrote of the live holder of the stage-one lock `path` ({} if not written yet), else None;
    probed with a shared flock taken and dropped at once (it sees holders on other NFS clients too), never by a pid."""
    try:
        fd = open_regular(path, os.O_RDONLY, single_link=False)  # the probe writes nothing: a second name is harmless
    except (FileNotFoundError, UnsafeFile):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)  # dropped at once: a writer that meets it retries (`acquire`)
        return None
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        return _record(fd)
    finally:
        os.close(fd)
