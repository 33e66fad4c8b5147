"""Stage two's read-ahead (`SampleDataset.prefetch`, `Lookahead`, `SampleReader.submit`): what it delivers is what
reads in order deliver, byte for byte and error for error; descriptors closed by the reader's LRU while reads are
pending never serve another shard; the read threads end with the loader, and a forked worker never waits on its
parent's reads."""

from __future__ import annotations

import gc
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from cache import format as F
from cache.errors import CacheError
from cache.prompt_store import EMBEDS_CRC32C, prompt_store_path
from cache.reader import C_SHARD, C_STEP, C_TENS_OFF, EpochPlan, SampleReader, open_index
from stages.train_student import data as D

BATCH = 4


def read_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wandistiller-read")]


def _bytes(t: torch.Tensor) -> tuple:
    return str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()


def snapshot(item: dict) -> tuple:
    """Everything an item delivers, as comparable bytes."""
    return (tuple((k, _bytes(v)) for k, v in sorted(item["fields"].items())), _bytes(item["context"]),
            *(item[k] for k in ("timestep", "sigma", "step", "weight", "key", "max_len")))


def batch_snapshot(b: dict) -> tuple:
    return (tuple((k, tuple(map(_bytes, v))) for k, v in sorted(b["fields"].items())), tuple(map(_bytes, b["context"])),
            b["max_len"],
            *(_bytes(b[k]) for k in ("timestep", "sigma", "step", "weight")), tuple(b["keys"]))


def outcome(ds: D.SampleDataset, item) -> tuple:
    try:
        return snapshot(ds[item])
    except CacheError as e:
        return ("error", type(e).__name__, str(e))


def make(kind: str, index, cache_size: int = 2, max_open: int = 64) -> D.SampleDataset:
    """A dataset over `index` (a small embedding LRU: evictions while reads are pending); `max_open` descriptors."""
    if kind == "sample":
        ds = D.SampleDataset(index, cache_size)
    else:  # steps 0 -> 1, 1 and 2 -> 3: partners in the shards; step 3 -> the final latent
        ds = D.SegmentDataset(index, cache_size, (F.T_X_T,), [1, 3, 3, index.steps])
    ds._open()
    ds._reader = SampleReader(index, max_open=max_open)
    return ds


def epoch(index, seed: int = 5) -> list[list[tuple[int, float]]]:
    plan = EpochPlan(len(index), 1, BATCH)
    return list(D.RankBatches(plan, np.arange(len(index)), seed, 0, 0))


def in_order(kind: str, index, batches) -> list[tuple]:
    """Each item's outcome read in order, one at a time, without read-ahead."""
    ds = make(kind, index)
    ds.hint_own_batch = False
    return [outcome(ds, it) for b in batches for it in b]


def read_ahead(kind: str, index, batches, depth: int, max_open: int = 1) -> list[tuple]:
    """Each item's outcome through a `Lookahead` of `depth` batches (one descriptor: evicted all the time)."""
    ds = make(kind, index, max_open=max_open)
    ds.hint_own_batch = False
    out = []
    for b in D.Lookahead(batches, ds, depth):
        assert len(ds._samples) <= (depth + 1) * BATCH  # what is read ahead is bounded
        out += [outcome(ds, it) for it in b]
    assert len(ds._samples) == 0 and not read_threads()
    return out


@pytest.fixture
def cache_copy(tiny_cache, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_cache, tmp_path / "cache"))


@pytest.mark.parametrize("kind", ["sample", "segment"])
def test_read_ahead_delivers_what_reads_in_order_deliver(tiny_cache, kind):
    index = open_index([tiny_cache])
    batches = epoch(index)
    want = in_order(kind, index, batches)
    assert len(want) == len(index) == 28 and all(w[0] != "error" for w in want)
    for depth in (0, 2, 8):
        assert read_ahead(kind, index, batches, depth) == want, depth
    # the loaders: in-process (Lookahead) and with a worker (each batch's own reads concurrent), same batches
    ref = [batch_snapshot(D.collate([make(kind, index)[it] for it in b])) for b in batches]
    for workers in (0, 1):
        ds = make(kind, index, max_open=1)
        got = [batch_snapshot(b) for b in D.make_loader(ds, batches, workers, False)]
        assert got == ref, workers
        assert not read_threads()


