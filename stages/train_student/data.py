"""Stage two's training items, loader and batches: a cached sample with its prompt's embedding, read by row in the
order the batch sampler (`epoch.RankBatches`) gives; the workers only fetch (each with its own reader and LRU); a
micro-batch holds lists of the samples' own tensors, laid out where they are used."""

from __future__ import annotations

import zlib
from functools import partial

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from cache import format as F
from cache.cache_error import CacheError
from cache.prompt_store import ROW_LATENT_UNWRITTEN, EmbeddingCache, PartRows, RowCache
from cache.reader import C_CACHE, C_PROMPT, C_SEED, C_STEP, CacheIndex, SampleReader, sample_code
from pipeline import signals
from pipeline.torch_private import shared_bytes

from .epoch import RankBatches

# The derived field a SegmentDataset adds to each item: the average velocity from the sample's state to the end of
# its segment (not a cache field: it is computed from two cached states).
SEGMENT_VELOCITY = "segment_velocity"
CONDITION_BYTES = 1 << 30  # what one reader process keeps of image-to-video conditions (an LRU of prompts) at most


class SampleDataset(Dataset):
    """Items are (row, weight) pairs; reads the sample's `fields` (cache/schema.py names, checked against the schema by
    the reader) and its prompt's real tokens (an LRU of `embedding_cache_size` prompts per process). Readers are
    opened on first use, so each DataLoader worker opens its own after the fork. On an image-to-video cache each item
    carries its trajectory's condition latent too (under F.T_CONDITION, from the prompt store, an LRU of prompts)."""

    def __init__(self, index: CacheIndex, embedding_cache_size: int, fields: tuple[str, ...] = (F.T_X_T, F.T_TARGET)):
        self.index = index
        self.embedding_cache_size = embedding_cache_size
        self.fields = tuple(dict.fromkeys((F.T_X_T, *fields)))
        self.max_len = int(index.manifest.max_sequence_length)
        self._reader: SampleReader | None = None
        self._embeds: list[EmbeddingCache] | None = None
        self._conditions: list[RowCache] | None = None

    def _open(self) -> None:
        self._reader = SampleReader(self.index)
        self._embeds = [EmbeddingCache(c.path, int(c.manifest.num_parts), self.embedding_cache_size)
                        for c in self.index.caches]
        m = self.index.manifest
        if m.condition != F.NO_CONDITION:  # every seed of a prompt per entry, float32
            per_prompt = 4 * int(m.seeds_per_prompt) * int(np.prod(m.condition_shape))
            size = max(1, min(self.embedding_cache_size, CONDITION_BYTES // per_prompt))
            self._conditions = [RowCache(c.path, int(c.manifest.num_parts), size, partial(_latents, F.Z_CONDITION))
                                for c in self.index.caches]

    def __getstate__(self) -> dict:
        """Pickled (a worker process spawned, not forked): readers and stores are the process's own."""
        return {k: None if k in ("_reader", "_embeds", "_finals", "_conditions") else v
                for k, v in self.__dict__.items()}

    def __getitem__(self, item: tuple[int, float]) -> dict:
        if self._reader is None:
            self._open()
        row, weight = item
        tensors, meta = self._reader.read(row)
        r = self.index.table[row]
        cache = self.index.caches[int(r[C_CACHE])]
        # the real tokens only (an A14B embedding is 4 MiB padded, ~0.5 MiB trimmed): `padded_context` pads
        # them to max_sequence_length on the device
        try:
            context, padded = self._embeds[int(r[C_CACHE])][int(r[C_PROMPT])]
        except (ValueError, FileNotFoundError, KeyError) as e:
            if isinstance(e, CacheError):
                raise
            raise CacheError(f"prompt embedding of prompt {int(r[C_PROMPT])} unreadable in {cache.path}: {e}") from e
        if padded != self.max_len:
            raise CacheError(f"prompt store of {cache.path} pads to {padded} tokens, the manifest says "
                             f"max_sequence_length {self.max_len}")
        fields = {name: tensors[name] for name in self.fields}
        if self._conditions is not None:
            fields[F.T_CONDITION] = _seed(self._conditions[int(r[C_CACHE])][int(r[C_PROMPT])], int(r[C_SEED]),
                                          F.Z_CONDITION)
        return {"fields": fields, "context": context,
                "timestep": float(meta[F.M_TIMESTEP]), "sigma": float(meta[F.M_SIGMA]), "step": int(meta[F.M_STEP]),
                "weight": float(weight), "key": self.index.key(row), "max_len": self.max_len}

    def __len__(self) -> int:
        return len(self.index)


def later_state_rows(index: CacheIndex, rows: np.ndarray, end_step: np.ndarray) -> np.ndarray:
    """For each of `rows`, the index row of the same trajectory (prompt, seed) at step `end_step[step]`, or -1 where
    that is the cache's step count (the trajectory's final latent, in the prompt store, not a shard). Rows of one
    trajectory are written in one block, so a pair usually lies in one shard. KeyError if a needed state is not
    indexed (`check_complete` guarantees every recorded step is, for a complete cache)."""
    table = index.table
    steps = table[rows, C_STEP]
    ends = np.asarray(end_step, dtype=np.int64)[steps]
    out = np.full(len(rows), -1, dtype=np.int64)
    inner = ends < index.steps
    if inner.any():
        codes = sample_code(table)
        order = np.argsort(codes, kind="stable")
        want = sample_code(table[rows[inner]]) - steps[inner] + ends[inner]
        found = order[np.searchsorted(codes, want, sorter=order).clip(0, len(codes) - 1)]
        bad = codes[found] != want
        if bad.any():
            r = table[rows[inner][np.argmax(bad)]]
            raise KeyError(f"sample {F.sample_key(int(r[C_PROMPT]), int(r[C_SEED]), int(ends[inner][np.argmax(bad)]))} "
                           "is not in the cache's index")
        out[inner] = found
    return out


def _latents(name: str, rows: PartRows, row: int) -> tuple[PartRows, int, torch.Tensor]:
    """Every seed's per-trajectory array `name` of a prompt's row (final latents, condition), float32 [seeds, ...],
    checked against its crc32c."""
    return rows, row, torch.from_numpy(np.ascontiguousarray(rows.latents(name, row), dtype=np.float32))


def _seed(entry: tuple[PartRows, int, torch.Tensor], seed: int, name: str) -> torch.Tensor:
    """One seed's array of a `_latents` entry; RowError where that trajectory's was never written (zeros)."""
    rows, prow, values = entry
    if not bool(values[seed].any()):
        raise rows.error(ROW_LATENT_UNWRITTEN, f"{name} of {rows.where(prow)} seed {seed} were never written")
    return values[seed]


class SegmentDataset(SampleDataset):
    """A SampleDataset whose items are pairs of states of one trajectory: the sample's x_t at step k and the state at
    `end_step[k]` (a later cached step, or the final latent), with their average velocity under SEGMENT_VELOCITY.
    Every row's partner is looked up once, here: a pair costs one more `pread` (usually in the same shard)."""

    def __init__(self, index: CacheIndex, embedding_cache_size: int, fields: tuple[str, ...], end_step):
        super().__init__(index, embedding_cache_size, fields)
        self.end_step = np.asarray(end_step, dtype=np.int64)
        self.sigmas = [float(v) for v in index.manifest.sigmas] + [0.0]  # the final latent is at sigma 0
        try:
            self.end_rows = later_state_rows(index, np.arange(len(index)), self.end_step)
        except KeyError as e:
            raise CacheError(f"a segment end is missing from the cache: {e.args[0]}; run `wandistiller cache verify`")
        self._finals: list[RowCache] | None = None

    def _open(self) -> None:
        super()._open()
        self._finals = [RowCache(c.path, int(c.manifest.num_parts), self.embedding_cache_size,
                                 partial(_latents, F.Z_FINAL_LATENTS)) for c in self.index.caches]

    def __getitem__(self, item: tuple[int, float]) -> dict:
        out = super().__getitem__(item)
        row = item[0]
        r = self.index.table[row]
        end, end_row, seed = int(self.end_step[int(r[C_STEP])]), int(self.end_rows[row]), int(r[C_SEED])
        if end_row >= 0:
            x_end = self._reader.read_tensors(end_row)[F.T_X_T]
        else:  # the trajectory's final latent [C, F, H, W] (an LRU of prompts), unless it was never written
            x_end = _seed(self._finals[int(r[C_CACHE])][int(r[C_PROMPT])], seed, F.Z_FINAL_LATENTS)
        # in float32, the constant velocity that carries x_t at its sigma to x_end at sigma_end along a straight line,
        # i.e. what one Euler step of that size must predict
        x_k = out["fields"][F.T_X_T]
        out["fields"][SEGMENT_VELOCITY] = (x_end.float() - x_k.float()) / (self.sigmas[end] - out["sigma"])
        return out


def make_loader(dataset: SampleDataset, sampler: RankBatches, num_workers: int, pin: bool) -> DataLoader:
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      pin_memory=pin, prefetch_factor=4 if num_workers else None,
                      worker_init_fn=signals.worker_ignores_sigterm if num_workers else None)


def _in_shared_memory(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, copied one after the other into one buffer in shared memory (views of it, same shapes)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = np.cumsum([0] + [-(-n // 64) * 64 for n in sizes])  # (each at a multiple of 64 bytes: any dtype's)
    buf = shared_bytes(int(starts[-1]))  # (shared: the batch reaches training uncopied)
    out, flat = [], buf.numpy()
    for t, n, at in zip(tensors, sizes, starts.tolist()):
        # (with numpy, never torch: torch's intra-op threads wait on each other on a busy machine, docs/architecture.md
        # "Batches"; as flat uint8 memory, whatever the dtype)
        np.copyto(flat[at:at + n], t.contiguous().reshape(-1).view(torch.uint8).numpy())
        out.append(buf[at:at + n].view(t.dtype).view(t.shape))
    return out


def collate(items: list[dict]) -> dict:
    """A micro-batch: every field the dataset read and the prompt embeddings, as lists of the samples' tensors
    (stacked and padded once, on the device, by `to_device` / `padded_context`; a loader worker's in one buffer of
    shared memory), and the per-sample metadata as tensors."""
    names = list(items[0]["fields"])
    tensors = [i["fields"][n] for n in names for i in items] + [i["context"] for i in items]
    if get_worker_info() is not None:
        tensors = _in_shared_memory(tensors)
    b = len(items)
    return {
        "fields": {n: tensors[k * b:(k + 1) * b] for k, n in enumerate(names)},
        "context": tensors[len(names) * b:],
        "max_len": items[0]["max_len"],
        "timestep": torch.tensor([i["timestep"] for i in items], dtype=torch.float32),
        "sigma": torch.tensor([i["sigma"] for i in items], dtype=torch.float32),
        "step": torch.tensor([i["step"] for i in items], dtype=torch.int64),
        "weight": torch.tensor([i["weight"] for i in items], dtype=torch.float32),
        "keys": [i["key"] for i in items if i["weight"] > 0],
        "sample": torch.tensor([zlib.crc32(i["key"].encode()) for i in items], dtype=torch.int64),  # a noise seed
    }


def to_device(tensors: list[torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A collated batch's field (a list of the samples' tensors, one shape) stacked on `device` as `dtype`: [B, ...]."""
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=dtype, device=device)
    for j, t in enumerate(tensors):
        out[j].copy_(t, non_blocking=True)
    return out


def padded_context(batch: dict, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A collated batch's prompt embeddings on `device` as the teacher saw them: [B, max_len, D], each sample's
    real tokens, then zeros (as WanPipeline pads them)."""
    ctx = batch["context"]
    out = torch.zeros((len(ctx), batch["max_len"], ctx[0].shape[-1]), dtype=dtype, device=device)
    for j, c in enumerate(ctx):
        out[j, :c.shape[0]].copy_(c, non_blocking=True)
    return out
