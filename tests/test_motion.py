"""Moving-shape clips (pipeline/clips.py) and the motion checker (stages/sample/motion.py), validated on the drawn
clips themselves: numpy only, no model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeline import clips, shapes
from pipeline.prompts import read_prompt_file
from pipeline.tiny_teacher import _WORDS, build_tokenizer
from stages.sample import motion

EXTRA = ("moving", "quickly", "slowly")  # scripts/train_tiny_video_teacher.EXTRA_WORDS


def _clip(caption: str, seed: int = 0) -> np.ndarray:
    return clips.render(clips.parse_caption(caption), random.Random(seed))


def test_clips_are_reproducible_seeded_and_split():
    a, caps_a, _ = clips.batch(0, 5, 6)
    b, caps_b, _ = clips.batch(0, 5, 6)
    assert a.shape == (6, clips.FRAMES, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and caps_a == caps_b and caps_a != clips.batch(1, 5, 6)[1]
    train = {clips.clip_for(0, i).caption for i in range(300)}
    held = {clips.clip_for(0, i, "heldout").caption for i in range(60)}
    assert not train & held and all(shapes.is_heldout(c) for c in held)
    for cap in list(train)[:40] + list(held)[:40]:
        assert clips.parse_caption(cap).caption == cap
    committed = read_prompt_file("data/clips-heldout.txt")
    assert len(set(committed)) == len(committed) == 128 and all(clips.is_heldout(c) for c in committed)


@pytest.mark.parametrize("bad", ["a small red circle in the top left on a blue background",
                                 "a red circle moving from left to left on a blue background",
                                 "a red circle moving fast from left to right on a blue background"])
def test_other_captions_are_refused(bad):
    with pytest.raises(ValueError, match="not a clips caption"):
        clips.parse_caption(bad)


def test_caption_words_are_whole_pieces_and_other_ids_stay():
    words = {w for i in range(300) for w in clips.clip_for(0, i).caption.split()}
    assert words - set(_WORDS) == set(EXTRA)
    plain, tok = build_tokenizer(), build_tokenizer(EXTRA)
    assert len(tok) == len(plain) + len(EXTRA) and tok.get_vocab().items() >= plain.get_vocab().items()
    cap = "a red circle moving quickly from left to right on a blue background"
    assert len(tok(cap).input_ids) == len(cap.split()) + 1  # one piece a word, then </s>


def test_paths_stay_inside_the_frame_at_the_drawn_speed():
    for i in range(40):
        clip = clips.clip_for(0, i)
        c = clips.track(clip, random.Random(i))
        assert c.min() >= clips.RADIUS + clips.MARGIN and c.max() <= 64 - clips.RADIUS - clips.MARGIN
        step = np.diff(c, axis=0)
        assert np.allclose(step, np.array(clips.DIRECTIONS[clip.direction]) * clips.SPEEDS[clip.speed])


def test_checker_reads_the_drawn_clips_right():
    """Ground truth: every direction at every speed, shapes of every kind, scored 100% with the drawn speeds."""
    u8, caps, _ = clips.batch(0, 0, 24)
    s = motion.score(list(u8), caps)
    assert {s[k] for k in ("background", "shape_colour", "attributes", "direction", "speed", "motion_right", "all")} \
        == {1.0}
    for word, px in s["speed_px"].items():
        assert px is None or abs(px - clips.SPEEDS[word]) < 0.05, (word, px)
    read = s["clip_reads"][0]
    assert len(read["backgrounds"]) == len(read["centres"]) == clips.FRAMES and read["all_right"]


def test_checker_survives_noise_and_float_frames():
    u8, caps, _ = clips.batch(0, 30, 6)
    noisy = np.clip(u8 + np.random.default_rng(0).normal(0, 12, u8.shape), 0, 255) / 255.0  # float in [0, 1]
    s = motion.score(list(noisy), caps)
    assert s["direction"] == s["attributes"] == 1.0


def test_checker_catches_wrong_motion():
    cap = "a red circle moving quickly from left to right on a blue background"
    clip = _clip(cap)
    backwards = motion.check(clip[::-1], cap)
    assert backwards["direction"] == "from right to left" and not backwards["motion_right"]
    assert backwards["frames_right"] == 1.0  # the colours are right in every frame, only the motion is wrong
    slow = motion.check(clip, cap.replace("quickly", "slowly"))
    assert slow["direction_right"] and not slow["speed_right"] and not slow["all_right"]
    assert motion.check(clip, cap.replace(" quickly", ""))["motion_right"]  # no speed word: any speed
    still = motion.check(np.repeat(clip[:1], clips.FRAMES, axis=0), cap)
    assert still["direction"] is None and still["speed"] < motion.MIN_SPEED and not still["motion_right"]
    empty = motion.check(np.repeat(clip[:, :1, :1], 64, axis=1).repeat(64, axis=2), cap)  # background only
    assert empty["direction"] is None and set(empty["shapes"]) == {None} and empty["frames_right"] == 0.0


def test_score_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="2 clips but 1 captions"):
        motion.score([np.zeros((9, 64, 64, 3), np.uint8)] * 2, ["x"])


@pytest.mark.slow
def test_video_training_recipe_runs_end_to_end(tmp_path):
    """scripts/train_tiny_video_teacher.py with a handful of steps: a Wan 2.2 pipeline that draws 9-frame clips
    (VAE with temporal layers, 3 latent frames), the clips' words as whole pieces, and its TRAINING.json."""
    import json
    import subprocess
    import sys

    import torch
    from diffusers import WanPipeline

    held = tmp_path / "held.txt"
    held.write_text("\n".join(read_prompt_file("data/clips-heldout.txt")[:2]) + "\n")
    out = tmp_path / "teacher"
    subprocess.run([sys.executable, "scripts/train_tiny_video_teacher.py", "--out", str(out), "--vae-steps", "2",
                    "--vae-batch", "1", "--pool", "4", "--shared-steps", "2", "--expert-steps", "2",
                    "--expert-batch", "4", "--eval-every", "0", "--vae-score-clips", "2", "--heldout", str(held),
                    "--threads", "1"], check=True, capture_output=True, text=True)
    report = json.loads((out / "TRAINING.json").read_text())
    assert report["heldout_captions"] == 2 and 0.0 <= report["heldout_score"]["motion_right"] <= 1.0
    pipe = WanPipeline.from_pretrained(out, torch_dtype=torch.float32)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
    assert list(pipe.vae.config.temperal_downsample) == [False, True, True] and pipe.vae_scale_factor_spatial == 16
    assert report["extra_words"] == list(EXTRA) and len(pipe.tokenizer) == len(build_tokenizer()) + len(EXTRA)
    frames = pipe(prompt=["a red circle moving from left to right on a blue background"], num_frames=clips.FRAMES,
                  height=64, width=64, num_inference_steps=2, output_type="np").frames
    assert frames.shape == (1, clips.FRAMES, 64, 64, 3)


