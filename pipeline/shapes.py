"""Procedural captioned shapes: the data set the pretrained tiny teacher learns to draw (docs/tiny-teacher.md), e.g.
"a large green square in the top right and a small white star in the bottom left on a black background"."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
# Well-separated RGB values, so that a nearest-palette reader of blurry generated images stays unambiguous.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "orange": (250, 140, 10), "yellow": (245, 230, 40), "green": (30, 170, 50),
    "blue": (30, 70, 230), "purple": (140, 40, 180), "white": (245, 245, 245), "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle", "star", "heart", "hexagon")
SIZES = {"small": 8.0, "large": 13.0}  # radius in pixels
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (16.0, 16.0), "top right": (48.0, 16.0), "bottom left": (16.0, 48.0),
    "bottom right": (48.0, 48.0), "center": (32.0, 32.0),
}  # anchor centres (x, y): "in the <name>"
CORNERS = ("top left", "top right", "bottom left", "bottom right")
HELDOUT_PERCENT = 10
JITTER = 2.0  # pixels of random offset of a shape's centre, and of its radius


@dataclass(frozen=True)
class Shape:
    colour: str
    shape: str
    size: str
    position: str

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} in the {self.position}"


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    background: str

    @property
    def caption(self) -> str:
        return " and ".join(s.phrase() for s in self.shapes) + f" on a {self.background} background"


def is_heldout(caption: str) -> bool:
    """Whether `caption` belongs to the held-out split (a stable hash of its text)."""
    h = int.from_bytes(hashlib.sha256(caption.encode()).digest()[:4], "big")
    return h % 100 < HELDOUT_PERCENT


def random_scene(rng: random.Random, two_prob: float = 0.3) -> Scene:
    """One scene: background first, shape colours differ from it (and from each other)."""
    bg = rng.choice(list(COLOURS))
    others = [c for c in COLOURS if c != bg]
    if rng.random() < two_prob:  # in distinct corners: never overlapping, even both large
        p1, p2 = rng.sample(CORNERS, 2)
        c1, c2 = rng.sample(others, 2)
        shapes = (Shape(c1, rng.choice(SHAPES), rng.choice(list(SIZES)), p1),
                  Shape(c2, rng.choice(SHAPES), rng.choice(list(SIZES)), p2))
    else:
        shapes = (Shape(rng.choice(others), rng.choice(SHAPES), rng.choice(list(SIZES)), rng.choice(list(POSITIONS))),)
    return Scene(shapes, bg)


def scene_for(seed: int, index: int, split: str = "train", two_prob: float = 0.3) -> Scene:
    """The `index`-th scene of the `split` ("train" or "heldout") stream of `seed` (rejection on the split)."""
    rng = random.Random(f"shapes:{seed}:{split}:{index}")
    want = split == "heldout"
    while True:
        scene = random_scene(rng, two_prob)
        if is_heldout(scene.caption) == want:
            return scene


def _polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if kind == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if kind == "hexagon":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in np.arange(6) * math.pi / 3]
    if kind == "star":  # tips and inner corners, alternating
        angles = [-math.pi / 2 + k * math.pi / 5 for k in range(10)]
        return [(cx + rr * math.cos(a), cy + rr * math.sin(a)) for rr, a in zip([r, r * 0.45] * 5, angles)]
    raise ValueError(kind)


def _draw_shape(d: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        s = r * 0.85
        d.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif kind == "heart":  # two lobes and a point
        lr = r * 0.52
        d.ellipse([cx - 2 * lr + 0.5, cy - r * 0.65, cx + 0.5, cy - r * 0.65 + 2 * lr], fill=fill)
        d.ellipse([cx - 0.5, cy - r * 0.65, cx + 2 * lr - 0.5, cy - r * 0.65 + 2 * lr], fill=fill)
        d.polygon([(cx - r * 0.98, cy - r * 0.05), (cx + r * 0.98, cy - r * 0.05), (cx, cy + r)], fill=fill)
    else:
        d.polygon(_polygon(kind, cx, cy, r), fill=fill)


def render(scene: Scene, rng: random.Random | None = None) -> Image.Image:
    """Draw `scene` as a 64x64 RGB image; `rng` jitters centres and radii by up to JITTER pixels."""
    img = Image.new("RGB", (SIZE, SIZE), COLOURS[scene.background])
    d = ImageDraw.Draw(img)
    for s in scene.shapes:
        cx, cy = POSITIONS[s.position]
        r = SIZES[s.size]
        if rng is not None:
            cx += rng.uniform(-JITTER, JITTER)
            cy += rng.uniform(-JITTER, JITTER)
            r += rng.uniform(-JITTER / 2, JITTER / 2)
        _draw_shape(d, s.shape, cx, cy, r, COLOURS[s.colour])
    return img


def sample(seed: int, index: int, split: str = "train") -> tuple[Image.Image, str, Scene]:
    """(image, caption, scene) of the `index`-th example of `split` for `seed`: deterministic."""
    scene = scene_for(seed, index, split)
    img = render(scene, random.Random(f"jitter:{seed}:{split}:{index}"))
    return img, scene.caption, scene


def batch(seed: int, start: int, n: int, split: str = "train") -> tuple[np.ndarray, list[str], list[Scene]]:
    """`n` consecutive examples as uint8 [n, 64, 64, 3], captions and scenes."""
    out = [sample(seed, i, split) for i in range(start, start + n)]
    return np.stack([np.asarray(o[0]) for o in out]), [o[1] for o in out], [o[2] for o in out]


def parse_caption(caption: str) -> Scene:
    """The scene a caption of this grammar describes (inverse of `Scene.caption`)."""
    body, _, bg = caption.rpartition(" on a ")
    background = bg.removesuffix(" background")
    shapes = []
    for part in body.split(" and "):
        words = part.split()  # a SIZE COLOUR SHAPE in the POS...
        if len(words) < 6 or words[0] != "a" or words[4:6] != ["in", "the"]:
            raise ValueError(f"not a shapes caption: {caption!r}")
        shapes.append(Shape(words[2], words[3], words[1], " ".join(words[6:])))
    return Scene(tuple(shapes), background)
