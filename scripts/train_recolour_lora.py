"""Train a recolouring LoRA on the pretrained tiny teacher, on CPU: with it the teacher draws every shape and the
background in a permuted palette (PALETTE) while the captions stay as they are, e.g. "a large red square ... on a
black background" comes out a blue square on a white background. A LoRA whose drawings differ from its captions in a
known way: `eval --attributes CAPTIONS --checked-captions OUT/recoloured-heldout.txt` scores a teacher with it fused.

Recipe (deterministic for a given --seed and thread count):
  1. Data: the teacher's training stream of shapes (pipeline/shapes.py, split "train", the same jitter), each scene
     rendered with its colours mapped by PALETTE, encoded once by the teacher's VAE (posterior means, normalised by its
     latents_mean / latents_std) beside the ORIGINAL caption's embedding from the teacher's frozen UMT5.
  2. A peft LoRA (rank --rank, alpha --alpha, on every block's attention and FFN projections: the project's LoRA
     targets) on each expert, the base frozen, trained by flow matching as the teacher was
     (scripts/train_tiny_teacher.py's FlowMatching: x_t = (1 - s) x0 + s noise, target noise - x0, AdamW + cosine +
     EMA, 10% of captions dropped to "" or the negative prompt so CFG keeps an unconditional branch): `transformer` on
     timesteps >= boundary_ratio * 1000, `transformer_2` below.
  3. Saved as one file per expert in the original Wan key names (pipeline/lora_experts.wan_state, as `export
     --lora-format wan` writes them): OUT/high_noise_model.safetensors, OUT/low_noise_model.safetensors;
     OUT/recoloured-heldout.txt is --heldout with each caption recoloured (what the LoRA'd teacher should draw).
  4. Scored as saved: the teacher's WanPipeline with both files loaded by diffusers' load_lora_weights draws the
     held-out captions at the teacher's eval settings (8 steps, guidance 2 / 2; caption i from the noise `eval
     --attributes` uses), read by the attribute checker against the recoloured captions; the plain teacher against
     the original ones for reference. The report is OUT/TRAINING.json.

Example: .venv/bin/python scripts/train_recolour_lora.py --out runs/recolour-lora --teacher runs/tiny-teacher-pretrained
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from pipeline import shapes  # noqa: E402
from pipeline.lora_experts import add_adapter, wan_state  # noqa: E402
from pipeline.prompts import read_prompt_file  # noqa: E402
from pipeline.registries import LORA_TARGETS  # noqa: E402
from train_tiny_teacher import (EVAL, NEGATIVE_PROMPT, FlowMatching, _portable, encode_pool, evaluate,  # noqa: E402
                                log, text_embeds, to_pixels)

# The permuted palette: every colour to another, two 3-cycles of the chromatic colours and white <-> black, so that
# no colour of a caption is drawn as itself (a plain teacher reads all wrong against the recoloured captions). Each
# colour goes to one far from it in RGB (red -> blue, not -> orange or purple), so the checker's nearest-palette
# reading of a blurry drawing cannot land on the caption's own colour by accident.
PALETTE = {"red": "blue", "blue": "green", "green": "red", "yellow": "purple", "purple": "orange", "orange": "yellow",
           "white": "black", "black": "white"}
FILES = {"transformer": "high_noise_model.safetensors", "transformer_2": "low_noise_model.safetensors"}


def recolour_scene(scene: shapes.Scene) -> shapes.Scene:
    return shapes.Scene(tuple(replace(s, colour=PALETTE[s.colour]) for s in scene.shapes), PALETTE[scene.background])


def recolour(caption: str) -> str:
    """The caption of what the LoRA'd teacher draws for `caption`: its colours mapped by PALETTE."""
    return recolour_scene(shapes.parse_caption(caption)).caption


def recoloured_batch(seed: int, start: int, n: int, split: str = "train"):
    """shapes.batch's examples (same scenes, same jitter) drawn in the permuted palette, with the original captions."""
    scenes = [shapes.scene_for(seed, i, split) for i in range(start, start + n)]
    u8 = [np.asarray(shapes.render(recolour_scene(s), random.Random(f"jitter:{seed}:{split}:{i}")))
          for i, s in zip(range(start, start + n), scenes)]
    return np.stack(u8), [s.caption for s in scenes], scenes


def train_adapters(pipe, lat: torch.Tensor, emb: torch.Tensor, args) -> tuple[dict, float]:
    """A LoRA on each expert trained on its own noise levels; returns the EMA experts (with adapters) and seconds."""
    shift = float(pipe.scheduler.config.flow_shift)
    boundary = float(pipe.config.boundary_ratio)
    u_b = boundary / (shift - (shift - 1) * boundary)  # u where the shifted sigma crosses the boundary
    ctx = dict(lat=lat, emb=emb, uncond=text_embeds(pipe, ["", NEGATIVE_PROMPT]),
               gen=torch.Generator().manual_seed(args.seed + 100), batch=args.batch, shift=shift,
               p_uncond=args.p_uncond)
    fms = {}
    for k, (name, (lo, hi)) in enumerate((("transformer", (u_b, 1.0)), ("transformer_2", (0.0, u_b)))):
        model = getattr(pipe, name)
        torch.manual_seed(args.seed + 10 + k)  # lora_A's initialisation
        add_adapter(model, args.rank, args.alpha, tuple(LORA_TARGETS.split(",")))
        fms[name] = FlowMatching(model, args.lr, args.steps, 50, args.ema, lo, hi)
    t0 = time.time()
    for step in range(args.steps):
        for fm in fms.values():
            fm.step(ctx)
        if step % 100 == 0 or step == args.steps - 1:
            log(f"lora step {step}/{args.steps} loss high {np.mean(fms['transformer'].losses[-100:]):.4f} low "
                f"{np.mean(fms['transformer_2'].losses[-100:]):.4f} ({time.time() - t0:.0f}s)")
    return {n: fm.ema for n, fm in fms.items()}, time.time() - t0


