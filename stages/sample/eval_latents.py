"""eval's final-latent errors: each entry samples from every selected trajectory's cached initial noise with its own
schedule and steps, and its final latent is compared with the teacher's cached one."""

from __future__ import annotations

import torch

from pipeline.progress_bar import progress_bar
from pipeline.sampling import mse

from .eval_setup import Entry, Setup


def final_latent_errors(su: Setup, entries: list[Entry], neg: torch.Tensor, batch_size: int) -> dict:
    """MSE between each entry's sampled final latent and the teacher's, per trajectory and mean (latents are read
    a batch at a time); the first entry's figure is also the report's `student`."""
    embeds = su.embeddings()
    errs = {e.label: [] for e in entries}
    bar = progress_bar(total=len(su.trajs) * len(entries), desc="eval sampling", unit="traj", dynamic_ncols=True)
    for i in range(0, len(su.trajs), batch_size):
        chunk = su.trajs[i:i + batch_size]
        init, final = su.latents(chunk)
        emb = torch.stack([embeds.get(t.prompt_idx) for t in chunk]).to(su.device)
        for e in entries:
            out = e.draw(emb, init.to(su.device), neg.to(su.device)).float().cpu()
            errs[e.label] += mse(out, final).tolist()
            bar.update(len(chunk))
    bar.close()
    return {**{name: sum(v) / len(v) for name, v in errs.items()},
            "per_trajectory": [{"prompt_idx": t.prompt_idx, "seed_idx": t.seed_idx,
                                **{name: errs[name][j] for name in errs}} for j, t in enumerate(su.trajs)],
            "student": sum(errs[entries[0].label]) / len(su.trajs), "student_steps": entries[0].steps}
