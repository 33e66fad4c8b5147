"""Train a tiny Wan 2.2 teacher to draw procedural shapes (pipeline/shapes.py), on CPU: the recipe of the
pretrained teacher committed under data/tiny-teacher-pretrained (`wandistiller tiny-teacher --variant pretrained`).

Recipe (deterministic for a given --seed and thread count):
  1. VAE: a small residual AutoencoderKLWan (Wan 2.2's design: 2x2-patchified pixels, z_dim 16, 16x spatial:
     64x64 images, 4x4 latents) on shapes, reconstruction (MSE, the shapes' pixels weighted up: their colours
     must survive) plus a small KL; then latents_mean / latents_std in its config are set from the posterior
     means of a pool.
  2. Experts: WanTransformer3DModel (one token per image) trained by flow matching on normalized latents of that
     pool, x_t = (1 - s) x0 + s noise, target = noise - x0, s = shift(u): first one transformer on every noise
     level, then two copies of it specialise, the high-noise expert (`transformer`) on timesteps
     >= boundary_ratio * 1000 and the low-noise one (`transformer_2`) below. The UMT5 text encoder (the tiny
     teacher's, random, its relative-position bias scaled up so that its attention is local: TEXT_BIAS_SCALE)
     stays frozen; 10% of captions are dropped to "" or the negative prompt so CFG has an unconditional branch.
  3. The experts and the VAE are saved in float16, and the saved pipeline is scored: WanPipeline samples the
     held-out captions (8 steps, guidance 2 / 2, 64x64; caption i from the noise `eval --attributes` uses) and
     the attribute checker (stages/sample/attributes.py) reads them; the report is OUT/TRAINING.json.

Example: make tiny-teacher-train   (or: .venv/bin/python scripts/train_tiny_teacher.py --out runs/t)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import shapes  # noqa: E402
from pipeline.model_call import Inputs, predict  # noqa: E402
from pipeline.prompts import read_prompt_file  # noqa: E402
from pipeline.tiny_teacher import build_tiny_pipeline  # noqa: E402

NEGATIVE_PROMPT = "blurry, low quality, distorted"
# Text tokens the experts see (WanPipeline's max_sequence_length; a teacher-cache of this teacher must match):
# the captions are under 32 tokens, and Wan's cross-attention has no mask, so every zero-padded position is
# attended and costs as much as a word.
MAX_SEQ = 32
# Sampling of the trained teacher. Guidance 2 / 2 was chosen on 256 *training* captions (shape colours right:
# 73% at guidance 1, 79% at 2 / 2 and at 3 / 2, 65% at 4 / 3); stronger guidance oversaturates one token.
EVAL = dict(num_inference_steps=8, guidance_scale=2.0, guidance_scale_2=2.0, height=64, width=64, num_frames=1,
            negative_prompt=NEGATIVE_PROMPT, max_sequence_length=MAX_SEQ)
# The VAE: Wan 2.2's residual design (as in TI2V-5B: pixels 2x2-patchified to 12 channels, average-pool
# shortcuts around each downsampling), 16x spatial compression: 64x64 images, 4x4x16 latents. It trains three
# times faster per step than last recipe's plain 4x VAE (16x16 latents) and reaches a 95% attribute score on
# held-out reconstructions; a plain (non-residual) 16x VAE did not learn in 600 steps.
VAE = dict(base_dim=16, decoder_base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
           temperal_downsample=[False, False, False], is_residual=True, in_channels=12, out_channels=12,
           patch_size=2, scale_factor_spatial=16)  # WanPipeline reads its latent grid size from scale_factor_spatial
# The experts: one token per image (patch 4x4 over the 4x4 latent). Wan's transformer has no absolute position
# signal (RoPE is relative, the patch embedding has no padding), so with many tokens it cannot tell where "top
# left" is and must pick a place from the noise; the shapes came out missing or misplaced (at 8x8 tokens: 48%
# shape colour and 8% position after 4000 steps). One token's patch embedding sees the whole latent, so
# position is free. Wan also has no skip from input to output: each token's velocity is proj_out(hidden), so
# the width must exceed the token's output size (4 * 4 * 16 = 256) for the noise to pass through; 8x8 tokens at
# patch 4 and width 64 kept the noise as coloured texture.
# Width 288 (6 heads x 48): 4.9M parameters, 9.8 MB per expert in float16, the dtype the weights are saved in
# (data/ holds at most 25 MB).
EXPERT = dict(patch_size=(1, 4, 4), num_attention_heads=6, attention_head_dim=48, in_channels=16, out_channels=16,
              text_dim=32, freq_dim=32, ffn_dim=576, num_layers=4, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


# The frozen text encoder: the tiny teacher's random UMT5, with its relative-position bias drawn larger. At T5's
# initial scale (std 0.18 over logits of similar size) every head attends almost evenly over the caption, so each
# word's embedding is the word plus the caption's mean, and which colour goes with which corner is all but lost: a
# probe reading the four corners' colours of two-shape captions from the embeddings (per-token MLP, one query,
# cross-attention, as the experts read text: scripts/probe_text_binding.py) scores 68% after 500 steps. Scaled 16x
# (std 2.9) each head looks at a few fixed offsets, as a trained T5's heads mostly do, and a colour word's embedding
# carries its phrase's corner: the probe scores 98%. The weights stay random (only scaled) and are never trained.
TEXT_BIAS_SCALE = 16.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@torch.no_grad()
def scale_text_position_bias(text_encoder, scale: float) -> None:
    """Multiply every layer's relative-position bias of the (UMT5) `text_encoder` by `scale`, in place."""
    for block in text_encoder.encoder.block:
        block.layer[0].SelfAttention.relative_attention_bias.weight.mul_(scale)


