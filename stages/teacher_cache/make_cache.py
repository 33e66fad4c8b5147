"""Stage one: prompts → encode → load → run blocks → finalize. The teacher runs once per (prompt, seed, step)."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import hashlib
import json
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save as st_save

from cache import format as F
from cache.atomic import WriteBehind, atomic_write_bytes, fsync_paths
from pipeline import lock
from cache.cache_error import CacheError
from cache.feature_projection import projection_matrix, write_projection
from cache.manifest import load_manifest, manifest_path, try_write_manifest
from cache.part_progress import PartProgress, list_parts
from cache.prompt_store import (
    PartRows, PromptRowWriter, create_prompt_store, damaged_part, open_prompt_store, part_negative,
    prompt_store_path, store_relpath, write_latent_rows,
)
from cache.records import CacheHeader
from cache.schema import recorded_steps
from pipeline import signals, teacher_lora
from pipeline.config import TeacherCacheConfig, save_resolved
from pipeline.errors import UserError, exit_rank
from pipeline.faults import fault_point
from pipeline.image_condition import condition_latent, image_tensor, open_image
from pipeline.model_call import InputRule
from pipeline.progress_bar import progress_bar
from pipeline.prompts import prompt_set_sha256
from pipeline.runtime import barrier, dist_env, init_distributed, print0, teardown

from . import outdir, placements
from .blocks import BlockSink, StageOneProgress, denoise, expert_window
from .part_plan import PartPlan, check_part_count, check_resume, one_frame_note, plan_part, resolve_parts
from .placements import ExpertSet, Placement, load_experts
from .speed import FLAGS, TeacherSpeed
from .teacher import encode_prompts, iter_encoded, load_scheduler, load_text_encoder, load_vae
from .trajectory import FeatureRecorder, Schedule, TrajectoryRunner, initial_noise

if TYPE_CHECKING:
    from tqdm import tqdm

# Initial-noise rows written per call in the encode phase: a whole file of the store's (64 A14B rows: 26 MB).
NOISE_ROWS = F.ROWS_PER_FILE
IMAGE_ROWS = 8  # images through the VAE at once


@signals.handle_sigterm()
def run(cfg: TeacherCacheConfig) -> dict:
    """Build (or resume) the cache described by `cfg`; returns the closing summary."""
    t0 = time.time()
    part, num_parts, torchrun = resolve_parts(cfg)
    if torchrun:
        init_distributed(use_cuda=placements.get(cfg.placement).uses_rank_gpu())
    try:
        return _run(cfg, part, num_parts, torchrun, t0)
    except BaseException as e:
        if torchrun:  # one line from this rank, torchrun's summary quotes it, the table's exit code
            exit_rank(e, dist_env(), "teacher-cache")
        raise
    finally:
        lock.release(lock.part_lock_path(cfg.out, part))
        if torchrun:
            teardown()


def _run(cfg: TeacherCacheConfig, part: int, num_parts: int, torchrun: bool, t0: float) -> dict:
    plan = plan_part(cfg, part, num_parts, torchrun)
    if plan.dropped:
        print0(f"dropped {plan.dropped} duplicate prompt(s); {len(plan.prompts)} unique")
    if note := one_frame_note(plan.spec, cfg.frames):
        print0(f"note: {note}")
    job = _setup(plan)
    prog = _open_part(job)
    loop_s = 0.0
    if not prog.complete:
        if not prog.encoded:
            _encode(job, prog)
        todo = [b for b in range(len(job.blocks)) if b not in set(prog.done_blocks)]
        if todo:
            if job.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(job.device)
            experts = load_experts(job.spec, job.placement, log=print0, prepare=job.speed.prepare,
                                   teacher_loras=job.teacher_loras)
            loop_s = _run_blocks(job, prog, experts, todo)
            experts.close()
        prog.complete = True
        prog.save(job.out)
    return _finalize(job, prog, loop_s, t0)


@dataclass(kw_only=True)
class _Part(PartPlan):
    """The part's plan, and what every step of it shares, fixed before any weight loads."""

    placement: Placement
    speed: TeacherSpeed  # the teacher's speed options, checked against the placement
    scheduler: object
    schedule: Schedule
    latent_shape: tuple[int, int, int, int]
    header: CacheHeader  # the manifest's description of the run
    fingerprint: str
    recorded: tuple[int, ...]  # the steps each trajectory records (--record-steps; every step without it)
    out: Path
    part_dir: Path
    dtype: torch.dtype
    device: torch.device
    owner: bool  # writes the root files (clears them on --overwrite): rank 0 under torchrun, or the only part
    blocks: list[list[tuple[int, int]]]  # the (prompt_idx, seed_idx), batch_size at a time: the unit of work and resume
    teacher_loras: list[teacher_lora.Loaded]  # --teacher-lora: fused into each expert as it loads


