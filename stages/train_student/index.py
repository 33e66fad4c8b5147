"""Stage two's data set: the caches checked and indexed once before training (the work split over the ranks,
the results summed, so every rank refuses a corrupt cache alike), and the train / held-out split."""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cache import format as F
from cache.cache_error import CacheError
from cache.format import prompt_location
from cache.manifest import negative_problem
from cache.prompt_store import REBUILD, ROW_UNREADABLE, PartRows, store_relpath
from cache.reader import (
    C_CACHE, C_PROMPT, C_SEED, C_STEP, SHARD_OK, CacheIndex, CacheInfo, ShardError, check_complete, empty_table,
    fill_table, sample_code, scan_shard, shard_list, shard_problem,
)
from cache.store_checks import check_prompt_rows
from pipeline.errors import UserError
from pipeline.runtime import DistEnv

from .comm import all_reduce_numpy

log = logging.getLogger(__name__)

_SCAN_THREADS = 4  # checksumming releases the GIL: a few shards at once per rank keep the disk busy


def build_index(caches: list[CacheInfo], env: DistEnv, device: torch.device, check: str) -> CacheIndex:
    """Check every shard against the manifest and index its members; CacheError naming the first bad shard."""
    shards = shard_list(caches)
    table = empty_table(caches)
    codes = np.zeros(len(shards), dtype=np.int64)
    details: dict[int, str] = {}

    def scan(sid: int):
        ci, cache_dir, rec, first = shards[sid]
        try:
            fill_table(table, sid, ci, first, scan_shard(cache_dir, rec, checksum=check == "checksum"))
        except ShardError as e:
            codes[sid] = e.code
            details[sid] = str(e)

    with ThreadPoolExecutor(max_workers=_SCAN_THREADS) as pool:
        list(pool.map(scan, range(env.rank, len(shards), env.world_size)))  # this rank's share
    codes = all_reduce_numpy(codes, device)
    bad = np.flatnonzero(codes != SHARD_OK)
    if len(bad):
        sid = int(bad[0])
        _, cache_dir, rec, _ = shards[sid]
        more = f" ({len(bad) - 1} more shard(s) also fail)" if len(bad) > 1 else ""
        err = CacheError(details.get(sid, shard_problem(cache_dir, rec, int(codes[sid]))) + more)
        err.all_ranks = True  # every rank raises it: rank 0 alone prints it
        raise err
    table = all_reduce_numpy(table, device)  # each row was filled by exactly one rank, zeros elsewhere
    try:  # every rank holds the whole table now and finds the same problem: rank 0 alone prints it
        for ci, c in enumerate(caches):
            check_complete(c, ci, table, shards)
            check_prompt_rows(c.path, int(c.manifest.num_parts), int(c.manifest.prompts))
            if problem := negative_problem(c.path, c.manifest):
                raise CacheError(problem)
        # What training reads of the prompt stores, each rank a share of the rows: every chunk of a prompt's real
        # tokens present, and with --verify checksum the tokens matching their crc32c and the final latents theirs.
        for c in caches:
            parts, prompts = int(c.manifest.num_parts), int(c.manifest.prompts)
            flags = all_reduce_numpy(row_check_flags(c.path, parts, prompts, env.rank, env.world_size,
                                                     checksums=check == "checksum"), device)
            if problem := row_flags_problem(c.path, parts, flags, checksums=check == "checksum"):
                raise CacheError(problem)
    except CacheError as err:
        err.all_ranks = True
        raise
    return CacheIndex(caches, table)


