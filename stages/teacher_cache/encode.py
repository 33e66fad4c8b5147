"""Prompt encoding with the teacher's own `WanPipeline.encode_prompt`, once per prompt."""

from __future__ import annotations

import torch

from pipeline.progress_bar import progress_bar


def iter_encoded(tokenizer, text_encoder, prompts: list[str], max_len: int, dtype: torch.dtype,
                 device: torch.device, batch_size: int = 16, progress: bool = True):
    """(index of the batch's first prompt, embeddings [b, L, D] in `dtype` zero past each prompt's real length,
    the lengths [b]) per batch, on the CPU, so memory does not grow with the prompt count. The pipeline's own
    encode_prompt and tokenizer call: tokenisation, cleaning and padding are exactly the teacher's."""
    from diffusers import WanPipeline
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, scheduler=None)
    bar = progress_bar(total=len(prompts), desc="encode prompts", unit="prompt", disable=not progress)
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            with torch.inference_mode():
                e, _ = pipe.encode_prompt(chunk, do_classifier_free_guidance=False, max_sequence_length=max_len,
                                          device=device, dtype=dtype)
            mask = tokenizer([prompt_clean(u) for u in chunk], padding="max_length", max_length=max_len,
                             truncation=True, add_special_tokens=True, return_attention_mask=True,
                             return_tensors="pt").attention_mask
            yield i, e.to(dtype).cpu(), mask.gt(0).sum(dim=1).to(torch.int32)
            bar.update(len(chunk))
    finally:
        bar.close()


def encode_prompts(tokenizer, text_encoder, prompts: list[str], max_len: int, dtype: torch.dtype,
                   device: torch.device, batch_size: int = 16, progress: bool = True):
    """Embeddings [n, L, D] and lengths [n] of a few prompts at once (`iter_encoded`, gathered)."""
    parts = list(iter_encoded(tokenizer, text_encoder, prompts, max_len, dtype, device, batch_size, progress))
    return torch.cat([e for _, e, _ in parts]), torch.cat([n for _, _, n in parts])
