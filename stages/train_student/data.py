"""Stage two's data: the checked shard index, the train / held-out split, and per-rank loaders.

The shards are checked and indexed once before training, the work split over the ranks (each scans
every W-th shard, sha256 and member offsets in one sequential read) and the results summed across
ranks, so a corrupt cache is refused by every rank with the same message before any step runs.
Loaders read by row (`cache.reader`), in the exact order `EpochPlan` prescribes; worker processes only
fetch, so the order and the exactly-once guarantee do not depend on their number. The reads of the next items
run ahead in a few threads per process (`SampleDataset.prefetch`): what they deliver is what a read in order
would, byte for byte, errors included.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from cache import direct_io
from cache import format as F
from cache.errors import CacheError
from cache.manifest import negative_problem
from cache.prompt_store import (
    EmbeddingCache, FinalLatentCache, check_prompt_rows, prompt_store_path, row_check_flags, row_flags_problem,
)
from cache.reader import (
    C_CACHE, C_META_OFF, C_PROMPT, C_SEED, C_STEP, C_TENS_LEN, C_TENS_OFF, LANES, SHARD_OK, CacheIndex, CacheInfo,
    EpochPlan, SampleReader, ShardError, check_complete, empty_table, fill_table, later_state_rows, sample_code,
    scan_shard, shard_list, shard_problem,
)
from pipeline import signals
from pipeline.errors import UserError
from pipeline.runtime import DistEnv

from .comm import all_reduce_numpy

log = logging.getLogger(__name__)

# Threads per process that read samples and embeddings ahead of the loader (`SampleDataset.prefetch`; preadv and
# file reads release the GIL). Random 400 KB preads of A14B-sized shards on the 2-core dev VM's disk: 572 MiB/s
# with 1 read in flight, 750 with 2, 896 with 4, 1082 with 8, 1330 with 16, 1253 with 32 (one thread issuing
# reads in turn, or posix_fadvise hints, keeps ~1 in flight). But past a few threads that loader is bound by the
# CPU (the kernel's page-cache work, the GIL changing hands): one epoch of the A14B-sized bench cache (batch 8,
# depth 3, no workers, a task per read) with 2 threads: 770 samples/s, 3: 800-915, 4: 820-1010, 6: 730-880,
# 8: 750-775, 16: 600-740. With O_DIRECT reads (`direct_reads`) and a grouped order the same epoch takes 16.8 s
# with 4 threads and 16.3-18.4 with 8: the disk's rate for random ~400 KB reads.
READ_THREADS = 4
# Batches an in-process loader reads ahead beyond the one it delivers (`Lookahead`): (depth + 1) x batch items are
# in memory or in flight at most. Same bench, 4 threads: depth 2: 750-960 samples/s, 3: 820-1010, 5: 680-885.
LOOKAHEAD_BATCHES = 3
_SCAN_THREADS = 4  # hashing releases the GIL: a few shards at once per rank keep the disk busy


def build_index(caches: list[CacheInfo], env: DistEnv, device: torch.device, check: str) -> CacheIndex:
    """Check every shard against the manifest and index its members; CacheError naming the first bad shard."""
    shards = shard_list(caches)
    mine = list(range(env.rank, len(shards), env.world_size))
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
        list(pool.map(scan, mine))
    codes = all_reduce_numpy(codes, device)
    bad = np.flatnonzero(codes != SHARD_OK)
    if len(bad):
        sid = int(bad[0])
        _, cache_dir, rec, _ = shards[sid]
        more = f" ({len(bad) - 1} more shard(s) also fail)" if len(bad) > 1 else ""
        msg = details.get(sid, shard_problem(cache_dir, rec, int(codes[sid])))
        err = CacheError(msg + more)
        err.all_ranks = True  # every rank raises it: rank 0 alone prints it
        raise err
    table = all_reduce_numpy(table, device)  # each row was filled by exactly one rank, zeros elsewhere
    try:  # every rank holds the whole table now and finds the same problem: rank 0 alone prints it
        for ci, c in enumerate(caches):
            check_complete(c, ci, table, shards)
            check_prompt_rows(c.path, int(c.manifest[F.F_NUM_PARTS]), int(c.manifest[F.F_PROMPTS]))
            problem = negative_problem(c.path, c.manifest)
            if problem:
                raise CacheError(problem)
        # What training reads of the prompt stores, each rank a share of the rows: every chunk of a prompt's real
        # tokens present, and with --verify checksum the tokens matching their crc32c and the final latents theirs.
        for c in caches:
            parts, prompts = int(c.manifest[F.F_NUM_PARTS]), int(c.manifest[F.F_PROMPTS])
            flags = all_reduce_numpy(row_check_flags(c.path, parts, prompts, env.rank, env.world_size,
                                                     checksums=check == "checksum"), device)
            problem = row_flags_problem(c.path, parts, flags, checksums=check == "checksum")
            if problem:
                raise CacheError(problem)
    except CacheError as err:
        err.all_ranks = True
        raise
    return CacheIndex(caches, table)


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
        h = hashlib.sha256()
        h.update(sample_code(self.index.table[self.train_rows]).tobytes())
        h.update(sample_code(self.index.table[self.heldout_rows]).tobytes())
        return h.hexdigest()


def split(index: CacheIndex, train_steps: tuple[int, ...] | None, holdout_prompts: int) -> DataSplit:
    """Rows to train on (optionally only some step indices) and the held-out prompts' rows."""
    steps_col = index.table[:, C_STEP]
    present = sorted(set(np.unique(steps_col).tolist()))
    if train_steps is None:
        use_steps = tuple(present)
    else:
        missing = sorted(set(train_steps) - set(present))
        if missing:
            raise UserError(f"--train-steps {','.join(map(str, train_steps))}: the cache has no step "
                            f"{','.join(map(str, missing))} (it holds steps "
                            + (f"{present[0]}..{present[-1]}" if len(present) == present[-1] - present[0] + 1
                               else ",".join(map(str, present)))
                            + f" of {index.steps}); choose from those")
        use_steps = tuple(sorted(set(train_steps)))
    keep = np.isin(steps_col, use_steps)
    prompts = index.table[:, C_PROMPT]
    held = holdout_set(prompts, holdout_prompts) if holdout_prompts else np.zeros(0, dtype=np.int64)
    is_held = np.isin(prompts, held)
    return DataSplit(index, np.flatnonzero(keep & ~is_held), np.flatnonzero(keep & is_held), held, use_steps)


