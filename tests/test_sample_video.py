"""Frames through `sample`, and the committed tiny video teacher as `tiny-teacher --variant video-pretrained`.

A video run (distill.json's frames > 1) draws whole clips at that frame count: a grid of frame strips, and each clip
as a lossless animated WebP beside it (PIL: the venv has neither imageio nor OpenCV, the backends of diffusers'
export_to_video). The image run's files are test_sample.py's, unchanged."""

from __future__ import annotations

import filecmp
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image, ImageSequence

from conftest import TEST_PROMPTS, make_cache
from pipeline import tiny_teacher
from pipeline.cli import main
from pipeline.prompts import read_prompt_file
from stages.sample import motion
from stages.sample.sample import grid_layout, initial_latents, to_clips
from test_sample import SIDE, assert_one_line_error, crop, invoke, tiny_student, write_run

FRAMES = 5  # the tiny random teacher's clips: 2 latent frames
# Held-out captions (data/clips-heldout.txt) the video teacher draws in the right direction from noise seed = index,
# as its recipe scored them (TRAINING.json eval_settings): one left to right, one right to left.
RIGHT = (3, 6)


@pytest.mark.slow
def test_video_variant_copies_the_committed_teacher_and_draws_motion(tmp_path):
    from diffusers import WanPipeline

    out = tmp_path / "video-teacher"
    r = CliRunner().invoke(main, ["tiny-teacher", "--out", str(out), "--variant", "video-pretrained"])
    assert r.exit_code == 0, r.output
    data = tiny_teacher.VIDEO_PRETRAINED_DIR
    for f in data.rglob("*"):
        if f.is_file():
            assert filecmp.cmp(f, out / f.relative_to(data), shallow=False), f
    pipe = WanPipeline.from_pretrained(out)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None  # Wan 2.2: two experts
    settings = json.loads((out / "TRAINING.json").read_text())["eval_settings"]
    captions = [read_prompt_file("data/clips-heldout.txt")[i] for i in RIGHT]
    assert "from left to right" in captions[0] and "from right to left" in captions[1]
    shape = (16, 3, SIDE // pipe.vae_scale_factor_spatial, SIDE // pipe.vae_scale_factor_spatial)
    latents = torch.stack([initial_latents(i, shape) for i in RIGHT])
    frames = pipe(prompt=captions, latents=latents, output_type="np", **settings).frames
    assert frames.shape == (2, 9, SIDE, SIDE, 3)
    for clip, caption in zip(to_clips(frames), captions):
        read = motion.check(clip, caption)
        assert read["direction_right"] and read["speed"] >= motion.MIN_SPEED, (caption, read["direction"])


def test_missing_video_weights_end_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_teacher, "VIDEO_PRETRAINED_DIR", tmp_path / "gone")
    r = CliRunner().invoke(main, ["tiny-teacher", "--out", str(tmp_path / "t"), "--variant", "video-pretrained"])
    assert_one_line_error(r, "video-pretrained", "missing", "train_tiny_video_teacher.py")


@pytest.fixture(scope="module")
def video_run(tiny_teacher, tmp_path_factory):
    """A student of a 5-frame cache of the tiny random teacher (untrained: sample draws what it is given)."""
    prompts = tmp_path_factory.mktemp("video-prompts") / "two.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    cache = make_cache(tiny_teacher, prompts, tmp_path_factory.mktemp("video-cache") / "cache", frames=FRAMES,
                       steps=2)
    return write_run(tmp_path_factory.mktemp("video-run") / "run", tiny_student(), cache, tiny_teacher)


def read_webp(path) -> tuple[list[np.ndarray], list[int]]:
    im = Image.open(path)
    return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)], [im.info.get("duration")]


@pytest.mark.slow
def test_sample_of_a_video_student_writes_clips_and_frame_strips(video_run, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    out = tmp_path / "s" / "grid.png"
    r = invoke(["sample", "--student", video_run, "--compare", video_run, "--prompts", prompts, "--out", out,
                "--fps", 4, "--steps", 2, "--student-steps", 2])
    assert r.exit_code == 0, r.output
    meta = json.loads(out.with_name("grid.png.json").read_text())
    folder = out.with_name("grid-videos")
    assert f"6 clip(s) of {FRAMES} frames (animated WebP, 4 fps) written to {folder}" in r.output
    assert (meta["frames"], meta["fps"], meta["config"]["fps"]) == (FRAMES, 4, 4)
    names = ["teacher", "student", "run"]
    assert list(meta["videos"]) == names and meta["columns"] == ["teacher", "student (2 steps)", "run (2 steps)"]
    # The grid's cells are frame strips: FRAMES frames side by side.
    grid = Image.open(out)
    layout = grid_layout(meta["columns"], FRAMES * SIDE, SIDE)
    assert grid.size == layout.size(2, 3) == tuple(meta["size"])
    for col, name in enumerate(names):
        for row, path in enumerate(meta["videos"][name]):
            assert path == str(folder / f"{row:02d}-{name}.webp")
            frames, (duration,) = read_webp(path)
            assert len(frames) == FRAMES and frames[0].shape == (SIDE, SIDE, 3) and duration == 250
            # lossless: the video's frames are the grid cell's strip, pixel for pixel
            assert np.array_equal(np.concatenate(frames, axis=1), crop(grid, layout, row, col))
    teacher, student = (read_webp(meta["videos"][n][0])[0] for n in ("teacher", "student"))
    assert not np.array_equal(teacher[0], teacher[-1]) and not np.array_equal(teacher[0], student[0])


def test_video_only_settings_and_mixed_frame_counts_end_in_one_line(video_run, tiny_teacher, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(TEST_PROMPTS[0] + "\n")
    image_run = tmp_path / "image-run"  # the same student, as if trained on a one-frame cache
    (image_run / "student").mkdir(parents=True)
    for f in (video_run / "student").iterdir():
        (image_run / "student" / f.name).write_bytes(f.read_bytes())
    distill = json.loads((video_run / "distill.json").read_text())
    distill |= {"frames": 1, "latent_shape": [16, 1, *distill["latent_shape"][2:]]}
    (image_run / "distill.json").write_text(json.dumps(distill))
    out = tmp_path / "g.png"
    assert_one_line_error(invoke(["sample", "--student", image_run, "--prompts", prompts, "--out", out, "--fps", 4]),
                          "--fps applies only to video students", "drop --fps")
    assert_one_line_error(invoke(["sample", "--student", video_run, "--compare", image_run, "--prompts", prompts,
                                  "--out", out]), f"on a 1-frame cache, the student on a {FRAMES}-frame one")
    assert_one_line_error(invoke(["sample", "--student", image_run, "--compare", video_run, "--prompts", prompts,
                                  "--out", out]), f"on a {FRAMES}-frame cache, the student on a 1-frame one")
    assert not out.exists()
