"""Inputs of a Wan transformer that every stage builds the same way.

Wan 2.2 TI2V (`expand_timesteps`) gives the transformer one timestep per latent token rather than one per
sample. diffusers' `WanPipeline` builds it from a mask over the latent grid sampled at the spatial patch
stride (`mask[0][0][:, ::p, ::p]`); stage one (the teacher), stage two (the student) and the inference
commands must lay it out identically, so they all call this one function.
"""

from __future__ import annotations

import torch


def model_timestep(t: torch.Tensor, latent_fhw: tuple[int, int, int], expand: bool,
                   patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """The transformer's timestep input for per-sample timesteps `t` [B].

    Without `expand` that is `t` itself. With it, one value per token: the latent's frames times its rows
    and columns taken every patch-stride (what `WanPipeline` computes), [B, F * ceil(H/ph) * ceil(W/pw)].
    """
    if not expand:
        return t
    f, h, w = (int(v) for v in latent_fhw)
    tokens = f * len(range(0, h, int(patch[1]))) * len(range(0, w, int(patch[2])))
    return t[:, None].expand(-1, tokens)
