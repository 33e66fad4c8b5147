"""The one teacher-free sampler of a trained student (`sample`, `eval`, `export` and stage two's validation all use
it), the schedule it samples with, and the timestep input of a Wan transformer that every stage must build alike:
docs/architecture.md, "Sampling a student"."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from cache.records import Manifest

from .artifact import DistillRecord
from .registries import CHOSEN

UNIPC = "UniPCMultistepScheduler"
FLOW_EULER = "FlowMatchEulerDiscreteScheduler"
SAMPLER = "sampler"  # distill.json's objective_settings key: an objective's own sampler, a key of SAMPLERS
# UniPC's corrector is disabled per step index; this many covers any step count a Wan pipeline runs.
_NO_CORRECTOR = 1000


def _record(source) -> DistillRecord | Manifest:
    """A DistillRecord or a cache Manifest; distill.json's dict read as a DistillRecord."""
    return DistillRecord.from_json(source) if isinstance(source, Mapping) else source


def scheduler_from_config(config: Mapping):
    """A diffusers scheduler from a config holding its `_class_name` (what a manifest records)."""
    import diffusers

    conf = dict(config)
    name = conf.pop("_class_name", None)
    cls = getattr(diffusers, str(name), None)
    if cls is None:
        raise ValueError(f"scheduler {name!r} is unknown to diffusers {diffusers.__version__}")
    return cls.from_config(conf)


def is_flow_matching(config: Mapping) -> bool:
    """Whether the scheduler samples a flow-matching model on flow sigmas (what Euler segments need)."""
    name = config.get("_class_name")
    if name == FLOW_EULER:
        return not config.get("use_dynamic_shifting", False)
    return (name == UNIPC and bool(config.get("use_flow_sigmas")) and config.get("prediction_type") == "flow_prediction"
            and config.get("final_sigmas_type", "zero") == "zero")


def euler_config(config: Mapping) -> dict:
    """The teacher's flow-matching scheduler config turned into a first-order Euler sampler on the same sigmas."""
    if not is_flow_matching(config):
        raise ValueError(f"scheduler {config.get('_class_name')!r} does not sample flow-matching sigmas to 0 "
                         f"({UNIPC} with use_flow_sigmas, or {FLOW_EULER}); a few-step Euler schedule needs one")
    conf = dict(config)
    if conf["_class_name"] == UNIPC:
        conf.update(solver_order=1, disable_corrector=list(range(_NO_CORRECTOR)), lower_order_final=True)
    else:
        conf.update(stochastic_sampling=False)
    return conf


def schedule_sigmas(config: Mapping, steps: int) -> list[float]:
    """The `steps` sigmas a scheduler of `config` visits (without the final 0)."""
    s = scheduler_from_config(config)
    s.set_timesteps(steps)
    return [float(v) for v in s.sigmas[:steps]]


def segment_boundaries(config: Mapping, steps: int, student_steps: int,
                       cached_sigmas: list[float] | None = None) -> tuple[list[int], bool]:
    """(K boundary steps of the N-step cached schedule, exact): the cached step nearest in sigma to each point of
    the K-step Euler schedule, from step 0; `exact` when those are the cached sigmas (K divides N for UniPC)."""
    if not 1 <= student_steps <= steps:
        raise ValueError(f"student steps must be in 1..{steps} (the cache's steps), got {student_steps}")
    cached = cached_sigmas if cached_sigmas is not None else schedule_sigmas(config, steps)
    grid = schedule_sigmas(euler_config(config), student_steps)
    bounds = [min(range(steps), key=lambda k: (abs(cached[k] - g), k)) for g in grid]
    bounds[0] = 0
    if len(set(bounds)) != len(bounds) or bounds != sorted(bounds):
        bounds = sorted(set(bounds))
    exact = len(bounds) == student_steps and all(abs(cached[b] - g) <= 1e-6 for b, g in zip(bounds, grid))
    return bounds, exact


