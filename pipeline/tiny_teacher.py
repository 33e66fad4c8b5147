"""The embedded default teacher: a tiny, deterministic Wan pipeline in diffusers format, with every component of
the real Wan 2.x checkpoints, only small (docs/tiny-teacher.md). Nothing is downloaded."""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

VARIANTS = ("wan2.2", "wan2.1", "ti2v")  # WanPipeline folders (text-to-video)
I2V_VARIANTS = ("i2v", "ti2v-i2v")  # WanImageToVideoPipeline folders (image-to-video)
# Tiny Wan 2.2 teachers whose weights are trained and committed, not built: `write_tiny_teacher(out, variant)` copies
# them. PRETRAINED draws the shapes of pipeline/shapes.py (scripts/train_tiny_teacher.py, docs/tiny-teacher.md);
# VIDEO_PRETRAINED 9-frame clips of a shape moving (pipeline/clips.py; scripts/train_tiny_video_teacher.py,
# docs/tiny-video-teacher.md); I2V_PRETRAINED those clips from their first frame (a WanImageToVideoPipeline;
# scripts/train_tiny_i2v_teacher.py). RETRAIN: how each one is made again.
PRETRAINED, VIDEO_PRETRAINED, I2V_PRETRAINED = "pretrained", "video-pretrained", "i2v-pretrained"
PRETRAINED_DIR = Path(__file__).resolve().parents[1] / "data" / "tiny-teacher-pretrained"
VIDEO_PRETRAINED_DIR = PRETRAINED_DIR.with_name("tiny-video-teacher-pretrained")
I2V_PRETRAINED_DIR = PRETRAINED_DIR.with_name("tiny-i2v-teacher-pretrained")
RETRAIN = {PRETRAINED: "make tiny-teacher-train", VIDEO_PRETRAINED: "python scripts/train_tiny_video_teacher.py",
           I2V_PRETRAINED: "python scripts/train_tiny_i2v_teacher.py --out data/tiny-i2v-teacher-pretrained "
                           "--eval-every 500 --eval-captions 32"}

# Words that get a whole-word piece in the tiny tokenizer; anything else falls back to characters.
_WORDS = """
a an the of in on at with and or to from by under over above below behind near beside between inside outside through
across along around into onto during while its their his her red orange yellow green blue purple pink brown black white
grey gray gold silver teal cyan magenta violet crimson amber beige turquoise navy pastel neon dark light bright pale
golden small large big tiny huge tall short long round square triangle circle star heart hexagon top bottom left right
center middle corner upper lower background foreground scene view cat dog bird fish horse fox owl bear wolf deer rabbit
lion tiger elephant whale dolphin frog turtle butterfly bee dragon robot astronaut knight wizard child woman man girl
boy people crowd chef painter dancer musician sailor farmer city street road bridge river lake sea ocean beach island
mountain mountains hill valley forest tree trees flower flowers garden field desert snow rain fog storm cloud clouds sky
sun moon stars night morning evening dawn dusk sunset sunrise winter spring summer autumn fall house castle tower temple
church market cafe kitchen room library window door table chair lamp book cup bowl plate bread cake fruit apple orange
lemon coffee tea soup pizza car train boat ship bicycle plane airplane balloon rocket spaceship planet galaxy nebula
lighthouse village harbor harbour station tunnel painting photo photograph watercolor watercolour oil sketch pencil
drawing illustration render pixel art style detailed cinematic lighting portrait landscape macro closeup wide angle shot
abstract pattern texture geometric minimalist vintage futuristic ancient modern old new glowing shining floating flying
running sitting standing walking sleeping reading playing covered made full empty wet dry warm cold soft hard glass
wooden stone metal paper
""".split()


@dataclass(frozen=True)
class TinySpec:
    """Sizes of one tiny variant: small enough for CPU tests, shaped like the real models."""

    two_experts: bool
    expand_timesteps: bool
    z_dim: int
    vae_spatial: int
    flow_shift: float
    boundary_ratio: float | None
    image: bool = False  # a WanImageToVideoPipeline: without expand_timesteps, mask + image latent on the channels


SPECS = {
    "wan2.2": TinySpec(True, False, 16, 8, 3.0, 0.875),  # Wan2.2-T2V-A14B: two experts, switch at boundary_ratio * 1000
    "wan2.1": TinySpec(False, False, 16, 8, 3.0, None),  # Wan2.1-T2V: one transformer
    "ti2v": TinySpec(False, True, 48, 16, 5.0, None),  # Wan2.2-TI2V-5B: per-token timesteps, 48-channel VAE, 16x
    # Wan2.2-I2V-A14B: two experts taking 16 noisy + 4 mask + 16 image-latent channels; no CLIP image encoder
    "i2v": TinySpec(True, False, 16, 8, 5.0, 0.9, image=True),
    "ti2v-i2v": TinySpec(False, True, 48, 16, 5.0, None, image=True),  # TI2V-5B's image mode: ti2v's weights
}