def _setup(plan: PartPlan) -> _Part:
    """The placement of the planned part, the sampler's schedule and the fingerprint (no weights yet)."""
    cfg, spec, prompts = plan.cfg, plan.spec, plan.prompts
    placement = placements.get(cfg.placement).resolve(cfg, spec)
    scheduler = load_scheduler(spec)
    # (guidance_2 None: the second expert's scale is the first's, as the header records it)
    schedule = Schedule.build(scheduler, cfg.steps, spec.boundary_ratio, cfg.guidance, cfg.guidance_2)
    if cfg.record_features is not None:
        FeatureRecorder.check_blocks(cfg.record_features, int(spec.transformer_config["num_layers"]),
                                     "the teacher's transformer")
    # The teacher's identity enters through its content (configs, weight samples), not its name or path,
    # so moving the teacher folder does not invalidate a cache. The manifest records it too, so that its
    # settings can be checked against the fingerprint (which is what it was before it was recorded).
    speed = TeacherSpeed.of(cfg)
    speed.check(placement)
    if cfg.teacher_lora:  # (before the text encoder runs or any weight is read)
        placement.check_fuse()
    teacher_loras = teacher_lora.read_fitted(cfg.teacher_lora, len(spec.experts), spec.configs)
    header = CacheHeader.planned(cfg, spec, scheduler, schedule, dtype=placement.dtype, prompts=len(prompts),
                                 prompt_set_sha256=prompt_set_sha256(plan.prompt_set), identity=spec.identity(),
                                 numerics=speed.numerics(placement.device),
                                 teacher_loras=[(x.record, x.path) for x in teacher_loras])
    out, traj = Path(cfg.out), [(p, s) for p in plan.rows for s in range(cfg.seeds_per_prompt)]
    return _Part(**vars(plan), placement=placement, speed=speed, scheduler=scheduler, schedule=schedule,
                 latent_shape=tuple(header.latent_shape), header=header, fingerprint=header.settings_fingerprint(),
                 recorded=recorded_steps(header), out=out, part_dir=out / F.PARTS_DIR / F.part_dirname(plan.part),
                 dtype=F.DTYPES[placement.dtype], device=placement.device,
                 owner=plan.torchrun and plan.part == 0 or plan.num_parts == 1,
                 blocks=[traj[i:i + cfg.batch_size] for i in range(0, len(traj), cfg.batch_size)],
                 teacher_loras=teacher_loras)


