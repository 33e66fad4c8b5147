"""The read side of the trust boundary: the one way the program opens a file it did not just write, whoever made
it (a cache, a run folder, an export, a teacher folder, a Hub snapshot, a config, a prompt file).

- A file of a folder is opened from the folder named down, one component at a time, `O_NOFOLLOW`: no link is
  followed (a Hub snapshot's links only into its own repository's `blobs/`: `walk`'s `links_into`), and what is
  opened must be a regular file, opened `O_NONBLOCK` so that a FIFO is never waited on.
- Every read is bounded: a file larger than its kind's cap (`CAPS`) is refused before a byte of it is read, and
  JSON/TOML nested deeper than `MAX_DEPTH` is refused, not recursed into.
- What is read is typed by its reader (`cache/records.py` for the cache's records; `pipeline/artifact.py` for a
  run's), never trusted for its shape.
Refusals are `UnsafeFileError` (exit 2), each naming the file and, through `fix`, what the user can do about it.
docs/reliability.md, "What is trusted", says what each kind of folder may hold."""

from __future__ import annotations

import errno
import json
import os
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from .cache_error import UnsafeFileError

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder",
          stat.S_IFREG: "a regular file"}

# What a refusal inside a cache tells the user to do (the default: the cache's readers were this module's first).
CACHE_FIX = ("rerun the same `wandistiller teacher-cache` command (it writes what is missing), or rebuild the cache "
             "with it and --overwrite")

# The largest file of each kind the program reads whole, in bytes. A record is a few KiB; a manifest lists every
# shard (~200 bytes each: 10^6 shards fit); a prompt file of 10^6 prompts at the 10 MB line bound of none of them
# would not, so prompt files are read line by line and capped per line instead (pipeline/prompts.py).
CAPS = {
    "record": 16 << 20,      # a run's distill.json, lora.json, trainer_state.json, digests; an export's marker
    "config": 16 << 20,      # a TOML or JSON config, a teacher's model_index.json and component configs
    "manifest": 1 << 30,     # a cache's manifest.json and progress records
    "metrics": 1 << 30,      # a run's metrics.jsonl, read line by line
    "prompts": 1 << 30,      # a prompt file, read line by line
    "weights_header": 100 << 20,  # a safetensors header (the format's own bound)
}
MAX_DEPTH = 32  # JSON/TOML nesting: every record the program reads is a few levels deep


def file_kind(mode: int) -> str:
    """`mode` (an st_mode) in words: "a FIFO", "a symbolic link", "a regular file", ..."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _refuse(root, parts: tuple[str, ...], st: os.stat_result, folder: bool, fix: str) -> UnsafeFileError:
    path = Path(root, *parts)
    if stat.S_ISLNK(st.st_mode):
        return UnsafeFileError(f"{path} is a symbolic link (to {os.readlink(path)}), and WanDistiller never follows "
                               f"a link inside a folder it reads: replace the link with a copy of what it points to, "
                               f"or remove it and {fix}")
    want = "a folder" if folder else "a regular file"
    return UnsafeFileError(f"{path} is {file_kind(st.st_mode)}, not {want}; delete it and {fix}")


def check_relpath(root, rel: str, fix: str = CACHE_FIX) -> tuple[str, ...]:
    """The components of `rel`, refused unless it is a plain relative path that stays inside `root`."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\x00" in rel:
        raise UnsafeFileError(f"{rel!r} is not a path inside the folder {root}; {fix}")
    return parts


