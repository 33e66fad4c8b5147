"""The guidance scale as a student's input (docs/architecture.md, "Guidance as a dial"): a student trained over a range
of scales (train-student --guidance-range) embeds the scale it is asked for as Wan embeds a timestep, and adds it to
its time embedding, as Flux's guidance embedding and LCM's w-embedding do. The embedding is a submodule of the
transformer (`guidance_embedder.*` in its weights, `guidance_embedding` in its config.json), so checkpoints, the EMA,
FSDP and the student folder carry it unchanged; `bake` folds one scale into the time embedding's bias, which makes a
plain WanTransformer3DModel again (what `export --guidance-scale` writes)."""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)
CONFIG_KEY = "guidance_embedding"  # config.json: the range it learned, [lo, hi]
NAME = "guidance_embedder"  # its submodule, and its tensors' prefix
SCALE = 1000.0  # the scale enters the sinusoids as Flux's and LCM's do: w * 1000, like a timestep


class GuidanceEmbedding(torch.nn.Module):
    """w -> an addition to the time embedding: the timestep's sinusoids of 1000 w and an MLP whose last layer starts at
    zero (an untrained one changes nothing)."""

    def __init__(self, freq_dim: int, dim: int, lo: float, hi: float):
        from diffusers.models.embeddings import TimestepEmbedding, Timesteps

        super().__init__()
        self.proj = Timesteps(freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)  # (Wan's timestep features)
        self.embed = TimestepEmbedding(freq_dim, dim)
        torch.nn.init.zeros_(self.embed.linear_2.weight)
        torch.nn.init.zeros_(self.embed.linear_2.bias)
        self.scale: torch.Tensor | None = None  # [B]: the scales of the forward under way (`given`)
        self.range = (float(lo), float(hi))  # the scales it is trained on

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        p = self.embed.linear_1.weight
        return self.embed(self.proj(w.to(p.device, torch.float32) * SCALE).to(p.dtype))


def _add(embedder: GuidanceEmbedding, _module, _args, temb: torch.Tensor) -> torch.Tensor:
    if embedder.scale is None:
        raise RuntimeError("a guidance-conditioned student was called without its scale (model_call.Inputs.guidance_input)")
    g = embedder(embedder.scale).to(temb.dtype)  # [B, D]; temb [B, D], or [B, tokens, D] (per-token timesteps)
    return temb + g.view(g.shape[0], *[1] * (temb.dim() - 2), g.shape[-1])


def attach(model: torch.nn.Module, lo: float, hi: float) -> torch.nn.Module:
    """Give the WanTransformer3DModel `model` a guidance embedding (fresh, a no-op until trained) for scales lo..hi."""
    cfg = model.config
    embedder = GuidanceEmbedding(int(cfg.freq_dim), int(cfg.num_attention_heads) * int(cfg.attention_head_dim), lo, hi)
    p = next(model.condition_embedder.time_embedder.parameters())
    model.add_module(NAME, embedder.to(p.device))
    model.condition_embedder.time_embedder.register_forward_hook(lambda m, a, out: _add(embedder, m, a, out))
    model.register_to_config(**{CONFIG_KEY: [float(lo), float(hi)]})
    return model


def trained_range(config) -> tuple[float, float] | None:
    """The scales a student's config.json says it learned; None: it takes no scale."""
    r = dict(config).get(CONFIG_KEY)
    return None if r is None else (float(r[0]), float(r[1]))


def scale_for(model: torch.nn.Module, guidance: float) -> float | None:
    """The scale to ask of `model` where it is compared with a teacher drawn at `guidance`: that one, for a student
    that takes the scale; None for any other (sample_latents' `scale`)."""
    ranges = [m.range for m in model.modules() if isinstance(m, GuidanceEmbedding)]
    if ranges and not ranges[0][0] <= guidance <= ranges[0][1]:
        log.warning("guidance %g is outside the scales %g..%g the student learned: it extrapolates", guidance,
                    *ranges[0])
    return float(guidance) if ranges else None


@contextlib.contextmanager
def given(model: torch.nn.Module, scale: torch.Tensor):
    """The scales [B] every guidance embedding of `model` (DDP-wrapped, or a LoRA's experts) reads in this forward."""
    embedders = [m for m in model.modules() if isinstance(m, GuidanceEmbedding)]
    for m in embedders:
        m.scale = scale
    try:
        yield
    finally:
        for m in embedders:
            m.scale = None


def load_tensors(model: torch.nn.Module, folder, files: list[str]) -> None:
    """The guidance embedding's tensors from the student folder's safetensors `files` (already checked against its
    config by the student kind), into the embedding `attach` gave `model`."""
    from safetensors import safe_open

    state = {}
    for f in files:
        with safe_open(str(folder / f), framework="pt") as st:
            state |= {k.removeprefix(NAME + "."): st.get_tensor(k) for k in st.keys() if k.startswith(NAME + ".")}
    getattr(model, NAME).load_state_dict(state, strict=True)


@torch.no_grad()
def bake(model: torch.nn.Module, w: float) -> torch.nn.Module:
    """`model` at the one scale `w`, as a plain WanTransformer3DModel: the embedding of w is a constant added to the
    time embedding's output, so it becomes part of that layer's bias (exact), and the embedding is removed."""
    from diffusers.configuration_utils import FrozenDict

    embedder = getattr(model, NAME)
    linear = model.condition_embedder.time_embedder.linear_2
    linear.bias += embedder(torch.tensor([w]))[0].to(linear.bias.dtype)
    model.condition_embedder.time_embedder._forward_hooks.clear()
    delattr(model, NAME)
    model._internal_dict = FrozenDict({k: v for k, v in model.config.items() if k != CONFIG_KEY})
    return model
