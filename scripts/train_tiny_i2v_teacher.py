"""Turn the tiny video teacher (data/tiny-video-teacher-pretrained) into a tiny Wan2.2-I2V teacher that moves the shape
of a given first frame as its caption says, on CPU. Draft: docs/tiny-video-teacher.md, "An image-to-video teacher".

Recipe (deterministic for a given --seed and thread count):
  1. Copied unchanged, file for file: the video teacher's VAE, text encoder, tokenizer and scheduler.
  2. Experts: each of the video teacher's two, widened to Wan2.2-I2V-A14B's input (pipeline/tiny_teacher.py's `i2v`
     layout): patch_embedding from 16 to 36 input channels (the noisy latent, then the mask's 4 channels and the
     image latent's 16, the order WanImageToVideoPipeline concatenates them in), the 20 new channels' weights zero.
     Before any step each expert draws exactly what the video teacher's draws; checked on one batch before training
     (predict within 1e-6 of the video teacher's, whatever the condition), recorded as `warm_start_gap`.
  3. Fine-tuned by flow matching (scripts/train_tiny_teacher.py's loss, LR schedule and EMA, through
     model_call.predict) on clips of pipeline/clips.py, each conditioned on its own frame 0
     (pipeline/image_condition.condition_latent: the latent WanImageToVideoPipeline builds from that image). Captions
     are dropped for CFG as the video teacher's were; the condition never is (the pipeline always gives one, to both
     branches of its guidance). Each expert trains on its own noise levels at the video teacher's boundary_ratio
     (0.875), the one its experts were trained for, not Wan2.2-I2V's 0.9 (--boundary changes it).
  4. Saved as a WanImageToVideoPipeline folder (experts in float16, no image encoder, as Wan2.2 ships), scored as
     saved: each held-out caption drawn from the first frame of a clip it describes, read by the motion checker
     (stages/sample/motion.py), with the first frame's fidelity; the report is OUT/TRAINING.json.

No TI2V variant: TI2V's image mode (expand_timesteps) is drawn by diffusers with one timestep per 2x2 latent patch
(`first_frame_mask[..., ::2, ::2]` in WanImageToVideoPipeline), and these experts take one token per 4x4 latent frame.

Time on 2 busy cores, 1 thread (extrapolated from timed steps, not a full run): pool ~3.5 min (33 ms a clip), experts
~11 min (0.44 s a step of both), scores ~1 min (0.19 s a clip drawn): about 16 min.

Example: .venv/bin/python scripts/train_tiny_i2v_teacher.py --out runs/tiny-i2v-teacher
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import scripts.train_tiny_teacher as tt  # noqa: E402
import scripts.train_tiny_video_teacher as vtt  # noqa: E402
from pipeline import clips  # noqa: E402
from pipeline.image_condition import condition_latent  # noqa: E402
from pipeline.model_call import Inputs, InputRule, predict  # noqa: E402
from pipeline.prompts import read_prompt_file  # noqa: E402
from pipeline.teacher_files import copy_tree  # noqa: E402
from pipeline.tiny_teacher import VIDEO_PRETRAINED_DIR  # noqa: E402
from stages.sample.motion import fidelity  # noqa: E402

EVAL = vtt.EVAL  # the video teacher's drawing settings: 9 frames, 64x64, 8 steps, guidance 2 / 2
COPIED = ("vae", "text_encoder", "tokenizer", "scheduler")  # the video teacher's, byte for byte
EXPERTS = ("transformer", "transformer_2")  # high-noise, low-noise
IN_CHANNELS = 16 + 4 + 16  # Wan2.2-I2V: noisy latent, mask (the VAE's temporal factor), image latent
MAX_GAP = 1e-6  # step 0: the widened expert's prediction against the video teacher's


def load_video_teacher(folder: Path):
    from diffusers import WanPipeline

    if not (folder / "model_index.json").is_file():
        sys.exit(f"--teacher {folder}: no model_index.json; name the video teacher's folder "
                 f"(e.g. {VIDEO_PRETRAINED_DIR.relative_to(ROOT)})")
    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    if pipe.transformer_2 is None or pipe.transformer.config.in_channels != pipe.vae.config.z_dim:
        sys.exit(f"--teacher {folder}: not a two-expert text-to-video Wan 2.2 teacher; name the video teacher's folder")
    for m in (pipe.text_encoder, pipe.vae, pipe.transformer, pipe.transformer_2):
        m.eval().requires_grad_(False)
    return pipe


def widen(expert, channels: int = IN_CHANNELS):
    """A copy of `expert` taking `channels` input channels: the patch embedding's weights of its own channels kept,
    those of the new ones zero (they see the condition; at zero the expert ignores it)."""
    from diffusers import WanTransformer3DModel

    wide = WanTransformer3DModel.from_config({**expert.config, "in_channels": channels})
    state = expert.state_dict()
    w = state["patch_embedding.weight"]  # [inner, in_channels, *patch]
    state["patch_embedding.weight"] = torch.cat([w, w.new_zeros(w.shape[0], channels - w.shape[1], *w.shape[2:])], 1)
    wide.load_state_dict(state)
    return wide


def assemble(base, experts: dict, boundary: float):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                                   scheduler=base.scheduler, transformer=experts["transformer"],
                                   transformer_2=experts["transformer_2"], boundary_ratio=boundary)


@torch.no_grad()
def encode_pool(vae, base, rule: InputRule, seed: int, n: int, chunk: int = 64):
    """The first n training clips of `seed`: normalised latents [n, 16, 3, 4, 4], their condition latents (each clip's
    frame 0, as the pipeline builds it) [n, 20, 3, 4, 4] and caption embeddings [n, MAX_SEQ, 32]."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    lats, conds, embs = [], [], []
    for start in range(0, n, chunk):
        u8, caps, _ = clips.batch(seed, start, min(chunk, n - start), "train")
        x = vtt.to_pixels(u8)
        lats.append((vae.encode(x).latent_dist.mode() - mean) * inv_std)
        conds.append(condition_latent(vae, x[:, :, 0], clips.FRAMES, rule))
        embs.append(tt.text_embeds(base, caps))
    return torch.cat(lats), torch.cat(conds), torch.cat(embs)