def direct_reads(index: CacheIndex) -> bool:
    """Whether the loader reads `index`'s caches with O_DIRECT (`cache.direct_io`): where an epoch's bytes, the
    shards and the stored prompt embeddings, exceed half of the machine's memory, so would not stay in the page
    cache from one epoch to the next."""
    nbytes = sum(int(rec[F.S_BYTES]) for _, _, rec, _ in index.shards)
    if not direct_io.wanted(nbytes):  # (the shards alone may decide it: no need to list the stores' files)
        for c in index.caches:
            for part in range(int(c.manifest[F.F_NUM_PARTS])):
                for folder, _, files in os.walk(prompt_store_path(c.path, part) / F.Z_EMBEDS):
                    nbytes += sum(os.stat(os.path.join(folder, f)).st_size for f in files)
    return direct_io.wanted(nbytes)


class SampleDataset(Dataset):
    """Items are (row, weight) pairs; reads the sample's `fields` (cache/schema.py names, checked against the
    schema by the reader) and its prompt embedding, padded as the teacher saw it.

    Embeddings come from the caches' zarr stores through a bounded LRU per process; stores are opened
    lazily, so each DataLoader worker opens its own after the fork.

    Read-ahead: `prefetch(items)` starts the items' reads in a pool of READ_THREADS threads of this process (made
    on first use, so a forked worker makes its own; ended by `end_reads`), and `__getitem__` takes their results
    (an error a read raised is raised there, at its item, as a read in order would) or reads synchronously
    what nothing read ahead. Only the calling thread touches the reader's descriptors and the LRUs: the pool's
    threads read and return (`SampleReader.submit`, `EmbeddingCache.submit`).
    """

    def __init__(self, index: CacheIndex, embedding_cache_size: int, fields: tuple[str, ...] = (F.T_X_T, F.T_TARGET)):
        self.index = index
        self.embedding_cache_size = embedding_cache_size
        self.fields = tuple(dict.fromkeys((F.T_X_T, *fields)))
        self.max_len = int(index.manifest[F.F_MAX_SEQUENCE_LENGTH])
        self.direct = direct_reads(index)  # read past the page cache (decided once, in the process that makes it)
        self._reader: SampleReader | None = None
        self._embeds: list[EmbeddingCache] | None = None
        self.hint_own_batch = True  # read a batch's items concurrently; off where a `Lookahead` reads ahead
        self._pid = os.getpid()  # the process the read-ahead state below belongs to
        self._pool: ThreadPoolExecutor | None = None
        self._pool_end: weakref.finalize | None = None  # shuts the pool down: at `end_reads`, or when collected
        self._samples = _Reads()  # row -> reads of the sample started by `prefetch`

    def _open(self) -> None:
        self._reader = SampleReader(self.index, direct=self.direct)
        self._embeds = [EmbeddingCache(c.path, int(c.manifest[F.F_NUM_PARTS]), self.embedding_cache_size,
                                       self._reader.direct) for c in self.index.caches]

    def __getstate__(self) -> dict:
        """Pickled (a worker process spawned, not forked): readers, stores and read-ahead are the process's own."""
        state = self.__dict__.copy()
        for name in ("_reader", "_embeds", "_finals", "_pool", "_pool_end"):
            if name in state:
                state[name] = None
        for name, value in state.items():
            if isinstance(value, _Reads):
                state[name] = _Reads()
        return state

    def __getitem__(self, item: tuple[int, float]) -> dict:
        if self._pid != os.getpid():
            self._forked()
        if self._reader is None:
            self._open()
        row, weight = item
        pending = self._samples.take(row)
        tensors, meta = self._reader.read(row) if pending is None else pending.result()
        r = self.index.table[row]
        prompt = int(r[C_PROMPT])
        try:
            # the real tokens only (an A14B embedding is 4 MiB padded, ~0.5 MiB trimmed): collate pads them to
            # the batch's longest prompt, to_batch to max_sequence_length on the device
            context, padded = self._embeds[int(r[C_CACHE])].get_trimmed(prompt)
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise CacheError(f"prompt embedding of prompt {prompt} unreadable in "
                             f"{self.index.caches[int(r[C_CACHE])].path}: {e}") from e
        if padded != self.max_len:
            raise CacheError(f"prompt store of {self.index.caches[int(r[C_CACHE])].path} pads to {padded} "
                             f"tokens, the manifest says max_sequence_length {self.max_len}")
        return {"fields": {name: tensors[name] for name in self.fields}, "context": context,
                "timestep": float(meta[F.M_TIMESTEP]), "sigma": float(meta[F.M_SIGMA]), "step": int(meta[F.M_STEP]),
                "weight": float(weight), "key": self.index.key(row), "max_len": self.max_len}

    def prefetch(self, items: list[tuple[int, float]]) -> None:
        """Start reading these items (their samples, and their embeddings not in memory nor on their way) in this
        process's read threads; each item's `__getitem__` takes what was read for it. One task per run of samples
        adjacent on disk (`SampleReader.runs`), in the order of the items, then one per run of consecutive rows of
        a prompt store (`EmbeddingCache.submit_many`): a batch of scattered samples is a task per item and per
        prompt, a grouped epoch's window a task per few MB. What is read ahead stays in memory until its item is
        read or `end_reads` drops it."""
        if self._pid != os.getpid():
            self._forked()
        if self._reader is None:
            self._open()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="wandistiller-read")
            self._pool_end = weakref.finalize(self, _end_pool, self._pool, self._pid)
        rows = [int(row) for row, _ in items]
        for run in self._reader.runs(rows):
            reads = _Run()
            self._submit(reads, run)
            if reads.calls:
                self._pool.submit(reads)
        t = self.index.table[rows]
        for ci in np.unique(t[:, C_CACHE]).tolist():
            try:  # (a read that cannot even start is left to the item's own, as the samples')
                self._embeds[ci].submit_many(self._pool, t[t[:, C_CACHE] == ci, C_PROMPT].tolist())
            except Exception:
                pass

    def _submit(self, reads: _Run, run: list[int]) -> None:
        """Add the reads of a run of samples (`SampleReader.runs`) to `reads`: the samples, in one read. One that
        cannot even start (a shard gone, no descriptor left) is left to the item's own read, which then raises
        its error at that item, as without read-ahead."""
        try:
            for row, fut in zip(run, self._reader.submit_run(reads, run)):
                self._samples.put(row, fut)
        except Exception:
            pass

    def end_reads(self, keep_pool: bool = False) -> None:
        """Drop the reads in flight (those not begun are cancelled) and, unless `keep_pool`, shut the pool down,
        joining its threads (the reads running finish first: milliseconds); a later `prefetch` starts a new one.
        `Lookahead` calls it when its iteration ends or is abandoned."""
        if self._pid != os.getpid():
            self._forked()
            return
        self._drop_reads(cancel=True)
        if not keep_pool and self._pool_end is not None:
            self._pool_end()
            self._pool = self._pool_end = None

    def _drop_reads(self, cancel: bool) -> None:
        self._samples.drop(cancel)
        for c in self._embeds or ():
            c.forget(cancel)

    def _forked(self) -> None:
        """In a forked child: the parent's pool has no thread here and its reads in flight never finish here.
        They are forgotten without being touched (a lock of theirs may have been held at the fork); the child
        starts its own pool when it reads ahead."""
        self._drop_reads(cancel=False)
        self._pool = self._pool_end = None  # (the parent's finalizer, copied here, does nothing in this process)
        self._pid = os.getpid()

    def __getitems__(self, items: list[tuple[int, float]]) -> list[dict]:
        own = self.hint_own_batch  # the batch's reads run concurrently (`Lookahead` started them already)
        if own:
            self.prefetch(items)
        try:
            return [self[i] for i in items]
        finally:
            if own:  # what an error left unread is dropped; a worker keeps its threads for its next batches,
                # the main process (evaluation) none past the call
                self.end_reads(keep_pool=get_worker_info() is not None)

    def __len__(self) -> int:
        return len(self.index)


