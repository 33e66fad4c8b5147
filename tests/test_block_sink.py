"""Stage one's BlockSink commits each shard (final latents, fsync, progress record) in a thread of its own while
the next shard is written: commits land in shard order, the progress record only ever lists shards whose final
latents are written, and a failed commit stops the run at the writer's next call, naming its cause."""

from __future__ import annotations

import errno

import pytest
import torch

from conftest import sample_header
from cache import format as F
from cache.part_progress import PartProgress
from cache.prompt_store import create_prompt_store, open_prompt_store, prompt_store_path
from stages.teacher_cache import blocks
from stages.teacher_cache.trajectory import StepRecord

LATENT = (4, 1, 2, 2)
STEPS = 2


class Figures:
    def __init__(self):
        self.shards: list[str] = []

    def block(self, samples: int) -> None:
        pass

    def shard(self, record) -> None:
        self.shards.append(record.path)


def _sink(tmp_path, prompts: int, per_shard: int):
    prog = PartProgress(part=0, num_parts=1, fingerprint="x", prompts=prompts, blocks=prompts, batch_size=1,
                        samples_per_shard=per_shard, header=sample_header(steps=STEPS, latent_shape=list(LATENT)))
    prog.save(tmp_path)
    create_prompt_store(prompt_store_path(tmp_path, 0), prompts, 4, 8, "float32", 1, LATENT)
    store = open_prompt_store(prompt_store_path(tmp_path, 0), mode="r+")
    figures = Figures()
    return blocks.BlockSink(tmp_path, prog, store, per_shard, 1, figures), prog, store, figures


def _block(sink, p: int) -> None:
    records = [StepRecord(step=k, timestep=1000.0 - k, sigma=1.0 - k / STEPS, expert=1, guidance=1.0,
                          x_t=torch.full((1, *LATENT), float(p)), target=torch.full((1, *LATENT), -float(p)))
               for k in range(STEPS)]
    sink.add(p, [(p, 0)], records, torch.full((1, 1, *LATENT), p + 0.5))


def test_shards_commit_in_order_with_their_final_latents(tmp_path):
    sink, prog, store, figures = _sink(tmp_path, prompts=7, per_shard=2 * STEPS)  # two blocks a shard
    for p in range(7):
        _block(sink, p)
    sink.flush()
    sink.close()
    saved = PartProgress.load(tmp_path, 0)
    paths = [s.path for s in saved.shards]
    assert paths == sorted(paths) == figures.shards and len(paths) == 4
    assert [s.blocks for s in saved.shards] == [[0, 1], [2, 3], [4, 5], [6]]
    assert saved.done_blocks == list(range(7))
    finals = open_prompt_store(prompt_store_path(tmp_path, 0))[F.Z_FINAL_LATENTS][:]
    assert all((finals[p] == p + 0.5).all() for p in range(7))


def test_a_failed_commit_stops_the_writer_and_records_nothing_after_it(tmp_path, monkeypatch):
    sink, prog, store, _ = _sink(tmp_path, prompts=8, per_shard=STEPS)  # a shard per block
    real, calls = blocks.write_latent_rows, []

    def full_disk(*args, **kw):
        calls.append(args[2])
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(blocks, "write_latent_rows", full_disk)
    with pytest.raises(OSError, match="No space left"):
        for p in range(8):
            _block(sink, p)
        sink.flush()
    sink.abort()
    saved = PartProgress.load(tmp_path, 0)
    assert saved.done_blocks == [0] and [s.blocks for s in saved.shards] == [[0]]
    assert len(calls) == 2  # nothing committed after the failure
