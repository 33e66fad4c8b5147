"""What a cache costs on disk, from its settings: bytes per sample, per prompt, and for a prompt count.

The one place for the arithmetic that `cache info`, `wandistiller plan` and teacher-cache's disk check share, exact
for what stage one writes (docs/architecture.md, "The cache", Size)."""

from __future__ import annotations

import json
import math
import os
import tarfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as st_save

from . import format as F
from .cache_error import CacheError, UnsafeFileError
from .part_progress import PartProgress
from .records import CacheHeader, Manifest
from .prompt_store import open_prompt_store, prompt_store_path
from .schema import SAMPLE_FIELDS, TRAJECTORY_FIELDS, recorded_steps, sample_fields, trajectory_fields
from .store_checks import count_problem, store_problem

_CRC = 4  # bytes of the crc32c that ends every prompt-store chunk
# The longest metadata a sample can carry (key digits at their limits, floats at their longest repr): its
# member takes one tar block either way, but the arithmetic does not rely on it.
_META_WORST = {F.M_PROMPT_IDX: 99_999_999, F.M_SEED_IDX: 99, F.M_STEP: 999, F.M_TIMESTEP: -1.2345678901234567e-300,
               F.M_SIGMA: -1.2345678901234567e-300, F.M_EXPERT: 2, F.M_GUIDANCE: -1.2345678901234567e-300}


def _tar_member(size: int) -> int:
    return tarfile.BLOCKSIZE + size + (-size % tarfile.BLOCKSIZE)


def sample_disk_bytes(settings: CacheHeader) -> int:
    """Bytes one sample takes in a shard of the cache `settings` (a manifest, or stage one's header) describe."""
    tensors = {f.name: torch.empty(f.shape(settings), dtype=F.DTYPES[f.dtype_name(settings)])
               for f in (SAMPLE_FIELDS[name] for name in sample_fields(settings))}
    meta = json.dumps(_META_WORST, sort_keys=True).encode()
    # safetensors' header depends on names, dtypes and shapes only: one save of uninitialised tensors gives it
    return _tar_member(len(meta)) + _tar_member(len(st_save(tensors)))


def shard_bytes(block_samples: Iterable[int], samples_per_shard: int, per_sample: int) -> int:
    """Bytes of the shards one part writes for blocks of `block_samples` samples each, in that order: a shard
    closes at the first block boundary past `samples_per_shard` samples (and after the last block)."""
    total, open_samples = 0, 0
    for n in block_samples:
        open_samples += int(n)
        if open_samples >= samples_per_shard:
            total += _shard(open_samples * per_sample)
            open_samples = 0
    return total + (_shard(open_samples * per_sample) if open_samples else 0)


def _shard(members: int) -> int:
    end = members + 2 * tarfile.BLOCKSIZE
    return end + (-end % tarfile.RECORDSIZE)


def embed_tokens_bound(text: str, settings: CacheHeader) -> int:
    """Real tokens a prompt's embedding can take at most: Wan's UMT5 tokenizer (SentencePiece, byte fallback) makes a
    token of at least one byte of UTF-8 text, plus the leading word marker and the end-of-sequence token."""
    return min(settings.max_sequence_length, len(text.encode("utf-8")) + 2)


def _token_bytes(settings: CacheHeader) -> int:
    return settings.text_dim * F.DTYPES[settings.dtype].itemsize


