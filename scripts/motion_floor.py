"""How repeatable the motion checker's "kept" is: the tiny video teacher against itself, drawn from the same noise as
`eval --attributes` draws it (same captions, same latents), with another solver or step count. A model that differs
from the teacher only as much as the teacher's own 16-step or Euler drawing does loses this share of the teacher's
all-right clips for that reason alone; docs/tiny-video-teacher.md, "How repeatable kept is", quotes the run.

    .venv/bin/python scripts/motion_floor.py [--teacher data/tiny-video-teacher-pretrained] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.prompts import read_prompt_file  # noqa: E402
from stages.sample import motion  # noqa: E402
from stages.sample.attributes import caption_noise, draw_clips  # noqa: E402
from stages.sample.sample import latent_frames  # noqa: E402

# (name, steps, scheduler: None = the teacher's own UniPC)
VARIANTS = [("UniPC, 16 steps", 16, None), ("UniPC, 6 steps", 6, None), ("Euler, 8 steps", 8, "euler"),
            ("UniPC, 4 steps", 4, None), ("Euler, 4 steps", 4, "euler"), ("UniPC, 2 steps", 2, None)]


def final_latents(pipe, captions: list[str], batch_size: int = 32, **call) -> torch.Tensor:
    """The final latents draw_clips decodes (same captions, same noise): eval's final-latent MSE is taken on these."""
    out, frames = [], latent_frames(pipe, call["num_frames"])
    for s in range(0, len(captions), batch_size):
        lat = caption_noise(pipe, 0, s, len(captions[s:s + batch_size]), call["height"], call["width"], frames)
        out.append(pipe(prompt=captions[s:s + batch_size], latents=lat, output_type="latent", **call).frames)
    return torch.cat(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default=str(ROOT / "data" / "tiny-video-teacher-pretrained"))
    ap.add_argument("--captions", default=str(ROOT / "data" / "clips-heldout.txt"))
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    captions = read_prompt_file(args.captions)
    settings = json.loads((Path(args.teacher) / "TRAINING.json").read_text())["eval_settings"]
    pipe = WanPipeline.from_pretrained(args.teacher, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    own = pipe.scheduler
    reference = motion.score(draw_clips(pipe, captions, 0, 32, **settings), captions)
    ref_latents = final_latents(pipe, captions, **settings)
    rows = [{"drawn": f"teacher as scored (UniPC, {settings['num_inference_steps']} steps)",
             "all": reference["all"], "kept": 1.0, "speed_ratio": 1.0, "final_latent_mse": 0.0}]
    for name, steps, kind in VARIANTS:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=own.config.flow_shift) if kind else own
        call = settings | {"num_inference_steps": steps}
        got = motion.score(draw_clips(pipe, captions, 0, 32, **call), captions)
        mse = torch.mean((final_latents(pipe, captions, **call) - ref_latents) ** 2).item()
        rows.append({"drawn": name, "all": got["all"],
                     "kept": motion.kept(reference["clip_reads"], got["clip_reads"]),
                     "speed_ratio": motion.speed_ratio(reference["clip_reads"], got["clip_reads"]),
                     "final_latent_mse": mse})
        print(f"{name:<22} all right {got['all']:.1%}  kept {rows[-1]['kept']:.1%}  "
              f"speed ratio {rows[-1]['speed_ratio']:.3f}  final-latent MSE {mse:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"captions": len(captions), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