def noisy_batch(ctx: dict, lo: float, hi: float):
    """A batch of the pool at noise levels s = shift(u), u uniform on [lo, hi): (x_t, sigma, caption embeddings with
    --p-uncond of them dropped to "" or the negative prompt, condition, flow-matching target noise - x0)."""
    gen, batch = ctx["gen"], ctx["batch"]
    idx = torch.randint(0, ctx["lat"].shape[0], (batch,), generator=gen)
    x0, e = ctx["lat"][idx], ctx["emb"][idx].clone()
    drop = torch.rand(batch, generator=gen) < ctx["p_uncond"]
    which = torch.randint(0, 2, (batch,), generator=gen)
    e[drop] = ctx["uncond"][which[drop]]
    sigma = tt.shifted_sigma(lo + (hi - lo) * torch.rand(batch, generator=gen), ctx["shift"])
    noise = torch.randn(x0.shape, generator=gen)
    s = sigma.view(-1, 1, 1, 1, 1)
    return (1 - s) * x0 + s * noise, sigma, e, ctx["cond"][idx], noise - x0


class ImageFlowMatching(tt.FlowMatching):
    """tt.FlowMatching (AdamW, cosine LR, EMA) with each sample's condition laid beside its noisy latent by the
    pipeline's input rule."""

    def step(self, ctx: dict) -> None:
        self.schedule()
        xt, sigma, e, c, target = noisy_batch(ctx, self.lo, self.hi)
        self.update((predict(self.model, Inputs(xt, sigma * 1000, e, condition=c), rule=ctx["rule"]).guided
                     - target).pow(2).mean())


@torch.no_grad()
def warm_start_gap(video, wide, ctx: dict, lo: float, hi: float) -> float:
    """Largest difference between the widened expert's prediction (with the batch's condition) and the video expert's
    (without one) on one batch of the pool at its noise levels: 0 up to float rounding, the new channels being zero."""
    xt, sigma, e, c, _ = noisy_batch(ctx, lo, hi)
    mine = predict(wide, Inputs(xt, sigma * 1000, e, condition=c), rule=ctx["rule"]).guided
    return (mine - predict(video, Inputs(xt, sigma * 1000, e)).guided).abs().max().item()


def heldout_clips(captions: list[str], seed: int) -> np.ndarray:
    """uint8 [n, F, 64, 64, 3]: for each held-out caption a clip it describes (its path drawn from `seed` and the
    caption's line), whose frame 0 is the image the teacher is given."""
    return np.stack([clips.render(clips.parse_caption(c), random.Random(f"i2v-heldout:{seed}:{i}"))
                     for i, c in enumerate(captions)])