def embeds_bytes(settings: CacheHeader, tokens: int) -> int:
    """Bytes of a part's `embeds` holding `tokens` real tokens: whole chunks (the last one padded), each ending in
    its crc32c, and per file its index."""
    if tokens <= 0:
        return 0
    chunks, files = math.ceil(tokens / F.EMBED_CHUNK_TOKENS), math.ceil(tokens / F.TOKENS_PER_FILE)
    return (chunks * (F.EMBED_CHUNK_TOKENS * _token_bytes(settings) + _CRC)
            + files * (16 * (F.TOKENS_PER_FILE // F.EMBED_CHUNK_TOKENS) + _CRC))


def latent_bytes(settings: CacheHeader) -> int:
    """Bytes of one float32 latent (initial noise or final latent of one seed)."""
    return math.prod(settings.latent_shape) * 4


def _trajectory_chunks(settings: CacheHeader) -> list[int]:
    """Bytes of one prompt's chunk (every seed, its crc32c) of each per-trajectory array (schema.TRAJECTORY_FIELDS)."""
    return [settings.seeds_per_prompt * math.prod(f.shape(settings)) * np.dtype(f.dtype).itemsize + _CRC
            for f in trajectory_fields(settings)]


def _latents_bytes(settings: CacheHeader, rows: int) -> int:
    """Bytes of a part's per-trajectory arrays for `rows` prompts: a chunk per prompt, and per file of ROWS_PER_FILE
    rows its index."""
    if rows <= 0:
        return 0
    per_file = min(rows, F.ROWS_PER_FILE)
    index = math.ceil(rows / per_file) * (16 * per_file + _CRC)
    return sum(rows * chunk + index for chunk in _trajectory_chunks(settings))


def prompt_bytes(settings: CacheHeader, embed_tokens: float | None = None) -> float:
    """Prompt-store bytes of one prompt whose embedding has `embed_tokens` real tokens (default: the bound,
    max_sequence_length), and its trajectories' arrays (the files' indexes and last chunk's padding left out)."""
    tokens = settings.max_sequence_length if embed_tokens is None else embed_tokens
    return tokens * (_token_bytes(settings) + _CRC / F.EMBED_CHUNK_TOKENS) + sum(_trajectory_chunks(settings))


def part_blocks(trajectories: int, batch_size: int) -> list[int]:
    """Trajectories per block of a part holding `trajectories` (stage one's blocks: batch_size at a time)."""
    full, rest = divmod(trajectories, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class CacheSize:
    """A cache's bytes, split by where they live."""

    prompts: int
    samples: int  # prompts x seeds x recorded steps
    recorded_steps: int  # per trajectory
    sample_bytes: int  # one sample in a shard
    prompt_bytes: float  # one prompt in the prompt store
    shard_bytes: int  # every shard (samples and each shard's tar end)
    store_bytes: int  # every prompt's rows and the files' indexes
    fixed_bytes: int  # manifest, negative prompt, progress, metadata (0 before a run)

    @property
    def total(self) -> int:
        return self.shard_bytes + self.store_bytes + self.fixed_bytes

    def to_dict(self) -> dict:
        return asdict(self) | {"total_bytes": self.total}


def project(settings: CacheHeader, prompts: int, num_parts: int = 1, *, batch_size: int, samples_per_shard: int,
            embed_tokens: float | None = None, fixed_bytes: int = 0) -> CacheSize:
    """The size of a cache of `prompts` prompts with these settings, written in `num_parts` parts without
    interruption (a resume closes a shard early: a few KiB more), in blocks of `batch_size` trajectories and shards
    of `samples_per_shard` samples."""
    per_sample, recorded = sample_disk_bytes(settings), len(recorded_steps(settings))
    seeds = settings.seeds_per_prompt
    tokens = settings.max_sequence_length if embed_tokens is None else embed_tokens
    shards = store = 0
    for part in range(num_parts):
        rows = len(F.part_prompts(part, prompts, num_parts))
        shards += shard_bytes([n * recorded for n in part_blocks(rows * seeds, batch_size)], samples_per_shard,
                              per_sample)
        store += embeds_bytes(settings, round(rows * tokens)) + _latents_bytes(settings, rows)
    return CacheSize(prompts, prompts * seeds * recorded, recorded, per_sample, prompt_bytes(settings, tokens), shards,
                     store, fixed_bytes)


def measured_inputs(cache_dir: str | os.PathLike, manifest: Manifest) -> dict:
    """What `project` takes from a finished cache: mean real tokens, fixed bytes, its batch and shard sizes; the
    manifest's counts and its stores' shapes checked first (as every reader's: nothing allocated per prompt that the
    files cannot back)."""
    cache_dir = Path(cache_dir)
    if problem := count_problem(cache_dir, manifest) or store_problem(cache_dir, manifest):
        raise CacheError(problem)
    tokens = rows = 0
    for part in range(manifest.num_parts):
        path = prompt_store_path(cache_dir, part)
        try:
            lens = np.asarray(open_prompt_store(path)[F.Z_SEQ_LENS][:], dtype=np.int64)
        except UnsafeFileError:
            raise
        except Exception as e:  # zarr's errors for a missing or damaged store are of many kinds
            raise CacheError(f"{path} is unreadable ({type(e).__name__}: {e}); run `wandistiller cache verify "
                             f"{cache_dir}`") from e
        lens = lens[lens >= 0]
        tokens += int(lens.sum())
        rows += len(lens)
    prog = PartProgress.load(cache_dir, 0)
    per_shard = prog.samples_per_shard if prog else max(s.samples for s in manifest.shards)
    return {"embed_tokens": tokens / max(rows, 1), "fixed_bytes": fixed_bytes(cache_dir),
            "batch_size": prog.batch_size if prog else 1, "samples_per_shard": int(per_shard)}


# Prompt-store arrays that grow with the prompts (counted by `prompt_bytes`); the rest of a store is metadata.
_PER_PROMPT_ARRAYS = (F.Z_EMBEDS, *TRAJECTORY_FIELDS)


def fixed_bytes(cache_dir: Path) -> int:
    """Bytes of a finished cache's files that are neither shards nor the chunk files of the arrays `prompt_bytes`
    counts (not listed: at a million prompts they are millions of files)."""
    total = sum(p.stat().st_size for p in cache_dir.iterdir() if p.is_file())
    for root, dirs, files in os.walk(cache_dir / F.PARTS_DIR):
        here = Path(root)
        if here.parent.name == F.PROMPTS_ZARR and here.name in _PER_PROMPT_ARRAYS:
            dirs[:] = []
            files = [f for f in files if f == "zarr.json"]
        total += sum((here / f).stat().st_size for f in files)
    return total


def human(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
