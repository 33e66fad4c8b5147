"""A rule-based reader of moving-shape clips (captions of pipeline/clips.py's grammar): per frame, the background and
the shape's colour by nearest palette colour (as stages/sample/attributes.py reads images) and the centroid of the
shape's pixels; over the clip, a least-squares line through the centroids gives the direction and the speed in pixels
per frame. What it reads and why: docs/tiny-video-teacher.md.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.clips import DIRECTIONS, SPEEDS, parse_caption

from .attributes import MIN_PIXELS, NAMES, PALETTE, _as_array, labels

MIN_SPEED = 0.5  # pixels per frame along the track's main axis; slower reads as standing still (no direction)


def read(clip) -> dict:
    """What a clip [F, 64, 64, 3] (uint8, or float in [0, 1]) shows: per frame the background and the shape colour
    (None: no colour but the background's covers MIN_PIXELS), the centroid of the clip's shape colour in each
    frame, and the track's velocity, direction and speed (None when fewer than half the frames show the shape)."""
    imgs = [_as_array(f) for f in clip]
    labs = [labels(a) for a in imgs]
    counts = np.stack([np.bincount(lab.ravel(), minlength=len(NAMES)) for lab in labs])  # [F, colours]
    bgs = counts.argmax(1)
    shapes = [shape_colour(a, lab, n, b) for a, lab, n, b in zip(imgs, labs, counts, bgs)]
    colour = max(set(shapes) - {None}, key=shapes.count, default=None)  # the clip's shape: its most common colour
    centres = []
    for lab in labs:
        ys, xs = np.nonzero(lab == colour) if colour is not None else ((), ())
        centres.append([xs.mean() + 0.5, ys.mean() + 0.5] if len(xs) >= MIN_PIXELS else None)
    t = [i for i, c in enumerate(centres) if c is not None]
    velocity = direction = speed = None
    if 2 * len(t) >= len(clip) and len(t) >= 2:
        velocity = np.polyfit(np.array(t, float), np.array([centres[i] for i in t]), 1)[0]  # (vx, vy) per frame
        axis = int(abs(velocity[1]) > abs(velocity[0]))
        speed = float(abs(velocity[axis]))
        step = (int(np.sign(velocity[0])), 0) if axis == 0 else (0, int(np.sign(velocity[1])))
        direction = next((d for d, v in DIRECTIONS.items() if v == step), None) if speed >= MIN_SPEED else None
    return {"backgrounds": [NAMES[b] for b in bgs], "shapes": [None if s is None else NAMES[s] for s in shapes],
            "centres": centres, "velocity": None if velocity is None else [float(v) for v in velocity],
            "direction": direction, "speed": speed}


def shape_colour(img: np.ndarray, lab: np.ndarray, counts: np.ndarray, bg: int) -> int | None:
    """One frame's shape colour (None: no colour but the background's covers MIN_PIXELS): of those that do, the one
    whose pixels' squared RGB distances from the background's palette colour sum highest: a blur's halo (the edge's
    blend with the background, nearest a third colour: yellow on red reads orange) weighs less a pixel than the shape,
    lying nearer the background (docs/tiny-video-teacher.md, "The checker on the VAE round trip")."""
    dist = ((img.astype(np.float32) - PALETTE[bg]) ** 2).sum(-1)
    weight = np.bincount(lab.ravel(), weights=dist.ravel(), minlength=len(NAMES))
    weight[(counts < MIN_PIXELS) | (np.arange(len(NAMES)) == bg)] = 0
    return int(weight.argmax()) if weight.max() > 0 else None


def speed_word(speed: float) -> str:
    """The speed word ("" for none) whose drawn speed is nearest to `speed` pixels per frame."""
    return min(SPEEDS, key=lambda w: abs(SPEEDS[w] - speed))


def check(clip, caption: str) -> dict:
    """One clip against its caption: the reads, attributes right per frame, direction and speed word right,
    motion right (both), all right (attributes in every frame and motion)."""
    want, got = parse_caption(caption), read(clip)
    frames = [b == want.background and s == want.colour for b, s in zip(got["backgrounds"], got["shapes"])]
    direction_right = got["direction"] == want.direction
    speed_right = got["speed"] is not None and speed_word(got["speed"]) == want.speed
    motion = direction_right and (speed_right or not want.speed)  # a caption without a speed word allows any
    return {**got, "caption": caption, "frames_right": sum(frames) / len(frames), "direction_right": direction_right,
            "speed_right": speed_right, "motion_right": motion, "all_right": motion and all(frames)}


def score(clips, captions) -> dict:
    """Scores in [0, 1] of `clips` against their `captions` (same order): `background`, `shape_colour` and
    `attributes` (both) per frame; per clip `direction`, `speed` (of the captions with a speed word), `motion_right`,
    `all` (of `clips`, with its 95% `all_interval`); `speed_px`: mean speed read per speed word over the clips read in
    the right direction; `clip_reads`."""
    clips, captions = list(clips), list(captions)
    if len(clips) != len(captions):
        raise ValueError(f"{len(clips)} clips but {len(captions)} captions")
    reads = [check(c, cap) for c, cap in zip(clips, captions)]
    wants = [parse_caption(cap) for cap in captions]
    frames = [(b == w.background, s == w.colour) for r, w in zip(reads, wants) for b, s in zip(r["backgrounds"],
                                                                                                   r["shapes"])]
    worded = [r for r, w in zip(reads, wants) if w.speed]
    n, nf = max(len(reads), 1), max(len(frames), 1)
    speeds = {w: [r["speed"] for r, c in zip(reads, wants) if c.speed == w and r["direction_right"]] for w in SPEEDS}
    return {"clips": len(reads), "background": sum(b for b, _ in frames) / nf,
            "shape_colour": sum(s for _, s in frames) / nf, "attributes": sum(b and s for b, s in frames) / nf,
            "direction": sum(r["direction_right"] for r in reads) / n,
            "speed": sum(r["speed_right"] for r in worded) / max(len(worded), 1),
            "motion_right": sum(r["motion_right"] for r in reads) / n, "all": sum(r["all_right"] for r in reads) / n,
            "all_interval": wilson(sum(r["all_right"] for r in reads), len(reads)),
            "speed_px": {w: float(np.mean(v)) if v else None for w, v in speeds.items()}, "clip_reads": reads}


def kept(teacher_reads: list[dict], reads: list[dict]) -> float | None:
    """Share of the teacher's all-right clips (`check` reads, caption by caption) that `reads` draws all right too;
    None when the teacher drew none all right."""
    k, n = kept_counts(teacher_reads, reads)
    return k / n if n else None


def kept_counts(teacher_reads: list[dict], reads: list[dict]) -> tuple[int, int]:
    """(of the teacher's all-right clips, how many `reads` draws all right too; how many the teacher drew)."""
    mine = [r["all_right"] for t, r in zip(teacher_reads, reads, strict=True) if t["all_right"]]
    return sum(mine), len(mine)


def wilson(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson score interval [low, high] of a share of k in n (None for n = 0): a kept figure's
    uncertainty, honest near 0 and 1 where the normal approximation is not."""
    if not n:
        return None
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [max(0.0, mid - half), min(1.0, mid + half)]


def speed_ratio(teacher_reads: list[dict], reads: list[dict]) -> float | None:
    """Mean of speed / the teacher's speed over the clips both drew in the right direction (so both read >=
    MIN_SPEED); None when there are none: "slow motion" as a number."""
    both = [r["speed"] / t["speed"] for t, r in zip(teacher_reads, reads, strict=True)
            if t["direction_right"] and r["direction_right"]]
    return float(np.mean(both)) if both else None


def fidelity(drawn, given, reads: list[dict]) -> dict:
    """How closely drawn clips start from the given ones, clip by clip (`given`: each clip [F, H, W, 3], or its
    first frame alone [1, H, W, 3]; `reads`: the drawn clips' `read`s): `first_frame_mad`, the mean absolute
    difference of drawn frame 0 to given frame 0 in 8-bit levels; `start_px`, the mean distance in pixels between the
    shape's centroid in drawn and given frame 0 over the clips where both show it (their share: `start_read`; None
    where none do); with whole given clips (more than one frame) `track_px`, the same distance over every frame."""
    mad = float(np.mean([np.abs(d[0].astype(np.float32) - g[0].astype(np.float32)).mean()
                         for d, g in zip(drawn, given, strict=True)]))
    wants = [read(g)["centres"] for g in given]

    def dist(frames: slice):
        d = [float(np.hypot(a[0] - b[0], a[1] - b[1])) for r, w in zip(reads, wants)
             for a, b in zip(r["centres"][frames], w[frames]) if a is not None and b is not None]
        return (float(np.mean(d)) if d else None), len(d)

    (start, n_start), (track, _) = dist(slice(0, 1)), dist(slice(None))
    out = {"first_frame_mad": mad, "start_px": start, "start_read": n_start / max(len(drawn), 1)}
    return out | ({"track_px": track} if all(len(g) > 1 for g in given) else {})
