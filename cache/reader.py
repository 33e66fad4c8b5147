"""Random-access reader of finished caches: the shard index and reads of a sample by row.

Unlike webdataset's streaming reader, every sample gets a fixed row number from the manifest before any byte is
read (so every sample once per epoch, equal steps per rank, a resumable position); a sample is read with one `pread`."""

from __future__ import annotations

import json
import math
import os
import tarfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load

import webdataset as wds

from . import format as F
from .checksum import crc32c
from .cache_error import CacheError, UnsafeFileError
from .manifest import load_manifest, settings_problem
from .safe_open import open_fd
from .schema import SAMPLE_FIELDS, meta_problems, recorded_steps, sample_problems
from .store_checks import count_problem, store_problem

# Columns of an index table (int64): one row per sample.
C_CACHE, C_SHARD, C_PROMPT, C_SEED, C_STEP, C_META_OFF, C_META_LEN, C_TENS_OFF, C_TENS_LEN = range(9)
N_COLS = 9
# Columns that `scan_shard` fills (the shard and cache ids are known to the caller).
SCAN_COLS = (C_PROMPT, C_SEED, C_STEP, C_META_OFF, C_META_LEN, C_TENS_OFF, C_TENS_LEN)

_CHUNK = 1 << 20

# Why a shard failed its check; small integers so ranks can exchange them in a tensor.
SHARD_OK, SHARD_MISSING, SHARD_SIZE, SHARD_CHECKSUM, SHARD_TAR, SHARD_MEMBERS, SHARD_UNSAFE = range(7)
SHARD_PROBLEMS = {
    SHARD_MISSING: "is missing",
    SHARD_SIZE: "has another size than the manifest records (truncated or replaced)",
    SHARD_CHECKSUM: "fails its checksum (content changed after it was written)",
    SHARD_TAR: "is not a readable tar",
    SHARD_MEMBERS: "holds other samples than the manifest records (count or members)",
    SHARD_UNSAFE: "is a symbolic link or no regular file, or lies below one (a cache holds its own files)",
}


class ShardError(CacheError):
    """A shard that does not match its manifest record; `code` is one of the SHARD_* values."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def shard_problem(cache_dir: str | os.PathLike, rec: dict, code: int) -> str:
    """The one-line message for a bad shard, with the remedy."""
    return (f"shard {Path(cache_dir) / rec.path} {SHARD_PROBLEMS[code]}; delete it and rerun the same "
            "`wandistiller teacher-cache` command to rebuild it (`wandistiller cache verify` lists every problem)")


@dataclass(frozen=True)
class CacheInfo:
    """One finished cache: its folder and manifest."""

    path: Path
    manifest: dict

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint


def open_caches(dirs: list[str | os.PathLike]) -> list[CacheInfo]:
    """Load the manifests of `dirs`; refuse missing, empty or duplicated caches, mixed fingerprints, a manifest that
    does not load, one claiming more samples than its shards could hold (`count_problem`), edited settings
    (`settings_problem`) or a prompt store not of the manifest's (`store_problem`)."""
    if not dirs:
        raise CacheError("no cache given; pass --cache CACHE_DIR (made by `wandistiller teacher-cache`)")
    caches, seen = [], {}
    for d in dirs:
        path = Path(d)
        real = path.resolve()
        if real in seen:
            raise CacheError(f"cache {path} is given twice (also as {seen[real]}); pass each CACHE_DIR once")
        seen[real] = path
        m = load_manifest(path)
        if not m.shards or m.samples <= 0:
            raise CacheError(f"cache {path} holds no samples; rebuild it with `wandistiller teacher-cache`")
        if problem := count_problem(path, m):  # before anything is allocated per prompt or sample
            raise CacheError(problem)
        caches.append(CacheInfo(path, m))
    fps = {c.fingerprint for c in caches}
    if len(fps) > 1:
        listed = ", ".join(f"{c.path} ({c.fingerprint[:12]})" for c in caches)
        raise CacheError(f"the caches were made with different settings and their targets cannot be mixed: "
                         f"{listed}; train on caches that share one fingerprint")
    for c in caches:
        if problem := settings_problem(c.path, c.manifest) or store_problem(c.path, c.manifest):
            raise CacheError(problem)
    return caches