def _open_part(job: _Part) -> PartProgress:
    """This part's progress record in --out: a new one, or the one to resume (what a crash left is tidied)."""
    cfg, out, part = job.cfg, job.out, job.part
    outdir.check_out_dir(out)
    # One writer per part (two runs on one --out would interleave shards); parts on other nodes lock their own.
    lock.acquire(lock.part_lock_path(out, part), f"part {part} of cache {out}")
    if cfg.overwrite:
        if job.owner or not job.torchrun:
            outdir.clear(out, None if job.owner else part)
        if job.torchrun:
            barrier()
    else:
        _refuse_other_settings(job)
    job.part_dir.mkdir(parents=True, exist_ok=True)
    prog = PartProgress.load(out, part)
    if prog is not None:
        check_resume(prog, cfg, out)
    outdir.check_free(out, job.header, job.prompts, job.num_parts, cfg.batch_size, cfg.samples_per_shard)
    save_resolved(cfg, job.part_dir / F.RESOLVED_CONFIG)  # only now: a refused run leaves the cache as it was
    if prog is None:
        prog = PartProgress(part=part, num_parts=job.num_parts, fingerprint=job.fingerprint, prompts=len(job.rows),
                            blocks=len(job.blocks), batch_size=cfg.batch_size,
                            samples_per_shard=cfg.samples_per_shard, header=job.header)
        prog.save(out)
    outdir.forget_lost_shards(out, prog)
    outdir.drop_orphans(out, prog, owns_root=job.owner)
    p = job.placement
    if prog.complete:
        print0(f"part {part}: already complete ({len(prog.shards)} shards)")
    else:
        print0(f"part {part}/{job.num_parts}: {len(job.rows)} prompts, {sum(map(len, job.blocks))} trajectories, "
               f"{len(job.blocks)} blocks ({len(prog.done_blocks)} done), placement {p.name}"
               f"{' (expert-major)' if p.expert_major else ''}, {p.dtype} on {p.device}")
        if p.reason:
            print0(f"auto placement: {p.reason}")
    return prog


def _refuse_other_settings(job: _Part) -> None:
    """A manifest or a part of --out made with other settings (or another part count) is the user's to replace."""
    out = job.out
    if manifest_path(out).exists():
        try:
            m = load_manifest(out)
        except CacheError:
            if not list_parts(out):
                raise
            m = None  # torn or edited by hand: rewritten from the parts' progress records, checked next
        if m is not None and m.fingerprint != job.fingerprint:
            raise UserError(f"{out} holds a cache made with other settings (fingerprint {m.fingerprint[:12]}, "
                            f"this run {job.fingerprint[:12]}{_changed(m, job.header)}); use a new --out, the same "
                            "settings, or add --overwrite to replace it")
    check_part_count(out, job.num_parts)
    for p in list_parts(out):
        other = PartProgress.load(out, p)
        if other.fingerprint != job.fingerprint:
            raise UserError(f"{out} holds part {p} of a run with other settings{_changed(other.header, job.header)}; "
                            "use a new --out, the same settings, or add --overwrite to replace it")


def _changed(then: CacheHeader, now: CacheHeader) -> str:
    """": SETTING X then, Y now; ..." for the fingerprinted settings that differ (a speed option by its flag)."""
    plain = {f.name: f.default for f in fields(TeacherSpeed)}  # what a header without `numerics` ran with

    def flat(h: dict) -> dict:
        speed = {FLAGS.get(k, k): v for k, v in (plain | (h.get("numerics") or {})).items()}  # (k: another's)
        return {k: v for k, v in h.items() if k != "numerics"} | speed

    a, b = flat(then.settings()), flat(now.settings())
    keys = [k for k in sorted(a.keys() | b.keys(), key=lambda k: not k.startswith("--"))
            if k not in CacheHeader.NOT_FINGERPRINTED and a.get(k) != b.get(k)]
    shown = [f"{k} {_short(a.get(k))} then, {_short(b.get(k))} now" for k in keys[:3]]
    return (": " + "; ".join(shown) + (f"; {len(keys) - 3} more" if len(keys) > 3 else "")) if keys else ""


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _encode(job: _Part, prog: PartProgress) -> None:
    """Encode the part's prompts and the negative prompt, write the rows and the initial noise, free the encoder."""
    cfg, dtype, device = job.cfg, job.dtype, job.device
    tokenizer, encoder = load_text_encoder(job.spec, dtype, device, job.placement.entry.caps.offloads_text_encoder)
    store = create_prompt_store(prompt_store_path(job.out, job.part), len(job.rows), cfg.max_sequence_length,
                                job.spec.transformer_config["text_dim"], job.placement.dtype, cfg.seeds_per_prompt,
                                job.latent_shape, job.header.condition, job.header.condition_shape)
    texts = [job.prompts[i] for i in job.rows]
    rows = PromptRowWriter(store)  # written batch by batch: memory does not grow with the prompt count
    for lo, embeds, lens in iter_encoded(tokenizer, encoder, texts, cfg.max_sequence_length, dtype, device,
                                         progress=dist_env().is_main or not job.torchrun):
        hi = lo + len(lens)
        rows.add(list(range(lo, hi)), job.rows[lo:hi], texts[lo:hi], embeds, lens)
    rows.close()
    fault_point("after_encode_rows")
    neg, neg_len = encode_prompts(tokenizer, encoder, [cfg.negative_prompt], cfg.max_sequence_length, dtype, device,
                                  progress=False)
    neg_bytes = st_save({F.NEG_EMBEDS: neg[0].contiguous(), F.NEG_SEQ_LEN: neg_len.to(torch.int64)})
    atomic_write_bytes(job.part_dir / F.NEGATIVE, neg_bytes)
    if job.part == 0:
        atomic_write_bytes(job.out / F.NEGATIVE, neg_bytes)
    behind = WriteBehind()  # each file of noise goes to the disk while the next is drawn and written
    for lo in range(0, len(job.rows), NOISE_ROWS):  # a block of rows per call, not a zarr write per row
        pairs = [(r, s) for r in range(lo, min(lo + NOISE_ROWS, len(job.rows))) for s in range(cfg.seeds_per_prompt)]
        noise = torch.stack([initial_noise(cfg.seed, job.rows[r], s, job.latent_shape) for r, s in pairs])
        write_latent_rows(store, F.Z_INIT_NOISE, [r for r, _ in pairs], [s for _, s in pairs], noise, behind)
    if job.images is not None:
        _encode_images(job, store, behind)
    behind.close()
    # Every file of the store on disk before the record says `encoded`: a power loss must not leave rows the
    # record vouches for that never reached the disk (zarr's own writes are not fsynced).
    fsync_paths([prompt_store_path(job.out, job.part)])
    del tokenizer, encoder
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    prog.encoded = True
    prog.negative_sha256 = hashlib.sha256(neg_bytes).hexdigest()  # checked when a resume reads it
    prog.save(job.out)


