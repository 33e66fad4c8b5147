"""A rule-based reader of shapes images (captions of `pipeline.shapes`' grammar): does a generated image show the
background colour, shape colours and rough positions its caption says? What it reads and why: docs/tiny-teacher.md,
"A teacher that draws"."""

from __future__ import annotations

import numpy as np

from pipeline import clips
from pipeline.errors import UserError
from pipeline.prompts import dedupe, read_prompt_file
from pipeline.shapes import COLOURS, POSITIONS, SIZE, parse_caption

NAMES = list(COLOURS)
PALETTE = np.array([COLOURS[n] for n in NAMES], dtype=np.float32)
ANCHORS = np.array([POSITIONS[p] for p in POSITIONS], dtype=np.float32)
ANCHOR_NAMES = list(POSITIONS)
MIN_PIXELS = 12


def _as_array(img) -> np.ndarray:
    a = np.asarray(img.convert("RGB") if hasattr(img, "convert") else img)
    if a.dtype != np.uint8:  # float images in [0, 1]
        a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
    if a.shape[:2] != (SIZE, SIZE):
        raise ValueError(f"expected {SIZE}x{SIZE} RGB images, got shape {a.shape}")
    return a


def labels(img) -> np.ndarray:
    """Index into NAMES of the nearest palette colour of every pixel: [64, 64] int."""
    a = _as_array(img).astype(np.float32)
    return ((a[:, :, None, :] - PALETTE[None, None]) ** 2).sum(-1).argmin(-1)


def read(img, n_shapes: int = 1) -> dict:
    """The background colour and up to `n_shapes` shape colours (most common first), each at its nearest anchor."""
    lab = labels(img)
    counts = np.bincount(lab.ravel(), minlength=len(NAMES))
    bg = int(counts.argmax())
    shapes = []
    for c in np.argsort(-counts, kind="stable"):
        if len(shapes) == n_shapes or counts[c] < MIN_PIXELS:
            break
        if c == bg:
            continue
        ys, xs = np.nonzero(lab == c)
        centre = np.array([xs.mean() + 0.5, ys.mean() + 0.5], dtype=np.float32)
        shapes.append({"colour": NAMES[c], "position": ANCHOR_NAMES[int(((ANCHORS - centre) ** 2).sum(-1).argmin())]})
    return {"background": NAMES[bg], "shapes": shapes}


def _checks(img, scene) -> tuple[bool, list[bool], list[bool]]:
    """(background right, per captioned shape: colour read, colour read at the captioned anchor)."""
    got = read(img, len(scene.shapes))
    where = {g["colour"]: g["position"] for g in got["shapes"]}
    return (got["background"] == scene.background, [s.colour in where for s in scene.shapes],
            [where.get(s.colour) == s.position for s in scene.shapes])


def _rates(checks) -> dict:
    """The accuracies of `score` over a list of `_checks` results."""
    n = max(len(checks), 1)
    n_shapes = max(sum(len(cs) for _, cs, _ in checks), 1)
    return {"images": len(checks), "background": sum(b for b, _, _ in checks) / n,
            "shape_colour": sum(sum(cs) for _, cs, _ in checks) / n_shapes,
            "position": sum(sum(ps) for _, _, ps in checks) / n_shapes,
            "colour": sum(b and all(cs) for b, cs, _ in checks) / n,
            "all": sum(b and all(cs) and all(ps) for b, cs, ps in checks) / n}


def score(images, captions) -> dict:
    """Accuracy in [0, 1] of `images` against their `captions`, overall and per shape count ("by_shapes": "1", "2");
    `image_reads`: per image whether it is `all_right`, for pairing with another model's (`motion.kept_counts`)."""
    images, captions = list(images), list(captions)
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    checks = [_checks(img, parse_caption(cap)) for img, cap in zip(images, captions)]
    counts = sorted({len(cs) for _, cs, _ in checks})
    return {**_rates(checks),
            "by_shapes": {str(k): _rates([c for c in checks if len(c[1]) == k]) for k in counts},
            "image_reads": [{"all_right": b and all(cs) and all(ps)} for b, cs, ps in checks]}


def attribute_captions(path: str, max_prompts: int | None, frames: int = 1) -> list[str]:
    """The captions of a prompt file (eval's --attributes) the checker can read at the cache's `frames`: shapes
    captions on an image cache, clip captions (pipeline/clips.py) on a video one; refuse the rest in one line."""
    captions = dedupe(read_prompt_file(path))[0][:max_prompts]
    video = frames > 1
    for c in captions:
        try:
            (clips.parse_caption if video else parse_caption)(c)
        except ValueError as e:
            try:
                (parse_caption if video else clips.parse_caption)(c)
            except ValueError:
                kind = "clips" if video else "shapes"
                raise UserError(f"--attributes {path}: {e}; the attribute checker reads captions of "
                                f"pipeline/{kind}.py's grammar, e.g. data/{kind}-heldout.txt") from e
            raise UserError(f"--attributes {path}: shapes captions on a {frames}-frame cache; pass clip captions "
                            "(pipeline/clips.py's grammar), e.g. data/clips-heldout.txt" if video else
                            f"--attributes {path}: clip captions on a one-frame cache; evaluate them on a video cache "
                            "(teacher-cache --frames 9), or pass shapes captions, e.g. data/shapes-heldout.txt") from e
    return captions


def caption_noise(pipe, seed: int, start: int, n: int, height: int, width: int, frames: int = 1):
    """Initial latents [C, frames, h, w] of captions start .. start + n - 1: caption i from seed + i, as sample's."""
    import torch

    from .sample import initial_latents

    vs = pipe.vae_scale_factor_spatial
    shape = (pipe.vae.config.z_dim, frames, height // vs, width // vs)  # (an I2V transformer takes more channels)
    return torch.stack([initial_latents(seed + start + i, shape) for i in range(n)])


def draw_clips(pipe, captions: list[str], seed: int, batch_size: int = 64, **call) -> list[np.ndarray]:
    """uint8 clips [F, H, W, 3] of `pipe(prompt=..., **call)` (height and width given; num_frames, else 1) on
    `captions`, from `caption_noise`."""
    from .sample import latent_frames, to_clips

    out, frames = [], latent_frames(pipe, call.get("num_frames", 1))
    for s in range(0, len(captions), batch_size):
        caps = captions[s:s + batch_size]
        lat = caption_noise(pipe, seed, s, len(caps), call["height"], call["width"], frames)
        out += to_clips(pipe(prompt=caps, latents=lat, output_type="np", **call).frames)
    return out


def draw(pipe, captions: list[str], seed: int, batch_size: int = 64, **call) -> list[np.ndarray]:
    """uint8 first frames [H, W, 3] of `draw_clips`."""
    return [clip[0] for clip in draw_clips(pipe, captions, seed, batch_size, **call)]
