"""`wandistiller eval`: how close the student comes to the teacher on the cache's (held-out) trajectories.

    (a) velocity error: the student's prediction at every cached x_t against the teacher's cached target,
        per step (untrained twin alongside as the baseline);
    (b) final-latent error: the student samples from each trajectory's cached initial noise with the cache's
        own scheduler and step count, and its final latent is compared with the teacher's;
    (c) speed: student and teacher sample the same latents at the same step count.

Everything runs on prompt embeddings stored in the cache: no text encoder is loaded, and the VAE never is.
A student that learned guided targets samples at guidance 1; one that learned conditional predictions is
compared with `target_cond` and samples with CFG at the teacher's scale (the cache's negative prompt).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cache import format as F
from cache.atomic import atomic_write_json
from cache.manifest import load_manifest
from cache.prompt_store import EmbeddingCache
from pipeline.errors import UserError
from pipeline.prompts import dedupe, read_prompt_file

from . import trajectories
from .config import EvalConfig
from .models import (
    Student, check_compatible, find_student, init_exact, load_teacher, load_transformer, pick_device,
    student_pipeline, teacher_dir, untrained_transformer,
)
from .plot import plot_report

REPORT_NAME = "eval.json"
MODELS = ("student", "untrained")
# distill.json fields whose value should match the cache's for the comparison to mean what it says.
COMPARED = ("cfg", "guidance", "guidance_2", "max_sequence_length", "latent_shape", "steps", "negative_prompt")


def _mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error in float32: [N, ...] x [N, ...] -> [N]."""
    return (a.float() - b.float()).pow(2).flatten(1).mean(1)


def model_timestep(t: torch.Tensor, latent_shape, expand: bool) -> torch.Tensor:
    """The transformer's timestep input for t [B]: per token when the teacher expands timesteps (TI2V),
    built as WanPipeline builds it (every 2nd row and column of the latent grid, times its frames)."""
    if not expand:
        return t
    _, f, h, w = latent_shape
    return t[:, None].expand(-1, f * len(range(0, h, 2)) * len(range(0, w, 2)))


def scheduler_from_manifest(manifest: dict):
    """The teacher's scheduler exactly as the cache recorded it (class and config)."""
    import diffusers

    conf = dict(manifest.get(F.F_SCHEDULER) or {})
    cls = getattr(diffusers, str(conf.pop("_class_name", None)), None)
    if cls is None:
        raise UserError(f"the cache's scheduler {manifest.get(F.F_SCHEDULER, {}).get('_class_name')!r} is unknown "
                        f"to diffusers {diffusers.__version__}")
    return cls.from_config(conf)


def _settings_warnings(student: Student, manifest: dict, teacher_timesteps: list[float]) -> list[str]:
    notes = []
    for key in COMPARED:
        mine, theirs = student.distill.get(key), manifest.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            notes.append(f"student trained with {key}={mine!r}, the cache has {theirs!r}")
    if [float(t) for t in teacher_timesteps] != [float(t) for t in manifest[F.F_TIMESTEPS]]:
        notes.append("the cache's scheduler config does not reproduce its recorded timesteps")
    return notes


