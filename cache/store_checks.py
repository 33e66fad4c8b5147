"""The checks of the parts' prompt stores against their manifest and of their rows, for readers and `cache verify`
(docs/architecture.md, "The cache")."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .cache_error import CacheError, UnsafeFileError
from .format import (
    MANIFEST, TOKENS_PER_FILE, Z_ATTR_TORCH_DTYPE, Z_EMBEDS, Z_PROMPT_IDX, Z_SEQ_LENS, Z_TEXT, Z_TOKEN_START,
    part_prompts, storage_numpy_dtype,
)
from .prompt_store import (
    EMBEDS_CRC32C, REBUILD, PartRows, damage, open_prompt_store, prompt_store_path, store_relpath,
)
from .records import Manifest
from .safe_open import open_fd
from .schema import recorded_steps, trajectory_fields

# The fewest bytes a sample takes in its shard: its two tar members, each behind a 512-byte header.
MIN_SAMPLE_BYTES = 1024


def count_problem(cache_dir: str | os.PathLike, m: Manifest) -> str | None:
    """Why the manifest's samples (its prompts x seeds x recorded steps, or those its shard records list, whichever
    is more) could not lie in its shards as they are on disk, at MIN_SAMPLE_BYTES each; None when they could. Every
    reader (`cache info`, `cache verify`, `open_caches`: stage two and eval) checks it before it allocates anything
    per prompt or per sample, as training's count of the samples it indexed (`reader.check_complete`) cannot: a
    manifest edited to claim 10^8 prompts costs a refusal, not gigabytes."""
    expected = m.prompts * m.seeds_per_prompt * len(recorded_steps(m))
    listed, held = sum(r.samples for r in m.shards), 0
    for rec in m.shards:
        try:
            fd = open_fd(cache_dir, rec.path)
        except FileNotFoundError:
            continue
        try:
            held += min(rec.bytes, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    if max(expected, listed) * MIN_SAMPLE_BYTES <= held:
        return None
    return (f"{Path(cache_dir) / MANIFEST}: its {m.prompts:,} prompts x {m.seeds_per_prompt} seed(s) x "
            f"{len(recorded_steps(m))} recorded step(s) make {expected:,} samples ({listed:,} listed), more than the "
            f"{held:,} bytes of its shards on disk could hold ({MIN_SAMPLE_BYTES} a sample at least): it was not "
            f"written for these files; rerun the same `wandistiller teacher-cache` command: it rewrites {MANIFEST} "
            "from the parts' progress records (or restore the manifest)")


def prompt_row_problems(cache_dir: str | os.PathLike, num_parts: int, prompts: int, checksums: bool = False,
                        progress: bool = False) -> list[str]:
    """Every row a reader relies on that is missing or wrong in the parts' stores (empty = sound): a store unreadable,
    rows never written and rows holding another prompt; with `checksums` every byte of every row read and checked
    (`cache verify`)."""
    problems = []
    for part in range(num_parts):
        rel, want = store_relpath(part), part_prompts(part, prompts, num_parts)
        try:
            rows = PartRows(cache_dir, part, num_parts, whole_files=True)  # read in row order, a file at a time
            seq, idx = rows.seq_lens, rows.g[Z_PROMPT_IDX][:]
            if checksums:
                rows.g[Z_TEXT][:], rows.crcs, rows.token_start, rows._latents  # zarr checks each chunk's crc32c
        except UnsafeFileError:
            raise  # a link or a FIFO in the store: refused whole
        except Exception as e:  # a missing or unreadable store, whatever zarr raises for it (said in our words)
            problems.append(f"{rel}: unreadable: its arrays {damage(e)}")
            continue
        if len(seq) != len(want):
            problems.append(f"{rel}: {len(seq)} rows, expected {len(want)}")
            continue
        problems += [f"{rel}: row {r} (prompt {want[r]}) was never written" for r in np.flatnonzero(seq < 0)]
        problems += [f"{rel}: row {r} holds prompt_idx {idx[r]}, expected {want[r]}"
                     for r in np.flatnonzero(idx != np.asarray(want))]
        if not checksums:
            continue
        for r in tqdm(range(len(want)), desc=f"verify {rel}", unit="row", disable=not progress):
            if seq[r] >= 0:
                problems += rows.problems(r, rel, want[r])
    return problems


def check_prompt_rows(cache_dir: str | os.PathLike, num_parts: int, prompts: int) -> None:
    """CacheError naming the first problem of `prompt_row_problems`: training must not discover a missing row
    thousands of steps in."""
    if problems := prompt_row_problems(cache_dir, num_parts, prompts):
        more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CacheError(f"prompt store of {cache_dir}: {problems[0]}{more}, yet the part is marked complete (the "
                         f"store was damaged); {REBUILD}")


def store_problem(cache_dir: str | os.PathLike, manifest: Manifest) -> str | None:
    """Why a part's prompt store is not what the manifest says it holds (an array of another shape, dtype or chunk,
    or one that does not open), or None. Metadata only: every reader checks it before reading a row, so that no
    edited shape makes one allocate terabytes (a chunk no larger than its array or file), nor a dtype misread."""
    m, dtype = manifest, manifest.dtype
    for part in range(m.num_parts):
        rows = len(part_prompts(part, m.prompts, m.num_parts))
        want = {Z_PROMPT_IDX: ((rows,), "int64"), Z_SEQ_LENS: ((rows,), "int32"), Z_TOKEN_START: ((rows,), "int64"),
                EMBEDS_CRC32C: ((rows,), "int64"), Z_TEXT: ((rows,), "string"),
                Z_EMBEDS: ((max(1, rows * m.max_sequence_length), m.text_dim), storage_numpy_dtype(dtype))} | {
                f.name: ((rows, m.seeds_per_prompt, *f.shape(m)), f.dtype) for f in trajectory_fields(m)}
        where = f"prompt store {Path(cache_dir) / store_relpath(part)}"
        try:
            g = open_prompt_store(prompt_store_path(cache_dir, part))
            for name, (shape, np_dtype) in want.items():
                try:
                    arr = g[name]
                except KeyError:
                    return f"{where} lacks its {name.replace('_', ' ')} array ({name}); {REBUILD}"
                blocks = [tuple(arr.chunks), *([tuple(arr.shards)] if arr.shards else [])]
                found = arr.metadata.to_dict()["data_type"]  # (as its zarr.json names it: "int64", "string")
                if (tuple(arr.shape) != shape or found != np_dtype
                        or any(c > max(h, TOKENS_PER_FILE) for b in blocks for c, h in zip(b, arr.shape))):
                    return (f"{where}: {name} is {found} {list(arr.shape)} in chunks of {list(arr.chunks)}, its "
                            f"manifest makes it {np_dtype} {list(shape)}; {REBUILD}")
            if (torch_dtype := g[Z_EMBEDS].attrs.get(Z_ATTR_TORCH_DTYPE)) != dtype:
                return f"{where}: {Z_EMBEDS} holds {torch_dtype!r} values, its manifest says {dtype}; {REBUILD}"
        except UnsafeFileError:
            raise
        except Exception as e:  # a missing store or array, whatever zarr raises for it (said in our words)
            return f"{where} does not open: its arrays {damage(e)}; {REBUILD}"
    return None