def to_pixels(u8: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, 1, H, W] in [-1, 1] (the Wan VAE's input)."""
    return torch.from_numpy(u8).float().div(127.5).sub(1).permute(0, 3, 1, 2)[:, :, None]


def cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1))))


def train_vae(seed: int, steps: int, batch: int, lr: float, kl_weight: float, fg_weight: float, eval_fn=None,
              eval_every: int = 0):
    """Train the VAE on examples 0, 1, ... of the train stream. Pixels of the shapes weigh `fg_weight` times
    the background's in the reconstruction loss: they are a small part of the image, and their colours are
    what the teacher must get right. The decoder reads the posterior mean, not a sample: with a unit-variance
    sample at the start, nearby colours (blue and purple) share one latent for hundreds of steps; the small
    KL term still keeps the means' scale in check (the latents are normalised afterwards anyway)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(**VAE).train()
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, 20)
        u8, _, scenes = shapes.batch(seed, step * batch, batch, "train")
        x = to_pixels(u8)
        bg = torch.tensor([shapes.COLOURS[s.background] for s in scenes], dtype=torch.uint8)
        fg = (torch.from_numpy(u8) != bg[:, None, None]).any(-1)[:, None, None].float()  # [B, 1, 1, H, W]
        w = 1 + (fg_weight - 1) * fg
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.mode()).sample
        mse = ((rec - x).pow(2) * w).mean() / w.mean()
        kl = 0.5 * (post.mean.pow(2) + post.var - 1 - post.logvar).mean()
        loss = mse + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} mse {mse.item():.5f} kl {kl.item():.3f} ({time.time() - t0:.0f}s)")
        if eval_fn is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            log(f"vae reconstruction score at step {step + 1}: {eval_fn(vae.eval())}")
            vae.train()
    return vae.eval(), time.time() - t0


@torch.no_grad()
def reconstruction_score(vae, seed: int, n: int = 256) -> dict:
    """Attribute score of the VAE's reconstructions of the first n held-out images (the ceiling for the teacher)."""
    from stages.sample.attributes import score

    u8, caps, _ = shapes.batch(seed, 0, n, "heldout")
    rec = vae.decode(vae.encode(to_pixels(u8)).latent_dist.mode()).sample
    rec_u8 = ((rec[:, :, 0].permute(0, 2, 3, 1) + 1) * 127.5).round().clamp(0, 255).byte().numpy()
    return score(list(rec_u8), caps)


@torch.no_grad()
def encode_pool(vae, pipe, seed: int, n: int, chunk: int = 256, batch=shapes.batch, pixels=to_pixels):
    """Posterior means [n, 16, T, 4, 4] and caption embeddings [n, MAX_SEQ, 32] of the first n training examples of
    `batch` (shapes' images, T = 1; the video script passes clips.batch and its clip `pixels`)."""
    lats, embs = [], []
    for start in range(0, n, chunk):
        u8, caps, _ = batch(seed, start, min(chunk, n - start), "train")
        lats.append(vae.encode(pixels(u8)).latent_dist.mode())
        embs.append(text_embeds(pipe, caps))
    return torch.cat(lats), torch.cat(embs)


