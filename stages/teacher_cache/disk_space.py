"""Refuse, before any weight loads, a teacher-cache run whose cache would not fit the free disk at --out (projected
with `cache.size`; the ranks of a node counted together: docs/architecture.md, "The cache")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cache.part_progress import PartProgress
from cache.schema import recorded_steps
from cache.size import embed_tokens_bound, human, latent_bytes, prompt_bytes, sample_disk_bytes, shard_bytes
from pipeline.errors import UserError
from pipeline.runtime import print0


def remaining_bytes(header: dict, texts: list[str], blocks: list[list], prog: PartProgress | None,
                    samples_per_shard: int) -> tuple[int, int, int]:
    """(shard bytes, prompt-store bytes, samples) the part still writes (`prog` None: nothing done yet); the store's
    embeddings at the bound their text allows before encoding, else the final latents still to come."""
    done = set(prog.done_blocks) if prog is not None else set()
    todo = [len(b) for i, b in enumerate(blocks) if i not in done]
    recorded = len(recorded_steps(header))
    shards = shard_bytes([n * recorded for n in todo], samples_per_shard, sample_disk_bytes(header))
    if prog is None or not prog.encoded:
        tokens = sum(embed_tokens_bound(t, header) for t in texts) / max(len(texts), 1)
        store = round(len(texts) * prompt_bytes(header, tokens))
    else:
        store = sum(todo) * latent_bytes(header)  # the final latents still to come
    return shards, store, sum(todo) * recorded


def check_free(out: Path, header: dict, texts: list[str], blocks: list[list], prog: PartProgress | None,
               samples_per_shard: int, torchrun: bool) -> None:
    """Print what the part will still write, and refuse (UserError, one line) when it exceeds the free disk."""
    shards, store, samples = remaining_bytes(header, texts, blocks, prog, samples_per_shard)
    need = shards + store
    if need == 0:
        return
    sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))) if torchrun else 1
    free = shutil.disk_usage(out).free
    ranks = f" x {sharing} ranks of this node" if sharing > 1 else ""
    print0(f"projected: {human(need)} more to write{ranks} ({samples} samples, {human(shards)} of shards + "
           f"{human(store)} of prompt store); {human(free)} free at {out}")
    if need * sharing <= free:
        return
    recorded, steps = len(recorded_steps(header)), int(header.steps)
    per_step = shards / recorded
    raise UserError(f"--out {out} has {human(free)} free, and this run would write {human(need * sharing)} more "
                    f"({samples} samples{ranks}: {human(shards)} of shards, {human(store)} of prompt store); free "
                    f"space, record fewer steps per trajectory with --record-steps N (now {recorded} of {steps}; each "
                    f"step costs ~{human(per_step * sharing)} here), or pass another --out")