@torch.inference_mode()
def velocity_errors(models: dict, cache_dir: Path, manifest: dict, trajs, target_key: str, batch_size: int,
                    device: torch.device, dtype: torch.dtype) -> dict:
    """Per-step mean of the per-sample MSE of every model against `target_key`, over `trajs`' samples."""
    steps = int(manifest[F.F_STEPS])
    shape, expand = manifest[F.F_LATENT_SHAPE], bool(manifest.get(F.F_EXPAND_TIMESTEPS, False))
    embeds = EmbeddingCache(cache_dir, int(manifest[F.F_NUM_PARTS]))
    seeds = {(t.prompt_idx, t.seed_idx) for t in trajs}
    sums = {name: [0.0] * steps for name in models}
    counts = [0] * steps
    bar = tqdm(total=len(trajs) * steps, desc="eval velocity", unit="sample", dynamic_ncols=True)

    def flush(batch):
        x = torch.stack([s[F.T_X_T] for s, _ in batch]).to(device, dtype)
        t = model_timestep(torch.tensor([m[F.M_TIMESTEP] for _, m in batch], device=device), shape, expand)
        enc = torch.stack([embeds.get(m[F.M_PROMPT_IDX]) for _, m in batch]).to(device, dtype)
        target = torch.stack([s[target_key] for s, _ in batch]).to(device)
        for name, model in models.items():
            pred = model(hidden_states=x, timestep=t, encoder_hidden_states=enc, return_dict=False)[0]
            for (_, m), e in zip(batch, _mse(pred, target).tolist()):
                sums[name][m[F.M_STEP]] += e
        for _, m in batch:
            counts[m[F.M_STEP]] += 1
        bar.update(len(batch))

    batch = []
    for tensors, meta in trajectories.iter_samples(cache_dir, manifest, {p for p, _ in seeds}):
        if (meta[F.M_PROMPT_IDX], meta[F.M_SEED_IDX]) not in seeds:
            continue
        if target_key not in tensors:
            raise UserError(f"the cache has no {target_key!r} tensors, which this student learned (conditional "
                            "predictions); rebuild the cache with --save-cond-uncond")
        batch.append((tensors, meta))
        if len(batch) == batch_size:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    bar.close()
    if sum(counts) != len(trajs) * steps:
        raise UserError(f"the cache holds {sum(counts)} samples of the selected trajectories, expected "
                        f"{len(trajs) * steps}; run `wandistiller cache verify {cache_dir}`")
    per_step = [{"step": k, "timestep": manifest[F.F_TIMESTEPS][k], "sigma": (manifest.get(F.F_SIGMAS) or [None] * steps)[k],
                 "expert": (manifest.get(F.F_EXPERTS) or [1] * steps)[k], "samples": counts[k],
                 **{name: sums[name][k] / counts[k] for name in models}} for k in range(steps)]
    mean = {name: sum(sums[name]) / sum(counts) for name in models}
    return {"per_step": per_step, "mean": mean}


def _sample_kwargs(manifest: dict) -> dict:
    return dict(num_inference_steps=int(manifest[F.F_STEPS]), height=int(manifest[F.F_HEIGHT]),
                width=int(manifest[F.F_WIDTH]), num_frames=int(manifest[F.F_FRAMES]), output_type="latent",
                max_sequence_length=int(manifest[F.F_MAX_SEQUENCE_LENGTH]))


def sample_latents(pipe, embeds: torch.Tensor, init: torch.Tensor, neg: torch.Tensor, guidance: float,
                   manifest: dict, extra: dict | None = None) -> torch.Tensor:
    """Final latents [B, ...] float32 (CPU) of a WanPipeline run from `init` with prompt embeddings `embeds`."""
    kw = dict(_sample_kwargs(manifest), guidance_scale=guidance, **(extra or {}))
    if guidance > 1.0:
        kw["negative_prompt_embeds"] = neg.expand(embeds.shape[0], -1, -1)
    return pipe(prompt_embeds=embeds, latents=init.clone(), **kw).frames.float().cpu()