# The derived field a SegmentDataset adds to each item: the average velocity from the sample's state to the end
# of its segment (not a cache field: it is computed from two cached states).
SEGMENT_VELOCITY = "segment_velocity"


class _Reads:
    """Reads in flight by key, oldest first (a row may be asked twice in a window: an epoch's zero-weight dummy)."""

    def __init__(self):
        self._d: dict[int, deque[Future]] = {}

    def put(self, key: int, fut: Future) -> None:
        self._d.setdefault(key, deque()).append(fut)

    def take(self, key: int) -> Future | None:
        q = self._d.get(key)
        if not q:
            return None
        fut = q.popleft()
        if not q:
            del self._d[key]
        return fut

    def drop(self, cancel: bool) -> None:
        for q in self._d.values() if cancel else ():
            for fut in q:
                fut.cancel()
        self._d.clear()

    def __len__(self) -> int:
        return sum(len(q) for q in self._d.values())


class _Run:
    """One run of samples' reads (the run's one read, and the segment partners of its samples), made one after
    the other in one thread of the pool: `submit` (an Executor's, for `SampleReader.submit_run`, `submit` and
    `FinalLatentCache.submit`) only records a call and returns its future; the pool then runs them as one task.
    Few tasks: each costs the waking of a thread and the GIL changing hands (one epoch of the A14B-sized bench on
    a busy 2-core VM, 3 runs each, side by side: a task per read 443-596 samples/s, per item 528-719)."""

    def __init__(self):
        self.calls: list = []

    def submit(self, fn, *args) -> Future:
        fut = Future()
        self.calls.append((fut, fn, args))
        return fut

    def __call__(self) -> None:
        calls, self.calls = self.calls, []
        while calls:
            fut, fn, args = calls.pop(0)
            if not fut.set_running_or_notify_cancel():
                continue  # dropped (`end_reads`): its owner has cleaned up after it (SampleReader.submit)
            try:
                result = fn(*args)
            except BaseException as e:  # raised by `result()`, at its item
                fut.set_exception(e)
            else:
                fut.set_result(result)
            # An error's traceback keeps this frame: it must not hold the run's other futures (an item's error
            # raised in the loader holds the loader, which would then live as long as another item's future).
            del fut, fn, args
            result = None