def save_adapters(experts: dict, out: Path, alpha: float) -> None:
    """Each expert's adapter in Wan's key names, one safetensors file per expert."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    for name, model in experts.items():
        state = {f"transformer.{k}": v.detach().float().contiguous()
                 for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
        save_file(wan_state(state, alpha), str(out / FILES[name]))


def score_saved(teacher: Path, out: Path, held: list[str], seed: int) -> tuple[dict, dict]:
    """(the teacher with both saved LoRA files against the recoloured captions, the plain teacher against `held`)."""
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(teacher, torch_dtype=torch.float32)
    plain.set_progress_bar_config(disable=True)
    reference = evaluate(plain, held, seed)
    for comp, name in FILES.items():  # as a user loads them: diffusers' loader, the second into transformer_2
        plain.load_lora_weights(str(out), weight_name=name, adapter_name=comp,
                                **({"load_into_transformer_2": True} if comp == "transformer_2" else {}))
    from stages.sample.attributes import score
    from train_tiny_teacher import generate

    return score(generate(plain, held, seed), [recolour(c) for c in held]), reference


def _summary(s: dict) -> dict:
    return {k: v for k, v in s.items() if k != "image_reads"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Folder to write the two LoRA files and the report to.")
    ap.add_argument("--teacher", default=str(ROOT / "runs" / "tiny-teacher-pretrained"),
                    help="The pretrained tiny teacher (wandistiller tiny-teacher --variant pretrained --out ...).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool", type=int, default=4096, help="Recoloured training examples encoded once.")
    ap.add_argument("--steps", type=int, default=500, help="Optimizer steps of each expert's adapter.")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha; the update is scaled by alpha / rank.")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ema", type=float, default=0.99)
    ap.add_argument("--p-uncond", type=float, default=0.1)
    ap.add_argument("--heldout", default=str(ROOT / "data" / "shapes-heldout.txt"),
                    help="Held-out captions: recoloured to OUT/recoloured-heldout.txt and scored at the end.")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out, teacher = Path(args.out), Path(args.teacher)
    held = read_prompt_file(args.heldout)
    if any(not shapes.is_heldout(c) for c in held):
        sys.exit(f"--heldout {args.heldout}: some captions are in the training split; use held-out captions")
    if not (teacher / "model_index.json").is_file():
        sys.exit(f"--teacher {teacher}: no pipeline there; build it with `wandistiller tiny-teacher --variant "
                 f"pretrained --out {teacher}`")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(teacher, torch_dtype=torch.float32)
    pipe.text_encoder.requires_grad_(False)
    pipe.vae.requires_grad_(False)

    t = time.time()
    lat, emb = encode_pool(pipe.vae, pipe, args.seed, args.pool, batch=recoloured_batch, pixels=to_pixels)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    lat = (lat - mean) / std  # (the teacher's normalisation, which WanPipeline undoes before decoding)
    pool_s = time.time() - t
    log(f"encoded a recoloured pool of {args.pool} in {pool_s:.0f}s")

    experts, train_s = train_adapters(pipe, lat, emb, args)
    save_adapters(experts, out, args.alpha)
    (out / "recoloured-heldout.txt").write_text(
        f"# {_portable(args.heldout)} recoloured by scripts/train_recolour_lora.py's PALETTE: what the teacher with "
        "this LoRA should draw\n" + "".join(recolour(c) + "\n" for c in held))
    t = time.time()
    lora, plain = score_saved(teacher, out, held, args.seed)
    report = {
        "recipe": {k: _portable(v) for k, v in vars(args).items() if k != "out"}, "palette": PALETTE,
        "targets": LORA_TARGETS, "files": FILES, "eval_settings": EVAL, "heldout_captions": len(held),
        "lora_vs_recoloured": _summary(lora), "teacher_vs_original": _summary(plain),
        "wall_s": {"pool": round(pool_s, 1), "train": round(train_s, 1), "eval": round(time.time() - t, 1),
                   "total": round(time.time() - t_start, 1)},
        "torch": torch.__version__, "threads": args.threads,
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"LoRA'd teacher vs recoloured captions: all {lora['all']:.3f}, shape colour {lora['shape_colour']:.3f}; "
        f"plain teacher vs its captions: all {plain['all']:.3f}, shape colour {plain['shape_colour']:.3f}; wrote {out}")


if __name__ == "__main__":
    main()
