"""The in-process loader's memory: read buffers reused from a pool only once nothing uses their bytes
(`direct_io.BufferPool`), and batches passed as the samples' own tensors, laid out (and the embeddings padded) where they are used
(`data.collate`, `to_device`, `padded_context`)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from cache import direct_io
from stages.train_student import data as D

MB = 1 << 20


def test_a_pooled_buffer_is_reused_only_once_every_view_of_it_is_gone():
    pool = direct_io.BufferPool(limit=64 * MB)
    a = pool.take(3 * MB)
    assert a.nbytes == 3 * MB and a.ctypes.data % direct_io.ALIGN == 0
    a[:] = 7
    addr = a.ctypes.data
    view = a[MB:2 * MB]  # a numpy view, and a tensor made over part of it: each keeps the slab out of the pool
    tensor = torch.frombuffer(a[2 * MB:], dtype=torch.uint8)
    del a
    gc.collect()
    assert pool.free_bytes() == 0
    b = pool.take(3 * MB)
    assert b.ctypes.data != addr  # the slab in use is never handed out again
    del view
    gc.collect()
    assert pool.free_bytes() == 0  # the tensor still uses it
    assert int(tensor[0]) == 7
    del tensor
    gc.collect()
    assert pool.free_bytes() == pool.size_class(3 * MB)
    c = pool.take(3 * MB - 4096)  # the same size class: the same slab
    assert c.ctypes.data == addr and pool.free_bytes() == 0
    del b, c


def test_the_pool_keeps_at_most_its_limit_letting_go_of_the_least_recent():
    pool = direct_io.BufferPool(limit=8 * MB)
    a, b, c = pool.take(2 * MB), pool.take(4 * MB), pool.take(4 * MB)
    addrs = [x.ctypes.data for x in (a, b, c)]
    del a  # given back first, in this order
    del b
    del c
    gc.collect()
    assert pool.free_bytes() == 8 * MB  # the 2 MiB slab went: the two 4 MiB ones came back later
    d, e = pool.take(4 * MB), pool.take(4 * MB)
    assert {d.ctypes.data, e.ctypes.data} == set(addrs[1:])
    small = pool.take(1024)  # below POOLED_MIN: not pooled, still aligned
    assert small.ctypes.data % direct_io.ALIGN == 0 and pool.free_bytes() == 0


def test_pread_returns_the_file_bytes_from_pooled_buffers(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 * MB, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    for direct in (True, False):
        fd, _ = direct_io.open_read(path, direct)
        try:
            for _ in range(3):  # the second and third reads reuse the first's slab
                got, _ = direct_io.pread(fd, 12345, 4 * MB)
                assert np.array_equal(got, data[12345:12345 + 4 * MB])
                del got
        finally:
            os.close(fd)


def items(lens=(3, 7, 1)) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"fields": {"x_t": torch.randn(2, 1, 4, 6, generator=g).bfloat16(),
                        "target": torch.randn(2, 1, 4, 6, generator=g)},
             "context": torch.randn(n, 8, generator=g).bfloat16(), "timestep": 10.0 * j, "sigma": 0.1 * j,
             "step": j, "weight": 1.0 if j else 0.0, "key": f"k{j}", "max_len": 9} for j, n in enumerate(lens)]


def test_a_batch_is_laid_out_and_padded_where_it_is_used():
    its = items()
    batch = D.collate(its)
    assert all(a is b["fields"]["x_t"] for a, b in zip(batch["fields"]["x_t"], its))  # no copy in the loader
    x = D.to_device(batch["fields"]["x_t"], torch.device("cpu"))
    assert x.dtype == torch.float32 and torch.equal(x, torch.stack([i["fields"]["x_t"] for i in its]).float())
    ctx = D.padded_context(batch, torch.device("cpu"))
    want = torch.zeros(3, 9, 8)
    for j, i in enumerate(its):
        want[j, :len(i["context"])] = i["context"].float()
    assert torch.equal(ctx, want)  # real tokens, then zeros up to max_len, as WanPipeline pads
    assert batch["keys"] == ["k1", "k2"] and batch["step"].tolist() == [0, 1, 2]


def test_a_worker_collates_into_one_buffer_in_shared_memory(monkeypatch):
    monkeypatch.setattr(D, "get_worker_info", lambda: object())
    its = items(lens=(5, 2))
    batch = D.collate(its)
    tensors = [*batch["fields"]["x_t"], *batch["fields"]["target"], *batch["context"]]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1 and tensors[0].is_shared()
    for got, want in zip(tensors, [*(i["fields"]["x_t"] for i in its), *(i["fields"]["target"] for i in its),
                                   *(i["context"] for i in its)]):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.gpu
def test_a_pinned_batch_reaches_the_gpu_as_it_does_the_cpu():
    """On CUDA the loader pins each of a batch's tensors (DataLoader pin_memory over the lists) and `to_device` /
    `padded_context` copy them sample by sample without blocking: the device batch equals the CPU one."""
    from torch.utils.data._utils.pin_memory import pin_memory

    batch = D.collate(items())
    pinned = pin_memory(batch)
    assert all(t.is_pinned() for t in pinned["fields"]["x_t"] + pinned["context"])
    cuda = torch.device("cuda")
    for name in ("x_t", "target"):
        got = D.to_device(pinned["fields"][name], cuda)
        assert torch.equal(got.cpu(), D.to_device(batch["fields"][name], torch.device("cpu")))
    ctx = D.padded_context(pinned, cuda)
    torch.cuda.synchronize()
    assert torch.equal(ctx.cpu(), D.padded_context(batch, torch.device("cpu")))
