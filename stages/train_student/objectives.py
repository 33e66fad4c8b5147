"""Distillation objectives: what stage two teaches the student, chosen by `train-student --objective NAME`.

An objective is one registered class. It declares the cache fields it reads (names from
`cache/schema.py`) and the model outputs it needs, may add trainable modules (projection heads) that are
checkpointed and resumed with the student but never exported, and turns one forward of the student into
per-sample loss terms. Stage two checks the declarations against the cache before the first step, records
the objective and its settings in distill.json (pipeline/artifact.py), and otherwise stays the same for
every objective: the exact epoch plan, loss scaling over ranks, checkpoints and resume.

Adding an objective: a subclass below (or in a module imported here) decorated with `@register`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from cache import format as F
from cache.schema import SAMPLE_FIELDS, missing_fields, recorded_steps, sample_fields
from pipeline.errors import UserError

log = logging.getLogger(__name__)

PREDICTION = "prediction"  # the transformer's output: the velocity (flow matching) at the sample's timestep


def block_output(i: int) -> str:
    """Name of the model output "hidden states after student block i"."""
    return f"block:{i}"


@dataclass
class Batch:
    """One micro-batch on the device: the cache fields an objective asked for, the model inputs, weights."""

    fields: dict[str, torch.Tensor]  # schema field name -> [B, ...] float32
    timestep: torch.Tensor  # the transformer's timestep input (per token for TI2V)
    context: torch.Tensor  # prompt embeddings [B, L, D]
    weight: torch.Tensor  # [B]: 1 for a sample, 0 for an epoch's padding dummy
    meta: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample metadata (timestep, sigma, step)

    @property
    def x_t(self) -> torch.Tensor:
        return self.fields[F.T_X_T]


@dataclass
class Outputs:
    """What one student forward produced: the prediction and any block outputs that were asked for."""

    prediction: torch.Tensor
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)


class WithHeads(torch.nn.Module):
    """The student and an objective's heads as one module, so DDP averages the heads' gradients too; its
    forward is the student's."""

    def __init__(self, student: torch.nn.Module, heads: torch.nn.Module):
        super().__init__()
        self.student, self.heads = student, heads

    def forward(self, *args, **kwargs):
        return self.student(*args, **kwargs)


def student_forward(model: torch.nn.Module, batch: Batch, autocast: Callable, blocks: tuple[int, ...] = ()) -> Outputs:
    """Run the student (DDP-wrapped or not) on the batch, capturing the outputs of `blocks` with forward hooks
    on the student's own blocks (they only read, so the numerics are those of a plain forward)."""
    inner = getattr(model, "module", model)  # DDP
    inner = getattr(inner, "student", inner)  # WithHeads
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in blocks:
        handles.append(inner.blocks[i].register_forward_hook(
            lambda _m, _in, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)))
    try:
        with autocast():
            pred = model(hidden_states=batch.x_t, timestep=batch.timestep, encoder_hidden_states=batch.context,
                         return_dict=False)[0]
    finally:
        for h in handles:
            h.remove()
    return Outputs(pred, captured)


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error in float32: [B, ...] x [B, ...] -> [B]."""
    return (a.float() - b).pow(2).flatten(1).mean(1)


class Objective:
    """Base of every objective; subclasses set the class attributes and implement `terms`."""

    name: ClassVar[str]
    help: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]  # cache sample fields read (cache/schema.py names)
    outputs: ClassVar[tuple[str, ...]] = (PREDICTION,)  # model outputs needed

    def __init__(self, settings: dict | None = None):
        self.settings = dict(settings or {})

    @classmethod
    def from_config(cls, cfg) -> Objective:
        """The objective with its settings taken from the stage-two config."""
        return cls()

    def heads(self, student_config: dict, manifest: dict) -> torch.nn.Module | None:
        """Trainable modules beyond the student (checkpointed with it, never exported); None if there are none."""
        return None

    def blocks(self) -> tuple[int, ...]:
        """Student blocks whose outputs `terms` reads."""
        return tuple(int(o.split(":")[1]) for o in self.outputs if o.startswith("block:"))

    def terms(self, out: Outputs, batch: Batch, heads: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        """Per-sample loss terms [B] in float32; the loss is their sum."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Batch, autocast: Callable,
             heads: torch.nn.Module | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(per-sample loss [B], its terms)."""
        terms = self.terms(student_forward(model, batch, autocast, self.blocks()), batch, heads)
        total = None
        for t in terms.values():
            total = t if total is None else total + t
        return total, terms

    def student_steps(self, manifest: dict) -> int | None:
        """Sampling steps the trained student is meant to use; None: the teacher's."""
        return None

    def check(self, manifest: dict, cache: str) -> None:
        """Refuse (UserError, one line) a cache this objective cannot train from beyond its declared fields, and
        settle settings that depend on the cache (called by `check_cache` before the data are indexed)."""

    def dataset(self, index, embedding_cache_size: int):
        """The training items: by default one cached sample each (stages/train_student/data.py)."""
        from .data import SampleDataset

        return SampleDataset(index, embedding_cache_size, self.fields)

    def record(self) -> dict:
        return dict(self.settings)


