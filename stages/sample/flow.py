"""Motion by optical flow, weight-free, for `wandistiller eval`: dense flow of each consecutive frame pair by OpenCV's
DIS (MEDIUM preset, on grayscale at the frame's own size), read the VBench dynamic-degree way (the mean of the top 5%
flow magnitudes of a pair, in pixels); across a model's clips against the teacher's of the same prompts and noise,
the share that moves, the flow ratio and the direction kept. `latent_motion` is the figure that needs no decoding.

Why DIS MEDIUM: measured on clips.batch(0, 0, 96) (flat-coloured shapes, 64x64), the mean |flow_px - drawn speed| is
0.105 / 0.060 / 0.064 px for slowly / (none) / quickly (1.5 / 2.25 / 3.0 px per frame), direction right in 96 of 96;
Farneback reads 0.33 / 0.26 / 0.17 (its windows blur a small shape's edge into the flat inside), DIS FAST and
ULTRAFAST 0.15-0.28, and 2x or 4x upscaling made every method worse, so frames stay at their size. On a smooth random
texture panned 1-5 px per frame (128x128 crops) DIS reads the shift within 0.13 px (10 px: 0.6 over at 128x128, 0.5
at 256x256: the edge where new content enters is in the top 5%; Farneback is closer there, 0.07-0.4); a 3% zoom per
frame reads 0.03 px per pixel out from the centre. Grayscale costs the palette nothing: red on purple (1 gray level
apart) reads as well as any. A still clip with iid noise (sigma 3-8 levels) reads about 0.67 px at 64x64, hence
FLOOR: half the motion threshold (0.75 px there), not a quarter. Time on 2 CPU cores: 9x64x64 4 ms, 81x480x832 3.6 s.
"""

from __future__ import annotations

import numpy as np

from pipeline.errors import UserError

from .motion import wilson

TOP = 0.05  # the share of a pair's pixels, by flow magnitude, its score is the mean of (VBench)
FLOOR = 0.5  # of the motion threshold: a teacher clip slower than this has no ratio or direction to keep
RESAMPLES = 2000  # the flow ratio's bootstrap interval: percentile, seed 0


def threshold(h: int, w: int) -> float:
    """VBench's motion threshold in pixels per frame pair for frames of h x w: 6 per 256 pixels of the short side."""
    return 6.0 * min(h, w) / 256


def flows(clip):
    """Dense flow [H, W, 2] (dx, dy pixels) from each frame of `clip` [F, H, W, 3] (RGB uint8, or float in [0, 1])
    to the next, one pair at a time (an 81x480x832 clip's would be 256 MB at once)."""
    try:  # imported here: only eval's flow figures need OpenCV (the `motion` extra)
        import cv2
    except ImportError as e:
        raise UserError("eval's optical-flow figures need OpenCV: pip install 'wandistiller[motion]' "
                        "(opencv-python-headless)") from e
    dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
    gray = [cv2.cvtColor(f, cv2.COLOR_RGB2GRAY) for f in _u8(clip)]
    return (dis.calc(a, b, None) for a, b in zip(gray, gray[1:]))


def _u8(clip) -> np.ndarray:
    clip = np.asarray(clip)
    return clip if clip.dtype == np.uint8 else (np.clip(clip, 0, 1) * 255).round().astype(np.uint8)


def read(clip) -> dict:
    """One clip [F >= 2, H, W, 3]: per pair the dynamic-degree score (`pairs`, px) and the mean flow vector of its
    top-5% pixels (`vectors`, [dx, dy]); `flow_px`, the mean score; `threshold` (px); `moves` (VBench: at least
    max(1, round(4 * pairs / 16)) pairs over the threshold); `flicker`, the mean absolute difference of consecutive
    frames in 8-bit levels."""
    clip = _u8(clip)
    if len(clip) < 2:
        raise ValueError(f"optical flow needs at least 2 frames, not {len(clip)}")
    k = max(1, round(TOP * clip.shape[1] * clip.shape[2]))
    scores, vectors = [], []
    for f in flows(clip):
        m = np.hypot(f[..., 0], f[..., 1]).ravel()
        top = np.argpartition(m, -k)[-k:]
        scores.append(float(m[top].mean()))
        vectors.append([float(v) for v in f.reshape(-1, 2)[top].mean(0)])
    thr = threshold(*clip.shape[1:3])
    flicker = np.mean([np.abs(a.astype(np.int16) - b).mean() for a, b in zip(clip, clip[1:])])
    return {"pairs": scores, "vectors": vectors, "flow_px": float(np.mean(scores)), "threshold": thr,
            "moves": sum(s > thr for s in scores) >= max(1, round(4 * len(scores) / 16)), "flicker": float(flicker)}


def summary(reads: list[dict]) -> dict:
    """A model's clips (`read`s): `dynamic_degree`, the share that moves (`moving` of `dynamic_degree_of`, its 95%
    Wilson `dynamic_degree_interval`), mean `flow_px` and mean `flicker`."""
    k, n = sum(r["moves"] for r in reads), len(reads)
    return {"dynamic_degree": k / n if n else None, "moving": k, "dynamic_degree_of": n,
            "dynamic_degree_interval": wilson(k, n), "flow_px": _mean([r["flow_px"] for r in reads]),
            "flicker": _mean([r["flicker"] for r in reads])}


def compare(teacher_reads: list[dict], reads: list[dict]) -> dict:
    """`summary(reads)` and, clip by clip against the teacher's `read`s of the same prompts and noise (same order):
    `flow_ratio`, the mean of flow_px / the teacher's over the clips where the teacher's is at least FLOOR of the
    threshold (`flow_ratio_of` of them; `flow_ratio_interval`, a 95% percentile bootstrap of that mean, seed 0, None
    under 2); `direction`, the mean over clips of the mean cosine between the two top-5% flow vectors per pair, over
    pairs where both vectors are at least FLOOR of the threshold long (1: same way, -1: reversed; `direction_of`
    clips)."""
    ratios, cosines = [], []
    for t, r in zip(teacher_reads, reads, strict=True):
        floor = FLOOR * t["threshold"]
        if t["flow_px"] >= floor:
            ratios.append(r["flow_px"] / t["flow_px"])
        cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
               for a, b in zip(t["vectors"], r["vectors"], strict=True)
               if min(np.linalg.norm(a), np.linalg.norm(b)) >= floor]
        if cos:
            cosines.append(np.mean(cos))
    interval = None
    if len(ratios) > 1:
        x = np.array(ratios)
        means = x[np.random.default_rng(0).integers(0, len(x), (RESAMPLES, len(x)))].mean(1)
        interval = [float(v) for v in np.percentile(means, [2.5, 97.5])]
    return summary(reads) | {"flow_ratio": _mean(ratios), "flow_ratio_of": len(ratios),
                             "flow_ratio_interval": interval, "direction": _mean(cosines),
                             "direction_of": len(cosines)}


def _mean(x) -> float | None:
    return float(np.mean(x)) if len(x) else None
