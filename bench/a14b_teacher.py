"""A Wan2.2-T2V-A14B-shaped teacher built here (no download): the embedded tiny Wan 2.2 pipeline (tokenizer, VAE,
scheduler, boundary ratio) with its text encoder and both experts replaced by ones of the real A14B widths (dim
5120, 40 heads, ffn 13824, text dim 4096, 16 latent channels, patch 1x2x2) and a few blocks each, and a one-layer
UMT5 at d_model 4096. Used where real widths matter: tests/test_real_width.py (one block, stage one on the CPU)
and bench/placements_a14b.py (placements on CUDA at 480x832).

The weights are written in bfloat16, as the real checkpoints are. They are drawn by tiling one seeded random
block, not by each module's init: drawing billions of numbers one by one would take minutes, and what the users of
this teacher check is that every width-dependent path runs and how fast, not what the teacher draws.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

A14B = dict(dim=5120, heads=40, ffn=13824, text_dim=4096, z_dim=16)
UMT5_XXL = dict(d_model=4096, d_kv=64, num_heads=64, d_ff=10240, relative_attention_num_buckets=32,
                relative_attention_max_distance=128)


def _fill(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter of a model built on the meta device real memory (bfloat16) and values: matrices
    N(0, 1/fan_in) in distribution (a tiled seeded random block), norm weights 1, biases 0."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randn(1 << 22, generator=g)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.ndim >= 2:
                flat, src = p.view(-1), torch.roll(block, -(i * 7919) % block.numel())
                for lo in range(0, flat.numel(), src.numel()):
                    flat[lo:lo + src.numel()] = src[:flat.numel() - lo]
                p.mul_(p[0].numel() ** -0.5)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


def write_a14b_teacher(out: Path, blocks: int = 1, seed: int = 0) -> Path:
    """Write the teacher to `out` (a diffusers folder); `blocks` transformer blocks per expert. The same arguments
    write the same bytes, and a folder already written with them is kept."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from pipeline.tiny_teacher import write_tiny_teacher

    out = Path(out)
    stamp = out / "a14b-teacher.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"blocks": blocks, "seed": seed}:
        return out
    write_tiny_teacher(out, "wan2.2", seed)
    vocab = json.loads((out / "text_encoder" / "config.json").read_text())["vocab_size"]
    parts = {"text_encoder": lambda: UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, num_layers=1, feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0,
        eos_token_id=1, **UMT5_XXL))}
    for comp in ("transformer", "transformer_2"):
        parts[comp] = lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=A14B["heads"], attention_head_dim=A14B["dim"] // A14B["heads"],
            in_channels=A14B["z_dim"], out_channels=A14B["z_dim"], text_dim=A14B["text_dim"], freq_dim=256,
            ffn_dim=A14B["ffn"], num_layers=blocks, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=1024)
    for i, (comp, build) in enumerate(parts.items()):  # one at a time: each is written, then freed
        with torch.device("meta"):
            model = build()
        model = _fill(model, seed + 10 + i)
        for f in (out / comp).iterdir():
            f.unlink()
        model.save_pretrained(out / comp, safe_serialization=True)
        del model
    stamp.write_text(json.dumps({"blocks": blocks, "seed": seed}))
    return out
