"""The teacher's sampling loop, step for step as diffusers' `WanPipeline.__call__`, the conditional and unconditional
passes in one batched forward (halves a streamed placement's weight traffic); each step's x_t, guided prediction
(the target) and chosen blocks' features (docs/architecture.md, "Feature distillation") are handed on."""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass

import torch

from cache.feature_projection import project
from pipeline.errors import UserError
from pipeline.model_call import PLAIN, InputRule, Inputs, predict


def initial_noise(base_seed: int, prompt_idx: int, seed_idx: int, shape) -> torch.Tensor:
    """float32 noise [C, F, H, W], drawn on the CPU so every device and placement gets the same bits, seeded by
    (base seed, prompt, seed index) alone: the cache does not depend on batches, parts, ranks or interruptions."""
    digest = hashlib.sha256(f"wandistiller/{base_seed}/{prompt_idx}/{seed_idx}".encode()).digest()
    g = torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


@dataclass(frozen=True)
class Schedule:
    """The sampler's timestep schedule and which expert runs each step."""

    timesteps: list[float]
    sigmas: list[float]
    experts: list[int]  # 1 or 2 per step
    guidance: list[float]  # CFG scale per step (1.0 where CFG is off)
    cfg: bool

    @classmethod
    def build(cls, scheduler, steps: int, boundary_ratio: float | None, guidance: float,
              guidance_2: float | None) -> Schedule:
        s = copy.deepcopy(scheduler)
        s.set_timesteps(steps, device="cpu")
        boundary = None if boundary_ratio is None else boundary_ratio * s.config.num_train_timesteps
        g2 = guidance if guidance_2 is None else guidance_2
        cfg = guidance > 1.0  # WanPipeline.do_classifier_free_guidance looks at the first scale only
        high = [boundary is None or t >= boundary for t in s.timesteps]  # the high-noise expert's steps
        return cls([float(t) for t in s.timesteps], [float(x) for x in s.sigmas[: len(s.timesteps)]],
                   [1 if h else 2 for h in high], [(guidance if h else g2) if cfg else 1.0 for h in high], cfg)


@dataclass
class StepRecord:
    step: int
    timestep: float
    sigma: float
    expert: int
    guidance: float
    x_t: torch.Tensor  # [B, C, F, H, W] the model input (teacher dtype), on CPU
    target: torch.Tensor  # [B, ...] guided prediction the sampler stepped with (teacher dtype), on CPU
    target_cond: torch.Tensor | None = None
    target_uncond: torch.Tensor | None = None
    features: torch.Tensor | None = None  # [B, blocks, tokens or 1, D] (teacher-cache --record-features)


class FeatureRecorder:
    """Captures [B, len(blocks), tokens or 1, D] per forward by hooks that only look (targets stay bit-identical)."""

    def __init__(self, blocks: tuple[int, ...], matrix: torch.Tensor, pool: str, dtype: torch.dtype):
        self.blocks, self.matrix, self.pool, self.dtype = tuple(blocks), matrix, pool, dtype
        self._out: dict[int, torch.Tensor] = {}

    @staticmethod
    def check_blocks(blocks: tuple[int, ...], num_layers: int, expert: str) -> None:
        bad = [b for b in blocks if not 0 <= b < num_layers]
        if bad:
            raise UserError(f"--record-features {','.join(map(str, blocks))}: {expert} has blocks 0..{num_layers - 1}, "
                            f"not {bad}; choose blocks inside every expert")

    @contextlib.contextmanager
    def capture(self, model: torch.nn.Module, batch: int):
        """Record the chosen blocks' outputs of `model` (its first `batch` rows) in the forward inside the `with`."""
        self._out = {}
        handles = [model.blocks[b].register_forward_hook(self._hook(b, batch)) for b in self.blocks]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, block: int, batch: int):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                self._out[block] = project(hidden[:batch], self.matrix, self.pool).to("cpu", self.dtype)
        return hook

    def result(self) -> torch.Tensor:
        """The last captured forward: [B, len(blocks), tokens or 1, D] on the CPU."""
        missing = [b for b in self.blocks if b not in self._out]
        if missing:
            raise RuntimeError(f"teacher blocks {missing} did not run in the last forward")
        return torch.stack([self._out[b] for b in self.blocks], dim=1)


@dataclass
class TrajectoryRunner:
    """Runs blocks of trajectories with the teacher's experts and scheduler."""

    experts: list[torch.nn.Module]
    scheduler: object
    schedule: Schedule
    steps: int
    dtype: torch.dtype
    device: torch.device
    rule: InputRule = PLAIN
    keep_cond_uncond: bool = False
    features: FeatureRecorder | None = None
    record: frozenset[int] | None = None  # steps handed to on_step (None: every step); every step runs either way

    @torch.inference_mode()
    def run(self, noise: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, on_step=None,
            experts: tuple[int, ...] | None = None, state=None, condition: torch.Tensor | None = None):
        """Denoise `noise` [B, C, F, H, W] (float32) with embeddings `cond` [B, L, D] (and the trajectories' condition
        latent, where the rule takes one), each recorded step to `on_step`; with `experts`, only their steps, the
        returned state continuing later. Returns (final latents on CPU, state)."""
        if state is None:
            sched = copy.deepcopy(self.scheduler)
            sched.set_timesteps(self.steps, device=self.device)
            sched.set_begin_index(0)
            latents = noise.to(self.device, torch.float32)
        else:
            latents, sched = state
        cond = cond.to(self.device, self.dtype)
        negative = uncond.to(self.device, self.dtype) if self.schedule.cfg else None
        condition = None if condition is None else condition.to(self.device, torch.float32)
        b = latents.shape[0]
        for i, t in enumerate(sched.timesteps):
            expert = self.schedule.experts[i]
            if experts is not None and expert not in experts:
                continue
            model = self.experts[expert - 1]
            scale = self.schedule.guidance[i]
            latent_in = latents.to(self.dtype)
            kept = on_step is not None and (self.record is None or i in self.record)
            recording = self.features.capture(model, b) if self.features and kept else contextlib.nullcontext()
            with recording:
                pred = predict(model, Inputs(latent_in, t.expand(b), cond, negative, condition), scale, self.rule,
                               batched=True)
            if kept:
                keep = self.keep_cond_uncond and pred.cond is not None
                pair = [n.to(self.dtype).cpu() if keep else None for n in (pred.cond, pred.uncond)]
                on_step(StepRecord(i, float(t), self.schedule.sigmas[i], expert, scale, latent_in.cpu(),
                                   pred.guided.to(self.dtype).cpu(), *pair,
                                   self.features.result() if self.features else None))
            latents = sched.step(pred.guided, t, latents, return_dict=False)[0]
        return self.rule.finish(latents, condition).float().cpu(), (latents, sched)