def final_latent_errors(pipes: dict, cache_dir: Path, manifest: dict, trajs, neg, guidance: float,
                        batch_size: int, device: torch.device) -> dict:
    """MSE between each model's sampled final latent (from the cached initial noise) and the teacher's cached
    one, per trajectory and mean. Latents are read a batch at a time."""
    embeds = EmbeddingCache(cache_dir, int(manifest[F.F_NUM_PARTS]))
    errs = {name: [] for name in pipes}
    bar = tqdm(total=len(trajs) * len(pipes), desc="eval sampling", unit="traj", dynamic_ncols=True)
    for i in range(0, len(trajs), batch_size):
        chunk = trajs[i:i + batch_size]
        init, final = trajectories.latents(cache_dir, manifest, chunk)
        emb = torch.stack([embeds.get(t.prompt_idx) for t in chunk]).to(device)
        for name, pipe in pipes.items():
            out = sample_latents(pipe, emb, init.to(device), neg.to(device), guidance, manifest)
            errs[name] += _mse(out, final).tolist()
            bar.update(len(chunk))
    bar.close()
    return {**{name: sum(v) / len(v) for name, v in errs.items()},
            "per_trajectory": [{"prompt_idx": t.prompt_idx, "seed_idx": t.seed_idx,
                                **{name: errs[name][j] for name in pipes}} for j, t in enumerate(trajs)]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sampling(student_pipe, teacher_pipe, cache_dir: Path, manifest: dict, trajs, neg,
                  student_guidance: float, runs: int, device: torch.device) -> dict:
    """Seconds per image of student and teacher on the same latents and step count (after one warm-up each),
    and the teacher's re-run final latent against the cache (≈0: checks this path reproduces stage one)."""
    embeds = EmbeddingCache(cache_dir, int(manifest[F.F_NUM_PARTS]))
    teacher_kw = {}
    if teacher_pipe.config.boundary_ratio is not None and manifest.get(F.F_GUIDANCE_2) is not None:
        teacher_kw["guidance_scale_2"] = float(manifest[F.F_GUIDANCE_2])
    jobs = {"student": (student_pipe, student_guidance, {}),
            "teacher": (teacher_pipe, float(manifest[F.F_GUIDANCE]), teacher_kw)}
    seconds = {name: 0.0 for name in jobs}
    teacher_err = []
    n = min(runs, len(trajs))
    init, final = trajectories.latents(cache_dir, manifest, trajs[:n])
    for j in tqdm(range(-1, n), desc="eval timing", unit="traj", dynamic_ncols=True):
        t = trajs[max(j, 0)]
        emb = embeds.get(t.prompt_idx)[None].to(device)
        lat = init[max(j, 0)][None].to(device)
        for name, (pipe, g, extra) in jobs.items():
            _sync(device)
            t0 = time.perf_counter()
            out = sample_latents(pipe, emb, lat, neg.to(device), g, manifest, extra)
            _sync(device)
            if j >= 0:  # j == -1 is the warm-up
                seconds[name] += time.perf_counter() - t0
                if name == "teacher":
                    teacher_err.append(_mse(out, final[j][None]).item())
    cfg_on = float(manifest[F.F_GUIDANCE]) > 1.0
    return {
        "runs": n, "steps": int(manifest[F.F_STEPS]),
        "student_s_per_image": seconds["student"] / n, "teacher_s_per_image": seconds["teacher"] / n,
        "speedup": seconds["teacher"] / max(seconds["student"], 1e-9),
        "student_forwards_per_step": 2 if student_guidance > 1.0 else 1,
        "teacher_forwards_per_step": 2 if cfg_on else 1,
        "student_params": sum(p.numel() for p in student_pipe.transformer.parameters()),
        "teacher_params_per_expert": sum(p.numel() for p in teacher_pipe.transformer.parameters()),
        "teacher_final_mse": sum(teacher_err) / len(teacher_err),
    }


def _check_cache_teacher(teacher, teacher_path: Path, manifest: dict) -> None:
    """Refuse a teacher whose latents are not the cache's (a different model than the one that wrote it)."""
    channels = int(manifest[F.F_LATENT_SHAPE][0])
    if int(teacher.transformer.config.in_channels) != channels:
        raise UserError(f"teacher {teacher_path} has {teacher.transformer.config.in_channels} latent channels, "
                        f"the cache {channels}: it is not the cache's teacher; pass the right --teacher")


def attribute_captions(path: str, max_prompts: int | None) -> list[str]:
    """The shapes captions of an --attributes prompt file; refuse text the checker cannot read."""
    from pipeline.shapes import parse_caption

    captions = dedupe(read_prompt_file(path))[0][:max_prompts]
    for c in captions:
        try:
            parse_caption(c)
        except ValueError as e:
            raise UserError(f"--attributes {path}: {e}; the attribute checker reads captions of pipeline/shapes.py's "
                            "grammar, e.g. data/shapes-heldout.txt") from e
    return captions


def _share(attrs: dict, key: str) -> str:
    v = attrs["student_vs_teacher"][key]
    return "n/a (teacher 0%)" if v is None else f"{v:.1%} of the teacher's"


def attribute_scores(cfg: EvalConfig, captions: list[str], teacher_path: Path, student_model, manifest: dict,
                     student_guidance: float, device, dtype, grid_path: Path) -> dict:
    """Teacher and student draw `captions` with the cache's settings (steps, guidance, negative prompt, size);
    the attribute checker scores both; the first pairs go to `grid_path`."""
    from PIL import Image

    from .attributes import compare
    from .grid import draw_grid
    from .sample import COLUMNS, SamplingSettings, _write_png

    teacher = load_teacher(teacher_path, dtype, device)
    _check_cache_teacher(teacher, teacher_path, manifest)
    g2 = manifest.get(F.F_GUIDANCE_2)
    settings = SamplingSettings(
        steps=int(manifest[F.F_STEPS]), guidance=float(manifest[F.F_GUIDANCE]),
        guidance_2=float(g2) if g2 is not None and teacher.config.boundary_ratio is not None else None,
        student_guidance=student_guidance, negative_prompt=str(manifest.get(F.F_NEGATIVE_PROMPT) or ""),
        height=int(manifest[F.F_HEIGHT]), width=int(manifest[F.F_WIDTH]),
        max_sequence_length=int(manifest[F.F_MAX_SEQUENCE_LENGTH]), seed=0)
    res = compare(teacher, student_pipeline(student_model, teacher=teacher), captions, settings, device,
                  cfg.batch_size, keep=cfg.attribute_grid)
    pairs = res.pop("images")
    if pairs:
        grid = draw_grid(captions[:len(pairs)], [[Image.fromarray(t), Image.fromarray(s)] for t, s in pairs],
                         COLUMNS)
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        _write_png(grid, grid_path)
    return {"prompts": cfg.attributes, "captions": len(captions), "settings": dataclasses.asdict(settings), **res,
            "grid": str(grid_path) if pairs else None}


def run(cfg: EvalConfig) -> dict:
    """Evaluate, write the JSON report and the plot next to it; returns the report."""
    t_start = time.time()
    # setup: cache, student, selection, models.
    cache_dir = Path(cfg.cache)
    manifest = load_manifest(cache_dir)
    student = find_student(cfg.student, cfg.weights)
    report_path = Path(cfg.report) if cfg.report else student.root / REPORT_NAME
    if report_path.is_dir():
        raise UserError(f"--report {report_path} is a folder; pass the JSON file to write")
    shape = manifest[F.F_LATENT_SHAPE]
    check_compatible(student, in_channels=int(manifest.get(F.F_IN_CHANNELS, shape[0])),
                     text_dim=int(manifest[F.F_TEXT_DIM]), latent_hw=(shape[2], shape[3]),
                     expand_timesteps=manifest.get(F.F_EXPAND_TIMESTEPS), against=f"cache {cache_dir}")
    teacher_path = None
    if cfg.teacher_timing or cfg.attributes:  # resolve now: fail before the long part, not after it
        name = cfg.teacher or manifest[F.F_TEACHER]
        try:
            teacher_path = teacher_dir(name)
        except UserError as e:
            raise UserError(f"{e} (timing and --attributes need the cache's teacher: pass --teacher PATH"
                            f"{'' if cfg.attributes else ' or --no-teacher-timing'})") from e
    captions = attribute_captions(cfg.attributes, cfg.attribute_max_prompts) if cfg.attributes else None
    # Held out: on the training cache, the prompts train-student kept aside (unless --prompts says otherwise).
    in_training = (manifest[F.F_FINGERPRINT] in student.fingerprints) if student.fingerprints else None
    kept_aside = [int(p) for p in student.setting("heldout_prompts", [])] if in_training else []
    trajs, selection = trajectories.select(cache_dir, manifest, cfg.prompts, cfg.max_prompts, only=kept_aside)
    device, dtype = pick_device(cfg.device, cfg.dtype)
    guided_cache = bool(manifest.get("cfg", float(manifest[F.F_GUIDANCE]) > 1.0))
    target_key = F.T_TARGET_COND if guided_cache and not student.guided else F.T_TARGET
    student_guidance = 1.0 if student.guided else float(manifest[F.F_GUIDANCE])
    scheduler = scheduler_from_manifest(manifest)
    scheduler.set_timesteps(int(manifest[F.F_STEPS]))
    warnings = _settings_warnings(student, manifest, scheduler.timesteps.tolist())
    if in_training:
        seen = sorted({t.prompt_idx for t in trajs} - set(kept_aside))
        if seen:
            warnings.append(f"{len(seen)} of the {selection['prompts']} prompts evaluated were trained on (this is "
                            "the student's training cache): they are not held out")
    if student.setting("init_from_teacher") and not init_exact(student, cfg.init_seed):
        warnings.append("train-student initialised the student from teacher blocks: the untrained baseline here is a "
                        "random initialisation, not its starting point (save student_init/ to compare with that)")
    for w in warnings:
        tqdm.write(f"warning: {w}")
    models = {"student": load_transformer(student, dtype, device)}
    models["untrained"], init_how = untrained_transformer(student, cfg.init_seed, dtype, device)

    # (a) velocity error per step.
    velocity = velocity_errors(models, cache_dir, manifest, trajs, target_key, cfg.batch_size, device, dtype)
    trained_steps = student.setting("train_steps")
    if isinstance(trained_steps, list):  # stage two may train on a subset of the cached steps
        for row in velocity["per_step"]:
            row["trained_step"] = row["step"] in trained_steps

    # (b) final latents sampled from the cached noise.
    neg = trajectories.negative_embeds(cache_dir)[None]
    expand = bool(manifest.get(F.F_EXPAND_TIMESTEPS, False))
    pipes = {name: student_pipeline(m, scheduler=scheduler, expand_timesteps=expand) for name, m in models.items()}
    finals = final_latent_errors(pipes, cache_dir, manifest, trajs, neg, student_guidance, cfg.batch_size, device)

    # (c) speed against the teacher on the same latents.
    timing = None
    if cfg.teacher_timing:
        teacher = load_teacher(teacher_path, dtype, device, text=False, vae=False)
        _check_cache_teacher(teacher, teacher_path, manifest)
        timing = time_sampling(pipes["student"], teacher, cache_dir, manifest, trajs, neg, student_guidance,
                               cfg.timing_runs, device)
        timing["teacher"] = str(teacher_path)
        del teacher

    # (d) attributes of images drawn from shapes captions (the teacher's text encoder and VAE load here).
    attrs = None
    if captions is not None:
        grid_path = report_path.with_name(report_path.stem + "-attributes.png")
        attrs = attribute_scores(cfg, captions, teacher_path, models["student"], manifest, student_guidance,
                                 device, dtype, grid_path)

    report = {
        "student": {**student.describe(), "init": init_how},
        "cache": {"path": str(cache_dir), "fingerprint": manifest[F.F_FINGERPRINT], "teacher": manifest[F.F_TEACHER],
                  "steps": manifest[F.F_STEPS], "guidance": manifest[F.F_GUIDANCE], "cfg": guided_cache,
                  "in_training_cache": in_training},
        "selection": selection, "trajectories": len(trajs), "target": target_key,
        "student_guidance": student_guidance,
        "velocity_mse": velocity, "final_latent_mse": finals, "timing": timing, "attributes": attrs,
        "warnings": warnings,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "wall_s": round(time.time() - t_start, 2),
        "config": dataclasses.asdict(cfg),
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(report_path, report)
    plot_path = report_path.with_suffix(".png")
    plot_report(report, plot_path)
    speed = (f"; {timing['speedup']:.2f}x faster than the teacher ({timing['student_s_per_image']:.3f}s vs "
             f"{timing['teacher_s_per_image']:.3f}s per image)") if timing else ""
    kept = ""
    if attrs:
        t, s = attrs["teacher"], attrs["student"]
        kept = (f"; attributes on {attrs['captions']} captions: colour accuracy teacher {t['colour']:.1%} (background "
                f"{t['background']:.1%}, shape {t['shape_colour']:.1%}), student {s['colour']:.1%} (background "
                f"{s['background']:.1%}, shape {s['shape_colour']:.1%}), kept {_share(attrs, 'colour')}; "
                f"grid {attrs['grid']}")
    tqdm.write(f"eval of {len(trajs)} trajectories: velocity MSE {velocity['mean']['student']:.4g} "
               f"(untrained {velocity['mean']['untrained']:.4g}), final-latent MSE {finals['student']:.4g} "
               f"(untrained {finals['untrained']:.4g}){speed}{kept}; report {report_path}, plot {plot_path}")
    return report
