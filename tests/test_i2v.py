"""Image-to-video in stage one: a cache of the tiny Wan2.2-I2V teacher (two experts, the image on the channels) and of
TI2V's image mode (the image in frame 0) holds WanImageToVideoPipeline's own trajectories, from the same image,
prompt and noise; the condition is stored once per trajectory and its refusals are one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import open_prompt_store, prompt_store_path
from conftest import TEST_PROMPTS, make_cache

NEG = "blurry, low quality"


def image_list(folder, n: int = 3):
    """n random RGB images and their list file (<path><TAB><prompt>), the last prompt repeated on another image."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        lines.append(f"img{i}.png\t{TEST_PROMPTS[min(i, n - 2)]}")
    (folder / "images.tsv").write_text("\n".join(lines) + "\n")
    return folder / "images.tsv"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["i2v", "ti2v"])
def test_final_latents_match_wan_image_to_video_pipeline(variant, tiny_teacher_factory, tmp_path):
    from diffusers import WanImageToVideoPipeline

    teacher = tiny_teacher_factory(variant)
    images = image_list(tmp_path / "images")
    g2 = 2.5 if variant == "i2v" else None
    cache = make_cache(teacher, None, tmp_path / "cache", images=str(images), frames=5, guidance=5.0,
                       guidance_2=g2, seeds_per_prompt=2, negative_prompt=NEG)
    m = load_manifest(cache)
    assert m.condition == ("concat" if variant == "i2v" else "first_frame")
    if variant == "i2v":
        assert set(m.experts) == {1, 2} and m.condition_shape == [20, 2, 8, 8]
    pipe = WanImageToVideoPipeline.from_pretrained(teacher).to("cpu")
    g = open_prompt_store(prompt_store_path(cache, 0))
    assert g[F.Z_CONDITION].shape == (3, 2, *m.condition_shape)
    for row in (0, 2):
        image = Image.open(images.parent / f"img{row}.png").convert("RGB")
        for seed_idx in (0, 1):
            noise = torch.from_numpy(g[F.Z_INIT_NOISE][row, seed_idx]).unsqueeze(0)
            ref = pipe(image=image, prompt=str(g[F.Z_TEXT][row]), negative_prompt=NEG, height=64, width=64,
                       num_frames=5, num_inference_steps=4, guidance_scale=5.0, guidance_scale_2=g2,
                       latents=noise.clone(), max_sequence_length=32, output_type="latent").frames
            got = torch.from_numpy(g[F.Z_FINAL_LATENTS][row, seed_idx]).unsqueeze(0)
            err = (got - ref).abs().max().item()
            assert err <= 1e-4 * ref.abs().max().item(), (variant, row, seed_idx, err)


