"""`wandistiller sample`: teacher and student images side by side in one grid (a row per prompt, its text on the
left, a labelled column per model), every column from the same prompt embeddings and initial latents, so that the
columns differ only by the denoiser and its schedule: the teacher runs as diffusers' WanPipeline, each student
through the one sampler (pipeline/sampling.py), decoded by the teacher's VAE. A video run (distill.json's frames
> 1) draws whole clips at its frame count: the grid's cells are frame strips, and each clip is also an animated
WebP and an mp4 in a folder beside the grid. A LoRA pair (RUN1+RUN2) is one column, each expert its run's adapter.
An image-to-video student (distill.json's `condition`) draws from --images instead of --prompts: the teacher as
WanImageToVideoPipeline from each image, the students from the condition latent its VAE makes of the same image, the
image itself in a first column."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

from cache import safe_write
from pipeline import guidance_input, teacher_lora
from pipeline.config import (
    DEFAULT_FPS, DEFAULT_GUIDANCE, DEFAULT_HEIGHT, DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_STEPS, DEFAULT_WIDTH,
    SampleConfig,
)
from pipeline.errors import UserError
from pipeline.image_condition import condition_latent, image_tensor, open_image, read_image_file
from pipeline.model_call import NONE, PLAIN, InputRule
from pipeline.progress_bar import progress_bar
from pipeline.prompts import dedupe, read_prompt_file
from pipeline.sampling import decode_latents, sample_latents, scheduler_from_config, student_scheduler

from .models import (
    Student, check_compatible, find_student, load_teacher, model_name, pick_device, student_teacher,
)
from .video_file import write_mp4


@dataclass(frozen=True)
class SamplingSettings:
    """Everything that decides the two images of a prompt, resolved from flags, distill.json and defaults."""

    steps: int
    guidance: float  # the teacher's
    guidance_2: float | None  # the teacher's low-noise expert (two-expert teachers only)
    student_guidance: float  # 1.0 when the student learned guided targets
    negative_prompt: str
    height: int
    width: int
    max_sequence_length: int
    seed: int
    student_steps: int | None = None  # the student's sampling steps; None: `steps`

    def teacher_call(self) -> dict:
        """The keyword arguments of the teacher's WanPipeline call for one image of these settings."""
        kw = dict(height=self.height, width=self.width, num_frames=1, num_inference_steps=self.steps,
                  max_sequence_length=self.max_sequence_length, output_type="np", guidance_scale=self.guidance)
        return kw if self.guidance_2 is None else kw | {"guidance_scale_2": self.guidance_2}


def student_sampler(student: Student, transformer, steps: int, guidance: float, teacher_scheduler,
                    rule: InputRule = PLAIN, start: int = 0, teacher_guidance: float | None = None):
    """`draw(embeds, latents, negative_embeds=None) -> final latents`: the student through the one sampler (from
    its step `start`: a hybrid's); a student that takes the guidance scale as an input is asked for
    `teacher_guidance`, the teacher's it is drawn beside."""
    scale = None if teacher_guidance is None else guidance_input.scale_for(transformer, teacher_guidance)
    if student.distill is not None and student.distill.scheduler:
        make = lambda: student_scheduler(student.distill)  # noqa: E731
    else:  # a bare student folder: the teacher's scheduler
        conf = {"_class_name": type(teacher_scheduler).__name__, **teacher_scheduler.config}
        make = lambda: scheduler_from_config(conf)  # noqa: E731

    def draw(embeds, latents, negative_embeds=None, condition=None):
        return sample_latents(transformer, make(), latents, embeds, steps, guidance=guidance,
                              negative_embeds=negative_embeds if guidance > 1.0 else None, rule=rule,
                              condition=condition, start=start, scale=scale)

    return draw


def teacher_drawer(pipe, call: dict):
    """`draw(embeds, latents, negative_embeds=None, condition=None, **more) -> final latents` of the teacher's pipeline
    (`call`: its keyword arguments, output_type latent; `more`: the pipeline's others)."""
    def draw(embeds, latents, negative_embeds=None, condition=None, **more):
        neg = None if negative_embeds is None or call["guidance_scale"] <= 1 else \
            negative_embeds.expand(embeds.shape[0], -1, -1)
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=neg, latents=latents, **call, **more).frames

    return draw


