"""eval's timing: seconds per image of the teacher (its steps, its CFG) and of every entry (its steps) on the same
latents (and image), batch 1: the denoising alone, and, when the teacher carries its text encoder and VAE, the whole
pipeline."""

from __future__ import annotations

import time
from statistics import median

import torch

from pipeline.image_condition import condition_latent, image_tensor
from pipeline.model_call import InputRule
from pipeline.progress_bar import progress_bar
from pipeline.sampling import decode_latents, mse

from .eval_setup import Entry, Setup, teacher_call
from .sample import teacher_drawer


def _timed(fn, device: torch.device) -> tuple:
    """(fn(), its seconds), the device synchronised on both sides so that queued kernels count where they run."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def _conditioner(pipe, image, kw: dict, rule: InputRule):
    """On an image-to-video cache: ({"image": image} for the teacher's pipeline, a function making the condition
    latent of `image` with the teacher's VAE for a student: timed with it, as the pipeline's own encoding is), else
    ({}, a function of None)."""
    if image is None:
        return {}, lambda: None
    pixels = image_tensor(image, kw["height"], kw["width"])
    return {"image": image}, lambda: condition_latent(pipe.vae, pixels, kw["num_frames"], rule)


def _denoisers(entries: list[Entry], pipe, emb, lat, neg, kw: dict, given: dict, cond) -> dict:
    """name -> one denoising of the trajectory: the teacher's pipeline (final latent on the CPU), then each entry
    (`given`, `cond`: `_conditioner`'s)."""
    teacher = teacher_drawer(pipe, kw)
    return {"teacher": lambda: teacher(emb, lat.clone(), neg, **given).float().cpu(),
            **{e.label: (lambda e=e: e.draw(emb, lat.clone(), neg, cond())) for e in entries}}


def _pipelines(entries: list[Entry], pipe, text: str, lat, kw: dict, negative: str, device, given: dict,
               cond) -> dict:
    """name -> one caption encoded, denoised and decoded: the teacher's pipeline, then each entry."""
    def student(e: Entry):
        pe, ne = pipe.encode_prompt(text, negative_prompt=negative, do_classifier_free_guidance=e.guidance > 1.0,
                                    max_sequence_length=kw["max_sequence_length"], device=device)
        return decode_latents(pipe.vae, e.draw(pe, lat.clone(), ne, cond())).numpy()

    return {"teacher": lambda: pipe(prompt=text, negative_prompt=negative, latents=lat.clone(),
                                    **{**kw, "output_type": "np"}, **given).frames,
            **{e.label: (lambda e=e: student(e)) for e in entries}}


def _per_image(entries: list[Entry], denoise: dict[str, list[float]], pipeline: dict[str, list[float]]) -> dict:
    """Median seconds per image of the teacher and every entry, and each entry's speed-up over the teacher."""
    per = {name: {"denoise_s_per_image": median(denoise[name]),
                  "pipeline_s_per_image": median(pipeline[name]) if pipeline[name] else None} for name in denoise}
    t = per["teacher"]
    for e in entries:
        p = per[e.label]
        p.update(steps=e.steps, passes=e.passes, forwards_per_step=2 if e.guidance > 1.0 else 1,
                 speedup_denoise=t["denoise_s_per_image"] / max(p["denoise_s_per_image"], 1e-9),
                 speedup_pipeline=(t["pipeline_s_per_image"] / max(p["pipeline_s_per_image"], 1e-9)
                                   if p["pipeline_s_per_image"] else None))
    return per


def time_sampling(su: Setup, entries: list[Entry], pipe, neg: torch.Tensor, runs: int) -> dict:
    """Seconds per image, the median over `runs` trajectories after one warm-up each; also the teacher's re-run
    final latent against the cache (~0: checks that this path reproduces stage one). On an image-to-video cache each
    run takes one of --attributes' images (none is recorded), so the re-run is not compared: every model is timed
    with that image's encoding by the teacher's VAE, the pipeline's own first step."""
    manifest, device = su.manifest, su.device
    embeds = su.embeddings()
    kw = teacher_call(pipe, manifest, int(manifest.steps))
    whole = pipe.text_encoder is not None and pipe.vae is not None
    negative, image, rule = manifest.negative_prompt, su.images is not None, InputRule.of(manifest)
    denoise = {n: [] for n in ("teacher", *(e.label for e in entries))}
    pipeline = {n: [] for n in denoise}
    teacher_err, n = [], min(runs, len(su.trajs))
    init, final = su.latents(su.trajs[:n])
    for j in progress_bar(range(-1, n), desc="eval timing", unit="traj", dynamic_ncols=True):  # j == -1: warm-up
        t = su.trajs[max(j, 0)]
        emb, lat = embeds.get(t.prompt_idx)[None].to(device), init[max(j, 0)][None].to(device)
        given, cond = _conditioner(pipe, su.images[max(j, 0) % len(su.images)] if image else None, kw, rule)
        fns = _denoisers(entries, pipe, emb, lat, neg.to(device), kw, given, cond)
        timed = {name: _timed(fn, device) for name, fn in fns.items()}
        if whole:
            with torch.inference_mode():
                whole_s = {name: _timed(fn, device)[1]
                           for name, fn in _pipelines(entries, pipe, t.text, lat, kw, negative, device, given,
                                                             cond).items()}
        if j < 0:
            continue
        if not image:
            teacher_err.append(mse(timed["teacher"][0], final[j][None]).item())
        for name, (_, sec) in timed.items():
            denoise[name].append(sec)
            if whole:
                pipeline[name].append(whole_s[name])
    per = _per_image(entries, denoise, pipeline)
    first = per[entries[0].label]
    return {
        "runs": n, "steps": int(manifest.steps), "statistic": "median over runs, batch 1",
        "student_steps": entries[0].steps, "student_s_per_image": first["denoise_s_per_image"],
        "teacher_s_per_image": per["teacher"]["denoise_s_per_image"], "speedup": first["speedup_denoise"],
        "teacher_pipeline_s_per_image": per["teacher"]["pipeline_s_per_image"],
        "student_forwards_per_step": first["forwards_per_step"],
        "teacher_forwards_per_step": 2 if kw["guidance_scale"] > 1.0 else 1,
        "student_params": sum(p.numel() for p in entries[0].model.parameters()),
        "teacher_params_per_expert": sum(p.numel() for p in pipe.transformer.parameters()),
        "teacher_final_mse": sum(teacher_err) / len(teacher_err) if teacher_err else None,
        "entries": {e.label: per[e.label] for e in entries}, "teacher": per["teacher"],
    }
