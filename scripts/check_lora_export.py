"""Check an adapter export against `sample` (issue 54; `make demo-video` and `make demo-i2v` run it): diffusers'
WanPipeline of the teacher (its WanImageToVideoPipeline, given each row's image, for an image-to-video grid), with
the export's scheduler and LoRA file(s) loaded as its card says (the second expert's with
load_into_transformer_2=True), draws the first prompts of a `sample` grid from sample's own noise; prints, per
prompt, the max pixel difference (of 255) against the clip of the grid's column for the same model, and exits 1 above
--tolerance.

    python scripts/check_lora_export.py --export runs/demo-video/lora-4step-export \
        --teacher runs/tiny-video-teacher-pretrained --grid runs/demo-video/grid.png --max-prompts 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageSequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache.safe_open import CAPS, parse_json, read_json, read_named  # noqa: E402
from pipeline.artifact import DistillRecord  # noqa: E402
from pipeline.image_condition import open_image  # noqa: E402
from pipeline.sampling import student_steps  # noqa: E402
from stages.sample.sample import initial_latents, latent_frames, to_clips  # noqa: E402


def _clip(path: str) -> np.ndarray:
    """The frames of a lossless animated WebP that `sample` wrote, uint8 [F, H, W, 3]."""
    with Image.open(path) as im:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="the adapter export (wandistiller export of a LoRA run or pair)")
    ap.add_argument("--teacher", required=True, help="the teacher folder the LoRA was trained on")
    ap.add_argument("--grid", required=True, help="a `sample` grid of the same runs (its .json lists the clips)")
    ap.add_argument("--column", help="the grid's column of the model (default: a pair's, RUN1+RUN2, else student)")
    ap.add_argument("--max-prompts", type=int, default=2)
    ap.add_argument("--tolerance", type=int, default=1, help="max pixel difference allowed (of 255)")
    args = ap.parse_args()
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    meta = parse_json(read_named(args.grid + ".json", "sample's summary", CAPS["record"]), args.grid + ".json")
    videos = meta.get("videos") or {}
    column = args.column or next((c for c in videos if "+" in c), "student")
    if column not in videos:
        print(f"error: the grid {args.grid} has no clips of {column!r} (its columns: {', '.join(videos)}); give "
              "--column", file=sys.stderr)
        return 2
    export, s = Path(args.export), meta["settings"]
    lora = read_json(export, "lora.json")
    steps = student_steps(DistillRecord.read(export / "distill.json"))
    images = meta.get("images")  # an image-to-video grid's: each row's first frame
    pipe = (WanImageToVideoPipeline if images else WanPipeline).from_pretrained(args.teacher)  # (float32, as sample)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = UniPCMultistepScheduler.from_pretrained(export, subfolder="scheduler")
    for comp, name in lora["files"].items():  # as the card: the high-noise expert's file, then the low-noise one's
        pipe.load_lora_weights(str(export), weight_name=name, adapter_name=comp,
                               **({"load_into_transformer_2": True} if comp == "transformer_2" else {}))
    frames, vs = int(meta["frames"]), pipe.vae_scale_factor_spatial
    shape = (1, pipe.vae.config.z_dim, latent_frames(pipe, frames), s["height"] // vs, s["width"] // vs)
    worst = 0
    for i, prompt in enumerate(meta["prompts"][:args.max_prompts]):
        given = {"image": open_image(Path(images[i]), f"{args.grid}.json")} if images else {}
        out = pipe(prompt=prompt, latents=initial_latents(s["seed"] + i, shape), num_frames=frames, guidance_scale=1.0,
                   **given, num_inference_steps=steps, height=s["height"], width=s["width"],
                   max_sequence_length=s["max_sequence_length"], output_type="np").frames
        got, want = to_clips(out)[0], _clip(videos[column][i])
        diff = int(np.abs(got.astype(int) - want.astype(int)).max())
        worst = max(worst, diff)
        print(f"prompt {i} ({prompt!r}): {frames} frames, max pixel difference {diff} of 255 (diffusers + {export.name} "
              f"vs sample's {column})")
    print(f"max pixel difference over {min(args.max_prompts, len(meta['prompts']))} prompt(s): {worst} of 255")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
