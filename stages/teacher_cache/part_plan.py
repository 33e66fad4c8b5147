"""Stage one's plan for one part, for the run and `--dry-run`: every check before the first weight that needs no GPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache.manifest import manifest_path
from cache.part_progress import PartProgress, list_parts
from cache.records import CacheHeader, TeacherLora, choose_recorded_steps
from cache.size import human
from pipeline import lock, teacher_lora
from pipeline.config import TeacherCacheConfig
from pipeline.errors import UserError
from pipeline.hub import CONFIGS, PIPELINE, is_hub_id, offline, teacher_folder
from pipeline.image_condition import image_sha256, read_image_file
from pipeline.prompts import dedupe, read_prompt_file
from pipeline.runtime import dist_env, print0

from .first_frames import first_frames
from . import placements, student_grids
from .outdir import check_free, listed_shard_bytes, refuse_foreign
from .placements.base import default_dtype
from .speed import TeacherSpeed, spelled
from .teacher import TeacherSpec, configs_spec, load_scheduler, resolve_teacher
from .trajectory import Schedule


@dataclass
class PartPlan:
    """What one part of stage one will do, checked before any weight loads."""

    cfg: TeacherCacheConfig
    part: int
    num_parts: int
    torchrun: bool
    prompts: list[str]  # the whole set, deduplicated: prompt_idx = position
    dropped: int  # duplicates dropped
    rows: list[int]  # this part's prompt_idx (idx % num_parts == part), in row order of its prompt store
    spec: TeacherSpec
    hub_configs: bool = False  # a dry run of a Hub id: its configs alone were fetched
    grids: list = field(default_factory=list)  # --for-students: each student grid's boundaries (StudentGrid)
    images: list | None = None  # --images: each prompt's image (a path), its trajectories' first frame

    @property
    def prompt_set(self) -> list[str]:
        """What the cache's prompt set identity covers: the prompts, and each one's image's bytes where given."""
        if self.images is None:
            return self.prompts
        return [f"{image_sha256(i)}\t{p}" for i, p in zip(self.images, self.prompts)]

    @property
    def trajectories(self) -> int:
        return len(self.rows) * self.cfg.seeds_per_prompt


def resolve_parts(cfg: TeacherCacheConfig, dry: bool = False) -> tuple[int, int, bool]:
    """(part, num_parts, under torchrun); a run (not a dry run) first refuses a placement its GPUs cannot run."""
    env = dist_env()
    if cfg.num_parts is not None and env.world_size > 1:
        raise UserError("--part/--num-parts cannot be combined with torchrun (each rank is a part already)")
    if not dry:
        placements.get(cfg.placement).validate(cfg)
    if cfg.num_parts is not None:
        return cfg.part, cfg.num_parts, False
    return env.rank, env.world_size, env.world_size > 1


def plan_part(cfg: TeacherCacheConfig, part: int, num_parts: int, torchrun: bool, dry: bool = False) -> PartPlan:
    """The part's prompts and teacher, checked, and the placement's checks that need no GPU."""
    if cfg.images:  # image-to-video: each (image, prompt) line a prompt of its own, the image its condition
        pairs, dropped = dedupe(read_image_file(cfg.images))
        images, prompts = [i for i, _ in pairs], [p for _, p in pairs]
    elif cfg.images_from:  # (its prompts are unique already)
        (images, prompts), dropped = first_frames(cfg.images_from, dry), 0
    else:
        (prompts, dropped), images = dedupe(read_prompt_file(cfg.prompts)), None
    rows = list(range(part, len(prompts), num_parts))
    if not rows:
        raise UserError(f"part {part} of {num_parts} gets no prompt: the file has only {len(prompts)}; "
                        "use fewer parts")
    # a dry run of a Hub id fetches its configs alone, but offline checks what the run will find: nothing is fetched
    hub = dry and not Path(cfg.teacher).expanduser().exists() and is_hub_id(cfg.teacher) and not offline()
    spec = configs_spec(teacher_folder(cfg.teacher, cfg.revision, files=CONFIGS, hint_files=PIPELINE), cfg.teacher) \
        if hub else resolve_teacher(cfg.teacher, cfg.revision)
    spec.check_sizes(cfg.height, cfg.width, cfg.frames)
    spec.condition_for(images is not None)  # refuses an image-to-video teacher without images, and the reverse
    if cfg.guidance_2 is not None and spec.boundary_ratio is None:
        raise UserError("--guidance-2 applies only to two-expert (Wan 2.2 A14B) teachers; drop it for this teacher")
    placements.get(cfg.placement).check(cfg, spec)
    cfg, grids = student_grids.resolve(cfg, spec)  # --for-students: the steps their boundaries need
    return PartPlan(cfg, part, num_parts, torchrun, prompts, dropped, rows, spec, hub, grids, images)


