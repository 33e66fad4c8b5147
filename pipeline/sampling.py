"""The one teacher-free sampler of a trained student (`sample`, `eval`, `export` and stage two's validation all use
it) and the schedule it samples with: docs/architecture.md, "Sampling a student"."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from cache.records import Manifest

from .artifact import DistillRecord
from .model_call import PLAIN, InputRule, Inputs, predict
from .registries import CHOSEN, grid_spec

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


@dataclass(frozen=True)
class StudentGrid:
    """A segment student's K boundaries on a teacher's N-step schedule (`student_grid`): the teacher steps they are,
    the sigma each boundary asked for, the sigma and timestep of the step it is, and the expert that runs it."""

    spec: str | None  # its --for-students spelling (None: explicit --student-timesteps)
    bounds: list[int]
    wanted: list[float]
    sigmas: list[float]
    timesteps: list[int]
    experts: list[int]

    @property
    def off(self) -> float:
        """How far (in sigma) the farthest boundary lies from the point it asked for: 0 when the grid is the
        teacher's steps, else the teacher's steps fall between the grid's points."""
        return max(abs(w - s) for w, s in zip(self.wanted, self.sigmas))

    def split(self) -> str:
        return "+".join(str(self.experts.count(e)) for e in sorted(set(self.experts)))

    def describe(self) -> str:
        """One line: the steps, their timesteps and experts, and the distance to the grid's own sigmas."""
        near = ("on the grid's sigmas" if self.off <= 1e-4 else
                f"the grid's sigmas {','.join(f'{w:.4g}' for w in self.wanted)} fall between the teacher's steps: "
                f"off by up to {self.off:.4f} in sigma ({1000 * self.off:.1f} timesteps)")
        experts = (f", experts {','.join(map(str, self.experts))} ({self.split()})" if len(set(self.experts)) > 1
                   else "")
        return (f"steps {','.join(map(str, self.bounds))} (t {','.join(map(str, self.timesteps))}){experts}; "
                f"{near}")


def student_grid(header, choice: Mapping) -> StudentGrid:
    """The boundaries the segment student `choice` (its StudentSchedule settings) takes on the schedule of `header`
    (steps, sigmas, timesteps, experts, scheduler), over every step: equal segments (--student-steps K), the K points
    of a flow schedule shifted by S from sigma 1 (--student-shift: Wan2.2-Lightning's and ComfyUI's ModelSamplingSD3
    grid; with --student-expert-steps H,L the split it must give at the teacher's expert boundary), each expert's
    steps cut equally (--student-expert-steps alone), or the timesteps named (--student-timesteps). Each boundary is
    the step nearest its sigma. ValueError, one line, for a grid the schedule cannot hold."""
    n, sig, ts = int(header.steps), [float(v) for v in header.sigmas], [int(t) for t in header.timesteps]
    experts = [int(e) for e in header.experts]
    k, explicit, shift, split = (choice.get(key) for key in ("student_steps", *CHOSEN))
    near = lambda w, pool: min(pool, key=lambda s: (abs(sig[s] - w), s))  # noqa: E731
    if explicit is not None:
        step = {t: s for s, t in enumerate(ts)}
        if shift is not None or split is not None:
            raise ValueError("--student-timesteps names the boundaries: drop --student-shift, --student-expert-steps")
        if missing := [t for t in explicit if t not in step]:
            raise ValueError(f"--student-timesteps {','.join(map(str, missing))}: not steps of the teacher's schedule; "
                             f"choose from its timesteps {','.join(map(str, ts))}")
        if (bounds := [step[t] for t in explicit])[0] != 0 or bounds != sorted(set(bounds)):
            raise ValueError(f"--student-timesteps must fall from the first step's {ts[0]}, got {list(explicit)}")
        wanted = [sig[b] for b in bounds]
    elif shift is not None:
        m = k if k is not None else sum(split)
        if split is not None and sum(split) != m:
            raise ValueError(f"--student-steps {m}, but --student-expert-steps {split[0]},{split[1]} are "
                             f"{sum(split)}; drop --student-steps")
        u = [1 - j / m for j in range(m)]
        wanted = [sig[0] * shift * v / (1 + (shift - 1) * v) for v in u]
        if len(set(bounds := [near(w, range(n)) for w in wanted])) < m:
            raise ValueError(f"--student-shift: the {m} points of the shift-{shift:g} grid meet on the teacher's {n} "
                             "steps; choose fewer")
        got = [sum(experts[b] == e for b in bounds) for e in (1, 2)]
        if split is not None and tuple(got) != tuple(split):
            if set(experts) == {experts[0]}:
                raise ValueError("--student-expert-steps H,L splits a two-expert teacher's steps; this teacher runs "
                                 "one: drop it")
            raise ValueError(f"--student-expert-steps {split[0]},{split[1]}: the {m}-step shift-{shift:g} grid gives the "
                             f"high-noise expert {got[0]} of its steps and the low-noise one {got[1]} at the teacher's "
                             f"boundary (t {ts[experts.index(2)] if 2 in experts else '-'}); ask for {got[0]},{got[1]}, "
                             "or another --student-shift")
    elif split is not None:
        b = next((s for s in range(n) if experts[s] != experts[0]), n)
        if len(split) != 2 or 0 in split or b == n:
            raise ValueError("--student-expert-steps H,L gives each of the teacher's two experts at least 1 step; the "
                             "cache's " + (f"{n} steps are {b} high-noise, {n - b} low" if b < n else "teacher runs one"))
        bounds = []
        for a, e, m, whose in ((0, b, split[0], "high"), (b, n, split[1], "low")):
            if m > e - a:
                raise ValueError(f"--student-expert-steps: {m} boundaries in the {e - a} steps of the {whose}-noise "
                                 "expert meet; choose fewer")
            bounds += [a + round(j * (e - a) / m) for j in range(m)]
        wanted = [sig[s] for s in bounds]
    else:
        if k is None:
            raise ValueError("--objective segment needs --student-steps K")
        bounds, _ = segment_boundaries(header.scheduler, n, int(k), sig)
        wanted = schedule_sigmas(euler_config(header.scheduler), int(k))[:len(bounds)]
    if k is not None and len(bounds) != k:
        raise ValueError(f"--student-steps {k}, but the chosen schedule has {len(bounds)} steps; drop --student-steps")
    return StudentGrid(grid_spec(choice), bounds, wanted, [sig[s] for s in bounds], [ts[s] for s in bounds],
                       [experts[s] for s in bounds])


