"""`wandistiller eval`: how close the student comes to the teacher on the cache's (held-out) trajectories.

    (a) velocity error: the student's prediction at every cached x_t against the teacher's cached target,
        per step (untrained twin alongside as the baseline);
    (b) final-latent error: the student samples from each trajectory's cached initial noise with its own
        schedule and steps (distill.json's: a few-step student's K Euler steps, else the teacher's scheduler and
        steps; `--student-steps` overrides, e.g. 1,2,4 for a velocity student sampled with fewer steps), through
        the one sampler of pipeline/sampling.py, and its final latent is compared with the teacher's;
    (c) speed: seconds per image of the teacher (its steps, its CFG) and the student (its steps) on the same
        latents: the denoising alone, and with --attributes also the whole pipeline (encode, denoise, decode);
    (d) with --attributes, the attribute checker's accuracy of teacher and student on shapes captions.

`--compare RUN` adds more students (each at its own steps) to (b)-(d), from the same noise in the same run, and
the report's `table` (also printed) lines them all up against the teacher. (a) and (b) run on prompt embeddings
stored in the cache, with no text encoder or VAE. A student that learned guided targets samples at guidance 1;
one that learned conditional predictions is compared with `target_cond` and samples with CFG at the teacher's
scale (the cache's negative prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cache import format as F
from cache.atomic import atomic_write_json
from cache.reader import open_caches
from cache.prompt_store import EmbeddingCache
from cache.schema import recorded_steps
from pipeline.config import EvalConfig
from pipeline.errors import UserError
from pipeline.progress_bar import progress_bar
from pipeline.prompts import dedupe, read_prompt_file
from pipeline.wan_inputs import model_timestep

from . import trajectories
from .models import (
    Student, check_compatible, find_student, init_exact, load_teacher, load_transformer, named_teacher, pick_device,
    teacher_dir, untrained_transformer,
)
from .plot import plot_report
from .report import few_step_table, format_table, summary_line

REPORT_NAME = "eval.json"
# distill.json fields whose value should match the cache's for the comparison to mean what it says.
COMPARED = ("cfg", "guidance", "guidance_2", "max_sequence_length", "latent_shape", "steps", "negative_prompt")


def _mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error in float32: [N, ...] x [N, ...] -> [N]."""
    return (a.float() - b.float()).pow(2).flatten(1).mean(1)


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
        mine, theirs = student.setting(key), manifest.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            notes.append(f"student trained with {key}={mine!r}, the cache has {theirs!r}")
    if [float(t) for t in teacher_timesteps] != [float(t) for t in manifest[F.F_TIMESTEPS]]:
        notes.append("the cache's scheduler config does not reproduce its recorded timesteps")
    return notes


@torch.inference_mode()
def velocity_errors(models: dict, cache_dir: Path, manifest: dict, trajs, target_key: str, batch_size: int,
                    device: torch.device, dtype: torch.dtype) -> dict:
    """Per-step mean of the per-sample MSE of every model against `target_key`, over `trajs`' samples (at the
    steps the cache records)."""
    steps, recorded = int(manifest[F.F_STEPS]), recorded_steps(manifest)
    shape, expand = manifest[F.F_LATENT_SHAPE], bool(manifest.get(F.F_EXPAND_TIMESTEPS, False))
    embeds = EmbeddingCache(cache_dir, int(manifest[F.F_NUM_PARTS]))
    seeds = {(t.prompt_idx, t.seed_idx) for t in trajs}
    sums = {name: [0.0] * steps for name in models}
    counts = [0] * steps
    bar = progress_bar(total=len(trajs) * len(recorded), desc="eval velocity", unit="sample", dynamic_ncols=True)

    def flush(batch):
        x = torch.stack([s[F.T_X_T] for s, _ in batch]).to(device, dtype)
        t = model_timestep(torch.tensor([m[F.M_TIMESTEP] for _, m in batch], device=device), shape[1:], expand,
                           tuple(manifest.get(F.F_PATCH_SIZE) or (1, 2, 2)))
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
    for tensors, meta in trajectories.iter_samples(cache_dir, {p for p, _ in seeds}):
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
    if sum(counts) != len(trajs) * len(recorded):
        raise UserError(f"the cache holds {sum(counts)} samples of the selected trajectories, expected "
                        f"{len(trajs) * len(recorded)}; run `wandistiller cache verify {cache_dir}`")
    per_step = [{"step": k, "timestep": manifest[F.F_TIMESTEPS][k], "sigma": (manifest.get(F.F_SIGMAS) or [None] * steps)[k],
                 "expert": (manifest.get(F.F_EXPERTS) or [1] * steps)[k], "samples": counts[k],
                 **{name: sums[name][k] / counts[k] for name in models}} for k in recorded]
    mean = {name: sum(sums[name]) / sum(counts) for name in models}
    return {"per_step": per_step, "mean": mean}


