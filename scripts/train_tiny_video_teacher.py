"""Train a tiny Wan 2.2 *video* teacher on moving shapes (pipeline/clips.py), on CPU: the image teacher's recipe
(scripts/train_tiny_teacher.py, whose functions it imports) on 9-frame clips. Draft: docs/tiny-video-teacher.md.

Recipe (deterministic for a given --seed and thread count):
  1. VAE: the image teacher's residual AutoencoderKLWan (2x2-patchified pixels, z_dim 16, 16x spatial) with Wan's
     temporal layers on (temperal_downsample [False, True, True]: 4x in time, 1 + 4k frames), so a 9-frame 64x64
     clip is 16 x 3 x 4 x 4 latents. Trained on clips (weighted MSE, small KL), optionally warm-started from an image
     VAE's spatial weights (--vae-init; the temporal convolutions start random); latents_mean / std set from a pool.
  2. Experts: the image teacher's WanTransformer3DModel (patch 1x4x4: one token per latent frame, 3 tokens a clip,
     told apart by Wan's temporal RoPE), trained by flow matching on the pool as the image teacher's (shared, then
     two experts at boundary_ratio), over the tiny teacher's frozen UMT5 with its position bias scaled, its tokenizer
     given whole-word pieces for the clips' words the image vocabulary lacks (EXTRA_WORDS).
  3. Saved (experts and VAE in float16) and scored: WanPipeline samples held-out captions (EVAL), the motion checker
     (stages/sample/motion.py) reads them; the report is OUT/TRAINING.json.

Time on 2 cores (extrapolated from timed steps, docs/tiny-video-teacher.md): VAE ~12 min, pool ~8 min, experts
~38 min, scoring ~2 min.

Example: .venv/bin/python scripts/train_tiny_video_teacher.py --out runs/tiny-video-teacher
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import scripts.train_tiny_teacher as tt  # noqa: E402
from pipeline import clips  # noqa: E402
from pipeline.prompts import read_prompt_file  # noqa: E402
from pipeline.tiny_teacher import _WORDS, _text_encoder, build_tiny_pipeline, build_tokenizer  # noqa: E402

EXTRA_WORDS = tuple(sorted(({w for d in clips.DIRECTIONS for w in d.split()} | {"moving", *clips.SPEEDS})
                           - {""} - set(_WORDS)))  # ("moving", "quickly", "slowly")
VAE = {**tt.VAE, "temperal_downsample": [False, True, True]}
EVAL = {**tt.EVAL, "num_frames": clips.FRAMES}


def to_pixels(u8: np.ndarray) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] -> float [B, 3, F, H, W] in [-1, 1]."""
    return torch.from_numpy(u8).float().div(127.5).sub(1).permute(0, 4, 1, 2, 3)


def to_u8(x: torch.Tensor) -> np.ndarray:
    """float [B, 3, F, H, W] in [-1, 1] -> uint8 [B, F, H, W, 3]."""
    return ((x.permute(0, 2, 3, 4, 1) + 1) * 127.5).round().clamp(0, 255).byte().numpy()


def build_base(text_encoder_seed: int, bias_scale: float):
    """The tiny wan2.2 pipeline of `text_encoder_seed` with the clips' tokenizer and its random UMT5 (drawn as
    build_tiny_pipeline draws it, for the larger vocabulary), relative-position bias scaled, frozen."""
    from diffusers import WanPipeline

    base = build_tiny_pipeline("wan2.2", text_encoder_seed)
    tokenizer = build_tokenizer(EXTRA_WORDS)
    torch.manual_seed(text_encoder_seed + 1)
    text_encoder = _text_encoder(len(tokenizer)).eval().requires_grad_(False)
    tt.scale_text_position_bias(text_encoder, bias_scale)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=base.vae, scheduler=base.scheduler,
                       transformer=base.transformer, transformer_2=base.transformer_2,
                       boundary_ratio=base.config.boundary_ratio)


