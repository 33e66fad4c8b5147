"""The teacher's trajectories as a finished cache holds them, read without any model: which prompts (a
held-out selection), every step's (x_t, target) from the shards, the initial noise and final latents from
prompts.zarr, and the prompt embeddings padded exactly as the teacher's pipeline padded them.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from cache import format as F
from cache.errors import CacheError
from cache.prompt_store import open_prompt_store, prompt_store_path
from cache.writer import decode_sample
from pipeline.errors import UserError
from pipeline.prompts import dedupe, read_prompt_file


@dataclass(frozen=True)
class Trajectory:
    """One (prompt, seed) of the cache."""

    prompt_idx: int
    seed_idx: int
    text: str


def _store(cache_dir: Path, manifest: dict, prompt_idx: int):
    """(prompt store, row) of a prompt: prompt i lives in part i % num_parts, row i // num_parts."""
    n = int(manifest[F.F_NUM_PARTS])
    return open_prompt_store(prompt_store_path(cache_dir, prompt_idx % n)), prompt_idx // n


def cache_prompts(cache_dir: str | os.PathLike, manifest: dict) -> dict[int, str]:
    """prompt_idx -> text of every prompt the cache holds (rows never written are left out)."""
    out: dict[int, str] = {}
    for part in range(int(manifest[F.F_NUM_PARTS])):
        try:
            g = open_prompt_store(prompt_store_path(cache_dir, part))
            idx, seq, text = g[F.Z_PROMPT_IDX][:], g[F.Z_SEQ_LENS][:], g[F.Z_TEXT][:]
        except Exception as e:  # a missing or unreadable store is a broken cache
            raise CacheError(f"prompt store of part {part} in {cache_dir} is unreadable ({type(e).__name__}); "
                             "run `wandistiller cache verify`") from e
        out.update({int(i): str(t) for i, s, t in zip(idx, seq, text) if s >= 0})
    return dict(sorted(out.items()))


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


def iter_samples(cache_dir: str | os.PathLike, manifest: dict,
                 prompts: set[int]) -> Iterator[tuple[dict[str, torch.Tensor], dict]]:
    """(tensors, metadata) of every cached step of `prompts`, shard by shard; other members are skipped
    after their tar header (a seek, not a read)."""
    cache_dir = Path(cache_dir)
    for rec in manifest[F.F_SHARDS]:
        path = cache_dir / rec[F.S_PATH]
        pending: dict[str, dict[str, bytes]] = {}
        try:
            with tarfile.open(path, "r:") as tar:
                for info in tar:
                    key, _, ext = info.name.partition(".")
                    if not info.isfile() or F.parse_key(key)[0] not in prompts:
                        continue
                    members = pending.setdefault(key, {})
                    members[ext] = tar.extractfile(info).read()
                    if len(members) == 2:
                        yield decode_sample(pending.pop(key))
        except (OSError, tarfile.TarError, ValueError) as e:
            raise CacheError(f"shard {path} is unreadable ({e}); run `wandistiller cache verify`") from e
        if pending:
            raise CacheError(f"shard {path} has unpaired members ({sorted(pending)[0]}); run `wandistiller cache verify`")


def latents(cache_dir: str | os.PathLike, manifest: dict, trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise and the teacher's final latents of `trajs`, each [N, C, F, H, W] float32."""
    init, final = [], []
    for t in trajs:
        g, row = _store(Path(cache_dir), manifest, t.prompt_idx)
        init.append(np.asarray(g[F.Z_INIT_NOISE][row, t.seed_idx]))
        final.append(np.asarray(g[F.Z_FINAL_LATENTS][row, t.seed_idx]))
    return torch.from_numpy(np.stack(init)), torch.from_numpy(np.stack(final))


def negative_embeds(cache_dir: str | os.PathLike) -> torch.Tensor:
    """The negative prompt's embedding [L, D], padded like the prompts'."""
    path = Path(cache_dir) / F.NEGATIVE
    if not path.is_file():
        raise CacheError(f"{path} is missing; rerun the same `wandistiller teacher-cache` command")
    return load_file(path)[F.NEG_EMBEDS]