def hybrid_sampler(pipe, call: dict, student: Student, model, steps: int | None, rule: InputRule, name: str):
    """(draw, the teacher's steps, M): the teacher's pipeline (`call`, guided) over its own steps before the segment
    run `student`'s boundary number M (`steps`; by default its first on the low-noise expert), then `student` from
    there with its own scheduler: the hybrid users run by hand to keep the teacher's motion. One-line UserErrors
    (`name` first) for a run of no boundaries, an M leaving either side no step, a boundary off the teacher's step."""
    bounds = student.distill and student.distill.objective_settings.get("boundaries")
    if not bounds:
        raise UserError(f"{name}: not a few-step segment run (no boundaries in its distill.json); pass one trained "
                        "with --objective segment")
    (sched := pipe.scheduler).set_timesteps(call["num_inference_steps"])
    ratio = pipe.config.boundary_ratio
    m = steps or sum(ratio is not None and float(sched.timesteps[b]) >= ratio * sched.config.num_train_timesteps
                     for b in bounds)
    if not 1 <= m < len(bounds):
        raise UserError(f"{name}: " + ("this teacher runs one expert: pass --hybrid-steps M, the run's steps the "
                        "teacher draws instead" if ratio is None and not steps else f"the teacher would draw {m} of "
                        f"the run's {len(bounds)} steps") + f"; choose 1-{len(bounds) - 1}")
    stop = int(bounds[m])  # the teacher's steps drawn: those before the run's m-th boundary
    (own := student_scheduler(student.distill)).set_timesteps(len(bounds))
    if abs(float(own.sigmas[m]) - float(sched.sigmas[stop])) > 1e-3:
        raise UserError(f"{name}: its step {m} starts at sigma {float(own.sigmas[m]):.4f}, not on the teacher's step "
                        f"{stop} (sigma {float(sched.sigmas[stop]):.4f}); pass another --hybrid-steps")
    teacher = teacher_drawer(pipe, call)
    rest = student_sampler(student, model, len(bounds), 1.0 if student.guided else call["guidance_scale"], sched,
                           rule, start=m, teacher_guidance=call["guidance_scale"])

    def interrupt(p, i, t, kw):
        p._interrupt = p._interrupt or i + 1 >= stop  # (diffusers' way to end a pipeline's loop early)
        return {}

    def draw(embeds, latents, negative_embeds=None, condition=None):
        z = teacher(embeds, latents, negative_embeds, callback_on_step_end=interrupt)
        return rest(embeds, z, negative_embeds, condition)

    return draw, stop, m


