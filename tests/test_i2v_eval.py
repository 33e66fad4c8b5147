"""eval --attributes on an image-to-video cache: a list of clip captions, each with its clip's first frame, that the
teacher (WanImageToVideoPipeline given the image) and every student (the image's condition latent) draw from the same
noise; the motion checker scores each, with each one's first-frame fidelity to the given image, the image the grid's
first column. The tiny random teacher draws no shapes: the plumbing and the figures' consistency are asserted, not
their values. The wrong form of file for the cache is refused in one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import clips
from pipeline.prompts import read_prompt_file
from stages.sample.attributes import caption_noise
from stages.sample.motion import fidelity, read
from stages.sample.sample import frame_strip, grid_layout, to_clips

from conftest import make_cache
from test_i2v_sample import FRAMES, MSL, SIDE, invoke, one_block, one_line_error, train

ROOT = Path(__file__).resolve().parents[1]
FIDELITY = {"first_frame_mad", "start_px", "start_read"}


def first_frames(folder: Path, n: int = 3) -> tuple[Path, Path]:
    """The first n held-out clip captions as an image list (each image frame 0 of a clip of its caption,
    pipeline/clips.render) and as captions alone."""
    folder.mkdir(parents=True, exist_ok=True)
    caps = read_prompt_file(ROOT / "data" / "clips-heldout.txt")[:n]
    for i, c in enumerate(caps):
        Image.fromarray(clips.render(clips.parse_caption(c), random.Random(i))[0]).save(folder / f"first{i}.png")
    (folder / "images.tsv").write_text("".join(f"first{i}.png\t{c}\n" for i, c in enumerate(caps)))
    (folder / "captions.txt").write_text("\n".join(caps) + "\n")
    return folder / "images.tsv", folder / "captions.txt"


@pytest.fixture(scope="module")
def built(tiny_teacher_factory, tmp_path_factory):
    """built(variant) -> (teacher, image list, captions alone, cache, run): the tiny teacher's cache of the list's 3
    images x 5 frames (CFG; I2V: both experts), a student of one block trained 2 steps on it."""
    made = {}

    def build(variant: str):
        if variant not in made:
            folder = tmp_path_factory.mktemp(f"{variant}-eval")
            images, captions = first_frames(folder / "images")
            teacher = tiny_teacher_factory(variant)
            cache = make_cache(teacher, None, folder / "cache", images=str(images), frames=FRAMES,
                               guidance_2=3.0 if variant == "i2v" else None)
            (folder / "run").mkdir()
            made[variant] = teacher, images, captions, cache, train(cache, folder / "run" / "out",
                                                                    student_config=one_block(teacher, folder / "run"))
        return made[variant]

    return build


def evaluate(run: Path, cache: Path, images: Path, report: Path, *more) -> tuple[str, dict]:
    r = invoke("eval", "--student", run, "--cache", cache, "--report", report, "--device", "cpu", "--attributes",
               images, "--attribute-max-prompts", 2, "--attribute-grid", 2, "--timing-runs", 1, *more)
    assert r.exit_code == 0, r.output
    return r.output, json.loads(report.read_text())


def test_fidelity_of_a_clip_to_its_own_first_frame_is_zero():
    clip = clips.render(clips.parse_caption(read_prompt_file(ROOT / "data" / "clips-heldout.txt")[0]),
                        random.Random(0))
    reads = [read(clip)]
    assert fidelity([clip], [clip[:1]], reads) == {"first_frame_mad": 0.0, "start_px": 0.0, "start_read": 1.0}
    assert fidelity([clip], [clip], reads)["track_px"] == 0.0  # a whole given clip: its track too
    c0, c1 = reads[0]["centres"][:2]  # given frame 1 as the image: the shape's start one frame's move away
    got = fidelity([clip], [clip[1:2]], reads)
    assert got["start_px"] == pytest.approx(math.hypot(c0[0] - c1[0], c0[1] - c1[1])) and got["start_px"] > 0
    assert got["first_frame_mad"] == pytest.approx(np.abs(clip[0].astype(float) - clip[1]).mean())
    blank = np.full_like(clip[:1], 255)  # no shape in the given image: no start distance
    assert fidelity([clip], [blank], reads)["start_px"] is None and fidelity([clip], [blank], reads)["start_read"] == 0


@pytest.mark.slow
def test_eval_scores_motion_and_first_frame_fidelity_on_an_i2v_cache(built, tmp_path):
    from diffusers import WanImageToVideoPipeline

    teacher, images, _, cache, run = built("i2v")
    output, rep = evaluate(run, cache, images, tmp_path / "a" / "eval.json")
    att = rep["attributes"]
    assert att["captions"] == 2 and att["frames"] == FRAMES and att["prompts"] == str(images)
    # timed on --attributes' images (the cache records none), every model with the image's encoding by the VAE
    t = rep["timing"]
    assert t["teacher"]["denoise_s_per_image"] > 0 and t["entries"]["student"]["speedup_denoise"] > 0
    assert t["teacher_final_mse"] is None and not any("teacher timing" in w for w in rep["warnings"])
    for who in ("teacher", "student"):
        a = att[who]
        assert a["clips"] == 2 and all(0.0 <= a[k] <= 1.0 for k in ("background", "shape_colour", "motion_right"))
        ff = a["first_frame"]
        assert set(ff) == FIDELITY and math.isfinite(ff["first_frame_mad"]) and ff["first_frame_mad"] >= 0
        assert (ff["start_px"] is None) == (ff["start_read"] == 0)
    s = att["student"]
    assert s["kept"] is None or 0.0 <= s["kept"] <= 1.0
    assert s["speed_ratio"] is None or s["speed_ratio"] > 0.0
    teacher_row, row = rep["table"]
    for r, who in ((teacher_row, "teacher"), (row, "student")):
        assert r["first_frame_mad"] == att[who]["first_frame"]["first_frame_mad"]
        assert r["start_px"] == att[who]["first_frame"]["start_px"]
    assert {"kept", "speed_ratio"} <= row.keys() and "kept" not in teacher_row
    assert "frame 0 MAD" in output and "start px" in output
    assert f"frame 0 against the given image: teacher {att['teacher']['first_frame']['first_frame_mad']:.2f}" in output

    # the grid: the given image, then the teacher's clip as diffusers' WanImageToVideoPipeline draws it from that image
    # and the caption's noise, then the student's
    columns = ["image", "teacher", "student"]
    grid = Image.open(att["grid"])
    layout = grid_layout(columns, SIDE * FRAMES, SIDE)
    assert grid.size == layout.size(2, 3)

    def cell(r: int, c: int) -> np.ndarray:
        x, y = layout.origin(r, c)
        return np.asarray(grid.crop((x, y, x + layout.cell_w, y + layout.cell_h)), dtype=np.int16)

    pipe = WanImageToVideoPipeline.from_pretrained(teacher)
    st, caps = att["settings"], [line.split("\t")[1] for line in images.read_text().splitlines()]
    for i in range(2):
        given = Image.open(images.parent / f"first{i}.png").convert("RGB")
        np.testing.assert_array_equal(cell(i, 0)[:, :SIDE], np.asarray(given, dtype=np.int16))
        ref = pipe(image=given, prompt=caps[i], negative_prompt=st["negative_prompt"], height=SIDE,
                   width=SIDE, num_frames=FRAMES, num_inference_steps=st["steps"], guidance_scale=st["guidance"],
                   guidance_scale_2=st["guidance_2"], latents=caption_noise(pipe, 0, i, 1, SIDE, SIDE, 2),
                   max_sequence_length=MSL, output_type="np").frames
        assert np.abs(cell(i, 1) - np.asarray(frame_strip(to_clips(ref)[0]), dtype=np.int16)).max() <= 1
    assert not np.array_equal(cell(0, 1), cell(0, 2))

    # the same run with a second student: the teacher's figures (and the first student's) are what they were
    _, again = evaluate(run, cache, images, tmp_path / "b" / "eval.json", "--compare", teacher / "transformer")
    for who in ("teacher", "student"):
        assert again["attributes"][who] == att[who]
    other = again["attributes"]["transformer"]
    assert set(other["first_frame"]) == FIDELITY and {"kept", "speed_ratio"} <= other.keys()
    assert [r["label"] for r in again["table"]] == ["teacher", "student", "transformer"]


@pytest.mark.slow
def test_under_ti2v_every_model_draws_frame_0_from_the_image(built, tmp_path):
    """TI2V's image is latent frame 0 of every model's output (the pipeline and the sampler re-impose it), so the
    teacher and the student, each given the image, draw the same frame 0: the same first-frame figures."""
    _, images, _, cache, run = built("ti2v")
    _, rep = evaluate(run, cache, images, tmp_path / "eval.json")
    t, s = rep["attributes"]["teacher"]["first_frame"], rep["attributes"]["student"]["first_frame"]
    assert s["first_frame_mad"] == pytest.approx(t["first_frame_mad"], abs=0.05) and s["start_read"] == t["start_read"]
    assert rep["final_latent_mse"]["student"] > 0  # (the clips after frame 0 are the student's own)


@pytest.mark.slow
def test_the_wrong_form_of_attributes_file_is_one_line(built, tiny_teacher, tiny_video_cache, tmp_path):
    _, images, captions, cache, run = built("i2v")
    report = tmp_path / "eval.json"
    one_line_error(invoke("eval", "--student", run, "--cache", cache, "--report", report, "--attributes", captions),
                   "captions alone, and the cache is image-to-video", "<image path><TAB><clip caption>")
    # a bare text-to-video transformer on a text-to-video video cache, given the image list
    one_line_error(invoke("eval", "--student", tiny_teacher / "transformer", "--cache", tiny_video_cache, "--report",
                          report, "--attributes", images), "is an image list", "text-to-video",
                   "pass the captions alone")
    shapes = tmp_path / "shapes.tsv"  # an image list of captions the motion checker cannot read
    shapes.write_text(f"{images.parent / 'first0.png'}\t{read_prompt_file(ROOT / 'data' / 'shapes-heldout.txt')[0]}\n")
    one_line_error(invoke("eval", "--student", run, "--cache", cache, "--report", report, "--attributes", shapes),
                   "not a clips caption", "clips-heldout.txt")
    assert not report.exists()