class _HashingReader:
    """Sequential file reader that checksums (crc32c) and counts everything read through it."""

    def __init__(self, f):
        self.f = f
        self.crc = self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.crc = crc32c(data, self.crc)
        self.bytes += len(data)
        return data

    def matches(self, rec: dict) -> bool:
        """Whether what was read is the shard `rec` records: its size and crc32c."""
        return self.bytes == rec.bytes and self.crc == rec.crc32c


def scan_shard(cache_dir: str | os.PathLike, rec: dict, checksum: bool = True) -> np.ndarray:
    """Index one shard: int64 [samples, len(SCAN_COLS)] in member order; ShardError if it is not as recorded. With
    `checksum` one sequential pass checksums it and collects the member offsets; without, tar headers only (seeks)."""
    try:
        fd = open_fd(cache_dir, rec.path)
    except FileNotFoundError:
        raise ShardError(shard_problem(cache_dir, rec, SHARD_MISSING), SHARD_MISSING) from None
    except UnsafeFileError as e:
        raise ShardError(str(e), SHARD_UNSAFE) from e
    members: dict[str, dict[str, tuple[int, int]]] = {}
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size != rec.bytes:
            raise ShardError(shard_problem(cache_dir, rec, SHARD_SIZE), SHARD_SIZE)
        reader = _HashingReader(f) if checksum else None
        try:
            with tarfile.open(fileobj=reader, mode="r|") if reader else tarfile.open(fileobj=f, mode="r:") as tar:
                for info in tar:
                    # a header claiming more bytes than the shard holds: tarfile's stream mode would skip to its end
                    # a block at a time, for ever (10^15 bytes: 10^11 reads of nothing)
                    if info.offset_data + info.size > size:
                        raise ShardError(shard_problem(cache_dir, rec, SHARD_TAR) + f" (member {info.name!r} claims "
                                         f"{info.size} bytes, past the shard's {size})", SHARD_TAR)
                    if not info.isfile():
                        continue
                    key, _, ext = info.name.partition(".")
                    members.setdefault(key, {})[ext] = (info.offset_data, info.size)
            if reader is not None:
                while reader.read(_CHUNK):
                    pass
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ShardError(shard_problem(cache_dir, rec, SHARD_TAR) + f" ({e})", SHARD_TAR) from e
    if reader is not None and not reader.matches(rec):
        raise ShardError(shard_problem(cache_dir, rec, SHARD_CHECKSUM), SHARD_CHECKSUM)
    try:  # (a foreign key: ValueError; a member alone: KeyError)
        rows = [(*F.parse_key(key), *mem[F.EXT_META], *mem[F.EXT_TENSORS]) for key, mem in members.items()]
    except (ValueError, KeyError):
        rows = None
    if rows is None or len(rows) != rec.samples:
        found = "unpaired or foreign members" if rows is None else f"{len(rows)} samples, manifest says {rec.samples}"
        raise ShardError(shard_problem(cache_dir, rec, SHARD_MEMBERS) + f" ({found})", SHARD_MEMBERS)
    return np.asarray(rows, dtype=np.int64).reshape(-1, len(SCAN_COLS))


class ShardStream:
    """Every sample of one shard as webdataset groups its members, in one pass that also checksums the file: once
    the iteration ends, `matches` says whether it is the file `rec` records. OSError / TarError when unreadable."""

    def __init__(self, cache_dir: str | os.PathLike, rec: dict):
        self.cache_dir, self.path, self.rec = cache_dir, Path(cache_dir) / rec.path, rec
        self._read: _HashingReader | None = None

    def __iter__(self):
        with os.fdopen(open_fd(self.cache_dir, self.rec.path), "rb") as f:
            self._read = _HashingReader(f)
            files = ({**m, "__url__": str(self.path)} for m in wds.tariterators.tar_file_iterator(self._read))
            yield from wds.tariterators.group_by_keys(files)
            while self._read.read(_CHUNK):  # the tar's end-of-archive padding
                pass

    def matches(self) -> bool:
        return self._read is not None and self._read.matches(self.rec)


