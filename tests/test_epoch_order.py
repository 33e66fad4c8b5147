"""The epoch's order (`EpochPlan.order`, `--order`) and where the loader reads past the page cache (`direct_io`):
a grouped epoch is still an exact permutation, a function of (seed, epoch) alone, each prompt's samples within one
window; it reads each embedding once where a shuffled epoch reads it again and again; small caches keep the
uniform shuffle; O_DIRECT reads deliver the bytes buffered reads deliver, and fall back where refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cache import direct_io
from cache.prompt_store import EmbeddingCache, PartRows
from cache.reader import EpochPlan, SampleReader, open_index
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from stages.train_student import data as D

ROOT = Path(__file__).resolve().parents[1]


def grouped(n_groups: int, per: int, window: int, world: int = 1, batch: int = 4) -> EpochPlan:
    groups = np.repeat(np.arange(n_groups) * 7 + 3, per)  # ids need not be dense
    return EpochPlan(len(groups), world, batch, 1, groups, window)


def test_a_grouped_epoch_is_a_permutation_with_each_group_inside_one_window():
    plan = grouped(50, 3, window=8)
    order = plan.order(seed=1, epoch=2)
    assert np.array_equal(np.sort(order), np.arange(plan.n))
    groups_in_order = plan.groups[order]
    span = 8 * 3  # a window holds 8 groups of 3 samples (the last one fewer)
    for start in range(0, plan.n, span):
        inside = set(groups_in_order[start:start + span].tolist())
        assert len(inside) <= 8
        later = set(groups_in_order[start + span:].tolist())
        assert not inside & later  # a group never comes back after its window
    # a function of (seed, epoch) alone: not of the world size or the batch, different per epoch and seed
    assert np.array_equal(order, grouped(50, 3, 8, world=4, batch=2).order(1, 2))
    assert not np.array_equal(order, plan.order(1, 3))
    assert not np.array_equal(order, plan.order(2, 2))
    # windows are shuffled inside: a group's samples are not simply consecutive
    assert any(groups_in_order[i] != groups_in_order[i + 1] for i in range(0, 24, 3))


def test_a_grouped_plan_needs_a_group_per_position():
    with pytest.raises(ValueError, match="a group for each"):
        EpochPlan(10, 1, 2, 1, np.zeros(9, dtype=np.int64), 4)


def test_auto_keeps_the_shuffle_while_the_lru_holds_every_prompt():
    groups = np.repeat(np.arange(100), 3)
    assert D.order_window("auto", groups, 100) == 0
    assert D.order_window("auto", groups, 99) == 49
    assert D.order_window("shuffle", groups, 10) == 0
    assert D.order_window("grouped", groups, 1024) == 512
    assert D.order_window("grouped", groups, 1) == 1


def test_order_is_checked_and_on_the_command_line():
    with pytest.raises(ValueError, match="order must be one of auto, shuffle, grouped"):
        TrainStudentConfig(cache=("c",), student_config="s", out="o", order="random")


def embedding_reads(index, order: str, lru: int, monkeypatch) -> int:
    """Prompt embeddings read from disk over one epoch of train-student's plan in `order` with an LRU of `lru`."""
    count = {"n": 0}
    load = EmbeddingCache._load

    def counted(self, *args):
        count["n"] += 1
        return load(self, *args)

    monkeypatch.setattr(EmbeddingCache, "_load", counted)
    split = D.split(index, None, 0)
    plan = D.epoch_plan(split, 1, 4, 1, order, lru)
    ds = D.SampleDataset(index, lru)
    for batch in D.make_loader(ds, D.RankBatches(plan, split.train_rows, 0, 0, 0), 0, False):
        assert batch["fields"]
    return count["n"]


def test_a_grouped_epoch_reads_each_embedding_once(tiny_cache, monkeypatch):
    index = open_index([tiny_cache])  # 7 prompts x 4 steps
    assert embedding_reads(index, "grouped", 2, monkeypatch) == 7  # a window of 1 prompt, LRU of 2
    assert embedding_reads(index, "shuffle", 2, monkeypatch) > 14  # 28 samples of 7 prompts in a uniform order: most reads miss an LRU of 2


def test_a_changed_order_is_refused_on_resume(tiny_cache, tmp_path):
    from stages import train_student

    common = dict(cache=(str(tiny_cache),), student_config=str(ROOT / "configs" / "student-tiny.json"),
                  out=str(tmp_path / "run"), max_steps=2, checkpoint_every=1, batch_size=2, warmup_steps=0,
                  eval_every=0, num_workers=0, report_to="none", embedding_cache_size=4)
    train_student.run(TrainStudentConfig(**common, order="grouped"))
    with pytest.raises(UserError, match="another order"):
        train_student.run(TrainStudentConfig(**(common | {"max_steps": 3}), order="shuffle", resume=True))
    train_student.run(TrainStudentConfig(**(common | {"max_steps": 3}), order="grouped", resume=True))


def test_direct_reads_deliver_what_buffered_reads_deliver(tiny_cache):
    index = open_index([tiny_cache])
    buffered, direct = SampleReader(index), SampleReader(index, direct=True)
    for row in range(len(index)):
        (a, ma), (b, mb) = buffered.read(row), direct.read(row)
        assert ma == mb and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    fd = direct._fd(0)
    assert direct_io.is_direct(fd) == direct.direct  # direct where this file system has it
    plain, through = EmbeddingCache(tiny_cache, 1, 4), EmbeddingCache(tiny_cache, 1, 4, direct=True)
    for p in range(7):
        assert torch.equal(plain.get(p), through.get(p))
    rows = PartRows(tiny_cache, 0, 1, direct=True)
    assert np.array_equal(rows.latents("final_latents", 3), PartRows(tiny_cache, 0, 1).latents("final_latents", 3))


def test_a_refused_direct_read_goes_on_buffered(tiny_cache, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *args):  # a file system without O_DIRECT: EINVAL at the open
        if flags & direct_io.FLAG:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    with monkeypatch.context() as m:
        m.setattr(direct_io.os, "open", refuse)
        index = open_index([tiny_cache])
        reader = SampleReader(index, direct=True)
        tensors, _ = reader.read(0)
        assert not reader.direct and torch.equal(tensors["x_t"], SampleReader(index).read(0)[0]["x_t"])
        cache = EmbeddingCache(tiny_cache, 1, 4, direct=True)
        assert torch.equal(cache.get(0), EmbeddingCache(tiny_cache, 1, 4).get(0))
    if not direct_io.FLAG:
        return
    real_preadv = os.preadv

    def misaligned(fd, bufs, off):  # a disk whose blocks are larger than direct_io.ALIGN: EINVAL at the read
        if direct_io.is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(direct_io.os, "preadv", misaligned)
    reader = SampleReader(index, direct=True)
    tensors, _ = reader.read(1)
    assert not reader.direct and torch.equal(tensors["x_t"], SampleReader(index).read(1)[0]["x_t"])


def test_the_loader_reads_directly_only_what_the_page_cache_cannot_keep(tiny_cache, monkeypatch):
    index = open_index([tiny_cache])
    assert not D.direct_reads(index)  # a few KB
    monkeypatch.setattr(direct_io.os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else 1000)
    assert D.direct_reads(index) == bool(direct_io.FLAG)  # 1000 bytes of "memory"