def _end_pool(pool: ThreadPoolExecutor, pid: int) -> None:
    """Shut a dataset's read pool down, in the process that made it only (a forked child's copy has no threads).
    The runs queued still run (their reads dropped by `end_reads` are skipped; a collected dataset's few are made):
    none is left holding a descriptor."""
    if os.getpid() == pid:
        pool.shutdown(wait=True)


def segment_velocity(x_k: torch.Tensor, x_end: torch.Tensor, sigma_k: float, sigma_end: float) -> torch.Tensor:
    """(x_end - x_k) / (sigma_end - sigma_k) in float32: the constant velocity that carries x_k at sigma_k to
    x_end at sigma_end along a straight line, i.e. what one Euler step of that size must predict."""
    return (x_end.float() - x_k.float()) / (sigma_end - sigma_k)


class SegmentDataset(SampleDataset):
    """A SampleDataset whose items are pairs of states of one trajectory: the sample's x_t at step k and the
    state at `end_step[k]` (a later cached step, or the final latent when that is the cache's step count), with
    their average velocity under SEGMENT_VELOCITY. The epoch plan still runs over the samples (one item per
    cached state); the partner of every row is looked up once, here, so reading a pair is the sample's own read
    plus one `pread` of its partner's tensors (usually in the same shard: stage one writes whole trajectories
    into one shard) or one prompt-store read of the final latent (LRU per process); both are read ahead with
    the sample (`prefetch`)."""

    def __init__(self, index: CacheIndex, embedding_cache_size: int, fields: tuple[str, ...], end_step):
        super().__init__(index, embedding_cache_size, fields)
        self.end_step = np.asarray(end_step, dtype=np.int64)
        self.sigmas = [float(v) for v in index.manifest[F.F_SIGMAS]] + [0.0]  # the final latent is at sigma 0
        try:
            self.end_rows = later_state_rows(index, np.arange(len(index)), self.end_step)
        except KeyError as e:
            raise CacheError(f"a segment end is missing from the cache: {e.args[0]}; run `wandistiller cache verify`")
        self._finals: list[FinalLatentCache] | None = None
        self._ends = _Reads()  # row -> reads of its partner's tensors started by `prefetch`

    def _open(self) -> None:
        super()._open()
        self._finals = [FinalLatentCache(c.path, int(c.manifest[F.F_NUM_PARTS]), self.embedding_cache_size,
                                         self._reader.direct) for c in self.index.caches]

    def _submit(self, reads: _Run, run: list[int]) -> None:
        super()._submit(reads, run)
        for row in run:
            r, end_row = self.index.table[row], int(self.end_rows[row])
            try:  # (as the sample's: a read that cannot start is left to the item's own)
                if end_row >= 0:
                    self._ends.put(row, self._reader.submit(reads, end_row, (F.T_X_T,)))
                else:
                    self._finals[int(r[C_CACHE])].submit(reads, int(r[C_PROMPT]))
            except Exception:
                pass

    def _drop_reads(self, cancel: bool) -> None:
        super()._drop_reads(cancel)
        self._ends.drop(cancel)
        for c in self._finals or ():
            c.forget(cancel)

    def __getitem__(self, item: tuple[int, float]) -> dict:
        out = super().__getitem__(item)
        row = item[0]
        r = self.index.table[row]
        end, end_row = int(self.end_step[int(r[C_STEP])]), int(self.end_rows[row])
        if end_row >= 0:
            pending = self._ends.take(row)
            x_end = (self._reader.read_tensors(end_row) if pending is None else pending.result())[F.T_X_T]
        else:
            x_end = self._finals[int(r[C_CACHE])].get(int(r[C_PROMPT]), int(r[C_SEED]))
        out["fields"][SEGMENT_VELOCITY] = segment_velocity(out["fields"][F.T_X_T], x_end, out["sigma"],
                                                           self.sigmas[end])
        return out