def _encode_images(job: _Part, store, behind: WriteBehind) -> None:
    """Each row's condition latent from its image with the teacher's VAE (loaded for this, then freed), every seed's
    the same, as WanImageToVideoPipeline builds it from the image it is given."""
    cfg, rule = job.cfg, InputRule.of(job.header)
    vae = load_vae(job.spec, job.device)
    bar = progress_bar(total=len(job.rows), desc=f"encode images part {job.part}", unit="image",
                       disable=job.torchrun and not dist_env().is_main)
    for lo in range(0, len(job.rows), IMAGE_ROWS):
        hi = min(lo + IMAGE_ROWS, len(job.rows))
        pixels = torch.cat([image_tensor(_image(job.images[p], p), cfg.height, cfg.width) for p in job.rows[lo:hi]])
        latent = condition_latent(vae, pixels, cfg.frames, rule).cpu()
        pairs = [(r, s) for r in range(lo, hi) for s in range(cfg.seeds_per_prompt)]
        write_latent_rows(store, F.Z_CONDITION, [r for r, _ in pairs], [s for _, s in pairs],
                          latent.repeat_interleave(cfg.seeds_per_prompt, dim=0), behind)
        bar.update(hi - lo)
    bar.close()
    del vae


def _image(image, prompt_idx: int):
    """An --images file (read again, checked) or an --images-from frame (in memory)."""
    return open_image(image, f"--images: prompt {prompt_idx}'s image") if isinstance(image, Path) else image