OBJECTIVES: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: make `cls` selectable as `--objective cls.name`."""
    if cls.name in OBJECTIVES:
        raise ValueError(f"objective {cls.name!r} is registered twice")
    unknown = [f for f in cls.fields if f not in SAMPLE_FIELDS]
    if unknown:
        raise ValueError(f"objective {cls.name!r} reads undeclared cache field(s) {unknown}: declare them in "
                         "cache/schema.py first")
    OBJECTIVES[cls.name] = cls
    return cls


def get_objective(name: str) -> type[Objective]:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise UserError(f"--objective {name!r} is not one of {', '.join(sorted(OBJECTIVES))}") from None


def check_cache(objective: Objective, manifest: dict, cache: str, num_layers: int) -> None:
    """Refuse, in one line, a cache or student that cannot give `objective` what it declared it needs."""
    missing = missing_fields(manifest, objective.fields)
    if missing:
        how = "; ".join(f"{n}: {SAMPLE_FIELDS[n].recorded_by}" for n in missing if SAMPLE_FIELDS[n].recorded_by)
        raise UserError(f"--objective {objective.name} needs cache field(s) {', '.join(missing)} that the cache {cache} "
                        f"does not carry (its samples hold {', '.join(sample_fields(manifest))}); "
                        + (f"rebuild it with {how}" if how else "rebuild it with a stage one that records them")
                        + " or choose another --objective")
    objective.check(manifest, cache)
    for o in objective.outputs:
        if o == PREDICTION:
            continue
        if not o.startswith("block:") or not 0 <= int(o.split(":")[1]) < num_layers:
            raise UserError(f"--objective {objective.name} needs the model output {o!r}, which a {num_layers}-block "
                            "student does not have; choose blocks below its num_layers")


@register
class Velocity(Objective):
    """The teacher's prediction at every cached step, by MSE: the student follows the teacher's trajectory
    step by step (and samples with the teacher's steps)."""

    name = "velocity"
    help = "MSE to the teacher's (guided) prediction at each cached step; samples with the teacher's steps"
    fields = (F.T_X_T, F.T_TARGET)

    def terms(self, out: Outputs, batch: Batch, heads) -> dict[str, torch.Tensor]:
        return {"velocity": mse(out.prediction, batch.fields[F.T_TARGET])}


@register
class Segment(Objective):
    """Few-step distillation from the cached trajectories alone: the teacher's schedule is cut into K segments
    whose boundaries are cached steps (the last ends at the final latent), and at every cached state x_k the
    student learns the average velocity to its segment's end x_j, (x_j - x_k) / (sigma_j - sigma_k). One Euler
    step of that velocity from a boundary lands on the next boundary, so the student samples in K steps with one
    forward each (the targets come from the guided trajectory: no CFG). The boundaries are the points of the
    K-step Euler schedule on the teacher's sigma grid (pipeline/sampling.py), exact when K divides the cache's
    steps. `velocity_weight` > 0 adds that weight times the per-step velocity loss at the same states;
    `start_weight` weighs the segment loss at the segments' first states (the only states the K-step sampler
    queries) against 1 at the states inside a segment."""

    name = "segment"
    help = ("K-step student (--student-steps K): at each cached state, MSE to the average velocity to the end of "
            "its segment of the teacher's schedule; samples with K Euler steps, no CFG")
    fields = (F.T_X_T,)

    def __init__(self, settings: dict | None = None):
        super().__init__(settings)
        if float(self.settings.get("velocity_weight", 0.0)) > 0:
            self.fields = (F.T_X_T, F.T_TARGET)
        self.end_step: list[int] | None = None

    @classmethod
    def from_config(cls, cfg) -> Objective:
        if cfg.student_steps is None:
            raise UserError("--objective segment needs --student-steps K (the student's sampling steps, 1 up to the "
                            "cache's steps; K dividing them reproduces the schedule exactly)")
        settings = {"student_steps": int(cfg.student_steps), "velocity_weight": float(cfg.segment_velocity_weight)}
        if float(cfg.segment_start_weight) != 1.0:  # recorded only when set: runs without it keep their settings
            settings["start_weight"] = float(cfg.segment_start_weight)
        return cls(settings)

    @property
    def k(self) -> int:
        return int(self.settings["student_steps"])

    def check(self, manifest: dict, cache: str) -> None:
        from pipeline.sampling import EULER, is_flow_matching, segment_boundaries

        steps = int(manifest[F.F_STEPS])
        sigmas, sched = manifest.get(F.F_SIGMAS), manifest.get(F.F_SCHEDULER) or {}
        if not 1 <= self.k <= steps:
            raise UserError(f"--student-steps {self.k}: the cache {cache} holds {steps}-step trajectories; choose K "
                            f"from 1 to {steps} (a divisor of {steps} reproduces the schedule exactly)")
        if not (isinstance(sigmas, list) and len(sigmas) == steps):
            raise UserError(f"--objective segment needs every state's sigma, and the cache {cache} does not record "
                            f"them ({F.F_SIGMAS} in its manifest); rebuild it with this version's teacher-cache")
        if not is_flow_matching(sched):
            raise UserError(f"--objective segment needs a flow-matching teacher schedule; the cache {cache} was "
                            f"sampled with {sched.get('_class_name')!r} {sched.get('prediction_type', '')}")
        from cache.prompt_store import final_latents_problem

        problem = final_latents_problem(cache, int(manifest[F.F_NUM_PARTS]), int(manifest[F.F_SEEDS_PER_PROMPT]),
                                        tuple(manifest[F.F_LATENT_SHAPE]))
        if problem:
            raise UserError(f"--objective segment needs each trajectory's final latent, and the cache {cache} lacks "
                            f"them ({problem}); rebuild it with `wandistiller teacher-cache`")
        bounds, exact = segment_boundaries(sched, steps, self.k, [float(v) for v in sigmas])
        if len(bounds) != self.k:
            raise UserError(f"--student-steps {self.k}: only {len(bounds)} distinct cached steps lie near the {self.k}-"
                            f"step schedule of the cache {cache}; choose a divisor of {steps}")
        _check_boundaries_recorded(self.k, bounds, manifest, cache, sched, [float(v) for v in sigmas])
        if not exact:
            log.warning("--student-steps %d does not divide the cache's %d steps: segments end at the nearest cached "
                        "steps %s, which the %d-step scheduler does not hit exactly", self.k, steps, bounds, self.k)
        ends = bounds[1:] + [steps]
        self.end_step = [next(e for e in ends if e > k) for k in range(steps)]
        self.settings.update(boundaries=bounds, exact_schedule=exact, sampler=EULER)

    def dataset(self, index, embedding_cache_size: int):
        from .data import SegmentDataset

        if self.end_step is None:
            self.check(index.manifest, str(index.caches[0].path))
        return SegmentDataset(index, embedding_cache_size, self.fields, self.end_step)

    def terms(self, out: Outputs, batch: Batch, heads) -> dict[str, torch.Tensor]:
        from .data import SEGMENT_VELOCITY

        seg = mse(out.prediction, batch.fields[SEGMENT_VELOCITY])
        start_w = float(self.settings.get("start_weight", 1.0))
        if start_w != 1.0:  # the states the K-step sampler starts its steps from weigh start_w, the others 1
            starts = torch.as_tensor(self.settings["boundaries"], device=seg.device)
            step = batch.meta["step"].to(seg.device)
            seg = seg * torch.where(torch.isin(step, starts), start_w, 1.0).to(seg.dtype)
        terms = {"segment": seg}
        w = float(self.settings.get("velocity_weight", 0.0))
        if w > 0:
            terms["velocity"] = w * mse(out.prediction, batch.fields[F.T_TARGET])
        return terms

    def student_steps(self, manifest: dict) -> int | None:
        return self.k


def _check_boundaries_recorded(k: int, bounds: list[int], manifest: dict, cache: str, sched: dict,
                               sigmas: list[float]) -> None:
    """A segment student starts its segments at cached states: refuse (one line) a cache recorded with
    --record-steps that lacks one of the K boundaries, naming the settings that would have them."""
    from pipeline.sampling import segment_boundaries

    recorded = recorded_steps(manifest)
    missing = [b for b in bounds if b not in recorded]
    if not missing:
        return
    steps = int(manifest[F.F_STEPS])
    usable = [j for j in range(1, min(steps, 16) + 1)
              if set(segment_boundaries(sched, steps, j, sigmas)[0]) <= set(recorded)]
    made = (f"teacher-cache --record-steps {manifest.get(F.F_RECORD_STEPS)} --record-seed "
            f"{manifest.get(F.F_RECORD_SEED)}"
            + (f" --keep-steps {','.join(map(str, manifest[F.F_KEEP_STEPS]))}" if manifest.get(F.F_KEEP_STEPS) else ""))
    raise UserError(f"--student-steps {k} starts its segments at steps {','.join(map(str, bounds))} of the cache "
                    f"{cache}, which records only steps {','.join(map(str, recorded))} ({made}), not "
                    f"{','.join(map(str, missing))}; rebuild it adding --keep-steps {','.join(map(str, bounds))} (or "
                    f"without --record-steps), or choose --student-steps {','.join(map(str, usable))}")


@contextlib.contextmanager
def registered(cls: type[Objective]):
    """Register `cls` for the duration of a `with` block (tests, plug-ins loaded for one run)."""
    register(cls)
    try:
        yield cls
    finally:
        OBJECTIVES.pop(cls.name, None)


# Objectives that live in modules of their own register themselves on import.
from . import feature  # noqa: E402,F401
