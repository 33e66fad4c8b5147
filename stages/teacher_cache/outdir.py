"""Stage one's output directory: refuse what is not a cache (nothing in --out is trusted before `refuse_foreign`;
only the cache's own names are deleted, never through a link: docs/reliability.md, "Folders someone else handed
over"), clear on --overwrite, tidy what a crash left, and refuse a run its free disk cannot hold (`check_free`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from cache import format as F
from cache.format import LOCKS_DIR
from cache.manifest import manifest_path
from cache.part_progress import PartProgress, list_parts
from cache.records import CacheHeader
from cache.safe_open import file_kind
from cache.schema import recorded_steps
from cache.size import (
    embed_tokens_bound, human, latent_bytes, part_blocks, prompt_bytes, sample_disk_bytes, shard_bytes,
)
from pipeline.errors import UserError
from pipeline.lock import UnsafeFile, open_regular, read_head
from pipeline.runtime import print0

from .placement_choice import free_space

OFFLOAD_DIR = "offload"  # --placement disk's default --offload-dir (placements/base.py)
# What a cache directory may hold: anything else means --out is someone else's folder.
CACHE_ENTRIES = {F.MANIFEST, F.PARTS_DIR, F.SHARDS_DIR, F.NEGATIVE, F.FEATURE_PROJECTION, F.RESOLVED_CONFIG,
                 OFFLOAD_DIR, LOCKS_DIR}
_PART_DIR = re.compile(r"part-\d{5,}")
_PART_LOCK = re.compile(r"part-\d{5,}\.lock")
_SHARD = re.compile(r"part-\d{5,}-\d{6,}\.tar")
# The fields that make a JSON file one of ours (any format version: an older cache is still ours to --overwrite).
_MANIFEST_KEYS = {"fingerprint", "shards"}
_PROGRESS_KEYS = {"part", "num_parts", "fingerprint", "done_blocks"}
_CONFIG_KEYS = {"teacher", "prompts", "out", "steps", "seeds_per_prompt"}


def refuse_foreign(out: Path) -> None:
    """One clear error unless `out` is new, empty, or a cache of ours holding no link and no special file."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    if not out.is_dir():
        return
    entries = sorted(os.listdir(out))
    foreign = [n for n in entries if n not in CACHE_ENTRIES and not n.endswith(F.TMP_SUFFIX)]
    if foreign:
        raise UserError(f"output {out} is not empty and is not a WanDistiller cache (found {foreign[0]!r}); "
                        "choose a new or empty directory")
    for path, mode in _unsafe_entries(out):  # the first one
        if stat.S_ISLNK(mode):
            raise UserError(f"{path} is a symbolic link inside the cache {out}; remove the link (stage one never "
                            "writes or deletes through one: nothing was) and rerun")
        raise UserError(f"{path} is {file_kind(mode)} inside the cache {out}, not a file stage one wrote; delete it "
                        "and rerun")
    if entries and not _holds_a_cache(out):
        held = ", ".join(repr(n) for n in entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        raise UserError(f"output {out} is not empty and is not a WanDistiller cache (it holds {held}, but no "
                        f"{F.MANIFEST} or {F.PARTS_DIR}/part-N/{F.PROGRESS} of one); choose a new or empty directory")


def _unsafe_entries(out: Path) -> Iterator[tuple[Path, int]]:
    """(path, st_mode) of each entry below `out` that is neither a folder nor a regular file. Links are never
    followed; entries that vanish meanwhile (a concurrent part's temporary files) are skipped."""
    todo = [out]
    while todo:
        folder = todo.pop()
        try:
            it = os.scandir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):  # d_type: no system call per entry
                        todo.append(Path(e.path))
                    elif not e.is_file(follow_symlinks=False):
                        yield Path(e.path), e.stat(follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue


def _ours(path: Path, keys: set[str]) -> bool:
    """Whether the regular file `path` (never read through a link, never blocking) is a JSON object with `keys`."""
    try:
        fd = open_regular(path, os.O_RDONLY, what="file", single_link=False)
    except (OSError, UnsafeFile):
        return False
    try:
        with os.fdopen(fd, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(value, dict) and keys <= value.keys()


def _part_dirs(out: Path) -> list[Path]:
    try:
        return [out / F.PARTS_DIR / n for n in sorted(os.listdir(out / F.PARTS_DIR)) if _PART_DIR.fullmatch(n)]
    except OSError:
        return []


def _holds_a_cache(out: Path) -> bool:
    """Whether `out` is demonstrably a cache stage one wrote, or the skeleton a refused or killed first run leaves."""
    return _ours(manifest_path(out), _MANIFEST_KEYS) or any(
        _ours(d / F.PROGRESS, _PROGRESS_KEYS) or _ours(d / F.RESOLVED_CONFIG, _CONFIG_KEYS) for d in _part_dirs(out)
    ) or _is_skeleton(out)


def _is_skeleton(out: Path) -> bool:
    """Only what stage one leaves before (or without) any record (the root's safetensors files: a damaged part's
    folder deleted, as its refusal advises, before the manifest was written)."""
    def only(folder: Path, ok) -> bool:
        try:
            with os.scandir(folder) as it:
                return all(ok(e) for e in it)
        except OSError:
            return False

    def tmp_file(e) -> bool:
        return e.is_file(follow_symlinks=False) and e.name.endswith(F.TMP_SUFFIX)

    def file_like(pattern: re.Pattern, check=lambda _path: True):
        return lambda f: tmp_file(f) or f.is_file(follow_symlinks=False) and pattern.fullmatch(f.name) is not None \
            and check(Path(f.path))

    folders = {F.SHARDS_DIR: file_like(_SHARD, _is_our_shard), LOCKS_DIR: file_like(_PART_LOCK),
               F.PARTS_DIR: lambda p: p.is_dir(follow_symlinks=False) and _PART_DIR.fullmatch(p.name) is not None
               and only(Path(p.path), tmp_file)}

    def root_entry(e) -> bool:
        if e.name in (F.NEGATIVE, F.FEATURE_PROJECTION):
            return e.is_file(follow_symlinks=False) and _is_safetensors(Path(e.path))
        if e.name in folders and e.is_dir(follow_symlinks=False):
            return only(Path(e.path), folders[e.name])
        return tmp_file(e)

    return only(out, root_entry)


def _is_our_shard(path: Path) -> bool:
    """A tar whose first member is `<sample key>.safetensors` or `.json` (its ustar header: the name, then the magic)."""
    head = read_head(path, 512)
    name = head[:100].split(b"\0", 1)[0].decode("ascii", "replace")
    stem, _, ext = name.rpartition(".")
    if head[257:262] != b"ustar" or ext not in (F.EXT_TENSORS, F.EXT_META):
        return False
    try:
        F.parse_key(stem)
    except ValueError:
        return False
    return True


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then that many bytes of a JSON object."""
    head = read_head(path, 8)
    size = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < size <= 1 << 20:
        return False
    try:
        return isinstance(json.loads(read_head(path, 8 + size)[8:]), dict)
    except (ValueError, RecursionError):
        return False


def check_out_dir(out: Path) -> None:
    """A new, empty, or cache directory we can write to; else one clear error."""
    refuse_foreign(out)
    try:
        (out / F.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}{F.TMP_SUFFIX}"
        probe.unlink(missing_ok=True)  # a leftover (or a link planted under the name) is replaced, never written through
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output directory {out} ({e.strerror}); choose a writable --out") from e


def clear(out: Path, part: int | None) -> None:
    """Remove cache files: all of them (part None) or one part's; a link among them is removed, never followed.
    The order keeps the folder a cache at every instant (and after a kill): the manifest first (it must never
    outlive its shards), each part's progress record last of its part."""
    _remove(manifest_path(out))
    if part is None:
        for name in (F.SHARDS_DIR, OFFLOAD_DIR, F.NEGATIVE, F.FEATURE_PROJECTION):
            _remove(out / name)
        for d in _part_dirs(out):
            _remove_part(d)
        _remove(out / F.PARTS_DIR)
        (out / F.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        return
    for f in (out / F.SHARDS_DIR).glob(f"part-{part:05d}-*"):
        _remove(f)
    _remove_part(out / F.PARTS_DIR / F.part_dirname(part))


def _remove_part(d: Path) -> None:
    """A part's folder, its progress record (the proof that the folder is ours) and resolved config last."""
    if not d.is_dir() or d.is_symlink():
        _remove(d)
        return
    last = [F.RESOLVED_CONFIG, F.PROGRESS]
    for name in [n for n in sorted(os.listdir(d)) if n not in last] + last:
        _remove(d / name)
    _remove(d)


def _remove(path: Path) -> None:
    """Delete `path` (rmtree unlinks links, never follows them); what vanished meanwhile is fine, else a UserError."""
    def onerror(_func, where, exc_info):
        if not isinstance(exc_info[1], FileNotFoundError):
            raise _cannot_remove(exc_info[1], where) from exc_info[1]

    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, onerror=onerror)
        else:
            path.unlink()
    except FileNotFoundError:
        pass  # gone meanwhile (or never there)
    except OSError as e:
        raise _cannot_remove(e, e.filename or path) from e


def _cannot_remove(e: BaseException, where) -> UserError:
    why = getattr(e, "strerror", None) or e
    return UserError(f"--overwrite cannot remove {where} ({why}); remove it by hand (or make it writable) and rerun")


def drop_orphans(out: Path, prog: PartProgress, owns_root: bool) -> None:
    """Delete what a crash of this part left half done; the root's temporary files only when it `owns_root`."""
    listed = {s.path for s in prog.shards}
    for f in (out / F.SHARDS_DIR).glob(f"part-{prog.part:05d}-*"):
        if f"{F.SHARDS_DIR}/{f.name}" not in listed:
            f.unlink()
    part_dir = out / F.PARTS_DIR / F.part_dirname(prog.part)
    stale = [*part_dir.glob(f"*{F.TMP_SUFFIX}"), *(part_dir / F.PROMPTS_ZARR).rglob("*.partial")]
    if owns_root:
        stale += [*out.glob(f"{F.MANIFEST}.*{F.TMP_SUFFIX}"), *out.glob(f"{F.NEGATIVE}.*{F.TMP_SUFFIX}")]
    for f in stale:
        f.unlink(missing_ok=True)


def forget_lost_shards(out: Path, prog: PartProgress) -> None:
    """Forget the shards this part lists that are gone or resized (deleted to be rebuilt) and their blocks."""
    lost = [s for s in prog.shards
            if not (out / s.path).is_file() or (out / s.path).stat().st_size != s.bytes]
    if not lost:
        return
    blocks = {b for s in lost for b in s.blocks}
    more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
    print0(f"part {prog.part}: shard {lost[0].path}{more} missing or damaged; recomputing {len(blocks)} block(s)")
    manifest_path(out).unlink(missing_ok=True)  # it lists them; rewritten once every part is complete again
    prog.shards = [s for s in prog.shards if s not in lost]
    prog.done_blocks = sorted(set(prog.done_blocks) - blocks)
    prog.complete = False
    prog.save(out)


def next_shard_index(prog: PartProgress) -> int:
    """One past the highest shard number of the part (not the count: a recomputed shard gets a new name)."""
    return 1 + max((int(Path(s.path).stem.rsplit("-", 1)[1]) for s in prog.shards), default=-1)


@dataclass(frozen=True)
class Writes:
    """What the cache in --out still has to write, every part of it (they all write into --out)."""

    shards: int  # bytes of the shards still to come
    store: int  # bytes of the prompt stores (a part not encoded yet: its embeddings at their text's bound)
    samples: int
    recorded: int  # steps each trajectory records
    steps: int

    @property
    def total(self) -> int:
        return self.shards + self.store

    def words(self) -> str:
        return f"{self.samples} samples, {human(self.shards)} of shards + {human(self.store)} of prompt store"


def still_to_write(out: Path, header: CacheHeader, texts: list[str], num_parts: int, batch_size: int,
                   samples_per_shard: int, cleared: Collection[int] = ()) -> Writes:
    """The bytes the `num_parts` parts of the cache of `texts` still write into `out`: a part's finished blocks
    (its progress record's) are counted as written, but for the parts in `cleared` (--overwrite's, not cleared
    yet: a dry run's count)."""
    recorded, per_sample, latent = len(recorded_steps(header)), sample_disk_bytes(header), latent_bytes(header)
    records = {part: PartProgress.load(out, part) for part in list_parts(out) if part not in cleared}
    shards = store = samples = 0
    for part in range(num_parts):
        rows, prog = texts[part::num_parts], records.get(part)
        blocks = part_blocks(len(rows) * header.seeds_per_prompt, prog.batch_size if prog else batch_size)
        done = set(prog.done_blocks) if prog is not None else set()
        todo = [n for i, n in enumerate(blocks) if i not in done]
        shards += shard_bytes([n * recorded for n in todo], samples_per_shard, per_sample)
        if prog is None or not prog.encoded:
            tokens = sum(embed_tokens_bound(t, header) for t in rows) / max(len(rows), 1)
            store += round(len(rows) * prompt_bytes(header, tokens))
        else:
            store += sum(todo) * latent  # the final latents still to come
        samples += sum(todo) * recorded
    return Writes(shards, store, samples, recorded, int(header.steps))


def listed_shard_bytes(out: Path, parts: list[int] | None = None) -> int:
    """Bytes of the shards the progress records of `out` list (of `parts`, default every part): what is written."""
    return sum(s.bytes for part in (list_parts(out) if parts is None else parts)
               if (prog := PartProgress.load(out, part)) is not None for s in prog.shards)


def disk_refusal(out, free: int, need: int, what: str, w: Writes) -> UserError:
    """The one line of a cache that does not fit the free space of --out's filesystem."""
    return UserError(f"--out {out} has {human(free)} free, and this cache would write {human(need)} more ({what}); "
                     f"free space, record fewer steps per trajectory with --record-steps N (now {w.recorded} of "
                     f"{w.steps}; each step costs ~{human(w.shards / max(w.recorded, 1))} here), or pass another --out")


def check_free(out: Path, header: CacheHeader, texts: list[str], num_parts: int, batch_size: int,
               samples_per_shard: int, *, cleared: Collection[int] = (), freed: int = 0, quiet: bool = False) -> dict:
    """What the cache still writes into --out (all its parts: embeddings at their text's bound) beside the free
    space of its filesystem (measured at --out, or its nearest existing parent), printed unless `quiet`; a UserError
    (one line) when it exceeds it. `freed`: bytes --overwrite would delete first (a dry run's count)."""
    w = still_to_write(out, header, texts, num_parts, batch_size, samples_per_shard, cleared)
    free, where = free_space(out)
    free += freed
    what = f"{w.words()}" + (f"; every one of the {num_parts} parts writes into --out" if num_parts > 1 else "")
    if w.total and not quiet:
        print0(f"projected: {human(w.total)} more to write ({what}); {human(free)} free at {where}")
    if w.total > free:
        raise disk_refusal(out, free, w.total, what, w)
    return {"bytes_to_write": w.total, "samples": w.samples, "shard_bytes": w.shards, "store_bytes": w.store,
            "free_bytes": free, "measured_at": str(where)}