def check_part_count(out: Path, num_parts: int) -> None:
    """--out's parts were started with this part count (else the user's to replace or match)."""
    for p in list_parts(out):
        other = PartProgress.load(out, p)
        if other.num_parts != num_parts:
            raise UserError(f"{out} holds part {p} of a run with {other.num_parts} parts, this command has "
                            f"{num_parts}; use a new --out, add --overwrite, or give --num-parts {other.num_parts}")


def check_resume(prog: PartProgress, cfg: TeacherCacheConfig, out: Path) -> None:
    """A part to resume keeps the batch and shard sizes it was started with (both are part of the cache's bytes)."""
    for name, theirs, ours in (("batch-size", prog.batch_size, cfg.batch_size),
                               ("samples-per-shard", prog.samples_per_shard, cfg.samples_per_shard)):
        if theirs != ours:
            raise UserError(f"part {prog.part} of {out} was started with --{name} {theirs}; resume with that value or "
                            "add --overwrite to start again")


def _out_state(plan: PartPlan) -> str:
    """What the run would find in --out for this part, refusing what it would refuse before computing anything."""
    cfg, part, num_parts, out = plan.cfg, plan.part, plan.num_parts, Path(plan.cfg.out)
    refuse_foreign(out)
    if not out.is_dir() or not any(out.iterdir()):
        return "a new cache"
    if cfg.overwrite:
        return "a cache to replace (--overwrite)"
    check_part_count(out, num_parts)
    prog = PartProgress.load(out, part)
    holder = lock.live_writer(lock.part_lock_path(out, part))
    if holder is not None:
        return (f"part {part} is being written right now (pid {holder.get('pid')} on {holder.get('host')}): the run "
                "would be refused until that one ends")
    if prog is None:
        return f"a cache of {num_parts} part(s), part {part} not started yet" + (
            " (its manifest exists: settings are compared when it runs)" if manifest_path(out).exists() else "")
    check_resume(prog, cfg, out)
    if prog.complete:
        return f"part {part} already finished ({len(prog.shards)} shards): nothing to compute"
    return (f"part {part} to resume: {len(prog.done_blocks)} of {prog.blocks} blocks done, {len(prog.shards)} shards "
            "(finished blocks are kept)")


