"""One writer per output: an exclusive `flock` on a lock file, held for the life of the writing process.

The kernel drops a flock when its process dies (SIGKILL and the OOM killer included), so a crash never
leaves a lock to clear by hand; the file itself only records the last holder (pid, host, start time,
command) so that a refused second writer can name it. A lock file left by a dead process is therefore
harmless: the next writer takes the lock at once and rewrites the record.

On NFS, Linux emulates flock with a lease held by the server: a lock taken by a host that died is freed
when its lease expires (NFSv4: about 90 s), which the refusal says when the holder is another host.

Stage one locks each part (`locks/part-NNNNN.lock` in the cache), so parts on several nodes still run side
by side; stage two locks its run folder (rank 0). The lock file is removed on release (the holder checks
after locking that the file it holds is still the one at the path, so a removal never lets two in).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from cache.format import LOCKS_DIR

from .errors import UserError

RUN_LOCK = "writer.lock"  # stage two: in the run folder
PROBE_RETRIES = 4  # 50 ms apart: how long a writer waits out a liveness probe (`live_writer`)


def part_lock_path(cache_dir: str | os.PathLike, part: int) -> Path:
    return Path(cache_dir) / LOCKS_DIR / f"part-{part:05d}.lock"


class _Held:
    def __init__(self, fd: int, made_dir: Path | None):
        self.fd = fd
        self.made_dir = made_dir  # the folder acquire created, removed on release if left empty


_HELD: dict[Path, _Held] = {}  # this process's locks; acquiring one it already holds is a no-op


def acquire(path: str | os.PathLike, what: str) -> None:
    """Take the exclusive lock `path` for `what` (e.g. "part 0 of cache /x") or refuse with one line naming the
    holder (exit 2). Kept until `release` or until this process exits."""
    path = Path(path).absolute()
    if path in _HELD:
        return
    made_dir = None
    while True:
        try:
            if not path.parent.exists():
                made_dir = path.parent
                path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(f"cannot write to {path.parent} ({e.strerror}); choose a writable --out") from e
        if not _lock_exclusive(fd):
            os.close(fd)
            raise UserError(f"{what} is being written by another process ({_describe_holder(path)}; lock {path}); "
                            "wait for it to finish, or use another --out") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
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
    _HELD[path] = _Held(fd, made_dir)


def _lock_exclusive(fd: int) -> bool:
    """Take the exclusive flock on `fd`, or False when another process holds it. A refusal is retried for a moment:
    `live_writer` (the probe of `cache info` and of every reader's refusal) holds a shared lock for
    microseconds, which must not pass for a writer."""
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
    """Give up the lock `path` if this process holds it, removing the lock file (and the folder acquire made
    for it, if nothing else is in it). Unlinked before unlocking, so no one can lock a file about to vanish."""
    path = Path(path).absolute()
    held = _HELD.pop(path, None)
    if held is None:
        return
    path.unlink(missing_ok=True)
    os.close(held.fd)
    if held.made_dir is not None:
        try:
            held.made_dir.rmdir()
        except OSError:
            pass


def _record(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        rec = {}
    return rec if isinstance(rec, dict) else {}


def _describe_holder(path: Path) -> str:
    rec = _record(path)
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
    live = {}
    for path in sorted((Path(cache_dir) / LOCKS_DIR).glob("part-*.lock")):
        record = live_writer(path)
        if record is not None:
            live[int(path.stem.split("-")[1])] = record
    return live


def live_writer(path: str | os.PathLike) -> dict | None:
    """The record of the live process holding the stage-one lock `path` (pid, host, since, started, command, as
    `acquire` writes it; {} if not written yet), or None when no process holds it: a lock file a killed writer
    left behind is not a live run. Probed with a shared flock taken and dropped at once (which sees holders on other
    NFS clients too), never by the file's existence or a pid, which say nothing across hosts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)  # dropped at once: a writer that meets it retries (`acquire`)
        return None
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        try:
            record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        except ValueError:
            record = {}
        return record if isinstance(record, dict) else {}
    finally:
        os.close(fd)