def resolve_settings(cfg: SampleConfig, student: Student, teacher) -> SamplingSettings:
    """Flags first, then distill.json, then the defaults; refuse sizes the teacher or student cannot tile."""
    vae_spatial = teacher.vae_scale_factor_spatial
    shape = student.setting("latent_shape")
    from_distill = isinstance(shape, list) and len(shape) == 4
    height = cfg.height or (shape[2] * vae_spatial if from_distill else student.setting("height", DEFAULT_HEIGHT))
    width = cfg.width or (shape[3] * vae_spatial if from_distill else student.setting("width", DEFAULT_WIDTH))
    for name, v, axis in (("height", height, 1), ("width", width, 2)):
        m = vae_spatial * max(teacher.transformer.config.patch_size[axis], student.patch_size[axis])
        if v % m:
            raise UserError(f"--{name} {v} is not a multiple of {m} (VAE factor {vae_spatial} x patch); "
                            f"use {max(m, v // m * m)} or {(v // m + 1) * m}")
    guidance = float(cfg.guidance if cfg.guidance is not None else student.setting("guidance", DEFAULT_GUIDANCE))
    guidance_2 = cfg.guidance_2 if cfg.guidance_2 is not None else student.setting("guidance_2")
    if teacher.config.boundary_ratio is None:
        if cfg.guidance_2 is not None:
            raise UserError("--guidance-2 applies only to two-expert (Wan 2.2 A14B) teachers; drop it")
        guidance_2 = None
    student_guidance = cfg.student_guidance if cfg.student_guidance is not None else 1.0 if student.guided else guidance
    steps = int(cfg.steps or student.setting("steps", DEFAULT_STEPS))
    negative = cfg.negative_prompt if cfg.negative_prompt is not None else str(student.setting("negative_prompt", ""))
    text_len = cfg.max_sequence_length or student.setting("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)
    return SamplingSettings(
        steps=steps, guidance=guidance, guidance_2=None if guidance_2 is None else float(guidance_2),
        student_guidance=float(student_guidance), negative_prompt=negative, height=int(height), width=int(width),
        max_sequence_length=int(text_len), seed=cfg.seed,
        student_steps=int(cfg.student_steps or student.setting("sampling_steps") or steps))


def initial_latents(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 noise drawn on the CPU: the same bits on every device, for the teacher and the student."""
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)


def latent_frames(pipe, frames: int) -> int:
    """The latent frames `pipe` (a WanPipeline) makes of `frames` decoded ones, by its VAE's temporal factor."""
    return (frames - 1) // pipe.vae_scale_factor_temporal + 1


def to_clips(frames) -> list[np.ndarray]:
    """A WanPipeline 'np' output [B, F, H, W, 3] in [0, 1] -> B uint8 clips [F, H, W, 3]."""
    return list((np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8))


def frame_strip(clip: np.ndarray) -> Image.Image:
    """A uint8 clip [F, H, W, 3] as one RGB image, its frames side by side (one frame: that frame)."""
    return Image.fromarray(np.concatenate(list(clip), axis=1))


def write_image(img: Image.Image, out: Path, format: str = "PNG", **save) -> None:
    """`img.save(out, format, **save)` by `safe_write.write_file`: no half-written file at `out`, a link planted at
    its name replaced, never written through."""
    safe_write.write_file(out, writer=lambda f: img.save(f, format=format, **save))


def write_videos(folder: Path, names: list[str], clips: list[list[np.ndarray]], fps: int) -> dict[str, dict]:
    """Each clip of `clips` (a row per prompt, a clip per name) as a lossless animated WebP `folder/PP-NAME.webp`
    (Pillow's: the frames exactly) and beside it an H.264 mp4 `folder/PP-NAME.mp4` (video_file.py: what players
    open); {"videos": {name: WebPs}, "mp4": {name: mp4s}}."""
    safe_write.ensure_folder(folder, "the video folder")
    paths: dict[str, dict[str, list[str]]] = {"videos": {n: [] for n in names}, "mp4": {n: [] for n in names}}
    for i, row in enumerate(clips):
        for name, clip in zip(names, row):
            first, *rest = [Image.fromarray(f) for f in clip]
            path = folder / f"{i:02d}-{name}.webp"
            write_image(first, path, "WEBP", save_all=True, append_images=rest, duration=round(1000 / fps), loop=0,
                        lossless=True)
            paths["videos"][name].append(str(path))
            paths["mp4"][name].append(str(write_mp4(path.with_suffix(".mp4"), clip, fps)))
    return paths


def _load_students(cfg: SampleConfig, student: Student, teacher, teacher_name: str, settings: SamplingSettings,
                   dtype: torch.dtype, device: torch.device) -> tuple[dict, dict]:
    """The student and each --compare one, checked against the teacher: ({column: (draw, steps)}, {column: info})."""
    tcfg, vs = teacher.transformer.config, teacher.vae_scale_factor_spatial
    rule, drawers, described = InputRule.of_pipeline(teacher), {}, {}

    def loaded(one: Student, path: str | None, flag: str) -> torch.nn.Module:
        """The model of `one` (the student, or --compare's or --hybrid's `path`), its frames and shapes checked."""
        want = student.setting("frames", 1)
        if path is not None and (n := one.setting("frames", want)) != want:  # (a bare folder draws the student's)
            raise UserError(f"{flag} {path} was trained on a {n}-frame cache, the student on a {want}-frame one: a "
                            "grid compares students of one frame count; sample them in separate grids")
        check_compatible(one, in_channels=tcfg.in_channels, out_channels=tcfg.out_channels, text_dim=tcfg.text_dim,
                         latent_hw=(settings.height // vs, settings.width // vs), rule=rule,
                         against=f"teacher {teacher_name}")
        return one.kind.load(one, dtype, device)

    for path in (None, *cfg.compare):
        one, own, name = student, settings, "student"
        if path is not None:
            one = find_student(path, cfg.weights)
            own = dataclasses.replace(settings, student_steps=one.setting("sampling_steps") or settings.steps,
                                      student_guidance=1.0 if one.guided else settings.guidance)
            name = model_name(path) if model_name(path) not in drawers else f"{model_name(path)}-{len(drawers)}"
        drawers[name] = (student_sampler(one, loaded(one, path, "--compare"), own.student_steps or own.steps,
                                         own.student_guidance, teacher.scheduler, rule,
                                         teacher_guidance=settings.guidance), own.student_steps)
        described[name] = one.describe()
    for path in cfg.hybrid:  # the teacher at the run's cache's steps, guided, then the run: steps "T+K"
        one = find_student(path, cfg.weights)
        call = settings.teacher_call() | {"num_frames": student.setting("frames", 1), "output_type": "latent",
                                          "num_inference_steps": int(one.setting("steps", settings.steps))}
        draw, stop, m = hybrid_sampler(teacher, call, one, loaded(one, path, "--hybrid"), cfg.hybrid_steps, rule,
                                       f"--hybrid {path}")
        name = f"teacher:{m}+{model_name(path)}"
        drawers[name] = (draw, f"{stop}+{one.setting('student_steps') - m}")
        described[name] = one.describe() | {"hybrid_teacher_steps": stop}
    return drawers, described


def _sample_rows(prompts: list[str], teacher, drawers: dict, settings: SamplingSettings, device: torch.device,
                 frames: int, images: list | None = None) -> tuple[list[list[np.ndarray]], dict[str, float]]:
    """Rows of uint8 clips of `frames` frames (the teacher's, then each student's, from the same latents and
    embeddings, and `images`' condition), seconds a column."""
    vs, rule = teacher.vae_scale_factor_spatial, InputRule.of_pipeline(teacher)
    shape = (1, teacher.vae.config.z_dim, latent_frames(teacher, frames), settings.height // vs, settings.width // vs)
    rows: list[list[np.ndarray]] = []
    seconds = {"teacher": 0.0, **{n: 0.0 for n in drawers}}
    for i, prompt in enumerate(progress_bar(prompts, desc="sample", unit="prompt", dynamic_ncols=True)):
        latents = initial_latents(settings.seed + i, shape)
        with torch.inference_mode():
            embeds, neg = teacher.encode_prompt(prompt, negative_prompt=settings.negative_prompt,
                                                do_classifier_free_guidance=True,
                                                max_sequence_length=settings.max_sequence_length, device=device)
        given, cond = {}, None
        if images is not None:  # the teacher's image, and the condition latent its VAE makes of it for the students
            given = {"image": images[i]}
            cond = condition_latent(teacher.vae, image_tensor(images[i], settings.height, settings.width), frames, rule)
        t = time.perf_counter()
        t_clip = teacher(prompt_embeds=embeds, negative_prompt_embeds=neg, latents=latents.clone(),
                         **settings.teacher_call() | {"num_frames": frames} | given).frames
        seconds["teacher"] += time.perf_counter() - t
        row = to_clips(t_clip)
        for name, (draw, _) in drawers.items():
            t = time.perf_counter()
            row += to_clips(decode_latents(teacher.vae, draw(embeds, latents.clone(), neg, cond)).numpy())
            seconds[name] += time.perf_counter() - t
        rows.append(row)
    return rows, seconds


def _rows(cfg: SampleConfig, student: Student) -> tuple[list[str], list[Path], list | None]:
    """The grid's prompts and, for an image-to-video student, their images' paths and images (--images); the wrong
    one of --prompts and --images refused."""
    learned = student.setting("condition", NONE)
    if learned != NONE and cfg.images is None:
        raise UserError(f"{cfg.student} is an image-to-video student (its cache's condition: {learned}): give --images "
                        "FILE of <image path><TAB><prompt> lines instead of --prompts")
    if cfg.images is None:
        prompts, _ = dedupe(read_prompt_file(cfg.prompts))
        return prompts[: cfg.max_prompts], [], None
    if student.distill is not None and learned == NONE:
        raise UserError(f"{cfg.student} is a text-to-video student (its cache had no images): give --prompts FILE "
                        "instead of --images")
    pairs = read_image_file(cfg.images)[: cfg.max_prompts]
    return [p for _, p in pairs], [i for i, _ in pairs], [open_image(i, f"--images {cfg.images}") for i, _ in pairs]


def image_cell(image, settings: SamplingSettings, size: tuple[int, int]) -> Image.Image:
    """The input image at the sampled size, at the left of a grid cell of `size`."""
    cell = Image.new("RGB", size, BACKGROUND)
    cell.paste(image.convert("RGB").resize((settings.width, settings.height)), (0, 0))
    return cell


def run(cfg: SampleConfig) -> dict:
    """Sample every prompt with teacher and student and write the grid; returns the summary."""
    t0 = time.time()
    out = Path(cfg.out)
    if out.is_dir() and not out.is_symlink():
        raise UserError(f"--out {out} is a folder; pass the PNG file to write, e.g. {out / 'grid.png'}")
    safe_write.ensure_folder(out.parent, "the folder of --out")  # (now: a typo ends the command before sampling)
    student = find_student(cfg.student, cfg.weights)
    prompts, paths, images = _rows(cfg, student)
    frames = int(student.setting("frames", 1))  # the cache's, as distill.json copied it: > 1 for a video run
    if cfg.fps is not None and frames == 1:
        raise UserError(f"--fps applies only to video students; {cfg.student} was trained on a one-frame (image) "
                        "cache and draws images: drop --fps")
    folder = out.with_name(f"{out.stem}-videos")
    if frames > 1:
        safe_write.ensure_folder(folder, "the video folder")
    teacher_name, teacher_path = student_teacher(cfg, student)
    device, dtype = pick_device(cfg.device, cfg.dtype)
    loras = teacher_lora.recorded(student.setting("teacher_loras"), student.setting("teacher_lora_paths"),
                                  f"{student.root}'s distill.json")
    teacher = load_teacher(teacher_path, dtype, device, image=images is not None, teacher_loras=loras)
    settings = resolve_settings(cfg, student, teacher)
    drawers, described = _load_students(cfg, student, teacher, teacher_name, settings, dtype, device)
    columns = ["teacher", *(f"{n} ({k} steps)" if len(drawers) > 1 else n for n, (_, k) in drawers.items())]
    rows, seconds = _sample_rows(prompts, teacher, drawers, settings, device, frames, images)

    # save: the grid (clips as frame strips, an I2V run's image first), a video run's clips beside it, and next to it
    # how it was made.
    cells = [[frame_strip(c) for c in row] for row in rows]
    if images is not None:
        cells = [[image_cell(im, settings, row[0].size), *row] for im, row in zip(images, cells)]
        columns = ["image", *columns]
    grid = draw_grid(prompts, cells, columns)
    write_image(grid, out)
    config, video, fps = dataclasses.asdict(cfg), {}, cfg.fps or DEFAULT_FPS
    if frames > 1:
        video = {"frames": frames, "fps": fps, **write_videos(folder, ["teacher", *drawers], rows, fps)}
    else:
        del config["fps"]  # an image run's summary as before video settings existed
    summary = {"grid": str(out), "rows": len(prompts), "size": list(grid.size), "prompts": prompts,
               "teacher": teacher_name, "student": student.describe(), "settings": dataclasses.asdict(settings),
               "columns": columns, "students": described,
               "device": str(device), "dtype": str(dtype).removeprefix("torch."),
               "seconds": {k: round(v, 3) for k, v in seconds.items()}, "wall_s": round(time.time() - t0, 2),
               **video, "config": config}
    if images is not None:
        summary["images"] = [str(p) for p in paths]
    safe_write.write_json(out.with_name(out.name + ".json"), summary)
    tqdm.write(f"grid of {len(prompts)} prompt(s) x {columns} written to {out} ({grid.size[0]}x{grid.size[1]}); "
               f"teacher {seconds['teacher']:.1f}s at {settings.steps} steps, "
               + ", ".join(f"{n} {seconds[n]:.1f}s at {k} steps" for n, (_, k) in drawers.items())
               + (f"; {len(rows) * len(columns)} clip(s) of {frames} frames (animated WebP, {fps} fps) written to "
                  f"{folder}, each also as an H.264 mp4" if video else ""))
    return summary


BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)


@dataclass(frozen=True)
class GridLayout:
    """Pixel geometry of a grid of `rows` x `cols` images of `cell_w` x `cell_h`."""

    cell_w: int
    cell_h: int
    label_w: int = 240  # the prompt column on the left
    header_h: int = 22  # the column labels on top
    pad: int = 4  # around and between images
    font_size: int = 12

    def size(self, rows: int, cols: int) -> tuple[int, int]:
        return (self.label_w + cols * (self.cell_w + self.pad) + self.pad,
                self.header_h + rows * (self.cell_h + self.pad) + self.pad)

    def origin(self, row: int, col: int) -> tuple[int, int]:
        """Top-left corner of image (row, col)."""
        return (self.label_w + self.pad + col * (self.cell_w + self.pad),
                self.header_h + self.pad + row * (self.cell_h + self.pad))


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


def _pieces(draw: ImageDraw.ImageDraw, word: str, font, width: int) -> list[str]:
    """`word` cut into pieces of at most `width` pixels (after a '-' where one fits), for words wider than a line."""
    out: list[str] = []
    while draw.textlength(word, font=font) > width and len(word) > 1:
        cut = max((i for i in range(1, len(word)) if draw.textlength(word[:i], font=font) <= width), default=1)
        dash = word.rfind("-", 0, cut)
        cut = dash + 1 if dash > 0 else cut
        out.append(word[:cut])
        word = word[cut:]
    return out + [word]


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels (long words cut); the last kept line ends in '...' when text is cut."""
    lines: list[str] = []
    cur = ""
    for word in (piece for w in text.split() for piece in _pieces(draw, w, font, width)):
        trial = f"{cur} {word}".strip()
        if cur and draw.textlength(trial, font=font) > width:
            lines.append(cur)
            cur = word
        else:
            cur = trial
    if cur:
        lines.append(cur)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and draw.textlength(last + "...", font=font) > width:
            last = last[:-1]
        lines[-1] = last.rstrip() + "..."
    return lines


def _titles(columns: list[str], layout: GridLayout) -> list[list[str]]:
    """Each column's title wrapped to its own column's width (at most 4 lines)."""
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    return [_wrap(measure, name, _font(layout.font_size), layout.cell_w + layout.pad, max_lines=4) for name in columns]


def grid_layout(columns: list[str], cell_w: int, cell_h: int) -> GridLayout:
    """The layout `draw_grid` uses: the header as tall as the longest wrapped column title."""
    layout = GridLayout(cell_w=cell_w, cell_h=cell_h)
    lines = max((len(t) for t in _titles(columns, layout)), default=1)
    return dataclasses.replace(layout, header_h=max(layout.header_h, lines * (layout.font_size + 2) + 6))


def draw_grid(labels: list[str], images: list[list[Image.Image]], columns: list[str]) -> Image.Image:
    """One row per label, its images (all one size) in `columns` order, each column's title wrapped over it."""
    if len(labels) != len(images) or any(len(r) != len(columns) for r in images):
        raise ValueError(f"grid needs {len(columns)} images for each of the {len(labels)} rows")
    layout = grid_layout(columns, *images[0][0].size)
    if any(im.size != (layout.cell_w, layout.cell_h) for r in images for im in r):
        raise ValueError(f"every grid image must be {layout.cell_w}x{layout.cell_h}")
    font = _font(layout.font_size)
    line_h = layout.font_size + 2
    titles = _titles(columns, layout)
    canvas = Image.new("RGB", layout.size(len(labels), len(columns)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for c, lines in enumerate(titles):
        x, _ = layout.origin(0, c)
        for i, line in enumerate(lines):
            tw = draw.textlength(line, font=font)
            draw.text((x + (layout.cell_w - tw) / 2, 3 + i * line_h), line, fill=INK, font=font)
    max_lines = max(1, layout.cell_h // line_h)
    for r, (label, row) in enumerate(zip(labels, images)):
        _, y = layout.origin(r, 0)
        for i, line in enumerate(_wrap(draw, label, font, layout.label_w - 2 * layout.pad, max_lines)):
            draw.text((layout.pad, y + i * line_h), line, fill=INK, font=font)
        for c, im in enumerate(row):
            canvas.paste(im.convert("RGB"), layout.origin(r, c))
    return canvas