def new_vae(seed: int, init: str | None):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(**VAE)
    if init:  # an image VAE of the same widths: every weight but the temporal convolutions'
        src = AutoencoderKLWan.from_pretrained(init, torch_dtype=torch.float32).state_dict()
        own = vae.state_dict()
        same = {k: v for k, v in src.items() if k in own and own[k].shape == v.shape}
        vae.load_state_dict(same, strict=False)
        tt.log(f"VAE warm start from {init}: {len(same)} of {len(own)} tensors")
    return vae


def train_vae(vae, seed: int, steps: int, batch: int, lr: float, kl_weight: float, fg_weight: float, eval_fn=None,
              eval_every: int = 0):
    """tt.train_vae on clips: the shape's pixels weigh `fg_weight` times the background's, the decoder reads the
    posterior mean (why: tt.train_vae)."""
    vae.train()
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = tt.cosine_lr(step, steps, lr, 20)
        u8, _, cs = clips.batch(seed, step * batch, batch, "train")
        x = to_pixels(u8)
        bg = torch.tensor([clips.COLOURS[c.background] for c in cs], dtype=torch.uint8)
        fg = (torch.from_numpy(u8) != bg[:, None, None, None]).any(-1)[:, None].float()  # [B, 1, F, H, W]
        w = 1 + (fg_weight - 1) * fg
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.mode()).sample
        mse = ((rec - x).pow(2) * w).mean() / w.mean()
        kl = 0.5 * (post.mean.pow(2) + post.var - 1 - post.logvar).mean()
        opt.zero_grad(set_to_none=True)
        (mse + kl_weight * kl).backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            tt.log(f"vae step {step}/{steps} mse {mse.item():.5f} kl {kl.item():.3f} ({time.time() - t0:.0f}s)")
        if eval_fn is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            tt.log(f"vae reconstruction score at step {step + 1}: {eval_fn(vae.eval())}")
            vae.train()
    return vae.eval(), time.time() - t0


def summary(s: dict) -> dict:
    return {k: v for k, v in s.items() if k != "clip_reads"}


@torch.no_grad()
def reconstruction_score(vae, seed: int, n: int = 128, chunk: int = 32) -> dict:
    """Motion score of the VAE's reconstructions of the first n held-out clips (the teacher's ceiling)."""
    from stages.sample.motion import score

    u8, caps, _ = clips.batch(seed, 0, n, "heldout")
    rec = np.concatenate([to_u8(vae.decode(vae.encode(to_pixels(u8[s:s + chunk])).latent_dist.mode()).sample)
                          for s in range(0, n, chunk)])
    return summary(score(list(rec), caps))


@torch.no_grad()
def generate(pipe, captions: list[str], seed: int, batch_size: int = 32, **overrides) -> list[np.ndarray]:
    """uint8 clips [F, 64, 64, 3] of `captions` at EVAL (+ overrides), each from the noise `eval --attributes` uses."""
    from stages.sample.attributes import draw_clips

    return draw_clips(pipe, captions, seed, batch_size, **{**EVAL, **overrides})