@torch.no_grad()
def generate(pipe, captions: list[str], firsts: np.ndarray, seed: int) -> list[np.ndarray]:
    """uint8 clips of `captions` drawn by the WanImageToVideoPipeline `pipe` at EVAL from the images `firsts`
    [n, 64, 64, 3], caption i from the noise of seed + i (the video teacher's eval noise: at step 0 the same clips)."""
    from PIL import Image

    from stages.sample.sample import initial_latents, latent_frames, to_clips

    vs = pipe.vae_scale_factor_spatial
    shape = (pipe.vae.config.z_dim, latent_frames(pipe, EVAL["num_frames"]), EVAL["height"] // vs, EVAL["width"] // vs)
    pipe.set_progress_bar_config(disable=True)
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # batch 1: a second thread only synchronises (35x slower on 2 busy cores)
    try:
        for i, (caption, first) in enumerate(zip(captions, firsts)):  # one a call: the pipeline takes one image
            frames = pipe(image=Image.fromarray(first), prompt=caption, latents=initial_latents(seed + i, shape)[None],
                          output_type="np", **EVAL).frames
            out += to_clips(frames)
    finally:
        torch.set_num_threads(threads)
    return out


def evaluate(pipe, captions: list[str], seed: int) -> dict:
    """The motion checker's scores of `pipe`'s clips drawn from the held-out first frames, and their `fidelity`."""
    from stages.sample.motion import score

    given = heldout_clips(captions, seed)
    drawn = generate(pipe, captions, given[:, 0], seed)
    s = score(drawn, captions)
    return {**vtt.summary(s), "first_frame": fidelity(drawn, given, s["clip_reads"])}


def save(pipe, teacher: Path, out: Path) -> None:
    """`pipe` saved to `out` (experts in float16), its copied components replaced by the teacher's own files."""
    for name in EXPERTS:
        getattr(pipe, name).to(torch.float16)
    pipe.save_pretrained(out, safe_serialization=True)
    for name in COPIED:
        shutil.rmtree(out / name)
        copy_tree(teacher / name, out / name)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Pipeline folder to write (diffusers WanImageToVideoPipeline).")
    ap.add_argument("--teacher", default=str(VIDEO_PRETRAINED_DIR), help="The video teacher to start from.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="Torch threads. 1: the experts' ops are too small to split (batch 64 on 2 busy cores: 0.20 s "
                         "an expert's step on 1 thread, 2.3 s on 2).")
    ap.add_argument("--pool", type=int, default=6000, help="Training clips encoded once (latent, condition, caption).")
    ap.add_argument("--steps", type=int, default=3000, help="Fine-tuning steps of each expert (1,500 left the shape's "
                    "start 4.8 px from the image's; 3,000 at lr 1e-3: 1.2 px, docs/tiny-video-teacher.md).")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="Peak LR (the committed teacher's; 5e-4 over 1,500 steps brought the start to 5 px at step "
                         "1,000, 1e-3 to 2.5 px).")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ema", type=float, default=0.995, help="EMA decay (a window of ~200 steps: a short run).")
    ap.add_argument("--p-uncond", type=float, default=0.1, help="Captions dropped for CFG (the condition never is).")
    ap.add_argument("--boundary", type=float, help="boundary_ratio of the experts  [default: the video teacher's]")
    ap.add_argument("--heldout", default=str(ROOT / "data" / "clips-heldout.txt"))
    ap.add_argument("--eval-captions", type=int, help="Score the first N held-out captions  [default: all]")
    ap.add_argument("--eval-every", type=int, default=250,
                    help="Steps between scores on the first 32 held-out captions (from step 0: the video teacher's "
                         "drawing); 0: none.")
    ap.add_argument("--score-only", action="store_true", help="Score the pipeline saved in --out; train nothing.")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out, teacher = Path(args.out), Path(args.teacher)
    held = read_prompt_file(args.heldout)[:args.eval_captions]
    if any(not clips.is_heldout(c) for c in held):
        sys.exit(f"--heldout {args.heldout}: some captions are in the training split; use held-out captions")
    if args.score_only:
        from diffusers import WanImageToVideoPipeline

        path = out / "TRAINING.json"
        report = json.loads(path.read_text()) if path.is_file() else {}
        report.update(eval_settings=EVAL, heldout_captions=len(held), heldout_score=evaluate(
            WanImageToVideoPipeline.from_pretrained(out, torch_dtype=torch.float32), held, args.seed))
        path.write_text(json.dumps(report, indent=2) + "\n")
        return tt.log(f"held-out score {report['heldout_score']}; updated {path}")
    t_start = time.time()
    base = load_video_teacher(teacher)
    boundary = float(base.config.boundary_ratio if args.boundary is None else args.boundary)
    experts = {name: widen(getattr(base, name)) for name in EXPERTS}
    rule = InputRule.of_pipeline(assemble(base, experts, boundary))

    t = time.time()
    lat, cond, emb = encode_pool(base.vae, base, rule, args.seed, args.pool)
    pool_s = time.time() - t
    tt.log(f"encoded a pool of {args.pool} clips in {pool_s:.0f}s; latents {tuple(lat.shape)}, conditions "
           f"{tuple(cond.shape)}")

    shift = float(base.scheduler.config.flow_shift)
    u_b = boundary / (shift - (shift - 1) * boundary)  # u where the shifted sigma crosses the boundary (tt)
    ranges = {"transformer": (u_b, 1.0), "transformer_2": (0.0, u_b)}
    ctx = dict(lat=lat, cond=cond, emb=emb, uncond=tt.text_embeds(base, ["", tt.NEGATIVE_PROMPT]), rule=rule,
               gen=torch.Generator().manual_seed(args.seed + 200), batch=args.batch, shift=shift,
               p_uncond=args.p_uncond)
    gaps = {n: warm_start_gap(getattr(base, n), experts[n], ctx, *ranges[n]) for n in EXPERTS}
    tt.log(f"step 0: widened experts against the video teacher's, largest prediction difference {gaps}")
    if max(gaps.values()) > MAX_GAP:
        sys.exit(f"the widened experts do not predict what the video teacher's do (largest difference "
                 f"{max(gaps.values()):.2e} > {MAX_GAP}); check the teacher's patch_embedding")

    fms = {n: ImageFlowMatching(experts[n], args.lr, args.steps, args.warmup, args.ema, *ranges[n]) for n in EXPERTS}
    eval_log = []

    def score_now(step: int) -> None:
        s = evaluate(assemble(base, {n: fm.ema for n, fm in fms.items()}, boundary), held[:32], args.seed)
        eval_log.append({"step": step, "score": s})
        tt.log(f"eval at step {step}: {s}")

    t, eval_s = time.time(), 0.0
    for step in range(args.steps):
        if args.eval_every and step % args.eval_every == 0:
            t_eval = time.time()
            score_now(step)
            eval_s += time.time() - t_eval
        for fm in fms.values():
            fm.step(ctx)
        if step % 50 == 0 or step == args.steps - 1:
            tt.log(f"step {step}/{args.steps} loss high {np.mean(fms['transformer'].losses[-50:]):.4f} low "
                   f"{np.mean(fms['transformer_2'].losses[-50:]):.4f} ({time.time() - t:.0f}s)")
    train_s = time.time() - t - eval_s

    from diffusers import WanImageToVideoPipeline

    save(assemble(base, {n: fm.ema for n, fm in fms.items()}, boundary), teacher, out)
    t = time.time()
    heldout = evaluate(WanImageToVideoPipeline.from_pretrained(out, torch_dtype=torch.float32), held, args.seed)
    report = {
        "recipe": {k: tt._portable(v) for k, v in vars(args).items() if k != "out"},
        "copied": list(COPIED),
        "expert_config": {k: v for k, v in fms["transformer"].ema.config.items() if not k.startswith("_")},
        "boundary_ratio": boundary,
        "boundary_ratio_from": "the video teacher's: its experts were trained for it (Wan2.2-I2V-A14B's is 0.9)"
                               if args.boundary is None else "--boundary",
        "warm_start_gap": gaps, "eval_settings": EVAL, "heldout_captions": len(held), "heldout_score": heldout,
        "eval_log": eval_log,
        "wall_s": {"pool": round(pool_s, 1), "experts": round(train_s, 1), "eval_during": round(eval_s, 1),
                   "eval": round(time.time() - t, 1), "total": round(time.time() - t_start, 1)},
        "torch": torch.__version__, "threads": args.threads,
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    tt.log(f"held-out score {heldout}; wrote {out}")


if __name__ == "__main__":
    main()