def chosen_boundaries(header, choice: Mapping, recorded) -> list[int]:
    """The boundary steps of `student_grid`, each of which the cache must have `recorded`: never another step in
    its place (ValueError, one line, naming the steps missing and the --for-students that records them)."""
    grid, rec = student_grid(header, choice), set(recorded)
    if missing := [s for s in grid.bounds if s not in rec]:
        ts = [int(t) for t in header.timesteps]
        made = list(getattr(header, "for_students", None) or [])  # the grids it was made for, and this one
        remake = (f"--for-students {','.join([*made, grid.spec])}" if grid.spec else
                  f"--keep-steps {','.join(map(str, grid.bounds))}")
        raise ValueError(f"its boundaries are the teacher's steps {','.join(map(str, grid.bounds))} and the cache does "
                         f"not record steps {','.join(map(str, missing))} (t {','.join(str(ts[s]) for s in missing)}; "
                         f"it records {','.join(map(str, sorted(rec)))}); rebuild it with {remake}")
    return grid.bounds


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


@torch.no_grad()
def sample_latents(transformer, scheduler, init_noise: torch.Tensor, prompt_embeds: torch.Tensor, steps: int,
                   guidance: float = 1.0, negative_embeds: torch.Tensor | None = None, *, rule: InputRule = PLAIN,
                   condition: torch.Tensor | None = None, start: int = 0, scale: float | None = None) -> torch.Tensor:
    """Final latents [B, C, F, H, W] (float32) of `steps` denoising steps of `transformer` from `init_noise`, op for op
    as WanPipeline (WanImageToVideoPipeline with a `condition` latent); `negative_embeds` [B or 1, L, D] is needed when
    `guidance` > 1 (CFG, two forwards per step). `start`: the steps before it were drawn by another model (a hybrid),
    `init_noise` being their result. `scale`: the guidance scale a student that takes it as an input is asked for
    (pipeline/guidance_input.py)."""
    device = next(transformer.parameters()).device
    dtype = transformer.dtype
    embeds = prompt_embeds.to(device).to(dtype)
    neg = negative_embeds.to(device).to(dtype) if guidance > 1.0 and negative_embeds is not None else None
    cond = None if condition is None else condition.to(device=device, dtype=torch.float32)
    scheduler.set_timesteps(steps, device=device)
    scheduler.set_begin_index(start)
    latents = init_noise.to(device=device, dtype=torch.float32)
    w = None if scale is None else torch.full((latents.shape[0],), float(scale), device=device)
    for t in scheduler.timesteps[start:]:
        inputs = Inputs(latents.to(dtype), t.expand(latents.shape[0]), embeds, neg,
                        None if cond is None else cond.to(dtype), guidance_input=w)
        pred = predict(transformer, inputs, guidance, rule, attention_kwargs=None).guided
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return rule.finish(latents, cond)


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


def latent_motion(latents) -> list[float]:
    """Motion without decoding, of latents [N, C, F, h, w] (torch or numpy): per clip the mean absolute difference of
    consecutive latent frames (eval's and validation's `latent_motion`: a sampled model's over the teacher's cached
    final latents', `motion_ratio`)."""
    x = torch.as_tensor(latents).detach().float()
    return [float(v) for v in abs(x[:, :, 1:] - x[:, :, :-1]).reshape(len(x), -1).mean(1)]


def motion_ratio(mine: list[float], teacher: list[float]) -> float | None:
    """The mean over clips of mine / the teacher's, clips where the teacher's is 0 left out (None: none left)."""
    r = [m / t for m, t in zip(mine, teacher, strict=True) if t > 0]
    return sum(r) / len(r) if r else None


def pseudo_huber(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """Per-sample pseudo-Huber distance in float32, sqrt(mse + c^2) - c: quadratic below c, the RMS error above."""
    return (mse(a, b) + c * c).sqrt() - c


SAMPLERS = {"euler": euler_config}  # an objective's own sampler: the student's scheduler config from the teacher's
