"""The write side of the trust boundary: the one way a command creates an output file or folder.

- A file is written under a new temporary name beside it (`O_CREAT | O_EXCL | O_NOFOLLOW`: never an existing file,
  never through a link), fsynced and renamed over its name: a link planted at the name is replaced, never written
  through, and a reader sees the old file or the new one.
- An output folder a command publishes whole (an export, the tiny teacher) is claimed first (`claim_folder`):
  refused when it is a link, not a folder, or holds anything that command did not write. What a command wrote is
  what its marker file (`MARKER`) lists, not a key any JSON may contain; replacing an earlier output removes only
  what that output's marker lists, so a folder that also holds a user's file (a `.git/`) is refused, not emptied.
- Output folders are created before the long work starts (`ensure_folder`), so a typo ends the command at once.
docs/reliability.md, "What is trusted"."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .atomic import atomic_write, publish_dir
from .cache_error import UnsafeFileError
from .format import TMP_SUFFIX
from .safe_open import file_kind, read_json

# The file that says which command wrote a folder and what it wrote there: {"written_by": ..., "entries": [...]}.
MARKER = ".wandistiller.json"
_MAX_ENTRIES = 100_000


def check_not_link(path: Path, flag: str) -> None:
    """Refuse `path` (an output the user named with `flag`) where it is a link or a special file; a missing path
    passes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}); WanDistiller never writes "
                              f"through one: name the folder it points to, or another {flag}")
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise UnsafeFileError(f"{flag} {path} is {file_kind(st.st_mode)}; choose another {flag}")


def ensure_folder(path: str | os.PathLike, flag: str) -> Path:
    """The folder `path` (and its parents) created now, before any work, and checked to be a folder of its own
    (not a link, not a file): where the command will write its outputs."""
    path = Path(path)
    check_not_link(path, flag)
    if path.exists() and not path.is_dir():
        raise UnsafeFileError(f"{flag} {path} is a file, not a folder; name a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UnsafeFileError(f"{flag} {path} lies below a file, not a folder; choose another {flag}") from None
    return path


def write_file(path: str | os.PathLike, data: bytes | None = None, *,
               writer: Callable[[BinaryIO], None] | None = None) -> Path:
    """Replace the file `path` with `data`, or with what `writer(f)` writes to the open file: a new temporary file
    beside it, fsynced, renamed over it (a link at `path` is replaced, not followed). Its folder must not be a link."""
    path = Path(path)
    check_not_link(path.parent, "the folder of")
    atomic_write(path, writer if writer is not None else (lambda f: f.write(data)))
    return path


def open_append(path: str | os.PathLike) -> BinaryIO:
    """`path` opened to append to (a log this command owns, e.g. a run's metrics.jsonl), created if missing; never
    through a link planted at its name, never a FIFO."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path} is {file_kind(os.fstat(fd).st_mode)}, not a regular file; remove it")
    return os.fdopen(fd, "a")


def write_json(path: str | os.PathLike, obj, indent: int = 2) -> Path:
    return write_file(path, (json.dumps(obj, indent=indent) + "\n").encode())


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy the regular file `src` (opened without following a link; the caller has checked where it lies) to `dst`
    by `write_file`: bytes only, never the source's modes or owner."""
    src = Path(src)
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFileError(f"{src} is {file_kind(os.fstat(fd).st_mode)}, not a regular file; remove it")
        return write_file(dst, writer=lambda out: shutil.copyfileobj(f, out, 1 << 20))


def entries(folder: Path) -> list[str]:
    """Every file and link below `folder` (relative, links as themselves, never followed), sorted; bounded."""
    out = []
    for root, dirs, files in os.walk(folder):
        here = Path(root).relative_to(folder)
        out += [(here / n).as_posix() for n in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]]
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        if len(out) > _MAX_ENTRIES:
            break
    return sorted(out)


def _marker(folder: Path, command: str) -> set[str] | None:
    """What `command`'s marker in `folder` says it wrote there, or None where there is no such marker."""
    try:
        rec = read_json(folder, MARKER, "record", fix=f"remove {folder / MARKER}")
    except FileNotFoundError:
        return None
    if not isinstance(rec, dict) or rec.get("written_by") != command:
        return None
    listed = rec.get("entries")
    return set(listed) if isinstance(listed, list) and all(isinstance(e, str) for e in listed) else None


def claim_folder(out: str | os.PathLike, command: str, replace: bool, flag: str = "--out",
                 hint: str = "") -> bool:
    """Check that `command` may publish a folder at `out`: missing or empty, or (with `replace`) an earlier output of
    the same command holding nothing but what its marker lists. True where there is an earlier output to replace.
    `hint`: how to ask for the replacement (" or add --overwrite ..."), said when `replace` is off."""
    out = Path(out)
    check_not_link(out, flag)
    if not out.exists():
        ensure_folder(out.parent, f"the folder of {flag}")
        return False
    if not out.is_dir():
        raise UnsafeFileError(f"{flag} {out} is a file; name a folder for the {command} output")
    found = entries(out)
    if not found:
        return False
    listed = _marker(out, command)
    if listed is None:
        raise UnsafeFileError(f"{flag} {out} holds files that `wandistiller {command}` did not write (e.g. "
                              f"{found[0]}); choose a new or empty folder")
    if not replace:
        raise UnsafeFileError(f"{flag} {out} holds an earlier {command} output; choose a new folder{hint}")
    if foreign := [e for e in found if e != MARKER and e not in listed]:
        raise UnsafeFileError(f"{flag} {out} holds {foreign[0]}, which `wandistiller {command}` did not write there; "
                              f"move it out of {out} first (only what the command wrote is ever replaced)")
    return True


def mark(folder: Path, command: str) -> None:
    """Write `command`'s marker into `folder` (being built): everything below it now is what the command wrote."""
    write_json(folder / MARKER, {"written_by": command, "entries": entries(folder)})


@contextlib.contextmanager
def building(out: Path, command: str, before_replace=None, after_replace=None) -> Iterator[Path]:
    """A new temporary folder beside `out` to write `command`'s output into; when the block ends the marker is
    written, the folder fsynced and swapped in whole (`publish_dir`), so an earlier output at `out` stays whole until
    the new one replaces it; removed on a failure. Call `claim_folder` first."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}{TMP_SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        if os.path.islink(tmp) or not tmp.is_dir():
            os.unlink(tmp)
        else:
            shutil.rmtree(tmp)
    os.mkdir(tmp)  # (exclusive: a name planted since is refused, never written into)
    try:
        yield tmp
        mark(tmp, command)
        publish_dir(tmp, out, before_replace=before_replace, after_replace=after_replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

