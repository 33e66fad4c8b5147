"""The one place a Wan transformer is called (docs/architecture.md, "The model call"): what it is called with
(`Inputs`), the rule its inputs follow (`InputRule`, read from the teacher's folder or a cache's header), and
`predict`, which builds the per-token timestep and the condition once. The teacher's sampler and stage one's
trajectories, the student's loss, eval, the discriminator, the LoRA router and the benches all call it, as diffusers'
WanPipeline and WanImageToVideoPipeline both end in one transformer call."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cache import format as F

from . import guidance_input
from .teacher_files import I2V_PIPELINE

NONE, CONCAT, FIRST_FRAME = F.NO_CONDITION, F.CONCAT, F.FIRST_FRAME


@dataclass(frozen=True)
class Layout:
    """Where a condition latent goes: stacked on the noisy latent's channels, or in place of some of its latent
    `frames` (whose tokens, under per-token timesteps, sit at t = 0: they are given, not denoised)."""

    channels: bool = False
    frames: slice | None = None


# Each condition a cache header may name (cache/format.py CONDITIONS), laid out: the one place that says how.
LAYOUTS = {NONE: Layout(), CONCAT: Layout(channels=True), FIRST_FRAME: Layout(frames=slice(0, 1))}


@dataclass(frozen=True)
class InputRule:
    """How a transformer takes its inputs. `per_token`: one timestep per latent token (Wan2.2-TI2V's
    expand_timesteps); `condition`: a key of LAYOUTS (none; `concat`: the image-to-video mask and image latent
    stacked on the channels, Wan2.x-I2V; `first_frame`: TI2V's image latent in frame 0)."""

    patch: tuple[int, int, int] = (1, 2, 2)
    per_token: bool = False
    condition: str = NONE

    def __post_init__(self):
        if self.condition not in LAYOUTS:
            raise ValueError(f"condition {self.condition!r} is not one of {', '.join(LAYOUTS)}")

    @classmethod
    def of(cls, source) -> InputRule:
        """The rule a cache's Manifest, a DistillRecord or a teacher spec records (expand_timesteps, patch_size and,
        where recorded, condition)."""
        return cls(tuple(int(v) for v in getattr(source, "patch_size", (1, 2, 2))),
                   bool(getattr(source, "expand_timesteps", False)), getattr(source, "condition", None) or NONE)

    @classmethod
    def of_teacher(cls, index, transformer, images: bool) -> InputRule:
        """The rule of a Wan teacher from its model_index and transformer config, drawing from images or not (an
        image-to-video pipeline always does): TI2V's image in frame 0, Wan I2V's on the channels."""
        per_token = bool(index.get("expand_timesteps", False))
        image = images or index.get("_class_name") == I2V_PIPELINE
        return cls(tuple(int(v) for v in transformer.get("patch_size", (1, 2, 2))), per_token,
                   (FIRST_FRAME if per_token else CONCAT) if image else NONE)

    @classmethod
    def of_pipeline(cls, pipe) -> InputRule:
        """The rule of a loaded diffusers Wan pipeline (its class, its expand_timesteps, its transformer's patch)."""
        return cls.of_teacher({**pipe.config, "_class_name": type(pipe).__name__}, pipe.transformer.config, False)

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.condition]

    def learned_frames(self, frames: int) -> list[int] | None:
        """The latent frames a model predicts, where a condition gives some (TI2V's image mode: frame 0, which the
        pipeline re-imposes on its output); None: all of them."""
        given = self.layout.frames
        return None if given is None else [f for f in range(frames) if f not in range(frames)[given]]

    def tokens(self, latent_fhw) -> int:
        f, h, w = (int(v) for v in latent_fhw)
        return f * len(range(0, h, self.patch[1])) * len(range(0, w, self.patch[2]))

    def timestep(self, t: torch.Tensor, latent_fhw) -> torch.Tensor:
        """The timestep input for per-sample timesteps `t` [B]: `t`, or one per token as WanPipeline lays them out;
        a condition's frames at 0 (WanImageToVideoPipeline's first_frame_mask)."""
        if not self.per_token:
            return t
        given = self.layout.frames
        if given is None:
            return t[:, None].expand(-1, self.tokens(latent_fhw))
        f = int(latent_fhw[0])
        per_frame = t[:, None].expand(-1, f).clone()
        per_frame[:, given] = 0
        return per_frame.repeat_interleave(self.tokens((1, *tuple(latent_fhw)[1:])), dim=1)

    def hidden(self, latent: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
        """The transformer's hidden_states for a noisy latent [B, C, F, H, W] and its condition."""
        if condition is None or self.condition == NONE:
            return latent
        condition = condition.to(latent.dtype)
        if self.layout.channels:
            return torch.cat([latent, condition], dim=1)
        out = latent.clone()
        out[:, :, self.layout.frames] = condition
        return out

    def finish(self, latent: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
        """Final latents as the pipeline returns them: a condition's frames re-imposed."""
        return latent if self.layout.channels else self.hidden(latent, condition)


PLAIN = InputRule()


@dataclass
class Inputs:
    """One call's inputs: the noisy latent [B, C, F, H, W], per-sample timesteps [B], the text embeddings [B, L, D]
    and, where the rule asks, the negative embeddings (classifier-free guidance), the condition latent and the image
    embeddings (Wan2.1-I2V's CLIP tokens); for a student that takes the guidance scale as an input
    (pipeline/guidance_input.py), the scale asked of it [B]."""

    latent: torch.Tensor
    t: torch.Tensor
    text: torch.Tensor
    negative: torch.Tensor | None = None
    condition: torch.Tensor | None = None
    image: torch.Tensor | None = None
    guidance_input: torch.Tensor | None = None


@dataclass
class Prediction:
    """The guided prediction and, under guidance, its conditional and unconditional branches."""

    guided: torch.Tensor
    cond: torch.Tensor | None = None
    uncond: torch.Tensor | None = None


def forward(model, hidden: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
            image: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """The transformer's raw forward on inputs already laid out (the LoRA router passes its rows through here)."""
    if image is not None:
        kwargs["encoder_hidden_states_image"] = image
    return model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False, **kwargs)[0]


def predict(model, x: Inputs, guidance: float = 1.0, rule: InputRule = PLAIN, *, batched: bool = False,
            **kwargs) -> Prediction:
    """The model's prediction on `x`; with `guidance` > 1, classifier-free guidance from `x.negative`, its branches
    run as WanPipeline runs them (two forwards) or, `batched`, in one forward of twice the batch (stage one). The
    branches run whenever `x.negative` is given (a guidance of 1 then still records them)."""
    if x.negative is None and guidance > 1.0:
        raise ValueError("guidance > 1 needs negative embeddings (classifier-free guidance)")
    if x.guidance_input is not None:  # (a student taking the scale as an input: it reads it during this forward)
        with guidance_input.given(model, x.guidance_input):
            return predict(model, replace(x, guidance_input=None), guidance, rule, batched=batched, **kwargs)
    hidden = rule.hidden(x.latent, x.condition)
    timestep = rule.timestep(x.t, x.latent.shape[2:])
    if x.negative is None:
        return Prediction(forward(model, hidden, timestep, x.text, x.image, **kwargs))
    negative = x.negative.expand(x.text.shape[0], -1, -1)
    if batched:
        image = None if x.image is None else torch.cat([x.image, x.image])
        out = forward(model, torch.cat([hidden, hidden]), torch.cat([timestep, timestep]),
                      torch.cat([x.text, negative]), image, **kwargs)
        cond, uncond = out.chunk(2)
    else:
        cond = forward(model, hidden, timestep, x.text, x.image, **kwargs)
        uncond = forward(model, hidden, timestep, negative, x.image, **kwargs)
    return Prediction(uncond + guidance * (cond - uncond), cond, uncond)