def _sample_kwargs(manifest: dict) -> dict:
    return dict(num_inference_steps=int(manifest[F.F_STEPS]), height=int(manifest[F.F_HEIGHT]),
                width=int(manifest[F.F_WIDTH]), num_frames=int(manifest[F.F_FRAMES]), output_type="latent",
                max_sequence_length=int(manifest[F.F_MAX_SEQUENCE_LENGTH]))


def teacher_latents(pipe, embeds: torch.Tensor, init: torch.Tensor, neg: torch.Tensor, guidance: float,
                    manifest: dict, extra: dict | None = None) -> torch.Tensor:
    """Final latents [B, ...] float32 (CPU) of the teacher's WanPipeline (its experts, its steps) from `init`."""
    kw = dict(_sample_kwargs(manifest), guidance_scale=guidance, **(extra or {}))
    if guidance > 1.0:
        kw["negative_prompt_embeds"] = neg.expand(embeds.shape[0], -1, -1)
    return pipe(prompt_embeds=embeds, latents=init.clone(), **kw).frames.float().cpu()


@dataclasses.dataclass
class Entry:
    """One student sampled one way: `draw(prompt_embeds, latents, negative_embeds)` -> final latents, through the
    one sampler (pipeline/sampling.py) with the student's own schedule at `steps`."""

    label: str
    student: Student
    model: torch.nn.Module
    steps: int
    guidance: float
    draw: Callable

    def describe(self) -> dict:
        return {"label": self.label, "path": str(self.student.path), "objective": self.student.setting("objective"),
                "trained_steps": self.student.setting("student_steps"), "steps": self.steps, "guidance": self.guidance}


def make_entry(label: str, student: Student, model, steps: int, guidance: float, manifest: dict) -> Entry:
    from .sample import SamplingSettings, student_sampler

    settings = SamplingSettings(steps=steps, guidance=guidance, guidance_2=None, student_guidance=guidance,
                                negative_prompt="", height=0, width=0, max_sequence_length=0, seed=0,
                                student_steps=steps)
    draw = student_sampler(student, model, settings, scheduler_from_manifest(manifest),
                           bool(manifest.get(F.F_EXPAND_TIMESTEPS, False)))
    return Entry(label, student, model, steps, guidance, draw)


