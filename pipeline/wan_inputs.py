"""Inputs of a Wan transformer that every stage (teacher, student, inference) must build identically."""

from __future__ import annotations

import torch


def model_timestep(t: torch.Tensor, latent_fhw: tuple[int, int, int], expand: bool,
                   patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """The transformer's timestep input for per-sample timesteps `t` [B]: `t` itself, or with `expand` (Wan 2.2
    TI2V) one per token, [B, F * ceil(H/ph) * ceil(W/pw)], as WanPipeline's mask sampled at the patch stride."""
    if not expand:
        return t
    f, h, w = (int(v) for v in latent_fhw)
    tokens = f * len(range(0, h, int(patch[1]))) * len(range(0, w, int(patch[2])))
    return t[:, None].expand(-1, tokens)
