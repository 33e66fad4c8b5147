"""Stage two's plan: everything `train-student` decides before it builds anything, made once by `make_plan`;
the run executes it and `--dry-run` measures it, so every check here is both's."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cache.reader import open_caches
from cache.records import Manifest
from pipeline import lock
from pipeline.artifact import RunLayout
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from pipeline.runtime import DistEnv, dist_env, print0
from stages.students.student_kind import StudentKind, student_kind

from .epoch import EpochPlan, epoch_plan, order_identity
from .index import DataSplit, prepare
from .objective_base import Objective, check_cache, get_objective
from .run_identity import KeptSettings, RunIdentity
from .strategy import Strategy, get_strategy


@dataclass
class TrainPlan:
    """What stage two decided before building anything: where, what to learn, from which data, in which order."""

    cfg: TrainStudentConfig
    env: DistEnv
    device: torch.device
    mixed: torch.dtype | None  # the autocast dtype; None: float32
    layout: RunLayout
    student: StudentKind  # compact or LoRA (student.py), chosen once
    objective: Objective
    data: DataSplit
    epochs: EpochPlan  # the exact order of every epoch
    total: int  # optimizer steps of the run
    identity: RunIdentity  # what a checkpoint must match to be resumed
    strategy: Strategy  # how the student is laid over the ranks (strategy.py)

    @property
    def manifest(self) -> Manifest:
        return self.data.index.manifest


def make_plan(cfg: TrainStudentConfig, env: DistEnv, device: torch.device) -> TrainPlan:
    """Student config, objective, the caches checked against both and indexed, the exact epoch plan."""
    mode = mixed_mode(cfg, device)
    layout = RunLayout(cfg.out)
    _check_apart(layout.root, cfg.cache)
    if not cfg.dry_run:  # a dry run writes nothing to --out: no lock, no folder (train_dry_run.py)
        _check_out(layout.root, cfg.resume)
    student = student_kind(cfg)
    objective = get_objective(cfg.objective).from_config(cfg)
    caches = open_caches(list(cfg.cache))
    manifest = caches[0].manifest
    train_steps = student.prepare(manifest, str(caches[0].path), cfg.train_steps)  # before the (slower) shard check
    student_cfg = student.config
    check_cache(objective, manifest, str(caches[0].path), int(student_cfg.get("num_layers", 1)))
    # A dry run checks sizes only: the checksum of an A14B cache's shards is hours of reading, not a step's cost.
    data = prepare(caches, env, device, "size" if cfg.dry_run else cfg.verify, train_steps, cfg.holdout_prompts,
                   cfg.train_trajectories)
    epochs, total = _epochs(cfg, data, env)
    if env.is_main and not cfg.dry_run:
        layout.root.mkdir(parents=True, exist_ok=True)
    default_objective = TrainStudentConfig.__dataclass_fields__["objective"].default
    identity = RunIdentity(
        fingerprints=sorted({c.fingerprint for c in data.index.caches}), data=data.digest(), seed=cfg.seed,
        global_batch=epochs.global_batch, grad_accum=cfg.grad_accum,
        student_config=student_cfg | {"patch_size": list(student_cfg.get("patch_size", (1, 2, 2)))},
        settings=KeptSettings.of(cfg, mode), lora=student.identity(),
        # the default objective without settings is recorded as none
        objective={"name": objective.name, **objective.record()}
        if objective.name != default_objective or objective.record() else None,
        order=order_identity(epochs, cfg.embedding_cache_size))
    mixed = MIXED[mode]
    return TrainPlan(cfg, env, device, mixed, layout, student, objective, data, epochs, total,
                     RunIdentity.from_json(json.loads(json.dumps(identity.to_json()))),  # as a checkpoint holds it
                     get_strategy(cfg.strategy, env, device, mixed))


MIXED = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --mixed-precision: the autocast dtype


def mixed_mode(cfg: TrainStudentConfig, device: torch.device) -> str:
    """--mixed-precision resolved for `device` (bf16 on CUDA, no on the CPU when not given)."""
    mode = cfg.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    if mode == "fp16" and device.type != "cuda":
        raise UserError("--mixed-precision fp16 needs CUDA; use bf16 or no on the CPU")
    return mode


def _check_out(out: Path, resume: bool) -> None:
    """--out is a run folder of ours (or empty, or new) that no one else is writing; refused before anything in it is
    written (the lock file included)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    if foreign := RunLayout(out).foreign():  # a project folder: the run's config.json etc. would overwrite its own
        raise UserError(f"--out {out} is not a train-student run folder: it holds {', '.join(foreign)}, and the run "
                        "would write its own config.json, metrics.jsonl and checkpoints among them; choose a new or "
                        "empty folder for --out")
    if dist_env().is_main:  # one writer per run folder: a second run would collide on checkpoints and metrics
        lock.acquire(out / lock.RUN_LOCK, f"run folder {out}")
    if out.is_dir() and not resume and (done := RunLayout(out).holds_run()):
        raise UserError(f"{out} already holds a training run ({done[0]}/); add --resume to continue it or "
                        "choose a new --out")


def _check_apart(out: Path, caches: tuple[str, ...]) -> None:
    """--out neither is, nor is inside, nor holds a --cache folder: the run's files would land in the cache stage one
    wrote (and `teacher-cache --overwrite` or a cleanup of either would take the other with it). Real paths: a link
    does not hide it."""
    where = out.resolve()
    for c in caches:
        cache = Path(c).resolve()
        how = "is" if where == cache else "is inside" if where.is_relative_to(cache) else \
            "holds" if cache.is_relative_to(where) else None
        if how is not None:
            raise UserError(f"--out {out} {how} the --cache folder {c}: the run would write its checkpoints, metrics "
                            "and student into a cache folder (or around it); choose an --out outside every --cache "
                            "folder")


def _epochs(cfg: TrainStudentConfig, data: DataSplit, env: DistEnv) -> tuple[EpochPlan, int]:
    n = len(data.train_rows)
    share = n // env.world_size
    if cfg.batch_size > share:
        raise UserError(f"--batch-size {cfg.batch_size} is larger than a rank's share of the data: {n} training "
                        f"samples over {env.world_size} rank(s) is {share} per rank per epoch; lower --batch-size "
                        f"to at most {max(share, 1)}" + (" or use fewer ranks" if env.world_size > 1 else ""))
    plan = epoch_plan(data, env.world_size, cfg.batch_size, cfg.grad_accum, cfg.order, cfg.embedding_cache_size)
    by_epochs = None if cfg.epochs is None and cfg.max_steps is not None else (cfg.epochs or 1) * plan.steps
    total = min(k for k in (cfg.max_steps, by_epochs) if k is not None)
    if warning := warmup_warning(cfg, total):
        print0(warning)
    return plan, total


def warmup_warning(cfg: TrainStudentConfig, total: int) -> str | None:
    """One line when the warmup does not end before the run does: the learning rate would climb the whole run and
    never reach --lr (the default 100 warmup steps under `--max-steps 5` train at a twentieth of it), silently."""
    if cfg.warmup_steps < total or total <= 0:
        return None
    top = lr_at(total - 1, total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
    return (f"warning: --warmup-steps {cfg.warmup_steps} is not below the run's {total} optimizer steps: the learning "
            f"rate climbs the whole run and peaks at {top:.3g}, not --lr {cfg.lr:g}; lower --warmup-steps (e.g. "
            f"{total // 10}) or train longer")


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to peak x min_ratio."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