def decode_sample(members: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of one sample's tar members (inverse of `writer.encode_sample`); parse failures propagate."""
    return st_load(members[F.EXT_TENSORS]), json.loads(members[F.EXT_META])


def shard_list(caches: list[CacheInfo]) -> list[tuple[int, Path, dict, int]]:
    """Every shard of `caches` in order: (cache id, cache dir, record, first row). Rows follow the manifests."""
    out, row = [], 0
    for ci, c in enumerate(caches):
        for rec in c.manifest.shards:
            out.append((ci, c.path, rec, row))
            row += int(rec.samples)
    return out


def empty_table(caches: list[CacheInfo]) -> np.ndarray:
    """A zeroed table with one row per sample listed in the manifests (filled by `fill_table`)."""
    return np.zeros((sum(int(r.samples) for c in caches for r in c.manifest.shards), N_COLS), dtype=np.int64)


def fill_table(table: np.ndarray, shard_id: int, cache_id: int, first_row: int, scanned: np.ndarray) -> None:
    """Place one shard's scan in the table (rows first_row .. first_row + len)."""
    rows = slice(first_row, first_row + len(scanned))
    table[rows, C_CACHE], table[rows, C_SHARD] = cache_id, shard_id
    table[rows, list(SCAN_COLS)] = scanned


class CacheIndex:
    """Every sample of one or more caches (sharing one fingerprint), addressable by row. The same (prompt, seed,
    step) in two caches is the same target (deterministic stage one): the first cache's copy is kept."""

    def __init__(self, caches: list[CacheInfo], table: np.ndarray):
        self.caches = caches
        self.shards = shard_list(caches)
        key = sample_code(table)
        _, first = np.unique(key, return_index=True)
        self.duplicates = len(table) - len(first)
        self.table = table[np.sort(first)] if self.duplicates else table
        self.steps = int(caches[0].manifest.steps)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def manifest(self) -> dict:
        return self.caches[0].manifest

    def key(self, row: int) -> str:
        r = self.table[row]
        return F.sample_key(int(r[C_PROMPT]), int(r[C_SEED]), int(r[C_STEP]))

    def shard_path(self, row: int) -> Path:
        _, cache_dir, rec, _ = self.shards[int(self.table[row, C_SHARD])]
        return cache_dir / rec.path


def check_complete(cache: CacheInfo, cache_id: int, table: np.ndarray, shards: list) -> None:
    """CacheError unless the indexed samples of `cache` are exactly one per (prompt, seed, recorded step) its
    manifest promises: a manifest edited by hand (a shard dropped or listed twice) must not become a partial or
    skewed epoch. `shards` is `shard_list` of the caches the table was built from."""
    m = cache.manifest  # (a checked record: `load_manifest`)
    dims, recorded = (m.prompts, m.seeds_per_prompt, m.steps), np.asarray(recorded_steps(m), dtype=np.int64)
    rows = table[table[:, C_CACHE] == cache_id]
    fix = (f"rerun the same `wandistiller teacher-cache` command on it: it rewrites {F.MANIFEST} from the parts' "
           "progress records (`wandistiller cache verify` lists every problem)")
    foreign = np.flatnonzero((rows[:, C_PROMPT] < 0) | (rows[:, C_PROMPT] >= dims[0]) | (rows[:, C_SEED] < 0)
                             | (rows[:, C_SEED] >= dims[1]) | ~np.isin(rows[:, C_STEP], recorded))
    if len(foreign):
        r = rows[foreign[0]]
        steps = f"recorded steps {','.join(map(str, recorded))}" if len(recorded) < dims[2] else f"{dims[2]} steps"
        raise CacheError(f"shard {cache.path / shards[int(r[C_SHARD])][2].path} holds sample "
                         f"{F.sample_key(*(int(r[c]) for c in (C_PROMPT, C_SEED, C_STEP)))}, outside the "
                         f"{dims[0]} prompts x {dims[1]} seeds x {steps} of its manifest; {fix}")
    codes, counts = np.unique(sample_code(rows), return_counts=True)
    if (counts > 1).any():
        code = codes[np.argmax(counts > 1)]
        where = sorted({shards[int(r[C_SHARD])][2].path for r in rows[sample_code(rows) == code]})
        raise CacheError(f"cache {cache.path}: {int((counts > 1).sum())} sample(s) are listed more than once "
                         f"(e.g. in {' and '.join(where) if len(where) > 1 else where[0] + ', listed twice'} of "
                         f"{F.MANIFEST}); {fix}")
    expected = dims[0] * dims[1] * len(recorded)
    if len(codes) != expected:
        listed = {rec.path for ci, _, rec, _ in shards if ci == cache_id}
        unlisted = sorted(f"{F.SHARDS_DIR}/{p.name}" for p in (cache.path / F.SHARDS_DIR).glob("*.tar")
                          if f"{F.SHARDS_DIR}/{p.name}" not in listed)
        why = f"; {', '.join(unlisted[:3])} exist(s) but {F.MANIFEST} does not list it" if unlisted else ""
        raise CacheError(f"cache {cache.path} lists {len(codes)} samples, its settings make {expected} "
                         f"(prompts x seeds x recorded steps): an epoch would miss {expected - len(codes)}{why}; {fix}")


def open_index(dirs: list[str | os.PathLike], checksum: bool = False) -> CacheIndex:
    """Index of finished caches in one process (stage two splits this over its ranks); CacheError for a bad shard."""
    caches = open_caches(dirs)
    table, shards = empty_table(caches), shard_list(caches)
    for sid, (ci, cache_dir, rec, first) in enumerate(shards):
        fill_table(table, sid, ci, first, scan_shard(cache_dir, rec, checksum=checksum))
    for ci, c in enumerate(caches):
        check_complete(c, ci, table, shards)
    return CacheIndex(caches, table)


def prompt_rows(index: CacheIndex, prompts) -> np.ndarray:
    """Index rows of every cached step of `prompts`, in shard order (sequential reads)."""
    return np.flatnonzero(np.isin(index.table[:, C_PROMPT], np.fromiter(prompts, dtype=np.int64)))


def sample_code(table: np.ndarray) -> np.ndarray:
    """One int64 per sample identifying (prompt, seed, step) (seed < 100, step < 1000 by the key format)."""
    return (table[:, C_PROMPT] * 100 + table[:, C_SEED]) * 1000 + table[:, C_STEP]


# safetensors dtype names -> torch dtypes, for `SampleReader`'s own decoding of a tensor member.
_ST_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
              "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
              "F64": torch.float64}


