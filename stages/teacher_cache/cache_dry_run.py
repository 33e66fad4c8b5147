"""`teacher-cache --dry-run`: check a stage-one command without running it, and say what it would do.

Everything a run checks before its first weight loads that does not need this machine's GPUs, through the run's own
functions: the settings, the prompt file and this part's share of it, the teacher (a local folder checked whole; a
Hub id resolved as the run resolves it, `hub.teacher_folder`, its configs alone: found in the local Hub cache or
fetched, a few kilobytes, and refused in the run's words when neither works), a device-map placement's JSON and
module names (`read_device_map`, `check_device_map`; which GPUs exist is checked where it runs) and --max-memory,
and what is in --out already (a new cache, a part to resume, a finished part, or another run's cache, refused as
the run would refuse it). Nothing is written to --out, no lock taken, no device touched: a login node can check
the command a SLURM array task will run (examples/slurm/teacher-cache.sbatch).
"""

from __future__ import annotations

from pathlib import Path

from cache.manifest import manifest_path
from cache.part_progress import PartProgress, list_parts
from pipeline import lock
from pipeline.config import TeacherCacheConfig
from pipeline.errors import UserError
from pipeline.hub import CONFIGS, PIPELINE, is_hub_id, teacher_folder
from pipeline.prompts import dedupe, read_prompt_file
from pipeline.runtime import dist_env, print0

from .group_offload import meta_transformer
from .outdir import refuse_foreign
from .placements.device_map import check_device_map, parse_max_memory, read_device_map
from .plan_report import configs_spec
from .teacher import TeacherSpec, resolve_teacher
from .trajectory import choose_recorded_steps


def _parts(cfg: TeacherCacheConfig) -> tuple[int, int]:
    """(part, num_parts) as the run would take them: the flags, else torchrun's rank and world size."""
    env = dist_env()
    if cfg.num_parts is not None and env.world_size > 1:
        raise UserError("--part/--num-parts cannot be combined with torchrun (each rank is a part already)")
    return (cfg.part, cfg.num_parts) if cfg.num_parts is not None else (env.rank, env.world_size)


def _teacher(cfg: TeacherCacheConfig) -> tuple[TeacherSpec, str]:
    """The teacher's spec and the teacher in words: a local folder checked whole, as the run checks it; a Hub id
    resolved by the run's resolver, its configs alone (found in the local Hub cache, or fetched: a few kilobytes),
    so that an id that is nowhere is refused now, in the run's words, not when the run starts."""
    hub = not Path(cfg.teacher).expanduser().exists() and is_hub_id(cfg.teacher)
    if hub:
        root = teacher_folder(cfg.teacher, cfg.revision, files=CONFIGS, hint_files=PIPELINE)
        spec = configs_spec(root, cfg.teacher)
    else:
        spec = resolve_teacher(cfg.teacher, cfg.revision)
    spec.check_sizes(cfg.height, cfg.width, cfg.frames)
    if cfg.guidance_2 is not None and spec.boundary_ratio is None:
        raise UserError("--guidance-2 applies only to two-expert (Wan 2.2 A14B) teachers; drop it for this teacher")
    c, f, h, w = spec.latent_shape(cfg.height, cfg.width, cfg.frames)
    what = (f"a Hub id at revision {cfg.revision or 'main'}: configs from {spec.path} checked, weights fetched when "
            "the run starts" if hub else "configs checked")
    return spec, f"{cfg.teacher} ({len(spec.experts)} expert(s), latent {c}x{f}x{h}x{w}; {what})"


def _placement(cfg: TeacherCacheConfig, spec: TeacherSpec) -> str:
    """The placement's checks that need no GPU, by the functions the run calls: a device map's JSON and its module
    names against the teacher's transformers, --max-memory's sizes. Which GPUs exist is checked where it runs."""
    if cfg.max_memory is not None:
        parse_max_memory(cfg.max_memory)
    if not cfg.placement.endswith(".json"):
        return f"{cfg.placement} (checked against the GPUs where it runs)"
    dmap, main = read_device_map(cfg.placement, check_devices=False)
    for comp in spec.experts:
        check_device_map(meta_transformer(spec.path, comp, real_buffers=False), dmap, cfg.placement)
    return (f"{cfg.placement} (a device map of {len(dmap)} entries, computing on {main}; its devices checked against "
            "the GPUs where it runs)")


