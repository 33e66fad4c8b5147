"""eval's attribute scores (--attributes): the teacher and every entry draw the captions from the same noise at the
cache's settings (whole clips on a video cache; on an image-to-video one from the same given images too),
attributes.py (motion.py for clips, with the first frame's fidelity to a given image) scores them, and the first rows
(teacher | entries, clips as frame strips, after the given image) go to a grid by the report."""

from __future__ import annotations

import dataclasses

import torch

from pipeline.config import EvalConfig
from pipeline.image_condition import condition_latent, image_tensor
from pipeline.model_call import InputRule
from pipeline.progress_bar import progress_bar
from pipeline.sampling import decode_latents

from . import motion
from .attributes import caption_noise, score
from .eval_setup import Entry, Setup
from .sample import SamplingSettings, image_cell, draw_grid, frame_strip, to_clips, write_image

# Scores whose student / teacher ratio the report gives ("colour": background and every shape colour right).
KEPT = ("background", "shape_colour", "position", "colour")
KEPT_MOTION = ("background", "shape_colour", "attributes", "motion_right")  # a video eval's (per frame, then per clip)


def _draw_all(teacher, entries: list[Entry], captions: list[str], settings: SamplingSettings, device,
              batch_size: int, shape: list[int], frames: int, rule: InputRule, images: list | None = None):
    """uint8 clips of every caption by the teacher and each entry (its VAE), all from `caption_noise` of the cache's
    latent `shape` [C, F, h, w] (`frames` decoded frames); given `images` (image-to-video), from each caption's image
    too: the teacher's pipeline called with it (one a call, as sample's), each entry with its condition latent. Returns
    (clips by model, the images as the models were given them: one-frame uint8 clips, or None)."""
    clips, given = {"teacher": [], **{e.label: [] for e in entries}}, None if images is None else []
    call = settings.teacher_call() | {"num_frames": frames}
    bar = progress_bar(total=len(captions), desc="attributes", unit="caption", dynamic_ncols=True)
    for s in range(0, len(captions), batch_size):
        caps = captions[s:s + batch_size]
        latents = caption_noise(teacher, settings.seed, s, len(caps), settings.height, settings.width, shape[1])
        with torch.inference_mode():
            embeds, neg = teacher.encode_prompt(caps, negative_prompt=[settings.negative_prompt] * len(caps),
                                                do_classifier_free_guidance=True,
                                                max_sequence_length=settings.max_sequence_length, device=device)
            cond = None
            if images is None:
                clips["teacher"] += to_clips(teacher(prompt_embeds=embeds, negative_prompt_embeds=neg,
                                                     latents=latents.clone(), **call).frames)
            else:
                pixels = [image_tensor(im, settings.height, settings.width) for im in images[s:s + len(caps)]]
                cond = torch.cat([condition_latent(teacher.vae, p, frames, rule) for p in pixels])
                for i, im in enumerate(images[s:s + len(caps)]):
                    clips["teacher"] += to_clips(teacher(image=im, prompt_embeds=embeds[i:i + 1],
                                                         negative_prompt_embeds=neg[i:i + 1],
                                                         latents=latents[i:i + 1].clone(), **call).frames)
                given += to_clips((torch.cat(pixels).permute(0, 2, 3, 1)[:, None].numpy() + 1) / 2)
            for e in entries:
                clips[e.label] += to_clips(decode_latents(teacher.vae, e.draw(embeds, latents.clone(), neg,
                                                                               cond)).numpy())
        bar.update(len(caps))
    bar.close()
    return clips, given


def _motion_scores(clips: dict[str, list], captions: list[str], entries: list[Entry], given: list | None) -> dict:
    """motion.py's scores of each one's clips (with `given` first frames, its `first_frame` fidelity to them); each
    entry's also `motion_kept` (with the teacher's all-right clips it counts and its 95% interval) and `speed_ratio`
    against the teacher's clips, caption by caption."""
    reads = {name: motion.score(cs, captions) for name, cs in clips.items()}
    res = {name: {k: v for k, v in r.items() if k != "clip_reads"} for name, r in reads.items()}
    if given is not None:
        for name, cs in clips.items():
            res[name]["first_frame"] = motion.fidelity(cs, given, reads[name]["clip_reads"])
    for e in entries:
        t, r = reads["teacher"]["clip_reads"], reads[e.label]["clip_reads"]
        k, n = motion.kept_counts(t, r)
        res[e.label] |= {"motion_kept": k / n if n else None, "motion_kept_of": n,
                         "motion_kept_interval": motion.wilson(k, n), "speed_ratio": motion.speed_ratio(t, r)}
    return res


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
    frames, video = int(m.frames), int(m.frames) > 1 or su.images is not None
    clips, given = _draw_all(teacher, entries, captions, settings, su.device, cfg.batch_size, m.latent_shape, frames,
                             InputRule.of(m), su.images)
    if video:
        res, kept = _motion_scores(clips, captions, entries, given), KEPT_MOTION
    else:
        res, kept = {name: score([c[0] for c in cs], captions) for name, cs in clips.items()}, KEPT
    t = res["teacher"]
    res["vs_teacher"] = {e.label: {k: round(res[e.label][k] / t[k], 4) if t[k] else None for k in kept + ("all",)}
                         for e in entries}
    res["student"] = res[entries[0].label]
    res["student_vs_teacher"] = {k: res["vs_teacher"][entries[0].label][k] for k in kept}
    keep = range(min(cfg.attribute_grid, len(captions)))
    rows = [[frame_strip(clips[name][i]) for name in clips] for i in keep]
    columns = ["image"] * (su.images is not None) + list(clips)
    if su.images is not None:  # the given image first, as sample's grid
        rows = [[image_cell(su.images[i], settings, r[0].size), *r] for i, r in zip(keep, rows)]
    grid_path = su.report_path.with_name(su.report_path.stem + "-attributes.png")
    if rows:
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        write_image(draw_grid(captions[:len(rows)], rows, columns), grid_path)
    return {"prompts": cfg.attributes, "captions": len(captions), "settings": dataclasses.asdict(settings), **res,
            "grid": str(grid_path) if rows else None, **({"frames": frames} if video else {})}