def _run_blocks(job: _Part, prog: PartProgress, experts: ExpertSet, todo: list[int]) -> float:
    """Run the blocks `todo` to their last step while the writer thread packs shards; returns the loop's seconds."""
    store = open_prompt_store(prompt_store_path(job.out, job.part), mode="r+")
    neg = part_negative(job.out, job.part, prog.negative_sha256).unsqueeze(0)
    cfg, tcfg, features = job.cfg, job.spec.transformer_config, None
    if cfg.record_features is not None:  # the projection written beside the manifest
        matrix = projection_matrix(int(tcfg["num_attention_heads"]) * int(tcfg["attention_head_dim"]),
                                   cfg.feature_dim, cfg.feature_seed)
        write_projection(job.out, matrix)
        features = FeatureRecorder(cfg.record_features, matrix, cfg.feature_pool, job.dtype)
    runner = TrajectoryRunner(experts, job.scheduler, job.schedule, cfg.steps, job.dtype, job.device,
                              InputRule.of(job.header), keep_cond_uncond=cfg.save_cond_uncond, features=features,
                              record=frozenset(job.recorded) if len(job.recorded) < cfg.steps else None)
    warm = _warm_up(job, runner, experts, todo)  # before the bar: the figures count teacher steps alone
    bar, progress = _progress_bar(job, prog, todo)
    if warm is not None:  # expert-major: an expert loaded in the loop compiles there, its seconds left out
        experts.on_load = lambda m: progress.exclude(warm(m))
    sink = BlockSink(job.out, prog, store, cfg.samples_per_shard, job.num_parts, progress)
    pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
    t_loop = time.perf_counter()
    inputs = _block_inputs(job)
    # One block at a time, or (expert-major) a window of blocks with expert 1, then with expert 2, their records
    # waiting in RAM meanwhile.
    major = job.placement.expert_major
    window = expert_window(cfg.batch_size, len(job.recorded), math.prod(job.latent_shape), job.dtype.itemsize,
                           cfg.save_cond_uncond) if major else 1
    phases = [(e,) for e in range(1, len(experts) + 1)] if major else [None]
    windows = [todo[w:w + window] for w in range(0, len(todo), window)]
    try:
        stopped = _pack_blocks(denoise(runner, experts, phases, windows, inputs, neg), job.blocks, sink, pool)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        sink.abort()
        raise
    finally:
        bar.close()  # end the bar's line so the error message starts on its own
        progress.close()
    pool.shutdown(wait=True)
    sink.close()
    if stopped:
        raise signals.Terminated(f"terminated (SIGTERM) with {len(prog.done_blocks)} of {len(job.blocks)} blocks of "
                                 f"part {job.part} cached; rerun the same command to resume")
    return time.perf_counter() - t_loop


def _warm_up(job: _Part, runner: TrajectoryRunner, experts: ExpertSet, todo: list[int]):
    """Under --compile, compile each resident expert now (and return the warm-up for those loaded later): one forward
    at every batch size of `todo`, its seconds printed, not counted as a step."""
    if not job.speed.compile:
        return None
    batches = [len(job.blocks[b]) for b in todo]
    context = (job.cfg.max_sequence_length, int(job.spec.transformer_config["text_dim"]))

    def warm(model) -> float:
        t0 = time.perf_counter()
        job.speed.warm_up(runner, model, batches, job.latent_shape, context)
        seconds = time.perf_counter() - t0
        print0(f"part {job.part}: compiled the teacher's repeated blocks in {seconds:.1f}s (a warm-up, not a step)")
        return seconds

    for m in experts.models:
        if m is not None:
            warm(m)
    return warm


def _progress_bar(job: _Part, prog: PartProgress, todo: list[int]) -> tuple[tqdm, StageOneProgress]:
    """The bar over the samples the blocks `todo` write (rank 0's alone under torchrun), and its figures."""
    cfg, recorded = job.cfg, len(job.recorded)
    bar = progress_bar(total=sum(len(job.blocks[b]) for b in todo) * recorded, desc=f"teacher-cache part {job.part}",
                       unit="sample", dynamic_ncols=True, disable=job.torchrun and not dist_env().is_main)
    progress = StageOneProgress(bar, part=job.part, steps=recorded, seeds=cfg.seeds_per_prompt,
                                cache_samples=len(job.prompts) * cfg.seeds_per_prompt * recorded, shards=prog.shards,
                                tensorboard_dir=job.part_dir / F.TENSORBOARD if cfg.report_to == "tensorboard" else None)
    return bar, progress


