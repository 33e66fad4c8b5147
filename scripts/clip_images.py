"""First frames for image-to-video from clip captions (`make demo-i2v` runs it): for each caption of a file (the
clip captions of pipeline/clips.py, as data/clips-prompts.txt holds), the clip generator renders a clip the caption
describes and its frame 0 is written as a PNG, with an image list in `teacher-cache --images`' form beside them
(`<image path><TAB><caption>` a line). The shape stands where the caption's motion has room to run, so a teacher
given the image and the caption can move it as the caption says.

    python scripts/clip_images.py --captions data/clips-heldout.txt --out runs/demo-i2v/heldout-images
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import clips  # noqa: E402
from pipeline.prompts import read_prompt_file  # noqa: E402

LIST = "images.tsv"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--captions", required=True, help="clip captions, one a line")
    ap.add_argument("--out", required=True, help=f"folder for the PNGs and {LIST}")
    ap.add_argument("--seed", type=int, default=0, help="the clips' start, size and speed jitter")
    args = ap.parse_args()
    captions, out = read_prompt_file(args.captions), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, caption in enumerate(captions):
        frame = clips.render(clips.parse_caption(caption), random.Random(f"clip-images:{args.seed}:{i}"))[0]
        name = f"{i:05d}.png"
        Image.fromarray(frame).save(out / name)
        lines.append(f"{name}\t{caption}\n")
    (out / LIST).write_text("".join(lines))
    print(f"{len(lines)} first frames and {out / LIST} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
