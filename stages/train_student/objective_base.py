"""What every distillation objective is (`Objective`) and what stage two checks before the first step
(docs/architecture.md "Objectives")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import torch

from cache import format as F
from cache.schema import SAMPLE_FIELDS, missing_fields, sample_fields
from pipeline.errors import UserError
from pipeline.model_call import PLAIN, InputRule, Inputs, predict
from pipeline.registries import OBJECTIVES
from pipeline.sampling import SAMPLER, mse  # noqa: F401 (mse: every objective's loss term, with the base)

PREDICTION = "prediction"  # the transformer's output: the velocity (flow matching) at the sample's timestep


def block_output(i: int) -> str:
    """Name of the model output "hidden states after student block i"."""
    return f"block:{i}"


@dataclass
class Batch:
    """One micro-batch on the device: the cache fields an objective asked for, the model inputs, weights."""

    fields: dict[str, torch.Tensor]  # schema field name -> [B, ...] float32
    timestep: torch.Tensor  # per-sample timesteps [B] (the rule lays them out per token where the teacher does)
    context: torch.Tensor  # prompt embeddings [B, L, D]
    weight: torch.Tensor  # [B]: 1 for a sample, 0 for an epoch's padding dummy
    meta: dict[str, torch.Tensor] = field(default_factory=dict)  # per-sample metadata (timestep, sigma, step)
    rule: InputRule = PLAIN  # how the cache's teacher takes its inputs (its header's)
    guidance_input: torch.Tensor | None = None  # [B]: the scale asked of a student that takes it (--guidance-range)

    def inputs(self, latent: torch.Tensor | None = None, t: torch.Tensor | None = None) -> Inputs:
        """The model call's inputs for this batch: its x_t at its timesteps, or `latent` at `t`."""
        return Inputs(self.x_t if latent is None else latent, self.timestep if t is None else t, self.context,
                      condition=self.fields.get(F.T_CONDITION), guidance_input=self.guidance_input)

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
    handles = [inner.blocks[i].register_forward_hook(
        lambda _m, _in, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in blocks]
    try:
        with autocast():
            pred = predict(model, batch.inputs(), rule=batch.rule).guided
    finally:
        for h in handles:
            h.remove()
    return Outputs(pred, captured)


def scored(out: Outputs, batch: Batch) -> tuple[Outputs, Batch]:
    """What an objective's distances see: everything, except the frames a condition gives, which the prediction and
    the batch's latent-shaped fields lose, so that no term learns (or is diluted by) what sampling throws away."""
    shape = out.prediction.shape
    if (kept := batch.rule.learned_frames(shape[2])) is None:
        return out, batch
    fields = {k: v[:, :, kept] if v.shape == shape else v for k, v in batch.fields.items()}
    return replace(out, prediction=out.prediction[:, :, kept]), replace(batch, fields=fields)


class Objective:
    """Base of every objective; subclasses set the class attributes and implement `terms`."""

    name: ClassVar[str]  # its Config's declared name (a plug-in without one sets name and help itself)
    help: ClassVar[str] = ""
    Config: ClassVar[type | None] = None  # its settings dataclass (pipeline/registries.py), recorded by asdict
    fields: ClassVar[tuple[str, ...]]  # cache sample fields read (cache/schema.py names)
    outputs: ClassVar[tuple[str, ...]] = (PREDICTION,)  # model outputs needed

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("Config") is not None:
            cls.name = cls.Config.NAME

    def __init__(self, settings: dict | None = None):
        self.settings = dict(settings or {})

    @classmethod
    def from_config(cls, cfg) -> Objective:
        """The objective with its settings (its `Config`, filled from the stage-two config's flags)."""
        settings = cfg.objective_settings if cls.Config is not None else None
        return cls(asdict(settings) if settings is not None else None)

    def adapt(self, model: torch.nn.Module) -> torch.nn.Module:
        """The student as this objective trains it, given what it adds to its inputs (velocity's --guidance-range:
        the scale's embedding, pipeline/guidance_input.py); by default as built."""
        return model

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
        out = student_forward(model, batch, autocast, self.blocks())
        terms = self.terms(*scored(out, batch), heads) | self.model_terms(out, batch, heads, autocast)
        first, *rest = terms.values()
        return sum(rest, first), terms

    def model_terms(self, out: Outputs, batch: Batch, heads: torch.nn.Module | None,
                    autocast: Callable) -> dict[str, torch.Tensor]:
        """Per-sample terms [B] that run a model of the heads' own under `autocast` (the segment objective's
        discriminator), added after `terms`; none by default."""
        return {}

    def record_fields(self, manifest: dict) -> dict:
        """distill.json's sampling fields this objective's targets change from the cache's (velocity's
        --target-guidance: the guidance); none by default."""
        return {}

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
        """Its settings as distill.json and the run identity record them (its sampler last, when it has its own)."""
        sampler = OBJECTIVES[self.name].caps.sampler
        return dict(self.settings) | ({SAMPLER: sampler} if sampler else {})


def _check_fields(cls: type[Objective]) -> type[Objective]:
    if unknown := [f for f in cls.fields if f not in SAMPLE_FIELDS]:
        raise ValueError(f"objective {cls.name!r} reads undeclared cache field(s) {unknown}: declare them in "
                         "cache/schema.py first")
    return cls


def get_objective(name: str) -> type[Objective]:
    """The implementation of `--objective NAME` (its module imported now)."""
    try:
        return _check_fields(OBJECTIVES.get(name, "--objective").load())
    except ValueError as e:
        if name in OBJECTIVES:
            raise
        raise UserError(str(e)) from None


def check_cache(objective: Objective, manifest: dict, cache: str, num_layers: int) -> None:
    """Refuse, in one line, a cache or student that cannot give `objective` what it declared it needs."""
    if missing := missing_fields(manifest, objective.fields):
        how = "; ".join(f"{n}: {SAMPLE_FIELDS[n].recorded_by}" for n in missing if SAMPLE_FIELDS[n].recorded_by)
        raise UserError(f"--objective {objective.name} needs cache field(s) {', '.join(missing)} that the cache "
                        f"{cache} does not carry (its samples hold {', '.join(sample_fields(manifest))}); "
                        + (f"rebuild it with {how}" if how else "rebuild it with a stage one that records them")
                        + " or choose another --objective")
    if InputRule.of(manifest).learned_frames(int(manifest.latent_shape[1])) == []:
        raise UserError(f"the cache {cache} is image-to-video of one latent frame, which sampling takes from the image "
                        "whole: a student has nothing to learn; rebuild it with --frames 5 or more")
    objective.check(manifest, cache)
    for o in objective.outputs:
        if o != PREDICTION and (not o.startswith("block:") or not 0 <= int(o.split(":")[1]) < num_layers):
            raise UserError(f"--objective {objective.name} needs the model output {o!r}, which a {num_layers}-block "
                            "student does not have; choose blocks below its num_layers")


@contextlib.contextmanager
def registered(cls: type[Objective]):
    """Declare plug-in `cls` for the duration of a `with` block (tests, plug-ins loaded for one run)."""
    OBJECTIVES.declare(_check_fields(cls).name, cls.help, cls.Config, impl=cls)
    try:
        yield cls
    finally:
        OBJECTIVES.forget(cls.name)