def _block_inputs(job: _Part) -> Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """`inputs(b)`: block b's initial noise, its prompts' embeddings and (image-to-video) its trajectories' condition
    latents, from the prompt store, checked."""
    stored = PartRows(job.out, job.part, job.num_parts)  # opened once: zarr re-reads metadata at every open

    def inputs(b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = [p // job.num_parts for p, _ in job.blocks[b]]
        try:
            read = stored.padded(rows)  # a block's rows are consecutive: their tokens lie together (one read)
        except ValueError as e:  # zarr's check of each chunk's crc32c: the store changed since it was written
            why = "fail their chunk's crc32c (changed after stage one wrote them)" if "checksum" in str(e) else \
                f"do not read ({e})"
            raise damaged_part(job.out, job.part, f"embeds of rows {min(rows)}-{max(rows)} of "
                                                  f"{store_relpath(job.part)} {why}") from e
        cond = F.storage_to_torch(read, stored.dtype_name)
        noise = torch.stack([initial_noise(job.cfg.seed, p, s, job.latent_shape) for p, s in job.blocks[b]])
        if job.images is None:
            return noise, cond, None
        condition = [torch.from_numpy(stored.latents(F.Z_CONDITION, p // job.num_parts)[s]) for p, s in job.blocks[b]]
        return noise, cond, torch.stack(condition)

    return inputs


def _pack_blocks(finished, blocks: list[list[tuple[int, int]]], sink: BlockSink, pool: cf.ThreadPoolExecutor) -> bool:
    """Hands each finished block to the writer thread, then packs the last shard; returns whether a SIGTERM stopped
    the teacher (what finished is kept). `finished` is lazy: the teacher runs inside the SIGTERM deferral here."""
    pending: cf.Future | None = None
    stopped = False
    with signals.deferred():  # SIGTERM stops at the next teacher step (denoise) or between windows
        try:
            for b, records, final in finished:
                if pending is not None:
                    pending.result()  # at most one block in flight: bounded memory, errors surface here
                pending = pool.submit(sink.add, b, blocks[b], records, final)
        except signals.Terminated:
            stopped = True
        if pending is not None:
            pending.result()
        pool.submit(sink.flush).result()
    return stopped


def _wait_for_parts(job: _Part) -> None:
    """The barrier before the manifest, under torchrun. A SIGTERM here reached every rank: a peer still denoising
    leaves, the barrier fails, and this rank stops as terminated (its part complete), not as a lost rank."""
    with signals.deferred():
        try:
            barrier()
        except Exception as e:
            if not signals.requested():
                raise
            raise signals.Terminated(f"terminated (SIGTERM) with every block of part {job.part} cached, while "
                                     "waiting for the other parts; rerun the same command to finish the cache") from e


def _finalize(job: _Part, prog: PartProgress, loop_s: float, t0: float) -> dict:
    """Write the manifest once every part is complete, and return (and print) the part's summary."""
    out, part, num_parts, device = job.out, job.part, job.num_parts, job.device
    if job.torchrun:
        _wait_for_parts(job)
    manifest = try_write_manifest(out, num_parts, before_replace=lambda: fault_point("in_manifest")) \
        if not job.torchrun or part == 0 else None
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    summary = {
        "cache": str(out), "part": part, "num_parts": num_parts,
        "samples": sum(s.samples for s in prog.shards), "shards": len(prog.shards),
        "bytes": sum(s.bytes for s in prog.shards), "wall_s": round(time.time() - t0, 2),
        "peak_rss_gib": round(peak_rss, 3), "placement": job.placement.name, "expert_major": job.placement.expert_major,
        "peak_cuda_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        "manifest": manifest is not None, "loop_s": round(loop_s, 3),
    }
    gpu = f", peak CUDA {summary['peak_cuda_gib']:.2f} GiB" if summary["peak_cuda_gib"] is not None else ""
    print0(f"part {part}: {summary['samples']} samples in {summary['shards']} shards, "
           f"{summary['bytes'] / 2**20:.1f} MiB, {summary['wall_s']:.1f}s, peak RSS {peak_rss:.2f} GiB{gpu}")
    if manifest is not None:
        print0(f"cache complete: {out} ({manifest.samples} samples, {len(manifest.shards)} shards, "
               f"{manifest.bytes / 2**20:.1f} MiB, fingerprint {manifest.fingerprint[:12]})")
    elif not job.torchrun:
        print0(f"part {part} done; the manifest is written when all {num_parts} parts are complete")
    return summary
