"""`teacher-cache --images-from CACHE`: image-to-video without an image set. Each prompt of a finished
text-to-video cache gives one image, the first frame of its seed-0 trajectory's final latent decoded with that cache's
teacher's VAE (a causal Wan VAE decodes frame 0 from latent frame 0 alone), and the same prompt."""

from __future__ import annotations

import numpy as np
import torch

from cache import format as F
from cache.cache_error import CacheError
from cache.manifest import load_manifest
from cache.prompt_store import prompt_texts, read_latents
from pipeline.errors import UserError
from pipeline.hub import teacher_folder
from pipeline.sampling import decode_latents

BATCH = 8  # latents through the VAE at once


def first_frames(cache_dir: str, dry: bool = False) -> tuple[list, list[str]]:
    """(images, prompts) of the cache at `cache_dir`, in prompt_idx order; a dry run checks the cache and returns
    its prompts with no image (nothing decoded)."""
    try:
        m = load_manifest(cache_dir)
    except CacheError as e:
        raise UserError(f"--images-from: {e}") from None
    texts = prompt_texts(cache_dir, int(m.num_parts))
    prompts = [texts[i] for i in sorted(texts)]
    if dry:
        return [None] * len(prompts), prompts
    from diffusers import AutoencoderKLWan
    from PIL import Image

    folder = teacher_folder(m.teacher_path or m.teacher, m.revision, flag="--images-from",
                            recorded_in=f"{cache_dir}'s manifest")
    vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32, use_safetensors=True)
    images = []
    for lo in range(0, len(prompts), BATCH):
        (final,) = read_latents(cache_dir, int(m.num_parts), [(p, 0) for p in sorted(texts)[lo:lo + BATCH]],
                                names=(F.Z_FINAL_LATENTS,))
        frames = decode_latents(vae, final[:, :, :1])[:, 0]  # [B, H, W, 3] in [0, 1]
        images += [Image.fromarray((f.numpy() * 255).round().astype(np.uint8)) for f in frames]
    return images, prompts
