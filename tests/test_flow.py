"""The optical-flow motion reader (stages/sample/flow.py) validated on motion it is known to read: the clip
generator's drawn speeds and directions, pans and zooms of a smooth texture, still, reversed and slowed clips."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
from PIL import Image

from pipeline import clips
from pipeline.errors import UserError
from pipeline.sampling import latent_motion, motion_ratio
from stages.sample import flow

pytest.importorskip("cv2", reason="flow.py needs OpenCV: pip install -e '.[motion]' (opencv-python-headless)")

SHAPES, _, CLIPS = clips.batch(0, 0, 96)
READS = [flow.read(c) for c in SHAPES]


def _texture(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth random RGB texture, uint8: detail at every place, nothing periodic."""
    x = np.random.default_rng(seed).random((h // 4 + 3, w // 4 + 3, 3))
    img = Image.fromarray((x * 255).astype(np.uint8)).resize((w + 12, h + 12), Image.BICUBIC)
    return np.asarray(img)[6:-6, 6:-6]


def _pan(dx: int, dy: int, n: int = 128, frames: int = 9) -> np.ndarray:
    """Frames n x n whose content moves (dx, dy) pixels per frame: a window moving the other way over a texture."""
    big, o = _texture(n + 100, n + 100), 50
    return np.stack([big[o - dy * i:o - dy * i + n, o - dx * i:o - dx * i + n] for i in range(frames)])


def test_shape_clips_read_their_drawn_speed_and_direction():
    # Tolerance: each speed word's mean within 0.15 px, a fifth of the 0.75 px between drawn speeds, and each clip
    # within 0.5 px (measured: means 0.07 / 0.06 / 0.06 px off, worst clip 0.38, where the rasterised edge steps
    # 1 or 2 px and the top 5% reads the larger)
    for word, speed in clips.SPEEDS.items():
        err = [r["flow_px"] - speed for r, c in zip(READS, CLIPS) if c.speed == word]
        assert len(err) >= 20 and abs(np.mean(err)) < 0.15 and max(map(abs, err)) < 0.5, (word, err)
    for direction, step in clips.DIRECTIONS.items():
        vs = [np.mean(r["vectors"], 0) for r, c in zip(READS, CLIPS) if c.direction == direction]
        assert len(vs) >= 15 and all(v @ step / np.linalg.norm(v) > 0.95 for v in vs), direction
    assert flow.threshold(64, 64) == 1.5 and all(r["moves"] for r in READS if r["flow_px"] > 1.7)


@pytest.mark.parametrize("dx, dy", [(1, 0), (0, -2), (3, 2), (-4, 1)])
def test_a_panned_texture_reads_its_shift(dx, dy):
    r = flow.read(_pan(dx, dy))
    # within 0.2 px, 5% of the 4 px shift (measured: 0.04 / 0.01 / 0.06 / 0.12 px over, the edge where new content
    # enters reads high; 10 px shifts read 0.6 px over at 128x128, 0.5 at 256x256)
    assert abs(r["flow_px"] - np.hypot(dx, dy)) < 0.2, r["pairs"]
    assert np.allclose(np.mean(r["vectors"], 0), [dx, dy], atol=0.2)
    assert r["moves"] == (np.hypot(dx, dy) > flow.threshold(128, 128) == 3.0)


def test_a_zoom_reads_flow_growing_from_the_centre():
    base, n = Image.fromarray(_texture(192, 192)), 128
    frames = []
    for i in range(9):
        s = round(192 * 1.05 ** i)
        o = (s - n) // 2
        frames.append(np.asarray(base.resize((s, s), Image.BICUBIC).crop((o, o, o + n, o + n))))
    f = np.mean(list(flow.flows(np.stack(frames))), 0)
    y, x = np.mgrid[:n, :n] - (n - 1) / 2
    r = np.hypot(x, y)
    outward = (f[..., 0] * x + f[..., 1] * y) / np.maximum(r, 1)
    rings = [np.hypot(f[..., 0], f[..., 1])[(r >= a) & (r < a + 10)].mean() for a in range(0, 60, 10)]
    assert (outward[r > 8] > 0).mean() > 0.95 and np.all(np.diff(rings) > 0)
    assert np.allclose(rings[1:], 0.05 * np.arange(15, 60, 10), rtol=0.2)  # 5% per frame: 0.05 px per px out
    assert flow.read(np.stack(frames))["moves"]


def test_a_still_clip_reads_no_flow_and_no_flicker():
    for frame in (SHAPES[0][0], _texture(128, 128)):
        r = flow.read(np.repeat(frame[None], 9, 0))
        assert r["flow_px"] < 0.01 and not r["moves"] and r["flicker"] == 0
    still = [flow.read(np.repeat(c[:1], 9, 0)) for c in SHAPES[:4]]
    vs = flow.compare(still, READS[:4])  # a still teacher: nothing to keep a ratio or direction of
    assert vs["flow_ratio"] is None and vs["flow_ratio_of"] == 0 and vs["direction"] is None
    s = flow.summary(still)
    assert s["dynamic_degree"] == 0 and s["dynamic_degree_of"] == 4 and s["dynamic_degree_interval"][0] == 0


def test_a_reversed_clip_keeps_the_flow_and_reverses_the_direction():
    back = [flow.read(c[::-1]) for c in SHAPES[:16]] + [flow.read(_pan(3, 1)[::-1])]
    vs = flow.compare(READS[:16] + [flow.read(_pan(3, 1))], back)
    assert abs(vs["flow_ratio"] - 1) < 0.05 and vs["flow_ratio_of"] == 17 and vs["direction"] < -0.95
    lo, hi = vs["flow_ratio_interval"]
    assert lo <= vs["flow_ratio"] <= hi and hi - lo < 0.1
    assert flow.compare(READS[:16], READS[:16])["direction"] == pytest.approx(1)


def test_a_slowed_clip_reads_its_flow_ratio():
    specs = [c for c in CLIPS if c.speed == "quickly"][:8]
    fast = [flow.read(clips.render(c, random.Random(i))) for i, c in enumerate(specs)]
    slow = [flow.read(clips.render(clips.Clip(c.colour, c.shape, c.direction, "slowly", c.background),
                                   random.Random(i))) for i, c in enumerate(specs)]
    vs = flow.compare(fast, slow)  # drawn at 1.5 against 3.0 px per frame
    assert abs(vs["flow_ratio"] - 0.5) < 0.1 and vs["direction"] > 0.95
    pan = _pan(2, 1)
    held = pan[[0, 0, 1, 1, 2, 2, 3, 3, 4]]  # every other frame repeated: half the motion per pair
    assert flow.compare([flow.read(pan)], [flow.read(held)])["flow_ratio"] == pytest.approx(0.5, abs=0.03)


def test_latent_motion():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 4, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    still = x[:, :, :1].repeat(1, 1, 5, 1, 1)
    assert latent_motion(still) == [0.0] * 3
    assert motion_ratio(latent_motion(x), latent_motion(x)) == pytest.approx(1)
    assert motion_ratio(latent_motion(x.numpy() * 2), latent_motion(x)) == pytest.approx(2)
    assert latent_motion(x.to(torch.bfloat16)) == pytest.approx(latent_motion(x), rel=0.02)
    assert motion_ratio([1.0, 2.0], [0.0, 1.0]) == 2.0 and motion_ratio([1.0], [0.0]) is None  # a still teacher clip: no ratio


def test_without_opencv_the_figures_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 raises ImportError
    with pytest.raises(UserError, match=r"wandistiller\[motion\]"):
        flow.read(SHAPES[0])