def chosen_boundaries(header, choice: Mapping, recorded) -> list[int]:
    """The boundary steps a segment student chose (`choice`: its settings) on the schedule of `header`, each a
    `recorded` step: `student_timesteps`; else in each part (the whole, or each expert's by `student_expert_steps`)
    its steps cut equally, or a flow schedule shifted by `student_shift` over its sigmas, at the nearest recorded
    steps. ValueError, one line, for a choice the cache cannot train."""
    n, sig, ts = int(header.steps), [float(v) for v in header.sigmas], [int(t) for t in header.timesteps]
    rec, (k, explicit, shift, split) = sorted(recorded), (choice.get(key) for key in ("student_steps", *CHOSEN))
    listed = lambda steps: ",".join(str(ts[s]) for s in steps)  # noqa: E731
    if explicit is not None:
        step = {t: s for s, t in enumerate(ts)}
        if shift is not None or split is not None:
            raise ValueError("--student-timesteps names the boundaries: drop --student-shift, --student-expert-steps")
        if missing := [t for t in explicit if step.get(t) not in rec]:
            raise ValueError(f"--student-timesteps {','.join(map(str, missing))}: not steps the cache recorded; choose "
                             f"from its recorded timesteps {listed(rec)}")
        if (bounds := [step[t] for t in explicit])[0] != 0 or bounds != sorted(set(bounds)):
            raise ValueError(f"--student-timesteps must fall from the first step's {ts[0]}, got {list(explicit)}")
    else:
        parts, flag, bounds = [(0, n, k, "")], "--student-expert-steps" if split else "--student-shift", []
        if split is not None:
            b = next((s for s in range(n) if header.experts[s] != header.experts[0]), n)
            if len(split) != 2 or 0 in split or b == n:
                raise ValueError(f"{flag} H,L gives each of the teacher's two experts at least 1 step; the cache's "
                                 + (f"{n} steps are {b} high-noise, {n - b} low" if b < n else "teacher runs one"))
            parts = [(0, b, split[0], " of the high-noise expert"), (b, n, split[1], " of the low-noise expert")]
        for a, e, m, whose in parts:
            end = sig[e] if e < n else 0.0
            want = [sig[a + round(j * (e - a) / m)] if shift is None else
                    end + (sig[a] - end) * shift * (1 - j / m) / (1 + (shift - 1) * (1 - j / m)) for j in range(m)]
            near = lambda pool: [min(pool, key=lambda s: (abs(sig[s] - w), s)) for w in want]  # noqa: E731
            if len(set(ideal := near(range(a, e)))) < m:
                raise ValueError(f"{flag}: {m} boundaries in the {e - a} steps{whose} meet; choose fewer")
            if len(set(got := near([s for s in rec if a <= s < e] or [a]))) < m:
                raise ValueError(f"{flag}: the cache records too few of the steps{whose} ({listed(range(a, e))}) for "
                                 f"{m} boundaries; rebuild it with --keep-steps {','.join(map(str, ideal))}")
            bounds += got
    if k is not None and len(bounds) != k:
        raise ValueError(f"--student-steps {k}, but the chosen schedule has {len(bounds)} steps; drop --student-steps")
    return bounds


def chosen_points(source) -> np.ndarray | None:
    """The points (scheduler's `sigmas=`, before its shift) of the boundaries a segment student chose; None: none."""
    r = _record(source)
    s, t = r.objective_settings, float(r.scheduler.get("num_train_timesteps", 1000))
    if not any(s.get(c) is not None for c in CHOSEN):
        return None
    sched = scheduler_from_config(r.scheduler)  # the unshifted points each flow scheduler starts from
    return (np.linspace(1, 1 / t, r.steps + 1)[:-1] if r.scheduler["_class_name"] == UNIPC else
            np.linspace(sched.sigma_max * t, sched.sigma_min * t, r.steps) / t)[s["boundaries"]]