def dry_run(cfg: TeacherCacheConfig) -> dict:
    """Check the command `cfg` came from and print what it would do; raises the UserError the run would raise."""
    plan = plan_part(cfg, *resolve_parts(cfg, dry=True), dry=True)
    cfg = plan.cfg  # (with --for-students' steps)
    spec, part, num_parts = plan.spec, plan.part, plan.num_parts
    seed = cfg.seed if cfg.record_seed is None else cfg.record_seed
    steps = len(choose_recorded_steps(cfg.steps, cfg.record_steps, seed, cfg.keep_steps or ()))
    c, f, h, w = spec.latent_shape(cfg.height, cfg.width, cfg.frames)
    what = (f"a Hub id at revision {cfg.revision or 'main'}: configs from {spec.path} checked, weights fetched when "
            "the run starts" if plan.hub_configs else "configs checked")
    summary = {
        "part": part, "num_parts": num_parts, "prompts": len(plan.prompts), "duplicates_dropped": plan.dropped,
        "part_prompts": len(plan.rows), "trajectories": plan.trajectories, "samples": plan.trajectories * steps,
        "blocks": -(-plan.trajectories // cfg.batch_size),
        "teacher": f"{cfg.teacher} ({len(spec.experts)} expert(s), latent {c}x{f}x{h}x{w}; {what})",
        "placement": cfg.placement, "out": _out_state(plan),
    }
    if plan.images is not None:
        shape = "x".join(map(str, spec.condition_shape(cfg.height, cfg.width, cfg.frames)))
        summary["condition"] = (f"{spec.condition_for(True)}: each prompt's image through the teacher's VAE, a "
                                f"{shape} latent per trajectory (float32)")
    summary["disk"] = _disk(plan)  # (refused here as the run refuses it)
    teacher_loras = teacher_lora.read_fitted(cfg.teacher_lora, len(spec.experts), spec.configs)
    if teacher_loras:
        summary["teacher_loras"] = TeacherLora.describe([x.record for x in teacher_loras])
    print0(f"teacher-cache --dry-run: the command is valid; nothing was run or written\n"
           f"  prompts    {len(plan.prompts)} unique ({plan.dropped} duplicates dropped); part {part} of {num_parts}: "
           f"{len(plan.rows)} prompts, {plan.trajectories} trajectories in {summary['blocks']} blocks of "
           f"{cfg.batch_size}, {summary['samples']} samples ({steps} of {cfg.steps} steps recorded)\n"
           f"  teacher    {summary['teacher']}\n"
           + (f"  images     {summary['condition']}\n" if "condition" in summary else "") +
           (f"  LoRAs      {summary['teacher_loras']}: fused into the teacher\n" if teacher_loras else "") +
           f"  placement  {placements.get(cfg.placement).describe(cfg)}\n"
           f"  --out      {cfg.out}: {summary['out']}\n"
           f"  disk       {_disk_words(summary['disk'])}")
    if note := one_frame_note(spec, cfg.frames):
        summary["note"] = note
        print0(f"  note       {note}")
    if plan.grids:
        summary["students"] = {g.spec: {"steps": g.bounds, "timesteps": g.timesteps, "experts": g.experts,
                                        "off_sigma": round(g.off, 6)} for g in plan.grids}
        print0("\n".join(student_grids.render(plan.grids, cfg)))
    if options := TeacherSpeed.of(cfg).numerics(None):  # (checked against the machine when the run resolves it)
        summary["speed"] = spelled(options)
        print0(f"  speed      {summary['speed']} (what can change a target enters the cache's fingerprint)")
    return summary


def sizing_header(cfg: TeacherCacheConfig, spec: TeacherSpec, dtype: str, prompts: int) -> CacheHeader:
    """Stage one's header as far as the cache's bytes go (no weight file read: no identity, no prompt-set hash)."""
    scheduler = load_scheduler(spec)
    schedule = Schedule.build(scheduler, cfg.steps, spec.boundary_ratio, cfg.guidance, cfg.guidance_2)
    return CacheHeader.planned(cfg, spec, scheduler, schedule, dtype=dtype, prompts=prompts, prompt_set_sha256="",
                               identity={})


def _disk(plan: PartPlan) -> dict:
    """What the cache still writes into --out beside its free space (`check_free`, the run's own check), at the dtype
    the run would take; --overwrite counts every block of the parts it clears, and their shards as freed."""
    cfg, out = plan.cfg, Path(plan.cfg.out)
    uses_gpu = placements.get(cfg.placement).uses_rank_gpu()  # (a device count: CUDA not initialised)
    dtype = cfg.dtype or default_dtype(torch.device("cuda" if uses_gpu else "cpu"))
    header = sizing_header(cfg, plan.spec, dtype, len(plan.prompts))
    owner = plan.torchrun and plan.part == 0 or plan.num_parts == 1
    cleared = (range(plan.num_parts) if owner else [plan.part]) if cfg.overwrite and out.is_dir() else ()
    return check_free(out, header, plan.prompts, plan.num_parts, cfg.batch_size, cfg.samples_per_shard,
                      cleared=cleared, freed=listed_shard_bytes(out, list(cleared)) if cleared else 0,
                      quiet=True) | {"dtype": dtype}


def _disk_words(d: dict) -> str:
    if not d["bytes_to_write"]:
        return f"nothing more to write; {human(d['free_bytes'])} free at {d['measured_at']} (measured)"
    return (f"{human(d['bytes_to_write'])} more to write ({d['samples']} samples at {d['dtype']}: "
            f"{human(d['shard_bytes'])} of shards + {human(d['store_bytes'])} of prompt store); "
            f"{human(d['free_bytes'])} free at {d['measured_at']} (measured): it fits")


# The video settings of the released teachers the project ships a config for, by their transformer's shape.
_VIDEO_CONFIGS = {(2, 40, 5120): "81 (or configs/wan2.2-t2v-a14b-video.toml)",
                  (1, 30, 3072): "121 (or configs/wan2.2-ti2v-5b.toml)"}


def one_frame_note(spec: TeacherSpec, frames: int) -> str | None:
    """A note (not an error) for a one-frame cache of a video teacher: one whose VAE compresses time (Wan's
    AutoencoderKLWan spells it `temperal_downsample`; every Wan 2.x VAE does), as the teacher-cache run, its dry
    run and `plan` print it."""
    vae = spec.configs.get("vae") or {}
    if frames != 1 or not any(vae.get("temperal_downsample", (False, True, True))):
        return None
    t = spec.transformer_config
    shape = (len(spec.experts), t.get("num_layers"), t.get("num_attention_heads", 0) * t.get("attention_head_dim", 0))
    frames = _VIDEO_CONFIGS.get(shape, "4k+1 (81 for the released Wan models)")
    return (f"frames 1: this cache trains an image student or LoRA of a video teacher (it samples single frames); "
            f"pass --frames {frames} for a video one")