def test_image_to_video_refusals(tiny_teacher_factory, prompts_file, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    images = image_list(tmp_path / "images")

    def run(*args):
        r = CliRunner().invoke(main, ["teacher-cache", "--out", str(tmp_path / "c"), "--dry-run", "--height", "64",
                                      "--width", "64", "--frames", "5", *args])
        return r.exit_code, r.output.strip().splitlines()[-1]

    code, line = run("--teacher", str(tiny_teacher_factory("i2v")), "--prompts", str(prompts_file))
    assert code == 2 and "image-to-video pipeline: give --images FILE" in line
    code, line = run("--teacher", str(tiny_teacher_factory("wan2.2")), "--images", str(images))
    assert code == 2 and "text-to-video only: drop --images" in line
    code, line = run("--teacher", str(tiny_teacher_factory("i2v")), "--images", str(images), "--prompts",
                     str(prompts_file))
    assert code == 2 and "give one of --prompts FILE" in line


@pytest.mark.slow
def test_images_from_a_video_cache_are_its_first_frames(tiny_teacher_factory, tiny_video_cache, tmp_path):
    """--images-from CACHE: the video cache's prompts, each with its decoded first frame; the same cache as --images of
    those frames saved as PNGs (lossless), condition for condition."""
    from stages.teacher_cache.first_frames import first_frames

    teacher = tiny_teacher_factory("i2v")
    made = make_cache(teacher, None, tmp_path / "from", images_from=str(tiny_video_cache), frames=5)
    images, prompts = first_frames(str(tiny_video_cache))
    assert prompts == TEST_PROMPTS[:2] and all(im.size == (64, 64) for im in images)
    (tmp_path / "png").mkdir()
    for i, im in enumerate(images):
        im.save(tmp_path / "png" / f"{i}.png")
    (tmp_path / "png" / "list.tsv").write_text("".join(f"{i}.png\t{p}\n" for i, p in enumerate(prompts)))
    listed = make_cache(teacher, None, tmp_path / "listed", images=str(tmp_path / "png" / "list.tsv"), frames=5)
    a, b = (open_prompt_store(prompt_store_path(c, 0)) for c in (made, listed))
    assert list(a[F.Z_TEXT][:]) == list(b[F.Z_TEXT][:]) == prompts
    np.testing.assert_array_equal(a[F.Z_CONDITION][:], b[F.Z_CONDITION][:])
    assert a[F.Z_CONDITION][:].any()


def test_plan_counts_the_condition_of_an_image_to_video_teacher():
    """plan on Wan2.2-I2V-A14B's configs: --images in stage one's command, the condition in the cache's bytes (one
    more float32 latent of 20 channels a trajectory than the text-to-video teacher of the same shape)."""
    from click.testing import CliRunner

    from conftest import ROOT
    from pipeline.cli import main

    def plan(teacher, *more, code=0):
        r = CliRunner().invoke(main, ["plan", "--teacher", str(ROOT / "tests" / "data" / teacher), "--prompts", "10",
                                      "--frames", "81", "--assume-gpus", "8x80GiB", "--assume-ram", "1TiB", "--json",
                                      *more])
        assert r.exit_code == code, r.output
        if code:
            return r.output
        import json

        return json.loads(r.output)

    i2v, t2v = plan("wan22-i2v-a14b-configs"), plan("wan22-a14b-configs")
    assert "--images IMAGES.tsv" in i2v["launch"]["commands"][0]["command"]
    assert "--prompts" not in i2v["launch"]["commands"][0]["command"]
    assert i2v["cache"]["condition"] == [20, 21, 60, 104] and t2v["cache"]["condition"] is None
    extra = i2v["cache"]["prompt_store_bytes"] - t2v["cache"]["prompt_store_bytes"]
    assert 0 <= extra - 20 * 21 * 60 * 104 * 4 <= 64  # (and its chunk's crc32c)
    # TI2V-5B: text-to-video unless --image-to-video, then its first-frame latent (48 channels, one latent frame)
    ti2v, t2v5 = plan("wan22-ti2v-5b-configs", "--image-to-video"), plan("wan22-ti2v-5b-configs")
    assert "--images IMAGES.tsv" in ti2v["launch"]["commands"][0]["command"]
    assert ti2v["cache"]["condition"] == [48, 1, 30, 52] and t2v5["cache"]["condition"] is None
    assert 0 <= ti2v["cache"]["prompt_store_bytes"] - t2v5["cache"]["prompt_store_bytes"] - 48 * 30 * 52 * 4 <= 64
    assert "text-to-video only" in plan("wan22-a14b-configs", "--image-to-video", code=2)


@pytest.mark.slow
def test_the_committed_i2v_teacher_moves_the_shape_of_its_first_frame(tmp_path):
    """`tiny-teacher --variant i2v-pretrained` copies data/tiny-i2v-teacher-pretrained byte for byte, and diffusers'
    WanImageToVideoPipeline of it, given a clip's first frame and its caption, starts the shape where the image
    shows it (within 2.5 px; its radius is 10) and moves it the caption's way."""
    import filecmp
    import json
    import random

    from click.testing import CliRunner
    from diffusers import WanImageToVideoPipeline

    from conftest import ROOT
    from pipeline import clips, tiny_teacher
    from pipeline.cli import main
    from pipeline.prompts import read_prompt_file
    from stages.sample import motion
    from stages.sample.sample import initial_latents, to_clips

    out = tmp_path / "i2v-teacher"
    r = CliRunner().invoke(main, ["tiny-teacher", "--out", str(out), "--variant", "i2v-pretrained"])
    assert r.exit_code == 0, r.output
    data = tiny_teacher.I2V_PRETRAINED_DIR
    assert all(filecmp.cmp(f, out / f.relative_to(data), shallow=False) for f in data.rglob("*") if f.is_file())
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.in_channels == 36 and pipe.transformer_2 is not None
    settings = json.loads((out / "TRAINING.json").read_text())["eval_settings"]
    vs = pipe.vae_scale_factor_spatial
    for i, caption in enumerate(read_prompt_file(ROOT / "data" / "clips-heldout.txt")[:3]):
        given = clips.render(clips.parse_caption(caption), random.Random(f"test:{i}"))
        frames = pipe(image=Image.fromarray(given[0]), prompt=caption, output_type="np", **settings,
                      latents=initial_latents(i, (16, 3, 64 // vs, 64 // vs))[None]).frames
        clip = to_clips(frames)[0]
        assert motion.check(clip, caption)["direction_right"], caption
        assert motion.fidelity([clip], [given[:1]], [motion.read(clip)])["start_px"] < 2.5, caption