@torch.no_grad()
def text_embeds(pipe, captions: list[str]) -> torch.Tensor:
    """[B, MAX_SEQ, 32] UMT5 embeddings, zero past each caption's tokens (as WanPipeline makes them)."""
    e = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=2 * MAX_SEQ,
                           device=torch.device("cpu"))[0]
    if e[:, MAX_SEQ:].abs().max() > 0:  # encoded with room to spare, so truncation shows
        raise ValueError(f"a caption is longer than {MAX_SEQ} tokens")
    return e[:, :MAX_SEQ].clone()


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * u / (1 + (shift - 1) * u)


class FlowMatching:
    """One denoiser trained by flow matching on the pool: x_t = (1 - s) x0 + s noise, target noise - x0, with
    s = shift(u), u uniform on [lo, hi) (the expert's share of the noise levels), AdamW + cosine + EMA."""

    def __init__(self, model, lr: float, steps: int, warmup: int, ema_decay: float, lo: float, hi: float, ema=None):
        self.model, self.lr, self.steps, self.warmup, self.ema_decay = model.train(), lr, steps, warmup, ema_decay
        self.lo, self.hi = lo, hi
        self.ema = ema if ema is not None else copy.deepcopy(model).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        self.step_no, self.losses = 0, []

    def step(self, ctx: dict) -> None:
        lat, emb, uncond, gen, batch, shift, p_uncond = (ctx[k] for k in (
            "lat", "emb", "uncond", "gen", "batch", "shift", "p_uncond"))
        self.schedule()
        idx = torch.randint(0, lat.shape[0], (batch,), generator=gen)
        x0, e = lat[idx], emb[idx].clone()
        drop = torch.rand(batch, generator=gen) < p_uncond
        which = torch.randint(0, 2, (batch,), generator=gen)
        e[drop] = uncond[which[drop]]
        u = self.lo + (self.hi - self.lo) * torch.rand(batch, generator=gen)
        sigma = shifted_sigma(u, shift)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = predict(self.model, Inputs(xt, sigma * 1000, e)).guided
        self.update((pred - (noise - x0)).pow(2).mean())

    def schedule(self) -> None:
        """This step's learning rate: linear warm-up, then cosine."""
        for g in self.opt.param_groups:
            g["lr"] = cosine_lr(self.step_no, self.steps, self.lr, self.warmup)

    def update(self, loss: torch.Tensor) -> None:
        """One optimizer step on `loss` (gradients clipped to norm 1), then the EMA's, and the step counted."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        decay = min(self.ema_decay, (1 + self.step_no) / (10 + self.step_no))
        with torch.no_grad():
            for pe, pm in zip(self.ema.parameters(), self.model.parameters()):
                pe.lerp_(pm, 1 - decay)
        self.losses.append(loss.item())
        self.step_no += 1


def train_experts(pipe, lat: torch.Tensor, emb: torch.Tensor, args, eval_fn=None):
    """Phase A: one transformer on every noise level (`--shared-steps`). Phase B: two copies of it (weights and
    EMA) specialise as Wan 2.2's experts (`--expert-steps` each): `transformer` on t >= boundary_ratio * 1000,
    `transformer_2` below. Returns the two EMA models and the seconds spent."""
    from diffusers import WanTransformer3DModel

    shift = float(pipe.scheduler.config.flow_shift)  # the expert boundary is where the sampler's sigmas cross it
    boundary = float(pipe.config.boundary_ratio)
    # u at which the shifted sigma crosses the boundary: high-noise expert draws u above it, low-noise below.
    u_b = boundary / (shift - (shift - 1) * boundary)
    ctx = dict(lat=lat, emb=emb, uncond=text_embeds(pipe, ["", NEGATIVE_PROMPT]),
               gen=torch.Generator().manual_seed(args.seed + 100), batch=args.expert_batch,
               shift=shift if args.train_shift is None else args.train_shift,
               p_uncond=args.p_uncond)
    t0 = time.time()
    torch.manual_seed(args.seed + 3)
    shared = FlowMatching(WanTransformer3DModel(**EXPERT), args.expert_lr, args.shared_steps, 200, args.ema, 0.0, 1.0)
    for step in range(args.shared_steps):
        shared.step(ctx)
        if step % 100 == 0 or step == args.shared_steps - 1:
            log(f"shared step {step}/{args.shared_steps} loss {np.mean(shared.losses[-100:]):.4f} "
                f"({time.time() - t0:.0f}s)")
        if eval_fn is not None and args.eval_every and step and step % args.eval_every == 0:
            log(f"eval at shared step {step}: {eval_fn({'transformer': shared.ema, 'transformer_2': shared.ema})}")
    experts = {
        name: FlowMatching(copy.deepcopy(shared.model), args.expert_lr * args.expert_lr_scale, args.expert_steps, 50,
                           args.ema, lo, hi, ema=copy.deepcopy(shared.ema))
        for name, (lo, hi) in (("transformer", (u_b, 1.0)), ("transformer_2", (0.0, u_b)))}
    del shared
    for step in range(args.expert_steps):
        for fm in experts.values():
            fm.step(ctx)
        if step % 100 == 0 or step == args.expert_steps - 1:
            log(f"experts step {step}/{args.expert_steps} loss high "
                f"{np.mean(experts['transformer'].losses[-100:]):.4f} low "
                f"{np.mean(experts['transformer_2'].losses[-100:]):.4f} ({time.time() - t0:.0f}s)")
        if eval_fn is not None and args.eval_every and step and step % args.eval_every == 0:
            log(f"eval at expert step {step}: {eval_fn({n: fm.ema for n, fm in experts.items()})}")
    return {n: fm.ema for n, fm in experts.items()}, time.time() - t0


def assemble(pipe, vae, experts):
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=vae, scheduler=pipe.scheduler,
                       transformer=experts["transformer"], transformer_2=experts["transformer_2"],
                       boundary_ratio=pipe.config.boundary_ratio)


@torch.no_grad()
def generate(pipe, captions: list[str], seed: int, **overrides) -> list[np.ndarray]:
    """uint8 [64, 64, 3] images of `captions` at EVAL (+ overrides), each from the noise `eval --attributes` uses."""
    from stages.sample.attributes import draw

    return draw(pipe, captions, seed, **{**EVAL, **overrides})


def evaluate(pipe, captions: list[str], seed: int = 0, **overrides) -> dict:
    from stages.sample.attributes import score

    return score(generate(pipe, captions, seed, **overrides), captions)


def score_saved(out: Path, held: list[str], seed: int) -> dict:
    """Held-out score of the pipeline saved in `out`, loaded in float32 as every stage of WanDistiller loads it."""
    from diffusers import WanPipeline

    return evaluate(WanPipeline.from_pretrained(out, torch_dtype=torch.float32), held, seed)


def rescore(out: Path, held: list[str], seed: int) -> None:
    """Score a saved teacher on `held` with the current EVAL settings; rewrite those fields of TRAINING.json."""
    path = out / "TRAINING.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    heldout = score_saved(out, held, seed)
    report.update(eval_settings=EVAL, heldout_captions=len(held), heldout_score=heldout)
    path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out score {heldout} ({EVAL}); updated {path}")



def _portable(value):
    """A recipe value as the record keeps it: a path inside the project relative to it, so no machine's folder is
    written into a file the repository ships."""
    if isinstance(value, str) and value.startswith(str(ROOT) + os.sep):
        return os.path.relpath(value, ROOT)
    return value

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Pipeline folder to write (diffusers format).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vae-steps", type=int, default=1200)
    ap.add_argument("--vae-batch", type=int, default=16)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-4)
    ap.add_argument("--fg-weight", type=float, default=5.0, help="Weight of the shapes' pixels in the VAE loss.")
    ap.add_argument("--vae-from", help="Skip stage 1: load this trained VAE folder (with latents_mean/std set).")
    ap.add_argument("--pool", type=int, default=30000, help="Training examples encoded once for the experts.")
    ap.add_argument("--shared-steps", type=int, default=3000, help="One transformer on all noise levels first.")
    ap.add_argument("--expert-steps", type=int, default=1000, help="Then each expert on its own noise levels.")
    ap.add_argument("--expert-lr-scale", type=float, default=0.5, help="Peak LR of phase B / --expert-lr.")
    ap.add_argument("--expert-batch", type=int, default=128)
    ap.add_argument("--train-shift", type=float, help="Shift of the training noise levels (1: uniform).  "
                    "[default: the scheduler's flow_shift]")
    ap.add_argument("--expert-lr", type=float, default=2e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--text-encoder-seed", type=int, default=0,
                    help="Seed of the tiny teacher whose random UMT5 (and tokenizer) the recipe keeps frozen.")
    ap.add_argument("--text-bias-scale", type=float, default=TEXT_BIAS_SCALE,
                    help="Scale of the frozen UMT5's relative-position bias (1: as drawn; see TEXT_BIAS_SCALE).")
    ap.add_argument("--p-uncond", type=float, default=0.1)
    ap.add_argument("--heldout", default=str(ROOT / "data" / "shapes-heldout.txt"),
                    help="Held-out captions scored at the end (and their first 48 during training).")
    ap.add_argument("--eval-every", type=int, default=500, help="Steps between held-out scores (VAE: half).")
    ap.add_argument("--score-only", action="store_true",
                    help="Train nothing: score the pipeline in --out as saved and update its TRAINING.json.")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    held = read_prompt_file(args.heldout)  # checked before any training, and used by --score-only as well
    if any(not shapes.is_heldout(c) for c in held):
        sys.exit(f"--heldout {args.heldout}: some captions are in the training split; use held-out captions")
    if args.score_only:
        return rescore(out, held, args.seed)
    t_start = time.time()
    # tokenizer, frozen text encoder, scheduler: given parts of the model, as a pretrained UMT5 would be; --seed
    # varies what the recipe trains (VAE, experts, data order, noise), not them
    base = build_tiny_pipeline("wan2.2", args.text_encoder_seed)
    base.text_encoder.requires_grad_(False)
    scale_text_position_bias(base.text_encoder, args.text_bias_scale)

    from diffusers import AutoencoderKLWan
    if args.vae_from:
        vae, vae_s = AutoencoderKLWan.from_pretrained(args.vae_from).eval(), 0.0
        vae.register_to_config(scale_factor_spatial=VAE["scale_factor_spatial"])
    else:
        vae, vae_s = train_vae(args.seed, args.vae_steps, args.vae_batch, args.vae_lr, args.kl_weight,
                               args.fg_weight, lambda v: reconstruction_score(v, args.seed, 128), args.eval_every // 2)
    vae_score = reconstruction_score(vae, args.seed)
    log(f"VAE reconstruction of held-out images, attribute score {vae_score}")

    t = time.time()
    lat, emb = encode_pool(vae, base, args.seed, args.pool)
    mean = lat.mean(dim=(0, 2, 3, 4))
    std = lat.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    lat = (lat - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    pool_s = time.time() - t
    log(f"encoded a pool of {args.pool} in {pool_s:.0f}s; latent mean {mean.abs().mean():.3f} std {std.mean():.3f}")
    if not args.vae_from:
        vae.save_pretrained(out.parent / (out.name + "-vae"), safe_serialization=True)

    def eval_fn(experts):
        return evaluate(assemble(base, vae, experts), held[:48], args.seed)

    experts, exp_s = train_experts(base, lat, emb, args, eval_fn)
    # Saved in float16 (half the bytes; the text encoder stays float32) and scored as saved.
    for m in (*experts.values(), vae):
        m.to(torch.float16)
    assemble(base, vae, experts).save_pretrained(out, safe_serialization=True)
    t = time.time()
    heldout = score_saved(out, held, args.seed)
    report = {
        "recipe": {k: _portable(v) for k, v in vars(args).items() if k not in ("out",)}, "expert_config": EXPERT,
        "eval_settings": EVAL, "heldout_captions": len(held), "heldout_score": heldout,
        "vae_reconstruction_score": vae_score,
        "wall_s": {"vae": round(vae_s, 1), "pool": round(pool_s, 1), "experts": round(exp_s, 1),
                   "eval": round(time.time() - t, 1), "total": round(time.time() - t_start, 1)},
        "torch": torch.__version__, "threads": args.threads,
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out score {heldout}; wrote {out}")


if __name__ == "__main__":
    main()
