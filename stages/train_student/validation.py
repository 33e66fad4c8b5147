"""Validation by sampling, teacher-free (`final_latent_mse`, and with --val-decode the teacher's VAE alone), each
trajectory from its cached noise (and, image-to-video, its cached condition) as the student will be sampled;
docs/usage.md "Watch a run" and docs/architecture.md "The run artifact" have what it runs and costs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from cache import format as F
from cache.manifest import negative_embeds
from cache.prompt_store import EmbeddingCache, read_latents
from cache.reader import C_CACHE, C_PROMPT, C_SEED
from pipeline import guidance_input
from pipeline.artifact import DistillRecord
from pipeline.errors import UserError, first_line
from pipeline.hub import is_hub_id, teacher_folder
from pipeline.model_call import NONE, InputRule
from pipeline.sampling import (decode_latents, latent_motion, motion_ratio, sample_latents, student_scheduler,
                               student_steps)

_GAP = 2  # pixels between grid cells
VAE_FILES = ("vae/*.json", "vae/*.safetensors")  # what --val-decode reads of a teacher (huggingface_hub patterns)


class Validator:
    """Samples the student on fixed held-out trajectories; `run` returns (metrics record, image grid or None)."""

    def __init__(self, record: DistillRecord, data, max_prompts: int, batch_size: int, device: torch.device,
                 vae: tuple[Path, str] | None = None):
        self.record, self.device, self.batch_size, self.decode = record, device, batch_size, vae is not None
        index = data.index
        self.manifest = index.manifest
        prompts = [int(p) for p in data.heldout_prompts[:max_prompts]]
        rows = index.table[data.heldout_rows]
        rows = rows[np.isin(rows[:, C_PROMPT], prompts)]
        # (prompt, seed) -> the cache holding it (the first one, as the index keeps duplicates once)
        where = {(p, s): ci for ci, p, s in reversed(rows[:, [C_CACHE, C_PROMPT, C_SEED]].tolist())}
        self.trajectories = sorted(where)
        self.caches = [index.caches[where[t]].path for t in self.trajectories]
        self.steps = student_steps(record)
        self.guidance = 1.0 if record.guided else float(self.manifest.guidance)
        self.rule = InputRule.of(self.manifest)
        self._inputs: list[tuple[torch.Tensor, ...]] | None = None
        self._neg: torch.Tensor | None = None
        self._vae = None
        self._vae_from = vae  # (folder holding vae/, what named it): vae_folder's answer, with --val-decode
        self._teacher_frames: np.ndarray | None = None
        self._teacher_motion: list[float] | None = None

    def _load_inputs(self) -> list[tuple[torch.Tensor, ...]]:
        """(initial noise, teacher's final latents, prompt embeddings, condition latents or None) per batch, read once
        from the cache."""
        if self._inputs is None:
            num_parts = int(self.manifest.num_parts)
            names = (F.Z_INIT_NOISE, F.Z_FINAL_LATENTS, *((F.Z_CONDITION,) if self.rule.condition != NONE else ()))
            embeds: dict[Path, EmbeddingCache] = {}
            arrays, emb = [], []
            for (p, s), cache in zip(self.trajectories, self.caches):
                arrays.append([a[0] for a in read_latents(cache, num_parts, [(p, s)], names)])
                emb.append(embeds.setdefault(cache, EmbeddingCache(cache, num_parts, len(self.trajectories))).get(p))
            if self.guidance > 1.0:
                self._neg = negative_embeds(self.caches[0])[None]
            b = self.batch_size
            self._inputs = []
            for k in range(0, len(emb), b):
                init, final, *cond = (torch.stack(a) for a in zip(*arrays[k:k + b]))
                self._inputs.append((init, final, torch.stack(emb[k:k + b]), cond[0] if cond else None))
        return self._inputs

    @torch.no_grad()
    def run(self, model: torch.nn.Module, step: int) -> tuple[dict, np.ndarray | None]:
        t0 = time.perf_counter()
        model.eval()
        errors, latents = [], []
        for init, final, emb, cond in self._load_inputs():
            out = sample_latents(model, student_scheduler(self.record), init, emb, self.steps, self.guidance,
                                 self._neg, rule=self.rule, condition=cond,
                                 scale=guidance_input.scale_for(model, self.manifest.guidance)).float().cpu()
            errors += (out - final.float()).pow(2).flatten(1).mean(1).tolist()
            latents.append(out)
        record = {"final_latent_mse": float(np.mean(errors)),
                  "final_latent_mse_per_prompt": {f"p{p}_s{s}": e for (p, s), e in zip(self.trajectories, errors)},
                  "trajectories": len(errors), "sampling_steps": self.steps}
        if latents[0].shape[2] > 1:  # video: the latent frame-difference ratio to the teacher's (below 1: slower)
            if self._teacher_motion is None:  # (the cached final latents': the same at every validation)
                self._teacher_motion = latent_motion(torch.cat([f for _, f, _, _ in self._load_inputs()]))
            record["latent_motion"] = motion_ratio(latent_motion(torch.cat(latents)), self._teacher_motion)
        grid = self._grid(torch.cat(latents)) if self.decode else None
        if self._vae is not None:
            record["vae_mib"] = self.vae_mib
        record["val_s"] = time.perf_counter() - t0
        return record, grid

    # -- --val-decode ---------------------------------------------------------------------------------
    def _load_vae(self):
        """The teacher's VAE alone (diffusers AutoencoderKLWan from the teacher's vae/ subfolder), float32."""
        from diffusers import AutoencoderKLWan

        folder, named_by = self._vae_from
        # A local folder only (vae_folder fetched whatever was to be fetched), safetensors only: no pickle is read.
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32,
                                               use_safetensors=True)
        vae = vae.eval().requires_grad_(False)  # on the CPU until it decodes
        self.vae_mib = sum(p.numel() * p.element_size() for p in vae.parameters()) / 2**20
        tqdm.write(f"validation: the teacher's VAE from {named_by} on rank 0 ({self.vae_mib:.1f} MiB of float32 "
                   "weights; the teacher's transformers and text encoder stay unloaded)")
        return vae

    def _grid(self, student_latents: torch.Tensor) -> np.ndarray | None:
        if self._vae is None:
            try:
                self._vae = self._load_vae()
            except Exception as e:  # noqa: BLE001 -- no images, but the latent error is still logged
                self.decode = False
                tqdm.write(f"warning: --val-decode: cannot load the teacher's VAE ({first_line(e)}); validation "
                           "goes on without images")
                return None
        if self._teacher_frames is None:
            self._teacher_frames = self._frames(torch.cat([b[1] for b in self._load_inputs()]))
        return image_grid(self._teacher_frames, self._frames(student_latents))

    def _frames(self, latents: torch.Tensor) -> np.ndarray:
        """First frame of each latent, decoded one at a time (one frame's activations at most): [N, H, W, 3] uint8."""
        self._vae.to(self.device)
        try:
            out = [decode_latents(self._vae, latents[k:k + 1])[:, 0] for k in range(len(latents))]
        finally:
            self._vae.to("cpu")  # the training device holds it only while it decodes
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return (torch.cat(out).numpy() * 255).round().astype(np.uint8)


def _has_vae(folder: Path) -> bool:
    return (folder / "vae" / "config.json").is_file()


def vae_folder(flag: str | None, teacher: str | None, revision: str | None, manifest: dict) -> tuple[Path, str]:
    """The local folder whose vae/ --val-decode loads, and what named it: the teacher the user named (`flag`
    `teacher`: a folder, or a Hub id fetched as every named teacher is), else the teacher's folder the manifest
    records when it is on this machine, else the manifest's Hub id when the local Hub cache holds its VAE. Nothing is
    fetched for a name that only the cache gives (its teacher fields are outside its fingerprint: anyone who can
    write a cache could choose the repository); without any of these, one UserError line."""
    if teacher is not None:
        local = Path(teacher).expanduser()
        if local.exists():
            if _has_vae(local):
                return local, f"{flag} {teacher}"
        elif is_hub_id(teacher):
            return teacher_folder(teacher, revision, files=VAE_FILES, flag=flag), f"{flag} {teacher}"
    name, path, rev = manifest.teacher, manifest.teacher_path, manifest.revision
    for where in (path, name):
        if isinstance(where, str) and where and Path(where).is_absolute() and _has_vae(Path(where)):
            return Path(where), f"the cache's teacher folder {where}"
    # (a name that is a folder here is no Hub id: teacher_folder would take it as it is, relative to wherever we run)
    hub_name = name if isinstance(name, str) and is_hub_id(name) and not Path(name).expanduser().exists() else None
    if hub_name is not None:
        try:  # the local Hub cache only (`recorded_in`): what the user downloaded, never a download
            snap = teacher_folder(hub_name, rev, files=VAE_FILES, recorded_in="the cache's manifest")
            if _has_vae(snap):
                return snap, f"the local Hub cache's {hub_name}"
        except UserError:  # not cached (or a revision it lacks): refused below, naming the flags that name a teacher
            pass
    named = (f"as the Hub id {hub_name}{f' at revision {rev}' if rev else ''}, whose VAE is not in the local Hub "
             "cache" if hub_name else f"by the folder {path or name}, which holds no vae/ on this machine")
    get = (f"download its VAE yourself (`hf download {hub_name}{f' --revision {rev}' if rev else ''} --include "
           "'vae/*'`), " if hub_name else "")
    raise UserError(f"--val-decode needs the teacher's VAE, and the cache names its teacher only {named}; nothing is "
                    f"downloaded because a cache says so: {get}name the teacher with --lora-of or --init-from-teacher "
                    "(a pipeline folder or Hub id), or drop --val-decode")


def image_grid(teacher: np.ndarray, student: np.ndarray) -> np.ndarray:
    """One row per trajectory: teacher | student, separated by white gaps. [N, H, W, 3] x2 -> HxWx3 uint8."""
    n, h, w, _ = teacher.shape
    grid = np.full((n * h + (n + 1) * _GAP, 2 * w + 3 * _GAP, 3), 255, dtype=np.uint8)
    for i in range(n):
        y = _GAP + i * (h + _GAP)
        grid[y:y + h, _GAP:_GAP + w] = teacher[i]
        grid[y:y + h, 2 * _GAP + w:2 * _GAP + 2 * w] = student[i]
    return grid


def make_validator(cfg, is_main: bool, data, record: DistillRecord, device: torch.device,
                   every_rank: bool = False, teacher: tuple[str, str | None] = ("", None)) -> Validator | None:
    """Rank 0's validator when --val-every is on, None elsewhere; `every_rank` (a sharded student's forward needs
    every rank): every rank samples, rank 0 alone decodes and logs. `teacher`: `StudentKind.teacher_flag`'s."""
    if not ((is_main or every_rank) and cfg.val_every and len(data.heldout_prompts)):
        return None
    # settled before step 1: a refusal costs no training
    vae = vae_folder(*teacher, cfg.revision, data.index.manifest) if cfg.val_decode and is_main else None
    return Validator(record, data, cfg.val_max_prompts, cfg.batch_size, device, vae)