def test_motion_kept_and_speed_ratio_from_the_drawn_clips():
    """eval's figures against the teacher, with the drawn clips as the teacher: the same clips keep all its motion
    at its speed; reversed they keep none (no clip is right both ways); drawn slowly they keep none, at half speed."""
    caps = [clips.clip_for(0, i).caption for i in range(8)]
    quick = [c.replace(" slowly", "").replace(" quickly", "").replace(" moving", " moving quickly") for c in caps]
    teacher = [motion.check(_clip(c, i), c) for i, c in enumerate(quick)]
    assert all(r["all_right"] for r in teacher)
    assert motion.kept(teacher, teacher) == 1.0 and motion.speed_ratio(teacher, teacher) == pytest.approx(1.0)
    reversed_ = [motion.check(_clip(c, i)[::-1], c) for i, c in enumerate(quick)]
    assert motion.kept(teacher, reversed_) == 0.0 and motion.speed_ratio(teacher, reversed_) is None
    slow = [motion.check(_clip(c.replace("quickly", "slowly"), i), c) for i, c in enumerate(quick)]
    assert motion.kept(teacher, slow) == 0.0
    half = clips.SPEEDS["slowly"] / clips.SPEEDS["quickly"]
    assert motion.speed_ratio(teacher, slow) == pytest.approx(half, abs=0.03)
    assert motion.kept(reversed_, teacher) is None  # a teacher with no all-right clip: nothing to keep


def test_kept_counts_and_their_wilson_interval():
    """A kept share's denominator is the teacher's all-right clips, and its 95% Wilson interval is the textbook one
    (84 of 87: 90.3-98.8%); the interval stays inside [0, 1] at the ends and is None without a denominator."""
    t = [{"all_right": a} for a in (True, True, True, False)]
    assert motion.kept_counts(t, [{"all_right": a} for a in (True, False, True, True)]) == (2, 3)
    lo, hi = motion.wilson(84, 87)
    assert (round(lo, 3), round(hi, 3)) == (0.903, 0.988)
    assert motion.wilson(0, 10)[0] == 0.0 and motion.wilson(10, 10)[1] == 1.0 and motion.wilson(0, 0) is None