def open_fd(root: str | os.PathLike, rel: str, fix: str = CACHE_FIX) -> int:
    """A read-only descriptor of the regular file ROOT/`rel` (the caller closes it); FileNotFoundError, or
    UnsafeFileError where `rel` leaves the folder, a component is a link, or it is no regular file."""
    parts = check_relpath(root, rel, fix)
    fd = open_dir(root)
    try:
        for i, name in enumerate(parts):
            folder = i < len(parts) - 1
            try:
                nxt = os.open(name, _FLAGS | (os.O_DIRECTORY if folder else 0), dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _refuse(root, parts[:i + 1], os.lstat(name, dir_fd=fd), folder, fix) from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(root, parts, st, False, fix)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir(root: str | os.PathLike) -> int:
    """A descriptor of the folder the user named (a link the user named is theirs to name: followed), never waited on;
    UnsafeFileError where it is something else."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except NotADirectoryError:
        raise UnsafeFileError(f"{root} is {file_kind(os.stat(root).st_mode)}, not a folder; name a folder") from None


_AS_WRITTEN = "replace it with the file as written"


def _read_fd(fd: int, where, cap: int | None, fix: str) -> bytes:
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if cap is not None and size > cap:
            raise UnsafeFileError(f"{where} is {size:,} bytes, more than the {cap:,} such a file may hold; {fix}")
        return f.read() if cap is None else f.read(cap + 1)[:cap]


def read_bytes(root: str | os.PathLike, rel: str, cap: int | None = None, fix: str = CACHE_FIX) -> bytes:
    """The whole of ROOT/`rel`, opened by `open_fd`; refused above `cap` bytes before any is read."""
    return _read_fd(open_fd(root, rel, fix), Path(root, rel), cap, fix)


def open_named(path: str | os.PathLike, what: str, fix: str | None = None) -> int:
    """A read-only descriptor of a file the user named on the command line (`what`: "the prompt file"): a link the
    user named is followed, but the file must be a regular file, and a FIFO is never waited on. `fix`: the end of a
    refusal's line (default: name a file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise UnsafeFileError(f"{what} {path} is a folder, not a file; {fix or 'name the file'}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{what} {path} is {file_kind(st.st_mode)}, not a regular file; {fix or 'name a file'}")
    return fd


def read_named(path: str | os.PathLike, what: str, cap: int, fix: str | None = None) -> bytes:
    """The whole of a file the user named (`open_named`), refused above `cap` bytes."""
    return _read_fd(open_named(path, what, fix), f"{what} {path}", cap, fix or _AS_WRITTEN)


def sha256_named(path: str | os.PathLike, what: str, cap: int, fix: str | None = None) -> str:
    """The sha256 of a file the user or a record named (`open_named`), read 16 MiB at a time: memory stays bounded
    whatever the file, where `read_named` holds it whole (a record's path is checked before it is read)."""
    import hashlib

    with os.fdopen(open_named(path, what, fix), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise UnsafeFileError(f"{what} {path} is {size:,} bytes, more than the {cap:,} such a file may hold; "
                                  f"{fix or _AS_WRITTEN}")
        h = hashlib.sha256()
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


_TOO_DEEP = object()  # what a parser's RecursionError stands for


def _depth_problem(obj) -> bool:
    """True where `obj` nests deeper than MAX_DEPTH (walked without recursion)."""
    todo = [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            if d > MAX_DEPTH:
                return True
            todo += [(v, d + 1) for v in (o.values() if isinstance(o, dict) else o)]
    return False


def parse_json(data: bytes | str, where, fix: str = _AS_WRITTEN) -> object:
    """`data` parsed as JSON; UnsafeFileError (naming `where`, ending in `fix`) where it is not JSON or nests deeper
    than MAX_DEPTH."""
    try:
        obj = json.loads(data)
    except RecursionError:
        obj = _TOO_DEEP
    except (ValueError, UnicodeError) as e:  # JSONDecodeError, bad UTF-8
        raise UnsafeFileError(f"{where} is not valid JSON ({e}); {fix}") from None
    if obj is _TOO_DEEP or _depth_problem(obj):
        raise UnsafeFileError(f"{where} nests deeper than the {MAX_DEPTH} levels any record of WanDistiller has; "
                              f"{fix}")
    return obj


def parse_toml(text: str, where, fix: str | None = None) -> dict:
    """`text` parsed as TOML; UnsafeFileError (ending in `fix`, if given) where it nests deeper than MAX_DEPTH
    (tomllib's own errors pass)."""
    try:
        obj = tomllib.loads(text)
    except RecursionError:
        obj = _TOO_DEEP
    if obj is _TOO_DEEP or _depth_problem(obj):
        raise UnsafeFileError(f"{where} nests deeper than the {MAX_DEPTH} levels any config of WanDistiller has"
                              + (f"; {fix}" if fix else ""))
    return obj


def read_json(root: str | os.PathLike, rel: str, kind: str = "record", fix: str = CACHE_FIX) -> object:
    """ROOT/`rel` read by `read_bytes` under CAPS[kind] and parsed by `parse_json`."""
    return parse_json(read_bytes(root, rel, CAPS[kind], fix), Path(root, rel))


def walk(root: str | os.PathLike, fix: str, links_into: str | os.PathLike | None = None,
         max_entries: int = 100_000, max_depth: int = 16) -> Iterator[str]:
    """The relative paths of the regular files below `root`, none followed through a link: a link, FIFO, socket or
    device anywhere below is refused (`fix`), except, with `links_into`, a link whose target lies inside that
    folder (a Hub snapshot's links into its repository's `blobs/`). Bounded in entries and depth (a link loop or a
    folder of millions is refused, never walked for ever)."""
    inside = os.path.realpath(links_into) if links_into is not None else None
    seen = 0
    todo = [()]
    while todo:
        parts = todo.pop()
        if len(parts) > max_depth:
            raise UnsafeFileError(f"{Path(root, *parts)} lies {len(parts)} folders deep, more than {max_depth}; {fix}")
        fd = open_dir(root) if not parts else None
        here = Path(root, *parts)
        try:
            names = sorted(os.listdir(fd if fd is not None else here))
        finally:
            if fd is not None:
                os.close(fd)
        for name in names:
            seen += 1
            if seen > max_entries:
                raise UnsafeFileError(f"{root} holds more than {max_entries:,} files and folders; {fix}")
            st = os.lstat(here / name)
            rel = (*parts, name)
            if stat.S_ISDIR(st.st_mode):
                todo.append(rel)
            elif stat.S_ISREG(st.st_mode):
                yield "/".join(rel)
            elif stat.S_ISLNK(st.st_mode) and inside is not None and _resolves_into(here / name, inside):
                yield "/".join(rel)
            else:
                raise _refuse(root, rel, st, False, fix)


def _resolves_into(link: Path, inside: str) -> bool:
    """True where `link` ends, through any number of links, at a regular file inside the folder `inside`."""
    try:
        target = os.path.realpath(link, strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop
        return False
    return os.path.commonpath([target, inside]) == inside and os.path.isfile(target)


def resolve_inside(root: str | os.PathLike, rel: str, fix: str, links_into: str | os.PathLike | None = None) -> Path:
    """ROOT/`rel` as a path another library may open: a regular file reached without a link (or, with
    `links_into`, one whose links end inside that folder, `walk`'s rule); FileNotFoundError where it is absent."""
    parts = check_relpath(root, rel, fix)
    path = Path(root, *parts)
    if links_into is not None and path.is_symlink():
        if not _resolves_into(path, os.path.realpath(links_into)):
            raise _refuse(root, parts, os.lstat(path), False, fix)
        return path
    os.close(open_fd(root, rel, fix))
    return path


# safetensors' dtypes and their bytes per element (a dtype outside these is no file WanDistiller wrote or reads).
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_header(root: str | os.PathLike, rel: str, fix: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of the safetensors file ROOT/`rel` (opened by `open_fd`), from its header alone:
    the header's length read first and capped (CAPS["weights_header"]), every tensor's data checked to lie inside the
    file and to be exactly its shape's bytes. UnsafeFileError (`fix`) where it is no such file."""
    where = Path(root, rel)

    def bad(why: str) -> UnsafeFileError:
        return UnsafeFileError(f"{where} is not a safetensors file ({why}); {fix}")

    with os.fdopen(open_fd(root, rel, fix), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= min(CAPS["weights_header"], size - 8):
            raise bad(f"its header length {n:,} does not fit its {size:,} bytes or the format's bound")
        header = parse_json(f.read(n), where)
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data, out = size - 8 - n, {}
    for name, t in header.items():
        if name == "__metadata__":
            if not (isinstance(t, dict) and all(isinstance(v, str) for v in t.values())):
                raise bad("its __metadata__ is not an object of strings")
            continue
        ok = isinstance(t, dict) and t.get("dtype") in _ST_BYTES and isinstance(t.get("shape"), list) and all(
            type(d) is int and d >= 0 for d in t["shape"]) and isinstance(t.get("data_offsets"), list) and len(
            t["data_offsets"]) == 2 and all(type(o) is int for o in t["data_offsets"])
        if not ok:
            raise bad(f"tensor {name!r} has no dtype, shape and data_offsets")
        begin, end = t["data_offsets"]
        count = 1
        for d in t["shape"]:
            count *= d
        if not 0 <= begin <= end <= data or end - begin != count * _ST_BYTES[t["dtype"]]:
            raise bad(f"tensor {name!r}'s data {begin}..{end} is not its shape's bytes inside the file")
        out[name] = (t["dtype"], tuple(t["shape"]))
    return out
