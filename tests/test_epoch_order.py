"""The epoch's order (`stages/train_student/epoch.py`, `--order`): a grouped epoch is still an exact permutation, a
function of (seed, epoch) alone, each prompt's samples within one window; it reads each embedding once where a
shuffled epoch reads it again and again; small caches keep the uniform shuffle; the loader delivers, with workers
or without, what reads in order deliver."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cache.prompt_store import PartRows
from cache.reader import open_index
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from stages.train_student import data as D
from stages.train_student import epoch as E
from stages.train_student.epoch import EpochPlan
from stages.train_student.index import split

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


def fake_index(prompts: int, steps: int, parts: int = 1, sample_bytes: int = 1000):
    """An index of `prompts` x `steps` samples laid out as stage one writes them (each part's prompts in row order,
    a prompt's steps one after the other), `sample_bytes` a sample."""
    from types import SimpleNamespace

    from cache.reader import C_META_LEN, C_META_OFF, C_PROMPT, C_SHARD, C_STEP, C_TENS_LEN, C_TENS_OFF, N_COLS

    rows = [(p, k) for part in range(parts) for p in range(part, prompts, parts) for k in range(steps)]
    t = np.zeros((len(rows), N_COLS), dtype=np.int64)
    t[:, C_PROMPT], t[:, C_STEP] = [p for p, _ in rows], [k for _, k in rows]
    t[:, C_SHARD] = t[:, C_PROMPT] % parts
    t[:, C_META_OFF] = np.concatenate([np.arange(np.sum(t[:, C_SHARD] == s)) for s in range(parts)]) * sample_bytes
    t[:, C_META_LEN], t[:, C_TENS_OFF] = 100, t[:, C_META_OFF] + 1024
    t[:, C_TENS_LEN] = sample_bytes - 1024
    return SimpleNamespace(table=t, caches=[SimpleNamespace(manifest=SimpleNamespace(num_parts=parts))])


def test_auto_keeps_the_shuffle_while_the_lru_holds_every_prompt():
    index = fake_index(100, 3)
    rows = np.arange(len(index.table))
    assert E.order_window("auto", index, rows, 100)[0] == 0
    assert E.order_window("auto", index, rows, 99)[0] == 49 // 16  # groups of 16 prompts, a window of <= 49 prompts
    assert E.order_window("shuffle", index, rows, 10)[0] == 0
    assert E.order_window("grouped", index, rows, 1024)[0] == 512 // 16
    assert E.order_window("grouped", index, rows, 1)[0] == 1  # at least a group (of one prompt)
    assert E.group_prompts(1024) == 16 and E.group_prompts(6) == 3 and E.group_prompts(1) == 1


def test_a_window_holds_at_most_read_window_bytes_of_samples():
    per_group = 16 * 40 * (400 << 10)  # 16 prompts x 40 steps of A14B samples: 250 MiB
    index = fake_index(64, 40, sample_bytes=400 << 10)
    rows = np.arange(len(index.table))
    assert E.order_window("grouped", index, rows, 1024)[0] == max(1, E.READ_WINDOW_BYTES // per_group) == 1
    index = fake_index(640, 3, sample_bytes=400 << 10)  # 19 MB a group: a window of 13 groups, 208 prompts
    rows = np.arange(len(index.table))
    assert E.order_window("grouped", index, rows, 1024)[0] == E.READ_WINDOW_BYTES // (16 * 3 * (400 << 10)) == 13


def test_read_groups_are_runs_of_consecutive_rows_of_one_store():
    index = fake_index(70, 2, parts=2)  # prompt p: part p % 2, row p // 2
    rows = np.arange(len(index.table))
    groups = E.read_groups(index, rows, 4)
    t = index.table
    for g in np.unique(groups):
        prompts = np.unique(t[groups == g, 2])
        assert len(set((prompts % 2).tolist())) == 1  # one part
        store_rows = prompts // 2
        assert store_rows.max() - store_rows.min() < 4 and len(set((store_rows // 4).tolist())) == 1
    assert len(np.unique(groups)) == 2 * 9  # 35 rows a part: 9 groups of <= 4


def runs_of(rows: np.ndarray) -> int:
    """Runs of consecutive integers in `rows` (sorted)."""
    rows = np.sort(rows)
    return 1 + int(np.count_nonzero(np.diff(rows) != 1)) if len(rows) else 0


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_each_rank_reads_its_own_lanes_in_long_runs(world):
    """A window of 40 groups of 48 adjacent samples (1,920: pieces of 30 samples to each of the 64 lanes): rank r
    of W takes the lanes congruent to r, pieces of adjacent samples, so its share of a window is at most one run
    per lane and per group boundary crossed, and no other rank reads them."""
    groups = np.repeat(np.arange(200), 48)
    plan = EpochPlan(len(groups), world, 8, 1, groups, 40)
    order, starts = plan.windows(seed=3, epoch=1)
    assert np.array_equal(order, EpochPlan(len(groups), 1, 8 * world, 1, groups, 40).order(3, 1))
    bounds = np.append(starts, plan.n)
    for w in range(len(starts)):
        seen = set()
        for rank in range(world):
            mine = order[bounds[w]:bounds[w + 1]][(np.arange(bounds[w], bounds[w + 1]) % world) == rank]
            assert runs_of(mine) <= 2 * E.LANES // world  # a piece crosses at most one group boundary
            assert not seen & set(mine.tolist())
            seen |= set(mine.tolist())
        assert len(seen) == bounds[w + 1] - bounds[w]


def test_a_batch_mixes_samples_from_across_its_window():
    groups = np.repeat(np.arange(200), 48)
    order = EpochPlan(len(groups), 1, 8, 1, groups, 40).order(seed=0, epoch=0)
    distinct = [len(set(groups[order[i:i + 8]].tolist())) for i in range(0, len(order), 8)]
    assert np.mean(distinct) >= 6  # 8 samples of a batch from ~7 of a window's 40 groups (not one or two)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_delivers_what_reads_in_order_deliver(tiny_cache, workers):
    """Through the loader (workers or none), a grouped epoch delivers every sample once, each with what a read of it
    alone delivers: its tensors and its prompt's real tokens."""
    index = open_index([tiny_cache])  # 7 prompts x 4 steps in 3 shards; one read group of 16 prompts
    data = split(index, None, 0)
    plan = E.epoch_plan(data, 1, 4, 1, "grouped", 32)
    assert plan.window == 1 and len(np.unique(plan.groups)) == 1
    want = {}
    plain = D.SampleDataset(index, 32)
    for row in range(len(index)):
        item = plain[(row, 1.0)]
        want[item["key"]] = (item["fields"]["x_t"], item["context"])
    seen = []
    for batch in D.make_loader(D.SampleDataset(index, 32), E.RankBatches(plan, data.train_rows, 0, 0, 0), workers,
                               False):
        for j, key in enumerate(batch["keys"]):
            x_t, context = want[key]
            assert torch.equal(batch["fields"]["x_t"][j], x_t)
            assert torch.equal(batch["context"][j], context)
            seen.append(key)
    assert sorted(seen) == sorted(want) and len(seen) == len(index) == 28


def test_order_is_checked_and_on_the_command_line():
    with pytest.raises(ValueError, match="order must be one of auto, shuffle, grouped"):
        TrainStudentConfig(cache=("c",), student_config="s", out="o", order="random")


def embedding_reads(index, order: str, lru: int, monkeypatch) -> int:
    """Prompt embeddings read from disk over one epoch of train-student's plan in `order` with an LRU of `lru`."""
    count = {"n": 0}
    load = PartRows.trimmed

    def counted(self, *args):
        count["n"] += 1
        return load(self, *args)

    monkeypatch.setattr(PartRows, "trimmed", counted)
    data = split(index, None, 0)
    plan = E.epoch_plan(data, 1, 4, 1, order, lru)
    ds = D.SampleDataset(index, lru)
    for batch in D.make_loader(ds, E.RankBatches(plan, data.train_rows, 0, 0, 0), 0, False):
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


def test_train_trajectories_keeps_the_first_trajectories_that_are_not_held_out(tiny_cache):
    """`--train-trajectories N` trains on what a stage one over fewer prompts would have cached: the first N
    (cache, prompt, seed) trajectories in order, every step of each, the held-out prompts still held out."""
    from cache.reader import C_PROMPT

    index = open_index([tiny_cache])  # 7 prompts x 1 seed x 4 steps
    whole = split(index, None, 2)
    some = split(index, None, 2, 3)
    trained = sorted(set(index.table[some.train_rows, C_PROMPT].tolist()))
    assert trained == sorted(set(index.table[whole.train_rows, C_PROMPT].tolist()))[:3]
    assert len(some.train_rows) == 3 * 4 and np.array_equal(some.heldout_rows, whole.heldout_rows)
    assert not set(trained) & set(whole.heldout_prompts.tolist())
    assert some.digest() != whole.digest()  # a resume with another N is refused (the data selection differs)
    with pytest.raises(UserError, match=r"--train-trajectories 6: the caches hold 5 trajectories to train on"):
        split(index, None, 2, 6)