def _tensors_in(buf: np.ndarray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf`, as views of its memory (`safetensors.torch.load` copies,
    which at A14B sizes costs as much as the read); ValueError for anything not well-formed."""
    n = int.from_bytes(buf[:8], "little")
    if len(buf) < 8 or not 0 < n <= len(buf) - 8:
        raise ValueError(f"header length {n} does not fit a member of {len(buf)} bytes")
    head = json.loads(bytes(memoryview(buf)[8:8 + n]))
    base, size, out = 8 + n, len(buf) - 8 - n, {}
    for name, info in head.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = _ST_DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        count = math.prod(shape)
        if not 0 <= start <= end <= size or end - start != count * dtype.itemsize or min(shape, default=0) < 0:
            raise ValueError(f"tensor {name!r} spans bytes {start}..{end} of {size}, not a {dtype} {shape}")
        out[name] = (torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start).view(shape) if count
                     else torch.empty(shape, dtype=dtype))
    return out


# The most bytes between a sample's metadata member and its tensor member that `SampleReader` reads along with them
# to read both in one request (the writer puts them 1 KiB apart: a tar header and padding).
_GAP = 64 << 10


class SampleReader:
    """Reads samples by row, each with one `os.pread` of both of its members (no shared file offset: safe after fork);
    a bounded LRU of open shards. One reader per process and thread: a DataLoader's workers each make their own."""

    def __init__(self, index: CacheIndex, max_open: int = 64):
        self.index, self.max_open = index, max_open
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._pid = os.getpid()
        # (cache, a tensor member's safetensors header) -> its tensors (name, dtype, count, offset, shape), for
        # layouts decoded and checked against the schema once (`_decode_members`): every sample of a cache has one
        self._layouts: dict[tuple[int, bytes], list] = {}

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # inherited through fork: the parent's descriptors are not ours to close
            self._fds, self._pid = OrderedDict(), os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            _, cache_dir, rec, _ = self.index.shards[shard]
            try:
                fd = open_fd(cache_dir, rec.path)
            except OSError as e:
                raise CacheError(f"cannot open shard {cache_dir / rec.path} ({e.strerror}); "
                                 "it was moved or deleted after training started") from e
            # Rows are read in random order: no kernel read-ahead past each read (with it, each ~400 KB read of an
            # A14B sample pulled ~1 MB from the disk).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[shard] = fd
            if len(self._fds) > self.max_open:
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(shard)
        return fd

    def _span(self, fd: int, off: int, n: int, row: int) -> np.ndarray:
        """`n` bytes of the shard at `off`, in one read."""
        buf = np.empty(n, dtype=np.uint8)
        if os.preadv(fd, [buf], off) != n:
            raise CacheError(f"shard {self.index.shard_path(row)} is shorter than its index (truncated while "
                             "training?); run `wandistiller cache verify`")
        return buf

    def read(self, row: int) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, metadata) of one sample, views of one buffer holding both members (the writer puts them a tar
        header apart); CacheError naming the shard if it does not decode."""
        r = self.index.table[row]
        fd = self._fd(int(r[C_SHARD]))
        meta_off, meta_len, tens_off, tens_len = (int(r[c]) for c in (C_META_OFF, C_META_LEN, C_TENS_OFF, C_TENS_LEN))
        if meta_off + meta_len <= tens_off <= meta_off + _GAP:
            buf = self._span(fd, meta_off, tens_off + tens_len - meta_off, row)
            meta_b, tens_b = buf[:meta_len].tobytes(), buf[tens_off - meta_off:]
        else:
            meta_b, tens_b = self._span(fd, meta_off, meta_len, row).tobytes(), self._span(fd, tens_off, tens_len, row)
        return self._decode_members(row, meta_b, tens_b)

    def _decode_members(self, row: int, meta_b: bytes, tens_b: np.ndarray) -> tuple[dict[str, torch.Tensor], dict]:
        r = self.index.table[row]
        n = int.from_bytes(tens_b[:8], "little") if len(tens_b) >= 8 else 0
        head = (int(r[C_CACHE]), tens_b[8:8 + n].tobytes()) if 0 < n <= len(tens_b) - 8 else None
        layout = self._layouts.get(head) if head is not None else None
        if layout is not None:  # a tensor layout already decoded and checked: its views, and the metadata's checks
            try:
                meta = json.loads(meta_b)
                ids = (int(r[C_PROMPT]), int(r[C_SEED]), int(r[C_STEP]))
                if isinstance(meta, dict) and not meta_problems("", meta, self.index.caches[int(r[C_CACHE])].manifest,
                                                                ids=ids):
                    return {name: torch.frombuffer(tens_b, dtype=dtype, count=count, offset=offset).view(shape)
                            for name, dtype, count, offset, shape in layout}, meta
            except Exception:
                pass  # (the full decode below says what is wrong, naming the sample)
        key, manifest = self.index.key(row), self.index.caches[int(r[C_CACHE])].manifest
        try:
            tensors, meta = _tensors_in(tens_b), json.loads(meta_b)
        except Exception as e:  # any parse failure is corruption of that member
            raise self._undecodable(row, e) from e
        if problems := sample_problems(key, tensors, meta, manifest):
            raise CacheError(f"{problems[0]} (in {self.index.shard_path(row)}); run `wandistiller cache verify`")
        if head is not None and all(t.numel() for t in tensors.values()) and len(self._layouts) < 64:
            base = tens_b.ctypes.data
            self._layouts[head] = [
                (name, t.dtype, t.numel(), t.data_ptr() - base, tuple(t.shape)) for name, t in tensors.items()]
        return tensors, meta

    def _undecodable(self, row: int, e: Exception) -> CacheError:
        return CacheError(f"sample {self.index.key(row)} in {self.index.shard_path(row)} does not decode "
                          f"({type(e).__name__}: {e}); run `wandistiller cache verify`")

    def read_tensors(self, row: int, names: tuple[str, ...] = (F.T_X_T,)) -> dict[str, torch.Tensor]:
        """The tensors `names` of one sample, from one `pread` of its tensor member (no metadata): the second state of
        a pair. Each is checked against its schema entry; CacheError naming the shard otherwise."""
        r = self.index.table[row]
        data = self._span(self._fd(int(r[C_SHARD])), int(r[C_TENS_OFF]), int(r[C_TENS_LEN]), row)
        key, manifest = self.index.key(row), self.index.caches[int(r[C_CACHE])].manifest
        try:
            tensors = _tensors_in(data)
        except Exception as e:  # any parse failure is corruption of that member
            raise self._undecodable(row, e) from e
        out = {}
        for name in names:
            t, spec = tensors.get(name), SAMPLE_FIELDS[name]
            shape, dtype = list(spec.shape(manifest)), spec.dtype_name(manifest)
            if t is None or list(t.shape) != shape or F.DTYPE_NAMES.get(t.dtype) != dtype:
                raise CacheError(f"sample {key} {name} is missing or not {dtype} {shape} (in "
                                 f"{self.index.shard_path(row)}); run `wandistiller cache verify`")
            out[name] = t
        return out

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds.clear()