def final_latent_errors(entries: list[Entry], cache_dir: Path, manifest: dict, trajs, neg, batch_size: int,
                        device: torch.device) -> dict:
    """MSE between each entry's sampled final latent (from the cached initial noise) and the teacher's cached
    one, per trajectory and mean. Latents are read a batch at a time."""
    embeds = EmbeddingCache(cache_dir, int(manifest[F.F_NUM_PARTS]))
    errs = {e.label: [] for e in entries}
    bar = progress_bar(total=len(trajs) * len(entries), desc="eval sampling", unit="traj", dynamic_ncols=True)
    for i in range(0, len(trajs), batch_size):
        chunk = trajs[i:i + batch_size]
        init, final = trajectories.latents(cache_dir, manifest, chunk)
        emb = torch.stack([embeds.get(t.prompt_idx) for t in chunk]).to(device)
        for e in entries:
            out = e.draw(emb, init.to(device), neg.to(device)).float().cpu()
            errs[e.label] += _mse(out, final).tolist()
            bar.update(len(chunk))
    bar.close()
    return {**{name: sum(v) / len(v) for name, v in errs.items()},
            "per_trajectory": [{"prompt_idx": t.prompt_idx, "seed_idx": t.seed_idx,
                                **{name: errs[name][j] for name in errs}} for j, t in enumerate(trajs)]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _timed(fn, device: torch.device):
    """(fn(), its seconds), the device synchronised on both sides so that queued kernels count where they run."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _time_denoising(entries: list[Entry], teacher_pipe, emb, lat, neg, guidance: float, manifest: dict,
                    teacher_kw: dict, device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """One trajectory denoised by the teacher, then by every entry, on the cached embeddings: (the teacher's final
    latent, seconds by name)."""
    out, sec = _timed(lambda: teacher_latents(teacher_pipe, emb, lat, neg.to(device), guidance, manifest,
                                              teacher_kw), device)
    seconds = {"teacher": sec}
    for e in entries:
        _, seconds[e.label] = _timed(lambda: e.draw(emb, lat.clone(), neg.to(device)), device)
    return out, seconds


def _time_pipelines(entries: list[Entry], teacher_pipe, text: str, lat, guidance: float, manifest: dict,
                    teacher_kw: dict, device: torch.device) -> dict[str, float]:
    """One caption through each whole pipeline (encode, denoise, decode): the teacher's WanPipeline, then every
    entry with the teacher's text encoder and VAE; seconds by name."""
    from pipeline.sampling import decode_latents

    max_len, negative = int(manifest[F.F_MAX_SEQUENCE_LENGTH]), str(manifest.get(F.F_NEGATIVE_PROMPT) or "")
    with torch.inference_mode():
        _, sec = _timed(lambda: teacher_pipe(text, negative_prompt=negative, latents=lat.clone(),
                                             guidance_scale=guidance, **teacher_kw,
                                             **{**_sample_kwargs(manifest), "output_type": "np"}).frames, device)
        seconds = {"teacher": sec}
        for e in entries:
            def student_pipeline_run(e=e):
                pe, ne = teacher_pipe.encode_prompt(text, negative_prompt=negative,
                                                    do_classifier_free_guidance=e.guidance > 1.0,
                                                    max_sequence_length=max_len, device=device)
                return decode_latents(teacher_pipe.vae, e.draw(pe, lat.clone(), ne)).numpy()
            _, seconds[e.label] = _timed(student_pipeline_run, device)
    return seconds


def _per_image(entries: list[Entry], denoise: dict[str, list[float]], pipeline: dict[str, list[float]]) -> dict:
    """Median seconds per image of the teacher and every entry, and each entry's speed-up over the teacher."""
    per = {name: {"denoise_s_per_image": _median(denoise[name]),
                  "pipeline_s_per_image": _median(pipeline[name]) if pipeline[name] else None} for name in denoise}
    for e in entries:
        p, t = per[e.label], per["teacher"]
        p.update(steps=e.steps, forwards_per_step=2 if e.guidance > 1.0 else 1,
                 speedup_denoise=t["denoise_s_per_image"] / max(p["denoise_s_per_image"], 1e-9),
                 speedup_pipeline=(t["pipeline_s_per_image"] / max(p["pipeline_s_per_image"], 1e-9)
                                   if p["pipeline_s_per_image"] else None))
    return per


def time_sampling(entries: list[Entry], teacher_pipe, cache_dir: Path, manifest: dict, trajs, neg, runs: int,
                  device: torch.device) -> dict:
    """Seconds per image (median over `runs` trajectories at batch 1, after one warm-up each) of the teacher (its
    steps, its CFG) and of every entry (its steps) on the same latents: the denoising alone, on the cached
    embeddings; and, when the teacher pipeline carries its text encoder and VAE, the whole pipeline too
    (encode the caption, denoise, decode). Also the teacher's re-run final latent against the cache (~0: checks
    that this path reproduces stage one)."""
    embeds = EmbeddingCache(cache_dir, int(manifest[F.F_NUM_PARTS]))
    teacher_kw = {}
    if teacher_pipe.config.boundary_ratio is not None and manifest.get(F.F_GUIDANCE_2) is not None:
        teacher_kw["guidance_scale_2"] = float(manifest[F.F_GUIDANCE_2])
    t_guidance = float(manifest[F.F_GUIDANCE])
    whole = teacher_pipe.text_encoder is not None and teacher_pipe.vae is not None
    names = ["teacher", *(e.label for e in entries)]
    denoise = {n: [] for n in names}
    pipeline = {n: [] for n in names}
    teacher_err = []
    n = min(runs, len(trajs))
    init, final = trajectories.latents(cache_dir, manifest, trajs[:n])
    for j in progress_bar(range(-1, n), desc="eval timing", unit="traj", dynamic_ncols=True):
        t = trajs[max(j, 0)]
        emb = embeds.get(t.prompt_idx)[None].to(device)
        lat = init[max(j, 0)][None].to(device)
        out, seconds = _time_denoising(entries, teacher_pipe, emb, lat, neg, t_guidance, manifest, teacher_kw, device)
        if j >= 0:  # j == -1 is the warm-up
            teacher_err.append(_mse(out, final[j][None]).item())
            for name, sec in seconds.items():
                denoise[name].append(sec)
        if not whole:
            continue
        seconds = _time_pipelines(entries, teacher_pipe, t.text, lat, t_guidance, manifest, teacher_kw, device)
        if j >= 0:
            for name, sec in seconds.items():
                pipeline[name].append(sec)
    per = _per_image(entries, denoise, pipeline)
    first = per[entries[0].label]
    return {
        "runs": n, "steps": int(manifest[F.F_STEPS]), "statistic": "median over runs, batch 1",
        "student_steps": entries[0].steps,
        "student_s_per_image": first["denoise_s_per_image"], "teacher_s_per_image": per["teacher"]["denoise_s_per_image"],
        "speedup": first["speedup_denoise"],
        "teacher_pipeline_s_per_image": per["teacher"]["pipeline_s_per_image"],
        "student_forwards_per_step": first["forwards_per_step"],
        "teacher_forwards_per_step": 2 if t_guidance > 1.0 else 1,
        "student_params": sum(p.numel() for p in entries[0].model.parameters()),
        "teacher_params_per_expert": sum(p.numel() for p in teacher_pipe.transformer.parameters()),
        "teacher_final_mse": sum(teacher_err) / len(teacher_err),
        "entries": {e.label: per[e.label] for e in entries}, "teacher": per["teacher"],
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


def attribute_scores(cfg: EvalConfig, captions: list[str], teacher, entries: list[Entry], manifest: dict,
                     device, grid_path: Path) -> dict:
    """The teacher (its steps, its CFG) and every entry (its own steps and schedule) draw `captions` from the same
    noise with the cache's settings (guidance, negative prompt, size, text length); the attribute checker scores
    them; the first rows (teacher | entries) go to `grid_path`."""
    from PIL import Image

    from .attributes import compare
    from .grid import draw_grid
    from .sample import SamplingSettings, _write_png

    g2 = manifest.get(F.F_GUIDANCE_2)
    settings = SamplingSettings(
        steps=int(manifest[F.F_STEPS]), guidance=float(manifest[F.F_GUIDANCE]),
        guidance_2=float(g2) if g2 is not None and teacher.config.boundary_ratio is not None else None,
        student_guidance=entries[0].guidance, negative_prompt=str(manifest.get(F.F_NEGATIVE_PROMPT) or ""),
        height=int(manifest[F.F_HEIGHT]), width=int(manifest[F.F_WIDTH]),
        max_sequence_length=int(manifest[F.F_MAX_SEQUENCE_LENGTH]), seed=0, student_steps=entries[0].steps)
    res = compare(teacher, {e.label: e.draw for e in entries}, captions, settings, device, cfg.batch_size,
                  keep=cfg.attribute_grid)
    rows = res.pop("images")
    if rows:
        grid = draw_grid(captions[:len(rows)], [[Image.fromarray(a) for a in row] for row in rows],
                         ["teacher", *(e.label for e in entries)])
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        _write_png(grid, grid_path)
    return {"prompts": cfg.attributes, "captions": len(captions), "settings": dataclasses.asdict(settings), **res,
            "grid": str(grid_path) if rows else None}


def _label(path: str, taken: set[str]) -> str:
    p = Path(path)
    name = p.name if p.name not in ("student", "student_ema") else p.parent.name
    label, i = name, 2
    while label in taken:
        label, i = f"{name}-{i}", i + 1
    return label


def _check_against_cache(student: Student, manifest: dict, cache_dir: Path) -> None:
    shape = manifest[F.F_LATENT_SHAPE]
    check_compatible(student, in_channels=int(manifest.get(F.F_IN_CHANNELS, shape[0])),
                     text_dim=int(manifest[F.F_TEXT_DIM]), latent_hw=(shape[2], shape[3]),
                     expand_timesteps=manifest.get(F.F_EXPAND_TIMESTEPS), against=f"cache {cache_dir}")


def _own_steps(student: Student, manifest: dict) -> int:
    """The steps a student samples with: its own (a few-step student's `distill.json`), else the cache's."""
    d = student.distill
    return d.sampling_steps if d is not None and d.sampling_steps else int(manifest[F.F_STEPS])


@dataclasses.dataclass
class _Setup:
    """What `run` resolved before sampling anything: every check that can fail has run."""

    cache_dir: Path
    manifest: dict
    student: Student
    report_path: Path
    teacher_path: Path | None
    captions: list[str] | None
    trajs: list
    selection: dict
    in_training: bool | None
    device: torch.device
    dtype: torch.dtype
    target_key: str
    guided_cache: bool
    student_guidance: float
    warnings: list[str]


def _setup(cfg: EvalConfig) -> _Setup:
    """Cache, student, teacher and selection, checked before the long part (not after it)."""
    cache_dir = Path(cfg.cache)
    # stage two's checks of a cache it opens: its fingerprint (an edited `guidance` or `steps` would mislabel every
    # figure of the report) and its prompt stores' shapes and dtypes (an edited one would allocate terabytes)
    manifest = open_caches([cache_dir])[0].manifest
    student = find_student(cfg.student, cfg.weights)
    report_path = Path(cfg.report) if cfg.report else student.root / REPORT_NAME
    if report_path.is_dir():
        raise UserError(f"--report {report_path} is a folder; pass the JSON file to write")
    _check_against_cache(student, manifest, cache_dir)
    teacher_path = None
    if cfg.teacher_timing or cfg.attributes:
        name, revision, recorded_in = named_teacher(cfg.teacher, cfg.revision, manifest[F.F_TEACHER],
                                                    manifest.get(F.F_REVISION), f"{cache_dir}/{F.MANIFEST}")
        try:
            teacher_path = teacher_dir(name, revision, recorded_in)
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
    return _Setup(cache_dir, manifest, student, report_path, teacher_path, captions, trajs, selection, in_training,
                  device, dtype, F.T_TARGET_COND if guided_cache and not student.guided else F.T_TARGET, guided_cache,
                  1.0 if student.guided else float(manifest[F.F_GUIDANCE]), warnings)


def _entries(cfg: EvalConfig, su: _Setup, model) -> list[Entry]:
    """What is sampled: the student at its own steps (or each of --student-steps), then every --compare student at
    its own steps, all from the same noise."""
    steps_list = list(cfg.student_steps or (_own_steps(su.student, su.manifest),))
    labels = ["student"] if len(steps_list) == 1 else [f"student@{k}" for k in steps_list]
    entries = [make_entry(lab, su.student, model, k, su.student_guidance, su.manifest)
               for lab, k in zip(labels, steps_list)]
    taken = set(labels) | {"teacher", "untrained"}
    for path in cfg.compare:
        other = find_student(path, cfg.weights)
        _check_against_cache(other, su.manifest, su.cache_dir)
        if other.fingerprints and su.manifest[F.F_FINGERPRINT] in other.fingerprints:
            seen = {t.prompt_idx for t in su.trajs} - {int(p) for p in other.setting("heldout_prompts", [])}
            if seen:
                su.warnings.append(f"--compare {path} was trained on {len(seen)} of the prompts evaluated")
        label = _label(path, taken)
        taken.add(label)
        entries.append(make_entry(label, other, load_transformer(other, su.dtype, su.device),
                                  _own_steps(other, su.manifest),
                                  1.0 if other.guided else float(su.manifest[F.F_GUIDANCE]), su.manifest))
    return entries


def _velocity(cfg: EvalConfig, su: _Setup, models: dict) -> dict:
    """(a) Every model's velocity error per cached step; where stage two trained on some of the steps only, each
    step says whether it was one of them."""
    velocity = velocity_errors(models, su.cache_dir, su.manifest, su.trajs, su.target_key, cfg.batch_size, su.device,
                               su.dtype)
    trained_steps = su.student.setting("train_steps")
    if isinstance(trained_steps, list):  # stage two may train on a subset of the cached steps
        for row in velocity["per_step"]:
            row["trained_step"] = row["step"] in trained_steps
    return velocity


def _final_latents(cfg: EvalConfig, su: _Setup, entries: list[Entry], untrained: Entry, neg) -> dict:
    """(b) Final latents sampled from the cached noise, each with its own schedule and steps; the first entry's
    figure is also the report's `student`."""
    finals = final_latent_errors([*entries, untrained], su.cache_dir, su.manifest, su.trajs, neg, cfg.batch_size,
                                 su.device)
    finals["student"] = finals[entries[0].label]
    finals["student_steps"] = entries[0].steps
    return finals


def _against_teacher(cfg: EvalConfig, su: _Setup, entries: list[Entry], neg) -> tuple[dict | None, dict | None]:
    """(c) speed against the teacher on the same latents and (d) attributes of images drawn from shapes captions:
    (timing, attributes), None where not asked. The teacher is loaded once, for both; with --attributes whole
    (text encoder and VAE), and the whole pipeline is timed too."""
    timing, teacher = None, None
    if cfg.teacher_timing or su.captions is not None:
        teacher = load_teacher(su.teacher_path, su.dtype, su.device, text=su.captions is not None,
                               vae=su.captions is not None)
        _check_cache_teacher(teacher, su.teacher_path, su.manifest)
    if cfg.teacher_timing:
        timing = time_sampling(entries, teacher, su.cache_dir, su.manifest, su.trajs, neg, cfg.timing_runs, su.device)
        timing["teacher_path"] = str(su.teacher_path)
    attrs = None
    if su.captions is not None:
        grid_path = su.report_path.with_name(su.report_path.stem + "-attributes.png")
        attrs = attribute_scores(cfg, su.captions, teacher, entries, su.manifest, su.device, grid_path)
    return timing, attrs


def run(cfg: EvalConfig) -> dict:
    """Evaluate, write the JSON report and the plot next to it; returns the report."""
    t_start = time.time()
    su = _setup(cfg)
    manifest = su.manifest
    for w in su.warnings:
        tqdm.write(f"warning: {w}")
    models = {"student": load_transformer(su.student, su.dtype, su.device)}
    models["untrained"], init_how = untrained_transformer(su.student, cfg.init_seed, su.dtype, su.device)
    entries = _entries(cfg, su, models["student"])
    # the untrained twin at the first entry's steps is the baseline
    untrained = make_entry("untrained", su.student, models["untrained"], entries[0].steps, su.student_guidance,
                           manifest)
    velocity = _velocity(cfg, su, models)
    neg = trajectories.negative_embeds(su.cache_dir)[None]
    finals = _final_latents(cfg, su, entries, untrained, neg)
    timing, attrs = _against_teacher(cfg, su, entries, neg)
    table = few_step_table(entries, manifest, finals, timing, attrs)

    report = {
        "student": {**su.student.describe(), "init": init_how},
        "cache": {"path": str(su.cache_dir), "fingerprint": manifest[F.F_FINGERPRINT], "teacher": manifest[F.F_TEACHER],
                  "steps": manifest[F.F_STEPS], "guidance": manifest[F.F_GUIDANCE], "cfg": su.guided_cache,
                  "in_training_cache": su.in_training},
        "selection": su.selection, "trajectories": len(su.trajs), "target": su.target_key,
        "student_guidance": su.student_guidance,
        "velocity_mse": velocity, "final_latent_mse": finals, "timing": timing, "attributes": attrs,
        "entries": [e.describe() for e in entries], "table": table, "warnings": su.warnings,
        "device": str(su.device), "dtype": str(su.dtype).removeprefix("torch."),
        "wall_s": round(time.time() - t_start, 2), "config": dataclasses.asdict(cfg),
    }
    su.report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(su.report_path, report)
    plot_path = su.report_path.with_suffix(".png")
    plot_report(report, plot_path)
    tqdm.write(summary_line(report, entries, su.report_path, plot_path))
    tqdm.write(format_table(table))
    return report
