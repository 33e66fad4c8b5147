"""Procedural captioned clips: one shape of pipeline/shapes.py's palette moving in a straight line, the data set the
tiny video teacher learns (docs/tiny-video-teacher.md).

    "a red circle moving slowly from left to right on a blue background"
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .shapes import COLOURS, SHAPES, SIZE, _draw_shape, is_heldout

FRAMES = 9  # 1 + 4k: 3 latent frames through the Wan VAE's 4x temporal compression
RADIUS = 10.0  # pixels; jittered by up to 1 per clip
MARGIN = 2.0  # pixels between the shape and the frame's edge, in every frame
DIRECTIONS: dict[str, tuple[int, int]] = {
    "from left to right": (1, 0), "from right to left": (-1, 0),
    "from top to bottom": (0, 1), "from bottom to top": (0, -1),
}  # (dx, dy) in image coordinates
SPEEDS = {"slowly": 1.5, "": 2.25, "quickly": 3.0}  # pixels per frame; "": the caption has no speed word


@dataclass(frozen=True)
class Clip:
    colour: str
    shape: str
    direction: str
    speed: str
    background: str

    @property
    def caption(self) -> str:
        return (f"a {self.colour} {self.shape} moving{' ' + self.speed if self.speed else ''} {self.direction} "
                f"on a {self.background} background")


def clip_for(seed: int, index: int, split: str = "train") -> Clip:
    """The `index`-th clip of the `split` ("train" or "heldout") stream of `seed` (rejection on the split)."""
    rng = random.Random(f"clips:{seed}:{split}:{index}")
    while True:
        bg = rng.choice(list(COLOURS))
        clip = Clip(rng.choice([c for c in COLOURS if c != bg]), rng.choice(SHAPES), rng.choice(list(DIRECTIONS)),
                    rng.choice(list(SPEEDS)), bg)
        if is_heldout(clip.caption) == (split == "heldout"):
            return clip


def track(clip: Clip, rng: random.Random) -> np.ndarray:
    """Centres (x, y) of the shape per frame [FRAMES, 2]: `rng` picks where the path starts and its lane."""
    dx, dy = DIRECTIONS[clip.direction]
    lo, hi = RADIUS + 1 + MARGIN, SIZE - RADIUS - 1 - MARGIN
    along = rng.uniform(lo, hi - SPEEDS[clip.speed] * (FRAMES - 1)) + SPEEDS[clip.speed] * np.arange(FRAMES)
    along = along if dx + dy > 0 else SIZE - along  # mirrored: the same range, travelled the other way
    lane = np.full(FRAMES, rng.uniform(lo, hi))
    return np.stack([along, lane] if dx else [lane, along], axis=1)


def render(clip: Clip, rng: random.Random) -> np.ndarray:
    """Draw `clip` as uint8 [FRAMES, 64, 64, 3]; `rng` picks the path (`track`) and jitters the radius."""
    centres, r = track(clip, rng), RADIUS + rng.uniform(-1.0, 1.0)
    out = []
    for cx, cy in centres:
        img = Image.new("RGB", (SIZE, SIZE), COLOURS[clip.background])
        _draw_shape(ImageDraw.Draw(img), clip.shape, cx, cy, r, COLOURS[clip.colour])
        out.append(np.asarray(img))
    return np.stack(out)


def batch(seed: int, start: int, n: int, split: str = "train") -> tuple[np.ndarray, list[str], list[Clip]]:
    """`n` consecutive clips as uint8 [n, FRAMES, 64, 64, 3], their captions and `Clip`s: deterministic."""
    cs = [clip_for(seed, i, split) for i in range(start, start + n)]
    u8 = [render(c, random.Random(f"track:{seed}:{split}:{i}")) for i, c in zip(range(start, start + n), cs)]
    return np.stack(u8), [c.caption for c in cs], cs


def parse_caption(caption: str) -> Clip:
    """The clip a caption of this grammar describes (inverse of `Clip.caption`)."""
    body, _, bg = caption.rpartition(" on a ")
    words = body.split()  # a COLOUR SHAPE moving [SPEED] from A to B
    speed = words[4] if len(words) > 4 and words[4] in SPEEDS else ""
    clip = Clip(*words[1:3], " ".join(words[4 + bool(speed):]), speed, bg.removesuffix(" background")) \
        if len(words) >= 8 and words[0] == "a" and words[3] == "moving" else None
    if clip is None or clip.direction not in DIRECTIONS or clip.caption != caption:
        raise ValueError(f"not a clips caption: {caption!r}")
    return clip