def test_a_corrupt_sample_or_embedding_read_ahead_fails_at_its_item(cache_copy):
    """The same CacheError, with the same message, at the same item as reads in order; the items around it are
    delivered intact."""
    index = open_index([cache_copy])  # before the damage: the index must not refuse it
    t = index.table
    bad_decode = 9
    with open(index.shard_path(bad_decode), "r+b") as f:  # the safetensors header length: does not decode
        f.seek(int(t[bad_decode, C_TENS_OFF]))
        f.write(b"\xff" * 8)
    shard = int(t[bad_decode, C_SHARD]) + 1
    last = max(np.flatnonzero(t[:, C_SHARD] == shard), key=lambda r: t[r, C_TENS_OFF])
    os.truncate(index.shard_path(last), int(t[last, C_TENS_OFF]) + 100)  # its last sample: shorter than its index
    g = zarr.open_group(str(prompt_store_path(cache_copy, 0)), mode="r+")
    g[EMBEDS_CRC32C][3] = (int(g[EMBEDS_CRC32C][3]) + 1) % (1 << 31)  # prompt 3's tokens no longer match
    batches = epoch(index, seed=11)
    for kind in ("sample", "segment"):
        want = in_order(kind, index, batches)
        errors = [w[2] for w in want if w[0] == "error"]
        assert any("does not decode" in e for e in errors) and any("shorter than its index" in e for e in errors)
        assert any("embeds of row 3 (prompt 3) fail their crc32c" in e for e in errors)
        assert sum(w[0] != "error" for w in want) >= 12  # the other items still read
        for depth in (1, 3):
            assert read_ahead(kind, index, batches, depth) == want, (kind, depth)
        # through the loader: the first error, at its batch, after the batches before it
        first = next(i for i, w in enumerate(want) if w[0] == "error")
        ds, got = make(kind, index, max_open=1), []
        with pytest.raises(CacheError) as err:
            for b in D.make_loader(ds, batches, 0, False):
                got.append(b)
        assert str(err.value) == want[first][2] and len(got) == first // BATCH
        del err  # (its traceback holds the loader's frames)
        gc.collect()
        assert not read_threads()


def test_reads_pending_keep_their_shard_while_the_lru_closes_and_reuses_its_descriptor(tiny_cache):
    """`SampleReader.submit` with one descriptor allowed: every read below is queued behind blocked threads while
    the reader closes and reopens shards (the kernel hands the same numbers out again), then runs."""
    index = open_index([tiny_cache])
    ref = SampleReader(index)
    rows = sorted(range(len(index)), key=lambda r: (r % 5, -r))  # hopping between the shards
    assert len({int(index.table[r, C_SHARD]) for r in rows}) == 3
    reader, gate = SampleReader(index, max_open=1), threading.Event()
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(gate.wait) for _ in range(3)]
        pending = [(r, reader.submit(pool, r), reader.submit(pool, r, (F.T_X_T, F.T_TARGET))) for r in rows]
        assert not any(f.done() for _, f, _ in pending)
        gate.set()
        for r, whole, tensors in pending:
            got_t, got_m = whole.result()
            want_t, want_m = ref.read(r)
            assert got_m == want_m and got_t.keys() == want_t.keys()
            assert all(torch.equal(got_t[k], want_t[k]) for k in want_t), r
            assert all(torch.equal(v, want_t[k]) for k, v in tensors.result().items()), r
        assert all(h.result() for h in held)
    reader.close()
    ref.close()


def test_no_read_thread_outlives_its_loader(tiny_cache):
    index = open_index([tiny_cache])
    batches = epoch(index)
    ds = make("segment", index)
    for b in D.make_loader(ds, batches, 0, False):
        assert read_threads()  # reading ahead
    assert not read_threads()  # exhausted
    it = iter(D.make_loader(ds, batches, 0, False))
    next(it), next(it)
    assert read_threads() and len(ds._samples) > 0
    del it  # abandoned mid-epoch: its reads dropped, its threads joined
    gc.collect()
    assert not read_threads() and len(ds._samples) == 0
    ds.hint_own_batch = True  # a batch's own reads, in this process (evaluation): no thread past the call
    assert len(ds.__getitems__(batches[0])) == BATCH and not read_threads()
    ds.prefetch(batches[1])
    assert read_threads()
    del ds  # collected with reads in flight: its pool is shut down
    gc.collect()
    assert not read_threads()


@pytest.mark.timeout(120, method="thread")  # a hang is a failure, not a stuck run
def test_a_forked_worker_never_waits_on_its_parents_reads(tiny_cache, monkeypatch):
    """Reads started in the parent, still pending when a worker forks, are not the worker's: it reads its own."""
    parent, gate = os.getpid(), threading.Event()

    class Held(ThreadPoolExecutor):  # in the parent, every read waits for the gate
        def submit(self, fn, *args, **kwargs):
            def held():
                if os.getpid() == parent:
                    gate.wait()
                return fn(*args, **kwargs)
            return super().submit(held)

    monkeypatch.setattr(D, "ThreadPoolExecutor", Held)
    index = open_index([tiny_cache])
    batches = epoch(index)
    ref = [batch_snapshot(D.collate([make("sample", index)[it] for it in b])) for b in batches]
    ds = make("sample", index)
    for b in batches[:3]:
        ds.prefetch(b)  # pending in the parent, never done before the fork
    got = [batch_snapshot(b) for b in D.make_loader(ds, batches, 1, False)]
    assert got == ref
    gate.set()
    ds.end_reads()
    assert not read_threads()


def test_steps_of_the_segment_partners(tiny_cache):
    """(The segment dataset above reads partners both in the shards and in the prompt store.)"""
    index = open_index([tiny_cache])
    ds = make("segment", index)
    ends = ds.end_rows[np.arange(len(index))]
    assert (ends >= 0).any() and (ends < 0).any()
    assert set(index.table[ends[ends >= 0], C_STEP].tolist()) == {1, 3}
