"""`train-student --dry-run`: check a stage-two command without training, and say what the run would be.

What a run refuses before its first step and can be known without a GPU or a process group: the settings, the
student config against the caches (latent shape, text width, blocks an objective needs), each cache's manifest
(finished, one fingerprint, settings that hash to it: a cache stage one has not finished is refused naming its
parts), --out (a run there needs --resume), the tracker's package; then the shape of the run: ranks (torchrun's
WORLD_SIZE), global batch, steps per epoch and in all (from the manifests: the held-out prompts and --train-steps
are subtracted when the run indexes the cache), the checkpoint --resume would start from, and what the check
before step 1 reads (`--verify`). Nothing is read past the manifests, written or locked: a login node can check
the command every node of examples/slurm/train-student.sbatch runs.
"""

from __future__ import annotations

from pathlib import Path

from cache import format as F
from cache.reader import open_caches
from cache.size import human
from pipeline.artifact import RunLayout
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from pipeline.runtime import dist_env, print0

from . import checkpoint
from .objectives import check_cache, get_objective
from .run import warmup_warning
from .student import check_compatible, load_student_config
from .tracking import require_backend


def _out_state(cfg: TrainStudentConfig) -> str:
    """What the run finds in --out, refusing as it would (without taking its lock)."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    done = RunLayout(out).holds_run() if out.is_dir() else []
    if done and not cfg.resume:
        raise UserError(f"{out} already holds a training run ({done[0]}/); add --resume to continue it or choose a "
                        "new --out")
    newest = checkpoint.latest(out) if cfg.resume else None
    if newest is not None:
        return f"resumes from {newest.name} (or the newest sound checkpoint before it)"
    return "starts from step 0" + (" (--resume: no checkpoint yet)" if cfg.resume else "")


def _verify_text(cfg: TrainStudentConfig, shard_bytes: int, world: int) -> str:
    if cfg.verify == "checksum":
        return (f"checksum: every shard ({human(shard_bytes)}, {human(shard_bytes / world)} per rank) and each "
                "prompt's tokens and final latents are read and checked before step 1 (docs/multi-gpu.md: its time "
                "per GB; --verify size once the cache has been verified)")
    return "size: shard sizes and tar member index, and that each prompt's rows are there (no checksums)"


def dry_run(cfg: TrainStudentConfig) -> dict:
    """Check the command `cfg` came from and print the run's shape; raises the UserError the run would raise."""
    env = dist_env()  # the ranks torchrun would start; no process group is joined
    require_backend(cfg.report_to)
    student_cfg = load_student_config(cfg.student_config)
    objective = get_objective(cfg.objective).from_config(cfg)
    caches = open_caches(list(cfg.cache))
    manifest = caches[0].manifest
    check_compatible(student_cfg, manifest, cfg.student_config)
    check_cache(objective, manifest, str(caches[0].path), int(student_cfg.get("num_layers", 1)))
    if cfg.init_from_teacher and not Path(cfg.init_from_teacher).exists():
        raise UserError(f"--init-from-teacher {cfg.init_from_teacher} does not exist; pass the teacher's pipeline "
                        "or transformer folder (or a .safetensors file)")
    samples = sum(int(c.manifest[F.F_SAMPLES]) for c in caches)
    shard_bytes = sum(int(c.manifest[F.F_BYTES]) for c in caches)
    global_batch = cfg.batch_size * env.world_size * cfg.grad_accum
    per_epoch = samples // global_batch
    if per_epoch < 1:
        raise UserError(f"--batch-size {cfg.batch_size} x {env.world_size} rank(s) x --grad-accum {cfg.grad_accum} "
                        f"is more than the {samples} cached samples; lower --batch-size")
    total = cfg.max_steps if cfg.max_steps is not None and cfg.epochs is None else (cfg.epochs or 1) * per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    summary = {"ranks": env.world_size, "global_batch": global_batch, "samples": samples, "steps_per_epoch": per_epoch,
               "steps": total, "out": _out_state(cfg), "objective": objective.name, "verify": cfg.verify}
    print0(f"train-student --dry-run: the command is valid; nothing was trained or written\n"
           f"  caches     {len(caches)} ({samples} samples, {human(shard_bytes)} of shards, fingerprint "
           f"{caches[0].fingerprint[:12]})\n"
           f"  run        {env.world_size} rank(s) x {cfg.batch_size} x {cfg.grad_accum} accum = global batch "
           f"{global_batch}; about {per_epoch} steps/epoch, {total} steps (objective {objective.name}, "
           f"strategy {cfg.strategy})\n"
           f"  --out      {cfg.out}: {summary['out']}\n"
           f"  --verify   {_verify_text(cfg, shard_bytes, env.world_size)}")
    warning = warmup_warning(cfg, total)
    if warning:
        print0(warning)
    return summary
