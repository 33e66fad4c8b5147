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

from . import flow, motion
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
    entry's also `kept`, the paired share of the teacher's all-right clips it draws all right too (`kept_of` of them,
    its 95% `kept_interval`), and `speed_ratio` against the teacher's clips, caption by caption."""
    reads = {name: motion.score(cs, captions) for name, cs in clips.items()}
    res = {name: {k: v for k, v in r.items() if k != "clip_reads"} for name, r in reads.items()}
    if given is not None:
        for name, cs in clips.items():
            res[name]["first_frame"] = motion.fidelity(cs, given, reads[name]["clip_reads"])
    for e in entries:
        t, r = reads["teacher"]["clip_reads"], reads[e.label]["clip_reads"]
        k, n = motion.kept_counts(t, r)
        res[e.label] |= {"kept": k / n if n else None, "kept_of": n, "kept_interval": motion.wilson(k, n),
                         "speed_ratio": motion.speed_ratio(t, r)}
    return res


def _image_scores(clips: dict[str, list], captions: list[str], entries: list[Entry]) -> dict:
    """attributes.py's scores of each one's first frames, the all-right share with its 95% interval; each entry's also
    `kept`, the paired share of the teacher's all-right images it draws all right too (`kept_of`, `kept_interval`)."""
    reads = {name: score([c[0] for c in cs], captions) for name, cs in clips.items()}
    res = {name: {k: v for k, v in r.items() if k != "image_reads"} for name, r in reads.items()}
    for name, r in reads.items():
        res[name]["all_interval"] = motion.wilson(sum(i["all_right"] for i in r["image_reads"]), r["images"])
    for e in entries:
        k, n = motion.kept_counts(reads["teacher"]["image_reads"], reads[e.label]["image_reads"])
        res[e.label] |= {"kept": k / n if n else None, "kept_of": n, "kept_interval": motion.wilson(k, n)}
    return res


def _flow_scores(clips: dict[str, list], entries: list[Entry]) -> dict:
    """flow.py's figures of each one's clips: the teacher's own (dynamic degree, flow, flicker), each entry's also
    against the teacher's clips of the same prompt and noise (flow ratio, direction)."""
    reads = {name: [flow.read(c) for c in cs] for name, cs in clips.items()}
    return {"teacher": flow.summary(reads["teacher"]), **{e.label: flow.compare(reads["teacher"], reads[e.label])
                                                          for e in entries}}


def attribute_scores(cfg: EvalConfig, su: Setup, teacher, entries: list[Entry]) -> dict:
    """Each one's scores (the first entry's also as "student"), shares of the teacher's, settings, grid path: of
    --attributes' captions (the checker's and, on video, the flow's figures) or --motion's prompts (the flow's), each
    drawn from --attribute-seeds noises (scored against --checked-captions' when given)."""
    m, seeds = su.manifest, cfg.attribute_seeds
    captions, images = su.captions * seeds, None if su.images is None else su.images * seeds
    scored = captions if su.checked_captions is None else su.checked_captions * seeds  # (clip i is caption i's)
    g2 = m.guidance_2
    settings = SamplingSettings(
        steps=int(m.steps), guidance=float(m.guidance),
        guidance_2=float(g2) if g2 is not None and teacher.config.boundary_ratio is not None else None,
        student_guidance=entries[0].guidance, negative_prompt=m.negative_prompt,
        height=int(m.height), width=int(m.width), max_sequence_length=int(m.max_sequence_length),
        seed=0, student_steps=entries[0].steps)
    frames, video = int(m.frames), int(m.frames) > 1 or su.images is not None
    clips, given = _draw_all(teacher, entries, captions, settings, su.device, cfg.batch_size, m.latent_shape, frames,
                             InputRule.of(m), images)
    res: dict = {}
    if video:
        res = _flow_scores(clips, entries)
        if su.checked:
            res = {name: r | res[name] for name, r in _motion_scores(clips, scored, entries, given).items()}
        kept = KEPT_MOTION
    else:
        res, kept = _image_scores(clips, scored, entries), KEPT
    if su.checked:
        t = res["teacher"]
        res["vs_teacher"] = {e.label: {k: round(res[e.label][k] / t[k], 4) if t[k] else None for k in kept + ("all",)}
                             for e in entries}
        res["student_vs_teacher"] = {k: res["vs_teacher"][entries[0].label][k] for k in kept}
    res["student"] = res[entries[0].label]
    keep = range(min(cfg.attribute_grid, len(captions)))
    rows = [[frame_strip(clips[name][i]) for name in clips] for i in keep]
    columns = ["image"] * (images is not None) + list(clips)
    if images is not None:  # the given image first, as sample's grid
        rows = [[image_cell(images[i], settings, r[0].size), *r] for i, r in zip(keep, rows)]
    grid_path = su.report_path.with_name(su.report_path.stem + "-attributes.png")
    if rows:
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        write_image(draw_grid(captions[:len(rows)], rows, columns), grid_path)
    checked_file = {"checked_captions": cfg.checked_captions} if cfg.checked_captions else {}
    return {"prompts": cfg.attributes or cfg.motion, "checked": su.checked, **checked_file,
            "captions": len(su.captions), "seeds": seeds, "clips": len(captions),
            "settings": dataclasses.asdict(settings), **res, "grid": str(grid_path) if rows else None,
            **({"frames": frames} if video else {})}
