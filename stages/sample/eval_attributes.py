"""eval's attribute scores (--attributes): the teacher and every entry draw shapes captions from the same noise at
the cache's settings, attributes.py scores them, and the first rows (teacher | entries) go to a grid by the report."""

from __future__ import annotations

import dataclasses

import torch
from PIL import Image

from pipeline.config import EvalConfig
from pipeline.progress_bar import progress_bar
from pipeline.sampling import decode_latents

from .attributes import caption_noise, first_frames_u8, score
from .eval_setup import Entry, Setup
from .sample import SamplingSettings, _write_png, draw_grid

# Scores whose student / teacher ratio the report gives ("colour": background and every shape colour right).
KEPT = ("background", "shape_colour", "position", "colour")


def _draw_all(teacher, entries: list[Entry], captions: list[str], settings: SamplingSettings, device,
              batch_size: int) -> dict[str, list]:
    """uint8 first frames of every caption by the teacher and each entry (its VAE), all from `caption_noise`."""
    images = {"teacher": [], **{e.label: [] for e in entries}}
    bar = progress_bar(total=len(captions), desc="attributes", unit="caption", dynamic_ncols=True)
    for s in range(0, len(captions), batch_size):
        caps = captions[s:s + batch_size]
        latents = caption_noise(teacher, settings.seed, s, len(caps), settings.height, settings.width)
        with torch.inference_mode():
            embeds, neg = teacher.encode_prompt(caps, negative_prompt=[settings.negative_prompt] * len(caps),
                                                do_classifier_free_guidance=True,
                                                max_sequence_length=settings.max_sequence_length, device=device)
            images["teacher"] += first_frames_u8(teacher(prompt_embeds=embeds, negative_prompt_embeds=neg,
                                                         latents=latents.clone(), **settings.teacher_call()).frames)
            for e in entries:
                frames = decode_latents(teacher.vae, e.draw(embeds, latents.clone(), neg)).numpy()
                images[e.label] += first_frames_u8(frames)
        bar.update(len(caps))
    bar.close()
    return images


def attribute_scores(cfg: EvalConfig, su: Setup, teacher, entries: list[Entry]) -> dict:
    """Each one's scores (the first entry's also as "student"), shares of the teacher's, settings, grid path."""
    m, captions = su.manifest, su.captions
    g2 = m.guidance_2
    settings = SamplingSettings(
        steps=int(m.steps), guidance=float(m.guidance),
        guidance_2=float(g2) if g2 is not None and teacher.config.boundary_ratio is not None else None,
        student_guidance=entries[0].guidance, negative_prompt=m.negative_prompt,
        height=int(m.height), width=int(m.width), max_sequence_length=int(m.max_sequence_length),
        seed=0, student_steps=entries[0].steps)
    images = _draw_all(teacher, entries, captions, settings, su.device, cfg.batch_size)
    res = {name: score(imgs, captions) for name, imgs in images.items()}
    t = res["teacher"]
    res["vs_teacher"] = {e.label: {k: round(res[e.label][k] / t[k], 4) if t[k] else None for k in KEPT + ("all",)}
                         for e in entries}
    res["student"] = res[entries[0].label]
    res["student_vs_teacher"] = {k: res["vs_teacher"][entries[0].label][k] for k in KEPT}
    keep = range(min(cfg.attribute_grid, len(captions)))
    rows = [[Image.fromarray(images[name][i]) for name in images] for i in keep]
    grid_path = su.report_path.with_name(su.report_path.stem + "-attributes.png")
    if rows:
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        _write_png(draw_grid(captions[:len(rows)], rows, list(images)), grid_path)
    return {"prompts": cfg.attributes, "captions": len(captions), "settings": dataclasses.asdict(settings), **res,
            "grid": str(grid_path) if rows else None}
