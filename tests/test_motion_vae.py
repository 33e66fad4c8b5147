"""The motion checker on the tiny video teacher's VAE round trip, the pixels it reads in eval (every clip a model
draws is that decoder's output): the colour pairs whose blur halo is nearest a third palette colour read right
(docs/tiny-video-teacher.md, "The checker on the VAE round trip"; scripts/check_checker_vae.py measures every pair)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from pipeline import clips
from scripts.check_checker_vae import VAE, round_trip
from stages.sample import motion
from stages.sample.attributes import NAMES, labels

HALO = [("yellow", "red"), ("red", "yellow"), ("blue", "red"), ("black", "orange")]  # halo: orange, orange, purple, red


def _old_rule(clip) -> list[str]:
    """Per frame, the shape colour as motion.read took it before: the most common colour but the background's."""
    return [NAMES[np.argsort(np.bincount(labels(f).ravel(), minlength=len(NAMES)), kind="stable")[-2]] for f in clip]


def test_halo_pairs_read_right_through_the_vae():
    dirs = list(clips.DIRECTIONS)
    cs = [clips.Clip(colour, kind, dirs[i % 4], "", bg) for i, ((colour, bg), kind) in
          enumerate((pair, kind) for pair in HALO for kind in ("circle", "hexagon"))]
    u8 = np.stack([clips.render(c, random.Random(i)) for i, c in enumerate(cs)])
    rec = round_trip(AutoencoderKLWan.from_pretrained(str(VAE), torch_dtype=torch.float32).eval(), u8, 8, False)
    for clip, c in zip(rec, cs):
        read = motion.check(clip, c.caption)
        assert read["all_right"], (c.caption, read["shapes"], read["direction"], read["speed"])
    for clip, c in zip(rec[:4], cs[:4]):  # yellow on red, red on yellow: the old rule read the halo, orange
        assert Counter(_old_rule(clip)).most_common(1)[0][0] == "orange", c.caption
    for clip, c in zip(u8, cs):  # the clean clips: both rules read the shape
        assert motion.check(clip, c.caption)["all_right"] and set(_old_rule(clip)) == {c.colour}