def row_check_flags(cache_dir: str | os.PathLike, num_parts: int, prompts: int, rank: int = 0, world: int = 1,
                    checksums: bool = True) -> np.ndarray:
    """int64 [prompts]: for each prompt this rank checks (0 for the others), the ROW_* bit of the first problem of
    what stage two reads of its row (`PartRows.check`). A rank checks whole files of the stores (file f of part P
    goes to rank (f * num_parts + P) % world), so summed over the ranks every prompt is checked once."""
    flags = np.zeros(prompts, dtype=np.int64)
    parts: dict[int, PartRows] = {}
    for p in range(prompts):
        part, row = prompt_location(p, num_parts)
        if (row // F.ROWS_PER_FILE * num_parts + part) % world != rank:
            continue
        try:  # nothing escapes on one rank alone: the others would wait for it in the sum
            if part not in parts:
                parts[part] = PartRows(cache_dir, part, num_parts, whole_files=True)
            rows = parts[part]
            if row < len(rows.seq_lens) and rows.seq_lens[row] >= 0:
                err = rows.check(row, checksums)
                flags[p] = 0 if err is None else err.bit
        except Exception:  # whatever zarr raises for a store it cannot read: named by `row_flags_problem`
            flags[p] = ROW_UNREADABLE
    return flags


def row_flags_problem(cache_dir: str | os.PathLike, num_parts: int, flags: np.ndarray,
                      checksums: bool = True) -> str | None:
    """The one-line message for `row_check_flags` summed over the ranks: its first bad prompt, checked again for the
    words (every rank finds the same), the count of the others and the fix; None if every row is sound."""
    bad = np.flatnonzero(flags)
    if not len(bad):
        return None
    p = int(bad[0])
    part, row = prompt_location(p, num_parts)
    try:
        err = PartRows(cache_dir, part, num_parts).check(row, checksums)
        detail = err.detail if err is not None else f"row {row} (prompt {p}) failed its check"
    except Exception as e:  # whatever zarr raises for a store it cannot read
        detail = f"row {row} (prompt {p}) does not read ({type(e).__name__}: {e})"
    more = f" ({len(bad) - 1} more prompt(s) also fail)" if len(bad) > 1 else ""
    return (f"prompt store {Path(cache_dir) / store_relpath(part)}: {detail}{more}; {REBUILD} (`wandistiller cache "
            "verify` lists every problem)")


def holdout_set(prompts: np.ndarray, n: int) -> np.ndarray:
    """`n` prompt indices chosen by a stable hash: the same prompts whatever the seed, world size or order."""
    uniq = np.unique(prompts)
    if n >= len(uniq):
        raise UserError(f"--holdout-prompts {n} leaves no prompt to train on: the cache has {len(uniq)} prompts")
    order = sorted(uniq.tolist(), key=lambda p: hashlib.sha256(f"wandistiller/holdout/{p}".encode()).digest())
    return np.asarray(sorted(order[:n]), dtype=np.int64)


@dataclass(frozen=True)
class DataSplit:
    index: CacheIndex
    train_rows: np.ndarray  # index rows trained on
    heldout_rows: np.ndarray  # index rows of the held-out prompts (evaluated, never trained on)
    heldout_prompts: np.ndarray
    train_steps: tuple[int, ...]  # cached step indices used

    def digest(self) -> str:
        """Identity of the training set: a resumed run must see the very same rows."""
        codes = [sample_code(self.index.table[rows]).tobytes() for rows in (self.train_rows, self.heldout_rows)]
        return hashlib.sha256(b"".join(codes)).hexdigest()


def first_trajectories(table: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """The `rows` of the first `n` trajectories (cache, prompt, seed) in that order: what a stage one over fewer
    prompts would have cached, for a data curve (`--train-trajectories`)."""
    # each row's rank among the distinct trajectories, sorted by cache, then prompt, then seed
    uniq, rank = np.unique(table[rows][:, [C_CACHE, C_PROMPT, C_SEED]], axis=0, return_inverse=True)
    if n > len(uniq):
        raise UserError(f"--train-trajectories {n}: the caches hold {len(uniq)} trajectories to train on (after "
                        f"--holdout-prompts); give at most {len(uniq)}, or 0 for all")
    return rows[rank.reshape(-1) < n]


def split(index: CacheIndex, train_steps: tuple[int, ...] | None, holdout_prompts: int,
          train_trajectories: int = 0) -> DataSplit:
    """Rows to train on (optionally only some step indices, or the first trajectories) and the held-out prompts'
    rows."""
    steps_col = index.table[:, C_STEP]
    present = np.unique(steps_col).tolist()
    if train_steps is not None and (missing := sorted(set(train_steps) - set(present))):
        raise UserError(f"--train-steps {','.join(map(str, train_steps))}: the cache has no step "
                        f"{','.join(map(str, missing))} (it holds steps "
                        + (f"{present[0]}..{present[-1]}" if len(present) == present[-1] - present[0] + 1
                           else ",".join(map(str, present)))
                        + f" of {index.steps}); choose from those")
    use_steps = tuple(present) if train_steps is None else tuple(sorted(set(train_steps)))
    keep = np.isin(steps_col, use_steps)
    prompts = index.table[:, C_PROMPT]
    held = holdout_set(prompts, holdout_prompts) if holdout_prompts else np.zeros(0, dtype=np.int64)
    is_held = np.isin(prompts, held)
    train = np.flatnonzero(keep & ~is_held)
    if train_trajectories:
        train = first_trajectories(index.table, train, train_trajectories)
    return DataSplit(index, train, np.flatnonzero(keep & is_held), held, use_steps)


def prepare(caches: list[CacheInfo], env: DistEnv, device: torch.device, check: str,
            train_steps: tuple[int, ...] | None, holdout_prompts: int, train_trajectories: int = 0) -> DataSplit:
    """Check and index the caches (opened by `cache.reader.open_caches`), then split them into training and
    held-out rows."""
    index = build_index(caches, env, device, check)
    if index.duplicates:
        log.info(f"{index.duplicates} sample(s) appear in more than one cache; each is trained on once")
    data = split(index, train_steps, holdout_prompts, train_trajectories)
    if len(data.train_rows) == 0:
        raise UserError(f"no sample left to train on in {', '.join(str(c.path) for c in caches)} after --train-steps / "
                        "--holdout-prompts")
    return data