def evaluate(pipe, captions: list[str], seed: int = 0, **overrides) -> dict:
    from stages.sample.motion import score

    return summary(score(generate(pipe, captions, seed, **overrides), captions))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Pipeline folder to write (diffusers format).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vae-steps", type=int, default=1000)
    ap.add_argument("--vae-batch", type=int, default=4, help="Clips per VAE step (9 frames each).")
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-4)
    ap.add_argument("--fg-weight", type=float, default=5.0, help="Weight of the shape's pixels in the VAE loss.")
    ap.add_argument("--vae-init", default=str(ROOT / "data" / "tiny-teacher-pretrained" / "vae"),
                    help="Image VAE whose weights start the clips' VAE ('' : random start).")
    ap.add_argument("--vae-from", help="Skip stage 1: load this trained clips VAE folder.")
    ap.add_argument("--pool", type=int, default=16000, help="Training clips encoded once for the experts.")
    ap.add_argument("--shared-steps", type=int, default=3000, help="One transformer on all noise levels first.")
    ap.add_argument("--expert-steps", type=int, default=1000, help="Then each expert on its own noise levels.")
    ap.add_argument("--expert-lr-scale", type=float, default=0.5, help="Peak LR of phase B / --expert-lr.")
    ap.add_argument("--expert-batch", type=int, default=128)
    ap.add_argument("--train-shift", type=float, help="Shift of the training noise levels  [default: flow_shift]")
    ap.add_argument("--expert-lr", type=float, default=2e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--text-encoder-seed", type=int, default=0)
    ap.add_argument("--text-bias-scale", type=float, default=tt.TEXT_BIAS_SCALE)
    ap.add_argument("--p-uncond", type=float, default=0.1)
    ap.add_argument("--heldout", default=str(ROOT / "data" / "clips-heldout.txt"))
    ap.add_argument("--vae-score-clips", type=int, default=128, help="Held-out clips the VAE reconstructs to score.")
    ap.add_argument("--eval-every", type=int, default=500, help="Steps between held-out scores (VAE: half).")
    ap.add_argument("--score-only", action="store_true", help="Score the pipeline saved in --out; train nothing.")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    held = read_prompt_file(args.heldout)
    if any(not clips.is_heldout(c) for c in held):
        sys.exit(f"--heldout {args.heldout}: some captions are in the training split; use held-out captions")
    if args.score_only:
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(out, torch_dtype=torch.float32)
        return tt.log(f"held-out score {evaluate(pipe, held, args.seed)}")
    t_start = time.time()
    base = build_base(args.text_encoder_seed, args.text_bias_scale)

    from diffusers import AutoencoderKLWan
    if args.vae_from:
        vae, vae_s = AutoencoderKLWan.from_pretrained(args.vae_from, torch_dtype=torch.float32).eval(), 0.0
    else:
        vae, vae_s = train_vae(new_vae(args.seed, args.vae_init), args.seed, args.vae_steps, args.vae_batch,
                               args.vae_lr, args.kl_weight, args.fg_weight,
                               lambda v: reconstruction_score(v, args.seed, 32), args.eval_every // 2)
    vae_score = reconstruction_score(vae, args.seed, args.vae_score_clips)
    tt.log(f"VAE reconstruction of held-out clips, motion score {vae_score}")

    t = time.time()
    lat, emb = tt.encode_pool(vae, base, args.seed, args.pool, 64, clips.batch, to_pixels)
    mean, std = lat.mean(dim=(0, 2, 3, 4)), lat.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    lat = (lat - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    pool_s = time.time() - t
    tt.log(f"encoded a pool of {args.pool} clips in {pool_s:.0f}s; latents {tuple(lat.shape)}")
    if not args.vae_from:
        vae.save_pretrained(out.parent / (out.name + "-vae"), safe_serialization=True)

    def eval_fn(experts):
        return evaluate(tt.assemble(base, vae, experts), held[:32], args.seed)

    experts, exp_s = tt.train_experts(base, lat, emb, args, eval_fn)
    for m in (*experts.values(), vae):
        m.to(torch.float16)
    tt.assemble(base, vae, experts).save_pretrained(out, safe_serialization=True)
    t = time.time()
    from diffusers import WanPipeline
    heldout = evaluate(WanPipeline.from_pretrained(out, torch_dtype=torch.float32), held, args.seed)
    report = {
        "recipe": {k: tt._portable(v) for k, v in vars(args).items() if k != "out"}, "expert_config": tt.EXPERT,
        "vae_config": VAE, "extra_words": EXTRA_WORDS, "eval_settings": EVAL, "heldout_captions": len(held),
        "heldout_score": heldout, "vae_reconstruction_score": vae_score,
        "wall_s": {"vae": round(vae_s, 1), "pool": round(pool_s, 1), "experts": round(exp_s, 1),
                   "eval": round(time.time() - t, 1), "total": round(time.time() - t_start, 1)},
        "torch": torch.__version__, "threads": args.threads,
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    tt.log(f"held-out score {heldout}; wrote {out}")


if __name__ == "__main__":
    main()
