"""eval's errors against the teacher's cache, on the prompt embeddings it stores: velocity errors (every model's
prediction at each cached x_t against the cached target, per step, the untrained twin as the baseline) and
final-latent errors (each entry sampled from the cached initial noise against the teacher's final latent). On an
image-to-video cache every model takes each trajectory's cached condition, as the teacher did, and the final latents'
first-frame fidelity is measured too."""

from __future__ import annotations

import torch

from cache import format as F
from cache.reader import SampleReader, open_index, prompt_rows
from cache.schema import recorded_steps
from pipeline.errors import UserError
from pipeline.progress_bar import progress_bar
from pipeline import guidance_input
from pipeline.model_call import InputRule, Inputs, predict
from pipeline.sampling import latent_motion, motion_ratio, mse

from .eval_setup import Entry, Setup


def _batches(su: Setup, size: int):
    """Lists of at most `size` (tensors, metadata) of the selected trajectories' cached steps, read by row."""
    index = open_index([su.cache_dir])
    rows = prompt_rows(index, {t.prompt_idx for t in su.trajs})
    reader = SampleReader(index)
    try:
        for i in range(0, len(rows), size):
            batch = [reader.read(int(r)) for r in rows[i:i + size]]
            if su.target_key not in batch[0][0]:
                raise UserError(f"the cache has no {su.target_key!r} tensors, which this student learned (conditional "
                                "predictions); rebuild the cache with --save-cond-uncond")
            yield batch
    finally:
        reader.close()


@torch.inference_mode()
def velocity_errors(su: Setup, models: dict, batch_size: int) -> dict:
    """Per-step mean MSE of every model against the student's target over the selected samples; where stage two
    trained on some of the cached steps only, each step says whether it was one of them."""
    manifest, device, dtype = su.manifest, su.device, su.dtype
    steps, recorded = int(manifest.steps), recorded_steps(manifest)
    rule = InputRule.of(manifest)
    kept = rule.learned_frames(int(manifest.latent_shape[1])) or slice(None)  # a condition's frames are not scored
    embeds = su.embeddings()
    sums, counts = {name: [0.0] * steps for name in models}, [0] * steps
    bar = progress_bar(total=len(su.trajs) * len(recorded), desc="eval velocity", unit="sample", dynamic_ncols=True)
    for batch in _batches(su, batch_size):
        x = torch.stack([s[F.T_X_T] for s, _ in batch]).to(device, dtype)
        t = torch.tensor([m[F.M_TIMESTEP] for _, m in batch], device=device)
        enc = torch.stack([embeds.get(m[F.M_PROMPT_IDX]) for _, m in batch]).to(device, dtype)
        target = torch.stack([s[su.target_key] for s, _ in batch]).to(device)
        keys = [(m[F.M_PROMPT_IDX], m[F.M_SEED_IDX]) for _, m in batch]
        trajs = list(dict.fromkeys(keys))  # each trajectory's condition read once
        cond = su.conditions(trajs)
        cond = None if cond is None else cond[[trajs.index(k) for k in keys]].to(device, dtype)
        for name, model in models.items():
            w = guidance_input.scale_for(model, float(manifest.guidance))  # (a student taking the scale: the cache's)
            w = None if w is None else torch.full((len(batch),), w, device=device)
            pred = predict(model, Inputs(x, t, enc, condition=cond, guidance_input=w), rule=rule).guided
            for (_, m), e in zip(batch, mse(pred[:, :, kept], target[:, :, kept]).tolist()):
                sums[name][m[F.M_STEP]] += e
        for _, m in batch:
            counts[m[F.M_STEP]] += 1
        bar.update(len(batch))
    bar.close()
    if sum(counts) != len(su.trajs) * len(recorded):
        raise UserError(f"the cache holds {sum(counts)} samples of the selected trajectories, expected "
                        f"{len(su.trajs) * len(recorded)}; run `wandistiller cache verify {su.cache_dir}`")
    sigmas, experts = manifest.sigmas, manifest.experts
    per_step = [{"step": k, "timestep": manifest.timesteps[k], "sigma": sigmas[k], "expert": experts[k],
                 "samples": counts[k], **{name: sums[name][k] / counts[k] for name in models}} for k in recorded]
    trained_steps = su.student.setting("train_steps")
    if isinstance(trained_steps, list):  # stage two may train on a subset of the cached steps
        for row in per_step:
            row["trained_step"] = row["step"] in trained_steps
    return {"per_step": per_step, "mean": {name: sum(sums[name]) / sum(counts) for name in models}}


def first_frame_error(final: torch.Tensor, condition: torch.Tensor) -> list[float]:
    """Per trajectory, the MSE of latent frame 0 of final latents [N, C, F, H, W] against the given image's latent (a
    concat condition's last C channels behind its mask, a first-frame condition itself): how close the decoded first
    frame stays to the image."""
    return mse(final[:, :, :1], condition[:, -final.shape[1]:, :1].to(final.device)).tolist()


def final_latent_errors(su: Setup, entries: list[Entry], neg: torch.Tensor, batch_size: int) -> dict:
    """MSE of each entry's sampled final latent against the teacher's, per trajectory and mean; on an image-to-video
    cache also `first_frame`: each model's (the teacher's cached latents' too) first-frame error, mean; on a video
    cache `latent_motion`: each entry's latent frame-difference ratio to the teacher's (`latent_motion`)."""
    embeds = su.embeddings()
    errs = {e.label: [] for e in entries}
    first, moves = {name: [] for name in ("teacher", *errs)}, {name: [] for name in ("teacher", *errs)}
    video = int(su.manifest.latent_shape[1]) > 1
    bar = progress_bar(total=len(su.trajs) * len(entries), desc="eval sampling", unit="traj", dynamic_ncols=True)
    for i in range(0, len(su.trajs), batch_size):
        chunk = su.trajs[i:i + batch_size]
        init, final = su.latents(chunk)
        emb = torch.stack([embeds.get(t.prompt_idx) for t in chunk]).to(su.device)
        cond = su.conditions([(t.prompt_idx, t.seed_idx) for t in chunk])
        if cond is not None:
            first["teacher"] += first_frame_error(final, cond)
        moves["teacher"] += latent_motion(final) if video else []
        for e in entries:
            out = e.draw(emb, init.to(su.device), neg.to(su.device),
                         condition=None if cond is None else cond.to(su.device)).float().cpu()
            errs[e.label] += mse(out, final).tolist()
            moves[e.label] += latent_motion(out) if video else []
            if cond is not None:
                first[e.label] += first_frame_error(out, cond)
            bar.update(len(chunk))
    bar.close()
    image = {"first_frame": {name: sum(v) / len(v) for name, v in first.items()}} if first["teacher"] else {}
    if video:  # the latent frame-difference ratio: motion kept without decoding
        image["latent_motion"] = {name: motion_ratio(v, moves["teacher"]) for name, v in moves.items() if name != "teacher"}
    return {**{name: sum(v) / len(v) for name, v in errs.items()}, **image,
            "per_trajectory": [{"prompt_idx": t.prompt_idx, "seed_idx": t.seed_idx,
                                **{name: errs[name][j] for name in errs}} for j, t in enumerate(su.trajs)],
            "student": sum(errs[entries[0].label]) / len(su.trajs), "student_steps": entries[0].steps}