TEXT_DIM = 32


def build_tokenizer(extra_words=()):
    """A T5 (Unigram) tokenizer over whole words plus single-character fallbacks; `extra_words` get whole-word
    pieces after all of these, so every other piece keeps its id."""
    from transformers import T5TokenizerFast

    chars = [c for c in string.printable if c not in string.whitespace]
    pieces: dict[str, float] = {}
    for w in _WORDS:
        pieces.setdefault("\u2581" + w, -5.0)
    pieces.setdefault("\u2581", -8.0)
    for c in chars:
        pieces.setdefault("\u2581" + c, -9.0)
        pieces.setdefault(c, -10.0)
    for w in extra_words:
        pieces.setdefault("\u2581" + w, -5.0)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + list(pieces.items())
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


def _text_encoder(vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1))


def _vae(spec: TinySpec):
    from diffusers import AutoencoderKLWan

    if spec.z_dim == 16:
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True])
    # TI2V: residual VAE on 2x2-patchified pixels (12 channels), 16x spatial compression, 48 latent channels.
    gen = torch.Generator().manual_seed(0)
    mean = [round(float(v), 4) for v in torch.randn(spec.z_dim, generator=gen) * 0.5]
    std = [round(float(v), 4) for v in torch.rand(spec.z_dim, generator=gen) + 0.75]
    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=spec.z_dim, dim_mult=[1, 1, 1, 1],
                            num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                            in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                            latents_mean=mean, latents_std=std)


def _transformer(spec: TinySpec):
    from diffusers import WanTransformer3DModel

    # Wan2.x-I2V's input: the noisy latent, then the mask's 4 channels (the VAE's temporal factor) and the image latent
    extra = 4 + spec.z_dim if spec.image and not spec.expand_timesteps else 0
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=spec.z_dim + extra,
        out_channels=spec.z_dim, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def build_tiny_pipeline(variant: str = "wan2.2", seed: int = 0):
    """Build the tiny `WanPipeline` (an I2V_VARIANTS one: `WanImageToVideoPipeline`, no image encoder, as Wan2.2
    ships) of `variant` with weights drawn from `seed` (CPU, float32)."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    if variant not in SPECS:
        raise ValueError(f"unknown tiny-teacher variant {variant!r}; choose one of "
                         f"{', '.join(VARIANTS + I2V_VARIANTS)}")
    spec = SPECS[variant]
    def seeded(k: int, make):  # each component draws from its own seeded stream: adding one changes no other
        torch.manual_seed(seed + k)
        return make()

    tokenizer = seeded(0, build_tokenizer)
    text_encoder = seeded(1, lambda: _text_encoder(len(tokenizer))).eval()
    vae = seeded(2, lambda: _vae(spec)).eval()
    transformer = seeded(3, lambda: _transformer(spec)).eval()
    transformer_2 = seeded(4, lambda: _transformer(spec)).eval() if spec.two_experts else None
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=spec.flow_shift)
    return (WanImageToVideoPipeline if spec.image else WanPipeline)(  # (I2V: image_encoder, image_processor None)
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer,
        transformer_2=transformer_2, boundary_ratio=spec.boundary_ratio, expand_timesteps=spec.expand_timesteps)


def write_tiny_teacher(out: str | Path, variant: str = "wan2.2", seed: int = 0) -> Path:
    """Write the tiny pipeline to `out` in diffusers format and return the folder (a RETRAIN variant: a copy of
    data/'s). `out` must be new, empty or this command's own earlier output (rebuilt whole: `make` reruns it); the
    folder is built beside it and swapped in (cache/safe_write.py)."""
    from cache import safe_write

    from .teacher_files import copy_tree

    out = Path(out)
    committed = {PRETRAINED: PRETRAINED_DIR, VIDEO_PRETRAINED: VIDEO_PRETRAINED_DIR,
                 I2V_PRETRAINED: I2V_PRETRAINED_DIR}.get(variant)
    if committed is not None and not (committed / "model_index.json").is_file():
        raise UserError(f"the {variant} tiny teacher is missing from {committed}; restore it with "
                        f"`git checkout -- data/` or retrain it with `{RETRAIN[variant]}`")
    safe_write.claim_folder(out, "tiny-teacher", replace=True)
    pipe = build_tiny_pipeline(variant, seed) if committed is None else None
    with safe_write.building(out, "tiny-teacher") as tmp:
        if pipe is None:
            copy_tree(committed, tmp, f"restore {committed} with `git checkout -- data/`")
        else:
            pipe.save_pretrained(tmp, safe_serialization=True)  # (0600 weights: published with the umask's modes)
    return out
