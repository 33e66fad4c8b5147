"""Which of a finished cache's trajectories the inference commands use (a held-out selection), and their
cached data through `cache/`'s readers: every step's (x_t, target), the initial noise and final latents,
and the negative prompt's embedding. No model is loaded and no cache file is parsed here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cache import format as F
from cache.manifest import negative_embeds
from cache.prompt_store import prompt_texts, read_latents
from cache.reader import SampleReader, open_index, prompt_rows
from pipeline.errors import UserError
from pipeline.prompts import dedupe, read_prompt_file

__all__ = ["Trajectory", "cache_prompts", "select", "iter_samples", "latents", "negative_embeds"]


@dataclass(frozen=True)
class Trajectory:
    """One (prompt, seed) of the cache."""

    prompt_idx: int
    seed_idx: int
    text: str


def cache_prompts(cache_dir: str | os.PathLike, manifest: dict) -> dict[int, str]:
    """prompt_idx -> text of every prompt the cache holds (rows never written are left out)."""
    return prompt_texts(cache_dir, int(manifest[F.F_NUM_PARTS]))


def select(cache_dir: str | os.PathLike, manifest: dict, heldout: str | None, max_prompts: int | None,
           only: list[int] | None = None) -> tuple[list[Trajectory], dict]:
    """All seeds of the cache's prompts, first `max_prompts`: those whose text is listed in the file `heldout`,
    else those whose index is in `only` (stage two's held-out prompts), else all."""
    texts = cache_prompts(cache_dir, manifest)
    info: dict = {"cache_prompts": len(texts), "source": "all prompts of the cache"}
    if heldout is not None:
        wanted, _ = dedupe(read_prompt_file(heldout))
        by_text = {t: i for i, t in texts.items()}
        chosen = [by_text[t] for t in wanted if t in by_text]
        info.update(source=f"prompts of {heldout}", heldout_file=str(heldout), heldout_prompts=len(wanted),
                    heldout_not_in_cache=len(wanted) - len(chosen))
        if not chosen:
            raise UserError(f"none of the {len(wanted)} prompts of {heldout} is in the cache {cache_dir}; build a "
                            "cache of the held-out prompts with `wandistiller teacher-cache` and evaluate on it")
    elif only:
        chosen = [p for p in sorted(set(only)) if p in texts]
        info["source"] = "heldout_prompts of distill.json"
        if not chosen:
            raise UserError(f"distill.json's held-out prompts {sorted(only)[:5]} are not in the cache {cache_dir}")
    else:
        chosen = list(texts)
    chosen = chosen[:max_prompts] if max_prompts else chosen
    info["prompts"] = len(chosen)
    seeds = int(manifest[F.F_SEEDS_PER_PROMPT])
    return [Trajectory(p, s, texts[p]) for p in chosen for s in range(seeds)], info


def iter_samples(cache_dir: str | os.PathLike, prompts: set[int]) -> Iterator[tuple[dict[str, torch.Tensor], dict]]:
    """(tensors, metadata) of every cached step of `prompts`, read by row through the cache's index (tar headers
    are scanned, only the selected samples' bytes are read), each checked against the schema."""
    index = open_index([cache_dir])
    reader = SampleReader(index)
    try:
        for row in prompt_rows(index, prompts):
            yield reader.read(int(row))
    finally:
        reader.close()


def latents(cache_dir: str | os.PathLike, manifest: dict, trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise and the teacher's final latents of `trajs`, each [N, C, F, H, W] float32."""
    return read_latents(cache_dir, int(manifest[F.F_NUM_PARTS]), [(t.prompt_idx, t.seed_idx) for t in trajs])
