"""Stage one: load → encode → run blocks → finalize. The teacher runs once per (prompt, seed, step)."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import math
import os
import resource
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tqdm.auto import tqdm

from cache import format as F
from cache.atomic import atomic_write_bytes
from cache.errors import CacheError
from cache.manifest import fingerprint, load_manifest, manifest_path, try_write_manifest
from cache.progress import PartProgress, list_parts
from cache.prompt_store import (
    create_prompt_store, open_prompt_store, prompt_store_path, write_latent_rows, write_prompt_rows,
)
from cache.writer import ShardWriter
from pipeline.config import TeacherCacheConfig, save_resolved
from pipeline.errors import UserError
from pipeline.faults import fault_point
from pipeline.prompts import dedupe, prompt_set_sha256, read_prompt_file
from pipeline.runtime import barrier, dist_env, init_distributed, teardown

from .encode import encode_prompts
from .placement import choose_placement, expert_window, load_experts, load_scheduler, load_text_encoder
from .teacher import resolve_teacher
from .trajectory import Schedule, StepRecord, TrajectoryRunner, initial_noise

_CACHE_ENTRIES = {F.MANIFEST, F.PARTS_DIR, F.SHARDS_DIR, F.NEGATIVE, F.RESOLVED_CONFIG, "offload"}


def _log(msg: str) -> None:
    tqdm.write(msg)


def _resolve_parts(cfg: TeacherCacheConfig) -> tuple[int, int, bool]:
    env = dist_env()
    if cfg.num_parts is not None:
        if env.world_size > 1:
            raise UserError("--part/--num-parts cannot be combined with torchrun (each rank is a part already)")
        return cfg.part, cfg.num_parts, False
    return env.rank, env.world_size, env.world_size > 1


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if p.name not in _CACHE_ENTRIES and not p.name.endswith(F.TMP_SUFFIX)]
        if foreign:
            raise UserError(f"output {out} is not empty and is not a WanDistiller cache (found {foreign[0]!r}); "
                            "choose a new or empty directory")
    try:
        (out / F.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}{F.TMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output directory {out} ({e.strerror}); choose a writable --out") from e


def _clear(out: Path, part: int | None) -> None:
    """Remove cache files: all of them (part None) or one part's. Only names the cache owns are touched."""
    manifest_path(out).unlink(missing_ok=True)
    if part is None:
        for name in (F.PARTS_DIR, F.SHARDS_DIR, "offload"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / F.NEGATIVE).unlink(missing_ok=True)
        (out / F.SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        return
    shutil.rmtree(out / F.PARTS_DIR / F.part_dirname(part), ignore_errors=True)
    for f in (out / F.SHARDS_DIR).glob(f"part-{part:05d}-*"):
        f.unlink()


def _drop_orphans(out: Path, prog: PartProgress, owns_root: bool) -> None:
    """Delete what a crash of this part left half done: its shards that progress does not list (temporary,
    or renamed just before the crash) and the temporary files of its atomic writes (progress record,
    negative embedding, zarr chunks). Root files (manifest, negative) only when no other part writes
    them meanwhile (`owns_root`): a part on another node may be renaming its manifest right now."""
    listed = {s[F.S_PATH] for s in prog.shards}
    for f in (out / F.SHARDS_DIR).glob(f"part-{prog.part:05d}-*"):
        if f"{F.SHARDS_DIR}/{f.name}" not in listed:
            f.unlink()
    part_dir = out / F.PARTS_DIR / F.part_dirname(prog.part)
    stale = [*part_dir.glob(f"*{F.TMP_SUFFIX}"), *(part_dir / F.PROMPTS_ZARR).rglob("*.partial")]
    if owns_root:
        stale += [*out.glob(f"{F.MANIFEST}.*{F.TMP_SUFFIX}"), *out.glob(f"{F.NEGATIVE}.*{F.TMP_SUFFIX}")]
    for f in stale:
        f.unlink(missing_ok=True)


def _forget_lost_shards(out: Path, prog: PartProgress) -> None:
    """Shards this part lists that are gone or have another size (deleted to be rebuilt, as `cache verify` and
    stage two advise for a corrupt shard): forget them and their blocks, so this run computes them again.
    Only existence and size are checked here (a stat per shard); `cache verify` re-hashes."""
    lost = [s for s in prog.shards
            if not (out / s[F.S_PATH]).is_file() or (out / s[F.S_PATH]).stat().st_size != s[F.S_BYTES]]
    if not lost:
        return
    if any(F.S_BLOCKS not in s for s in lost):
        raise UserError(f"shard {out / lost[0][F.S_PATH]} is missing or damaged and this cache does not record "
                        "which blocks it held (made by an older WanDistiller); rebuild the cache with --overwrite")
    blocks = {b for s in lost for b in s[F.S_BLOCKS]}
    more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
    _log(f"part {prog.part}: shard {lost[0][F.S_PATH]}{more} missing or damaged; recomputing {len(blocks)} block(s)")
    manifest_path(out).unlink(missing_ok=True)  # it lists them; rewritten once every part is complete again
    prog.shards = [s for s in prog.shards if s not in lost]
    prog.done_blocks = sorted(set(prog.done_blocks) - blocks)
    prog.complete = False
    prog.save(out)


def _next_shard_index(prog: PartProgress) -> int:
    """One past the highest shard number of the part (not the count: a recomputed shard gets a new name)."""
    return 1 + max((int(Path(s[F.S_PATH]).stem.rsplit("-", 1)[1]) for s in prog.shards), default=-1)


class _BlockSink:
    """Runs in the writer thread: packs finished blocks into shards, then records them as done.

    Order per shard: rename the tar into place → write its trajectories' final latents → rewrite
    progress.json. A crash anywhere before the last step leaves the blocks not done; they rerun.
    """

    def __init__(self, out: Path, prog: PartProgress, store, samples_per_shard: int, num_parts: int, bar):
        self.out, self.prog, self.store, self.bar = out, prog, store, bar
        self.samples_per_shard = samples_per_shard
        self.num_parts = num_parts
        self.writer: ShardWriter | None = None
        self.pending: list[tuple[int, list[tuple[int, int]], torch.Tensor]] = []

    def add(self, block: int, traj: list[tuple[int, int]], records: list[StepRecord], final: torch.Tensor) -> None:
        if self.writer is None:
            self.writer = ShardWriter(self.out, self.prog.part, _next_shard_index(self.prog))
        try:
            for rec in records:
                for j, (p, s) in enumerate(traj):
                    tensors = {F.T_X_T: rec.x_t[j], F.T_TARGET: rec.target[j]}
                    if rec.target_cond is not None:
                        tensors[F.T_TARGET_COND] = rec.target_cond[j]
                        tensors[F.T_TARGET_UNCOND] = rec.target_uncond[j]
                    meta = {F.M_PROMPT_IDX: p, F.M_SEED_IDX: s, F.M_STEP: rec.step, F.M_TIMESTEP: rec.timestep,
                            F.M_SIGMA: rec.sigma, F.M_EXPERT: rec.expert, F.M_GUIDANCE: rec.guidance}
                    self.writer.write(F.sample_key(p, s, rec.step), tensors, meta)
            fault_point("mid_shard")
        except BaseException:
            self.writer.abort()
            self.writer = None
            self.pending = []
            raise
        self.pending.append((block, traj, final))
        self.bar.update(len(records) * len(traj))
        if self.writer.samples >= self.samples_per_shard:
            self.flush()

    def flush(self) -> None:
        if self.writer is None:
            return
        record = self.writer.close() | {F.S_BLOCKS: sorted(b for b, _, _ in self.pending)}
        self.writer = None
        fault_point("after_rename")
        for _, traj, final in self.pending:
            rows = [p // self.num_parts for p, _ in traj]
            write_latent_rows(self.store, F.Z_FINAL_LATENTS, rows, [s for _, s in traj], final)
        fault_point("before_progress")
        self.prog.shards.append(record)
        self.prog.done_blocks = sorted(set(self.prog.done_blocks) | {b for b, _, _ in self.pending})
        self.prog.save(self.out)
        self.pending = []

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _denoise(runner: TrajectoryRunner, experts, phases, window: list[int], inputs, neg: torch.Tensor):
    """Run a window of blocks to their last step; returns [(block, records, final latents)] in block order.

    phases [None] is step-major (every step of a block, then the next block); [(1,), (2,)] is expert-major:
    every block's high-noise steps with expert 1, then their low-noise steps with expert 2, each block's
    scheduler state carried across. Both orders make the same records: same steps, same inputs, same batches.
    """
    records: dict[int, list[StepRecord]] = {b: [] for b in window}
    states: dict = {}
    finals: dict[int, torch.Tensor] = {}
    for phase in phases:
        experts.activate(phase)
        for b in window:
            noise, cond = inputs(b)
            finals[b], states[b] = runner.run(noise, cond, neg, on_step=records[b].append, experts=phase,
                                              state=states.get(b))
    return [(b, records[b], finals[b]) for b in window]


def run(cfg: TeacherCacheConfig) -> dict:
    """Build (or resume) the cache described by `cfg`; returns the closing summary."""
    t0 = time.time()
    part, num_parts, torchrun = _resolve_parts(cfg)
    if torchrun:
        init_distributed()
    try:
        return _run(cfg, part, num_parts, torchrun, t0)
    finally:
        if torchrun:
            teardown()


def _run(cfg: TeacherCacheConfig, part: int, num_parts: int, torchrun: bool, t0: float) -> dict:
    # 1. prompts: validate, dedupe; prompt_idx = order of first appearance; this part takes idx % N == part.
    all_prompts, dropped = dedupe(read_prompt_file(cfg.prompts))
    if dropped:
        _log(f"dropped {dropped} duplicate prompt(s); {len(all_prompts)} unique")
    part_idx = list(range(part, len(all_prompts), num_parts))
    if not part_idx:
        raise UserError(f"part {part} of {num_parts} gets no prompt: the file has only {len(all_prompts)}; "
                        "use fewer parts")

    # 2. teacher configs (no weights yet), sizes, schedule, fingerprint.
    spec = resolve_teacher(cfg.teacher, cfg.revision)
    spec.check_sizes(cfg.height, cfg.width, cfg.frames)
    if cfg.guidance_2 is not None and spec.boundary_ratio is None:
        raise UserError("--guidance-2 applies only to two-expert (Wan 2.2 A14B) teachers; drop it for this teacher")
    plan = choose_placement(cfg, spec)
    placement, device, dtype_name = plan.name, plan.device, plan.dtype
    dtype = F.DTYPES[dtype_name]
    scheduler = load_scheduler(spec)
    guidance_2 = cfg.guidance_2 if cfg.guidance_2 is not None else (cfg.guidance if spec.boundary_ratio else None)
    schedule = Schedule.build(scheduler, cfg.steps, spec.boundary_ratio, cfg.guidance, guidance_2)
    latent_shape = spec.latent_shape(cfg.height, cfg.width, cfg.frames)
    tcfg = spec.transformer_config
    header = {
        F.F_TEACHER: cfg.teacher, F.F_REVISION: cfg.revision, F.F_TEACHER_PATH: str(spec.path.resolve()),
        F.F_DTYPE: dtype_name, F.F_STEPS: cfg.steps,
        F.F_TIMESTEPS: schedule.timesteps, F.F_SIGMAS: schedule.sigmas, F.F_EXPERTS: schedule.experts,
        F.F_GUIDANCE: cfg.guidance, F.F_GUIDANCE_2: guidance_2, F.F_BOUNDARY_RATIO: spec.boundary_ratio,
        F.F_EXPAND_TIMESTEPS: spec.expand_timesteps, F.F_HEIGHT: cfg.height, F.F_WIDTH: cfg.width,
        F.F_FRAMES: cfg.frames, F.F_LATENT_SHAPE: list(latent_shape),
        F.F_MAX_SEQUENCE_LENGTH: cfg.max_sequence_length, F.F_NEGATIVE_PROMPT: cfg.negative_prompt,
        F.F_SEEDS_PER_PROMPT: cfg.seeds_per_prompt, F.F_SEED: cfg.seed, F.F_PROMPTS: len(all_prompts),
        F.F_PROMPT_SET_SHA256: prompt_set_sha256(all_prompts), F.F_TEXT_DIM: tcfg["text_dim"],
        F.F_IN_CHANNELS: tcfg["in_channels"], F.F_PATCH_SIZE: list(spec.patch_size),
        F.F_SCHEDULER: {k: v for k, v in scheduler.config.items() if not k.startswith("_")}
        | {"_class_name": type(scheduler).__name__},
        F.F_CFG: schedule.cfg, F.F_SAVE_COND_UNCOND: cfg.save_cond_uncond,
    }
    # The teacher's identity enters through its content (configs, weight samples), not its name or path,
    # so moving the teacher folder does not invalidate a cache.
    fp = fingerprint({k: v for k, v in header.items() if k not in (F.F_TEACHER, F.F_REVISION, F.F_TEACHER_PATH)}
                     | {"teacher_identity": spec.identity()})

    # 3. the output directory: refuse foreign or mismatched content unless --overwrite.
    out = Path(cfg.out)
    _check_out_dir(out)
    owner = torchrun and part == 0 or num_parts == 1
    if cfg.overwrite:
        if owner or not torchrun:
            _clear(out, None if owner else part)
        if torchrun:
            barrier()
    else:
        if manifest_path(out).exists():
            try:
                m = load_manifest(out)
            except CacheError:
                if not list_parts(out):
                    raise
                m = None  # torn or edited by hand: rewritten from the parts' progress records, checked next
            if m is not None and m[F.F_FINGERPRINT] != fp:
                raise UserError(f"{out} holds a cache made with other settings (fingerprint {m[F.F_FINGERPRINT][:12]}, "
                                f"this run {fp[:12]}); use a new --out or add --overwrite to replace it")
        for p in list_parts(out):
            other = PartProgress.load(out, p)
            if other.fingerprint != fp or other.num_parts != num_parts:
                raise UserError(f"{out} holds part {p} of a run with other settings or part count "
                                f"({other.num_parts} parts); use a new --out or add --overwrite to replace it")
    part_dir = out / F.PARTS_DIR / F.part_dirname(part)
    part_dir.mkdir(parents=True, exist_ok=True)

    trajectories = [(p, s) for p in part_idx for s in range(cfg.seeds_per_prompt)]
    blocks = [trajectories[i:i + cfg.batch_size] for i in range(0, len(trajectories), cfg.batch_size)]
    prog = PartProgress.load(out, part)
    if prog is not None and prog.batch_size != cfg.batch_size:
        raise UserError(f"part {part} of {out} was started with --batch-size {prog.batch_size}; resume with that "
                        "value or add --overwrite to start again")
    save_resolved(cfg, part_dir / F.RESOLVED_CONFIG)  # only now: a refused run leaves the cache as it was
    if prog is None:
        prog = PartProgress(part=part, num_parts=num_parts, fingerprint=fp, prompts=len(part_idx),
                            blocks=len(blocks), batch_size=cfg.batch_size, header=header)
        prog.save(out)
    _forget_lost_shards(out, prog)
    _drop_orphans(out, prog, owns_root=owner)
    store_path = prompt_store_path(out, part)
    n_done = len(prog.done_blocks)
    if prog.complete:
        _log(f"part {part}: already complete ({len(prog.shards)} shards)")
    else:
        _log(f"part {part}/{num_parts}: {len(part_idx)} prompts, {len(trajectories)} trajectories, "
             f"{len(blocks)} blocks ({n_done} done), placement {placement}"
             f"{' (expert-major)' if plan.expert_major else ''}, {dtype_name} on {device}")
        if plan.reason:
            _log(f"auto placement: {plan.reason}")

    # 4. encode prompts once (and the negative prompt), write the zarr rows and initial noise; free the encoder.
    neg_path = part_dir / F.NEGATIVE
    if not prog.complete and not prog.encoded:
        tokenizer, encoder = load_text_encoder(spec, dtype, device, plan)
        store = create_prompt_store(store_path, len(part_idx), cfg.max_sequence_length, tcfg["text_dim"],
                                    dtype_name, cfg.seeds_per_prompt, latent_shape)
        texts = [all_prompts[i] for i in part_idx]
        embeds, lens = encode_prompts(tokenizer, encoder, texts, cfg.max_sequence_length, dtype, device,
                                      progress=dist_env().is_main or not torchrun)
        write_prompt_rows(store, list(range(len(part_idx))), part_idx, texts, embeds, lens)
        fault_point("after_encode_rows")
        neg, neg_len = encode_prompts(tokenizer, encoder, [cfg.negative_prompt], cfg.max_sequence_length, dtype,
                                      device, progress=False)
        neg_bytes = st_save({F.NEG_EMBEDS: neg[0].contiguous(), F.NEG_SEQ_LEN: neg_len.to(torch.int64)})
        atomic_write_bytes(neg_path, neg_bytes)
        if part == 0:
            atomic_write_bytes(out / F.NEGATIVE, neg_bytes)
        for r, p in enumerate(part_idx):
            noise = torch.stack([initial_noise(cfg.seed, p, s, latent_shape) for s in range(cfg.seeds_per_prompt)])
            store[F.Z_INIT_NOISE][r] = noise.numpy()
        del tokenizer, encoder, embeds
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        prog.encoded = True
        prog.save(out)

    # 5. the trajectories, block by block; the writer thread packs shards while the teacher computes.
    loop_s = 0.0
    todo = [b for b in range(len(blocks)) if b not in set(prog.done_blocks)]
    if todo and not prog.complete:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        store = open_prompt_store(store_path, mode="r+")
        neg = st_load(neg_path.read_bytes())[F.NEG_EMBEDS].unsqueeze(0)
        experts = load_experts(spec, dtype, device, plan, log=_log)
        runner = TrajectoryRunner(experts, scheduler, schedule, cfg.steps, dtype, device, spec.expand_timesteps,
                                  keep_cond_uncond=cfg.save_cond_uncond)
        bar = tqdm(total=sum(len(blocks[b]) for b in todo) * cfg.steps, desc=f"teacher-cache part {part}",
                   unit="sample", dynamic_ncols=True, disable=torchrun and not dist_env().is_main)
        sink = _BlockSink(out, prog, store, cfg.samples_per_shard, num_parts, bar)
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        pending: cf.Future | None = None
        t_loop = time.perf_counter()

        # Opened once (zarr re-reads an array's metadata at every `store[name]`) and read once per block: a zarr
        # read costs ~2 ms (its event-loop round trip), a fifth of the tiny teacher's compute per trajectory.
        z_embeds = store[F.Z_EMBEDS]
        embeds_dtype = z_embeds.attrs[F.Z_ATTR_TORCH_DTYPE]

        def inputs(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [p // num_parts for p, _ in blocks[b]]
            lo = min(rows)  # a block's rows are consecutive (one per prompt, repeated per seed): one read
            cond = F.storage_to_torch(z_embeds[lo:max(rows) + 1], embeds_dtype)[[r - lo for r in rows]]
            noise = torch.stack([initial_noise(cfg.seed, p, s, latent_shape) for p, s in blocks[b]])
            return noise, cond

        # Step-major: one block at a time, all its steps. Expert-major: a window of blocks with expert 1, then
        # with expert 2, so one expert is resident at a time; the window's records wait in RAM meanwhile.
        window = expert_window(cfg.batch_size, cfg.steps, math.prod(latent_shape), dtype.itemsize,
                               cfg.save_cond_uncond) if plan.expert_major else 1
        phases = [(e,) for e in range(1, len(experts) + 1)] if plan.expert_major else [None]
        try:
            for w in range(0, len(todo), window):
                for b, records, final in _denoise(runner, experts, phases, todo[w:w + window], inputs, neg):
                    if pending is not None:
                        pending.result()  # at most one block in flight: bounded memory, errors surface here
                    pending = pool.submit(sink.add, b, blocks[b], records, final)
            if pending is not None:
                pending.result()
            pool.submit(sink.flush).result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            sink.abort()
            bar.close()  # end the bar's line so the error message starts on its own
            raise
        pool.shutdown(wait=True)
        loop_s = time.perf_counter() - t_loop
        bar.close()
        experts.close()
        del experts, runner
    if not prog.complete:
        prog.complete = True
        prog.save(out)

    # 6. finalize: the last part to finish writes the manifest.
    if torchrun:
        barrier()
    manifest = None
    if not torchrun or part == 0:
        manifest = try_write_manifest(out, num_parts, before_replace=lambda: fault_point("in_manifest"))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    summary = {
        "cache": str(out), "part": part, "num_parts": num_parts,
        "samples": sum(s[F.S_SAMPLES] for s in prog.shards), "shards": len(prog.shards),
        "bytes": sum(s[F.S_BYTES] for s in prog.shards), "wall_s": round(time.time() - t0, 2),
        "peak_rss_gib": round(peak_rss, 3), "placement": placement, "expert_major": plan.expert_major,
        "peak_cuda_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        "manifest": manifest is not None, "loop_s": round(loop_s, 3),
    }
    gpu = f", peak CUDA {summary['peak_cuda_gib']:.2f} GiB" if summary["peak_cuda_gib"] is not None else ""
    _log(f"part {part}: {summary['samples']} samples in {summary['shards']} shards, "
         f"{summary['bytes'] / 2**20:.1f} MiB, {summary['wall_s']:.1f}s, peak RSS {peak_rss:.2f} GiB{gpu}")
    if manifest is not None:
        _log(f"cache complete: {out} ({manifest[F.F_SAMPLES]} samples, {len(manifest[F.F_SHARDS])} shards, "
             f"{manifest[F.F_BYTES] / 2**20:.1f} MiB, fingerprint {manifest[F.F_FINGERPRINT][:12]})")
    elif not torchrun:
        _log(f"part {part} done; the manifest is written when all {num_parts} parts are complete")
    return summary