def student_scheduler(source):
    """A fresh scheduler for the student `source` describes: its objective's own sampler, else the teacher's; at the
    student's K steps, on the boundaries it chose (`chosen_points`)."""
    record = _record(source)
    sampler = own_sampler(record)
    sched = scheduler_from_config(SAMPLERS[sampler](record.scheduler) if sampler else record.scheduler)
    if sampler and (points := chosen_points(record)) is not None:
        plain = sched.set_timesteps
        sched.set_timesteps = lambda steps, device=None: plain(
            steps, device=device, sigmas=points if steps == len(points) else None)
    return sched


def own_sampler(source) -> str | None:
    """The sampler the student's objective recorded (a key of SAMPLERS); None: it samples as the teacher does."""
    record = _record(source)
    return record.objective_settings.get(SAMPLER) if isinstance(record, DistillRecord) else None


def student_steps(source) -> int:
    """Sampling steps of the student described by `source`: its own (student_steps), else the teacher's."""
    record = _record(source)
    return record.sampling_steps if isinstance(record, DistillRecord) else record.steps


def model_timestep(t: torch.Tensor, latent_fhw: tuple[int, int, int], expand: bool,
                   patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """Timestep input for per-sample timesteps `t` [B]: `t`, or with `expand` (TI2V) one per token, as WanPipeline."""
    if not expand:
        return t
    f, h, w = (int(v) for v in latent_fhw)
    tokens = f * len(range(0, h, int(patch[1]))) * len(range(0, w, int(patch[2])))
    return t[:, None].expand(-1, tokens)


@torch.no_grad()
def sample_latents(transformer, scheduler, init_noise: torch.Tensor, prompt_embeds: torch.Tensor, steps: int,
                   guidance: float = 1.0, negative_embeds: torch.Tensor | None = None, *,
                   expand_timesteps: bool = False, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """Final latents [B, C, F, H, W] (float32) of `steps` denoising steps of `transformer` from `init_noise`, op for op
    as WanPipeline; `negative_embeds` [B or 1, L, D] is needed when `guidance` > 1 (CFG, two forwards per step)."""
    device = next(transformer.parameters()).device
    dtype = transformer.dtype
    cfg = guidance > 1.0
    if cfg and negative_embeds is None:
        raise ValueError("guidance > 1 needs negative_embeds (classifier-free guidance)")
    embeds = prompt_embeds.to(device).to(dtype)
    neg = negative_embeds.to(device).to(dtype).expand(embeds.shape[0], -1, -1) if cfg else None
    scheduler.set_timesteps(steps, device=device)
    scheduler.set_begin_index(0)
    latents = init_noise.to(device=device, dtype=torch.float32)
    for t in scheduler.timesteps:
        x = latents.to(dtype)
        timestep = model_timestep(t.expand(latents.shape[0]), latents.shape[2:], expand_timesteps, patch)
        pred = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds, attention_kwargs=None,
                           return_dict=False)[0]
        if cfg:
            uncond = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=neg, attention_kwargs=None,
                                 return_dict=False)[0]
            pred = uncond + guidance * (pred - uncond)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Frames [B, F, H, W, 3] float in [0, 1] (on the CPU) of final latents, decoded as WanPipeline decodes them."""
    z = vae.config.z_dim
    lat = latents.to(next(vae.parameters()).device, dtype=vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
    video = vae.decode(lat / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
    return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu()


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error in float32: [B, ...] x [B, ...] -> [B]."""
    return (a.float() - b).pow(2).flatten(1).mean(1)


def pseudo_huber(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """Per-sample pseudo-Huber distance in float32, sqrt(mse + c^2) - c: quadratic below c, the RMS error above."""
    return (mse(a, b) + c * c).sqrt() - c


SAMPLERS = {"euler": euler_config}  # an objective's own sampler: the student's scheduler config from the teacher's
