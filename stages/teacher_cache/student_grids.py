"""`--for-students`: the segment students' grids a cache is made for, resolved on the teacher's own schedule into the
steps it records (docs/architecture.md, "Choosing the schedule"), for `plan`, the dry run and the run alike."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from pipeline.config import TeacherCacheConfig
from pipeline.errors import UserError
from pipeline.registries import grid_choice
from pipeline.sampling import StudentGrid, student_grid

from .teacher import TeacherSpec, load_scheduler
from .trajectory import Schedule


def schedule_of(spec: TeacherSpec, cfg: TeacherCacheConfig) -> SimpleNamespace:
    """The teacher's N-step schedule as a cache header holds it: steps, sigmas, timesteps, experts, scheduler."""
    sched = load_scheduler(spec)
    sc = Schedule.build(sched, cfg.steps, spec.boundary_ratio, cfg.guidance, cfg.guidance_2)
    return SimpleNamespace(steps=cfg.steps, sigmas=sc.sigmas, timesteps=sc.timesteps, experts=sc.experts,
                           scheduler={"_class_name": type(sched).__name__, **sched.config})


def resolve(cfg: TeacherCacheConfig, spec: TeacherSpec) -> tuple[TeacherCacheConfig, list[StudentGrid]]:
    """`cfg` recording the union of its student grids' boundaries (its --keep-steps, and --record-steps at least
    their count: the boundaries alone without it), and the grids; `cfg` itself without --for-students."""
    if cfg.for_students is None:
        return cfg, []
    header = schedule_of(spec, cfg)
    grids = []
    for g in cfg.for_students:
        try:
            grids.append(student_grid(header, grid_choice(g)))
        except ValueError as e:
            raise UserError(f"--for-students {g}: {e}") from None
    union = sorted({0, *(cfg.keep_steps or ()), *(b for g in grids for b in g.bounds)})
    n = len(union) if cfg.record_steps is None else cfg.record_steps
    if n < len(union):
        raise UserError(f"--record-steps {n} is fewer than the {len(union)} steps the student grids (and --keep-steps) "
                        f"need ({','.join(map(str, union))}); give --record-steps {len(union)} or more, or leave it out "
                        "to record those steps alone")
    return replace(cfg, keep_steps=tuple(union[1:]) or None, record_steps=n), grids


def render(grids: list[StudentGrid], cfg: TeacherCacheConfig, indent: str = "  ") -> list[str]:
    """A line per student grid (its steps, timesteps, experts and distance) and the steps recorded for them."""
    if not grids:
        return []
    width = max(len(g.spec) for g in grids)
    lines = [f"{indent}{'students' if i == 0 else '':<11}{g.spec:<{width}}  {g.describe()}" for i, g in enumerate(grids)]
    keep = sorted({0, *(cfg.keep_steps or ())})
    drawn = (cfg.record_steps or len(keep)) - len(keep)
    lines.append(f"{indent}{'':<11}records steps {','.join(map(str, keep))} of {cfg.steps}"
                 + (f" and {drawn} drawn by --record-seed" if drawn else "") + ": each grid trains from this cache")
    return lines