def _shared_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in shared memory: what a loader worker collates into, so that sending the batch
    to the training process does not copy it again (as torch's default_collate does)."""
    storage = torch.empty(0, dtype=torch.uint8).untyped_storage()._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a flat numpy uint8 array (any dtype, bfloat16 included), for copies.

    collate copies with numpy, never torch: torch spreads a copy over its intra-op threads, which on a busy
    machine (loader in the training process, other jobs on the cores) wait on each other ~100x longer than the
    copy takes (bench/real_size.py, `--num-workers 0` on 2 loaded cores: 10.7 ms vs 0.07 ms a batch field)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _in_shared_memory(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, copied one after the other into one buffer in shared memory (views of it, same shapes)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = np.cumsum([0] + [-(-n // 64) * 64 for n in sizes])  # (each at a multiple of 64 bytes: any dtype's)
    buf = _shared_bytes(int(starts[-1]))
    out, flat = [], buf.numpy()
    for t, n, at in zip(tensors, sizes, starts.tolist()):
        np.copyto(flat[at:at + n], _bytes(t))
        out.append(buf[at:at + n].view(t.dtype).view(t.shape))
    return out


def collate(items: list[dict]) -> dict:
    """A micro-batch: every field the dataset read and the prompt embeddings, as lists of the samples' tensors,
    and the per-sample metadata as tensors.

    Nothing is stacked here: in the training process the lists hold the tensors the reads made (views of the
    read buffers), and `to_device` / `padded_context` lay them out once, where the batch is used (on the device,
    where the embeddings are also padded with zeros to `max_len`, as WanPipeline pads them). An A14B batch of 8
    is ~3 MB of latents and ~4 MB of real tokens, which stacking (and padding to the batch's longest prompt: ~9 MB)
    copied once more on the loader's core, whose CPU bound it (bench/real_size.py). A loader worker copies
    them into one buffer in shared memory, which the training process then maps without a copy.
    """
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


# Prompts per read group of a grouped epoch (`read_groups`): consecutive rows of one prompt store, whose
# trajectories stage one writes one after the other into a shard and whose embeddings lie one after the other in
# one file of the store (ROWS_PER_FILE is a multiple); at A14B sizes and 3 steps, ~19 MB of samples and ~13 MB of
# embeddings a group.
GROUP_PROMPTS = 16
# Bytes of samples a grouped epoch's window holds at most (`order_window`): an in-process loader keeps the window
# it delivers and the next in memory (`Lookahead`), so one rank holds at most twice this / world size. A window
# of A14B samples at 3 steps: ~660 samples, ~210 prompts, 64 lanes of ~10 samples (~4 MB requests).
READ_WINDOW_BYTES = 256 << 20


def group_prompts(embedding_cache_size: int) -> int:
    """Prompts per read group: GROUP_PROMPTS, fewer where half the embedding LRU holds fewer (a window holds
    whole groups, and at most half the LRU's prompts)."""
    return max(1, min(GROUP_PROMPTS, embedding_cache_size // 2))


def read_groups(index: CacheIndex, rows: np.ndarray, prompts: int = GROUP_PROMPTS) -> np.ndarray:
    """The read group of each of `rows` for a grouped epoch order: `prompts` consecutive rows of one prompt store
    (a part of a cache), whose samples lie together in a shard and whose embeddings lie together in a file."""
    t = index.table[rows]
    parts = np.asarray([int(c.manifest[F.F_NUM_PARTS]) for c in index.caches], dtype=np.int64)[t[:, C_CACHE]]
    store_row = t[:, C_PROMPT] // parts  # format.prompt_location: prompt i is row i // num_parts of part i % num_parts
    width = int(store_row.max(initial=0)) // prompts + 1
    return (t[:, C_CACHE] * int(parts.max(initial=1)) + t[:, C_PROMPT] % parts) * width + store_row // prompts


def order_window(order: str, index: CacheIndex, rows: np.ndarray, embedding_cache_size: int) -> int:
    """The EpochPlan window of `order` (pipeline/config.py ORDERS) over `rows`: 0, a shuffled epoch, or the read
    groups (`read_groups` of `group_prompts`) per window of a grouped one. A window holds at most half the
    embedding LRU's prompts (every prompt of a window stays in memory from its first sample to its last, with room
    for the next window's) and READ_WINDOW_BYTES of samples, but at least one group.

    auto groups when the prompts outnumber the LRU: a shuffled epoch then reads a prompt's embedding again for
    nearly every sample (10,000 prompts x 3 steps, LRU of 1,024: 2.8 reads a prompt, 1.0 grouped; the real-size
    bench's epoch read 24.7 GiB from disk shuffled, 16.2 grouped by prompt), and reads one sample at a time, while
    an LRU that holds every prompt reads each once in any order, and the order stays the uniform shuffle."""
    return _grouping(order, index, rows, embedding_cache_size)[0]


def _grouping(order: str, index: CacheIndex, rows: np.ndarray,
              embedding_cache_size: int) -> tuple[int, np.ndarray | None]:
    """(`order_window`, the `read_groups` of `rows` it was counted from; None for a shuffled epoch)."""
    t = index.table[rows]
    n_prompts = len(np.unique(t[:, [C_CACHE, C_PROMPT]], axis=0)) if len(rows) else 0
    if order == "shuffle" or (order == "auto" and n_prompts <= embedding_cache_size):
        return 0, None
    per = group_prompts(embedding_cache_size)
    groups = read_groups(index, rows, per)
    n_groups = len(np.unique(groups))
    group_bytes = float(np.sum(t[:, C_TENS_OFF] + t[:, C_TENS_LEN] - t[:, C_META_OFF])) / max(n_groups, 1)
    by_prompts = (embedding_cache_size // 2) // per  # (groups of `per` prompts; a store's last group may hold fewer)
    return max(1, min(by_prompts, int(READ_WINDOW_BYTES // max(group_bytes, 1.0)))), groups


def epoch_plan(data: DataSplit, world: int, batch: int, accum: int, order: str,
               embedding_cache_size: int) -> EpochPlan:
    """train-student's plan of an epoch over `data`'s training rows, in `order` (`order_window`)."""
    window, groups = _grouping(order, data.index, data.train_rows, embedding_cache_size)
    return EpochPlan(len(data.train_rows), world, batch, accum, groups, window)


def order_identity(plan: EpochPlan, embedding_cache_size: int) -> dict | None:
    """What a grouped epoch's order depends on beyond (seed, epoch, data), for the run's identity (a resume with
    another order is refused); None for a shuffled one."""
    if not plan.window:
        return None
    return {"grouped": plan.window, "group_prompts": group_prompts(embedding_cache_size), "lanes": LANES}


class RankBatches(Sampler):
    """Batch sampler: this rank's micro-batches of one epoch, from optimizer step `start_step` on.

    A rank whose share of a micro-step is empty (only in an epoch's last window) gets one zero-weight
    sample, so it still runs forward/backward and joins the gradient all-reduce.
    """

    def __init__(self, plan: EpochPlan, rows: np.ndarray, seed: int, epoch: int, rank: int, start_step: int = 0):
        self.plan, self.rows, self.seed, self.epoch, self.rank = plan, rows, seed, epoch, rank
        self.start_step = start_step

    def __iter__(self):
        for _, batch in self.windowed():
            yield batch

    def windowed(self):
        """(window, batch) for each batch of `__iter__`: the window (`EpochPlan.windows`) of the batch's first
        position, for a reader that reads a window ahead (`Lookahead`)."""
        perm, starts = self.plan.windows(self.seed, self.epoch)
        for step in range(self.start_step, self.plan.steps):
            for micro in self.plan.micro_range(step):
                pos = self.plan.positions(micro, self.rank)
                if len(pos):
                    yield int(np.searchsorted(starts, pos[0], "right")) - 1, [(int(self.rows[perm[p]]), 1.0)
                                                                               for p in pos]
                else:
                    yield len(starts) - 1, [(int(self.rows[perm[0]]), 0.0)]

    def __len__(self) -> int:
        return sum(len(self.plan.micro_range(s)) for s in range(self.start_step, self.plan.steps))


class Lookahead(Sampler):
    """The batches of `batches`, each one's reads started before it is delivered (`SampleDataset.prefetch`): the
    read threads work on the next batches while this process collates the current one (and trains on it).

    By batches: each batch's reads start `depth` batches before it. By windows, for a grouped epoch (`batches` a
    `RankBatches` whose plan has windows): all of a window's reads start at once, in one `prefetch`, before the
    first batch of the window before it is delivered; its samples, which lie together on disk, are then read in
    large requests (`SampleReader.runs`, `EmbeddingCache.submit_many`) while the window before is trained on. At most two windows' items
    are in memory or in flight (READ_WINDOW_BYTES each, over the world size).

    For a loader without workers; workers read ahead by `prefetch_factor` batches themselves. When the iteration
    ends, or is abandoned (the generator closed), the reads still in flight are dropped and the read threads end
    (`SampleDataset.end_reads`)."""

    def __init__(self, batches, dataset: SampleDataset, depth: int = LOOKAHEAD_BATCHES):
        self.batches, self.dataset, self.depth = batches, dataset, depth

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        try:
            plan = getattr(self.batches, "plan", None)
            if plan is not None and plan.window:
                yield from self._by_window()
            else:
                yield from self._by_batch()
        finally:
            end = getattr(self.dataset, "end_reads", None)  # (a dataset without read-ahead has none)
            if end is not None:
                end()

    def _by_batch(self):
        ahead: deque = deque()  # started, not yet delivered: when a batch is yielded, it and the next `depth`
        for b in self.batches:
            self.dataset.prefetch(b)
            ahead.append(b)
            if len(ahead) > self.depth:
                yield ahead.popleft()
        yield from ahead

    def _by_window(self):
        src = self.batches.windowed()
        nxt = next(src, None)
        ahead: deque = deque()  # (window, batch) started, not yet delivered

        def start():  # every batch of the next window, in one prefetch
            nonlocal nxt
            w, group = nxt[0], []
            while nxt is not None and nxt[0] == w:
                group.append(nxt[1])
                nxt = next(src, None)
            self.dataset.prefetch([item for b in group for item in b])
            ahead.extend((w, b) for b in group)

        while nxt is not None or ahead:
            if not ahead or (nxt is not None and nxt[0] <= ahead[0][0] + 1):
                start()
                continue
            yield ahead.popleft()[1]


def make_loader(dataset: SampleDataset, sampler: RankBatches, num_workers: int, pin: bool) -> DataLoader:
    dataset.hint_own_batch = num_workers > 0
    if num_workers == 0:
        sampler = Lookahead(sampler, dataset)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      pin_memory=pin, prefetch_factor=4 if num_workers else None,
                      worker_init_fn=signals.worker_ignores_sigterm if num_workers else None)


def eval_batches(rows: np.ndarray, rank: int, world: int, batch: int) -> list[list[tuple[int, float]]]:
    """This rank's share of the held-out rows (positions rank, rank+W, ...), in batches."""
    mine = rows[rank::world]
    return [[(int(r), 1.0) for r in mine[i:i + batch]] for i in range(0, len(mine), batch)]


def prepare(caches: list[CacheInfo], env: DistEnv, device: torch.device, check: str,
            train_steps: tuple[int, ...] | None, holdout_prompts: int) -> DataSplit:
    """Check and index the caches (opened with `cache.reader.open_caches`), then split them into
    training and held-out rows."""
    index = build_index(caches, env, device, check)
    if index.duplicates:
        log.info(f"{index.duplicates} sample(s) appear in more than one cache; each is trained on once")
    data = split(index, train_steps, holdout_prompts)
    if len(data.train_rows) == 0:
        raise UserError(f"no sample left to train on in {', '.join(str(c.path) for c in caches)} after --train-steps / "
                        "--holdout-prompts")
    return data