def _out_state(cfg: TeacherCacheConfig, part: int, num_parts: int) -> str:
    """What the run would find in --out for this part, refusing what it would refuse before computing anything."""
    out = Path(cfg.out)
    refuse_foreign(out)
    if not out.is_dir() or not any(out.iterdir()):
        return "a new cache"
    if cfg.overwrite:
        return "a cache to replace (--overwrite)"
    for p in list_parts(out):
        other = PartProgress.load(out, p)
        if other.num_parts != num_parts:
            raise UserError(f"{out} holds part {p} of a run with {other.num_parts} parts, this command has "
                            f"{num_parts}; use a new --out, add --overwrite, or give --num-parts {other.num_parts}")
    prog = PartProgress.load(out, part)
    holder = lock.live_writer(lock.part_lock_path(out, part))
    if holder is not None:
        return (f"part {part} is being written right now (pid {holder.get('pid')} on {holder.get('host')}): the run "
                "would be refused until that one ends")
    if prog is None:
        return f"a cache of {num_parts} part(s), part {part} not started yet" + (
            " (its manifest exists: settings are compared when it runs)" if manifest_path(out).exists() else "")
    for name, theirs, ours in (("batch-size", prog.batch_size, cfg.batch_size),
                               ("samples-per-shard", prog.samples_per_shard, cfg.samples_per_shard)):
        if theirs != ours:
            raise UserError(f"part {part} of {out} was started with --{name} {theirs}; resume with that value or add "
                            "--overwrite to start again")
    if prog.complete:
        return f"part {part} already finished ({len(prog.shards)} shards): nothing to compute"
    return (f"part {part} to resume: {len(prog.done_blocks)} of {prog.blocks} blocks done, {len(prog.shards)} shards "
            "(finished blocks are kept)")


def dry_run(cfg: TeacherCacheConfig) -> dict:
    """Check the command `cfg` came from and print what it would do; raises the UserError the run would raise."""
    part, num_parts = _parts(cfg)
    prompts, dropped = dedupe(read_prompt_file(cfg.prompts))
    rows = len(range(part, len(prompts), num_parts))
    if not rows:
        raise UserError(f"part {part} of {num_parts} gets no prompt: the file has only {len(prompts)}; use fewer "
                        "parts")
    seed = cfg.seed if cfg.record_seed is None else cfg.record_seed
    steps = len(choose_recorded_steps(cfg.steps, cfg.record_steps, seed, cfg.keep_steps or ()))
    trajectories = rows * cfg.seeds_per_prompt
    spec, teacher = _teacher(cfg)
    placement = _placement(cfg, spec)
    summary = {
        "part": part, "num_parts": num_parts, "prompts": len(prompts), "duplicates_dropped": dropped,
        "part_prompts": rows, "trajectories": trajectories, "samples": trajectories * steps,
        "blocks": -(-trajectories // cfg.batch_size), "teacher": teacher, "placement": cfg.placement,
        "out": _out_state(cfg, part, num_parts),
    }
    print0(f"teacher-cache --dry-run: the command is valid; nothing was run or written\n"
           f"  prompts    {len(prompts)} unique ({dropped} duplicates dropped); part {part} of {num_parts}: {rows} "
           f"prompts, {trajectories} trajectories in {summary['blocks']} blocks of {cfg.batch_size}, "
           f"{summary['samples']} samples ({steps} of {cfg.steps} steps recorded)\n"
           f"  teacher    {summary['teacher']}\n"
           f"  placement  {placement}\n"
           f"  --out      {cfg.out}: {summary['out']}")
    return summary

