"""`sample` and `export` of image-to-video students: a compact student trained on a tiny I2V cache (Wan2.2-I2V's
image on the channels, TI2V's in latent frame 0) draws from --images, the teacher as diffusers' WanImageToVideoPipeline
from the same image and noise, the input image in a first column; its export loads as WanImageToVideoPipeline and
draws the grid's student clip; a LoRA of the I2V teacher's card and ComfyUI workflow start from an image."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from pipeline.cli import main
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from pipeline.model_call import CONCAT, FIRST_FRAME, NONE, InputRule
from stages import train_student
from stages.sample import comfyui, hub_card
from stages.sample.models import check_compatible
from stages.sample.sample import frame_strip, grid_layout, initial_latents, to_clips
from stages.students.compact import CompactStudent
from stages.students.student_kind import Student

from conftest import TINY_CACHE_ARGS, make_cache, sample_distill
from test_i2v import image_list

SIDE, FRAMES, SEED = 64, 5, 5
NEG = TINY_CACHE_ARGS["negative_prompt"]
MSL = TINY_CACHE_ARGS["max_sequence_length"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert all(n in errors[0] for n in needles), errors[0]


def train(cache: Path, out: Path, **kw) -> Path:
    args = dict(cache=(str(cache),), out=str(out), num_workers=0, warmup_steps=0, log_every=1, eval_every=0,
                checkpoint_every=0, lr=3e-3, batch_size=4, device="cpu", max_steps=2)
    train_student.run(TrainStudentConfig(**(args | kw)))
    return out


def one_block(teacher: Path, folder: Path) -> str:
    """The teacher's transformer config with one block: a compact student taking its input channels (36 for I2V)."""
    config = json.loads((teacher / "transformer" / "config.json").read_text())
    path = folder / "student.json"
    path.write_text(json.dumps({k: v for k, v in config.items() if not k.startswith("_")} | {"num_layers": 1}))
    return str(path)


@pytest.fixture(scope="module")
def runs(tiny_teacher_factory, tmp_path_factory) -> dict[str, tuple[Path, Path, Path, Path]]:
    """variant -> (teacher, image list, cache, compact run): 3 images x 1 seed x 4 steps of 5 frames, the I2V teacher with
    CFG (both experts at their own scales), a student of one block trained 2 steps on it."""
    folder = tmp_path_factory.mktemp("i2v-sample")
    images = image_list(folder / "images")
    out = {}
    for variant, g2 in (("i2v", 3.0), ("ti2v", None)):
        teacher = tiny_teacher_factory(variant)
        cache = make_cache(teacher, None, folder / f"cache-{variant}", images=str(images), frames=FRAMES,
                           guidance_2=g2)
        (folder / variant).mkdir()
        out[variant] = teacher, images, cache, train(cache, folder / variant / "run",
                                                     student_config=one_block(teacher, folder / variant))
    return out


def crop(img: Image.Image, columns: list[str], row: int, col: int) -> np.ndarray:
    layout = grid_layout(columns, SIDE * FRAMES, SIDE)
    x, y = layout.origin(row, col)
    return np.asarray(img.crop((x, y, x + layout.cell_w, y + layout.cell_h)), dtype=np.int16)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["i2v", "ti2v"])
def test_sample_draws_from_images_and_the_export_draws_the_same_clip(variant, runs, tmp_path):
    from diffusers import WanImageToVideoPipeline

    teacher, images, _, run = runs[variant]
    assert json.loads((run / "distill.json").read_text())["condition"] == (CONCAT if variant == "i2v" else FIRST_FRAME)
    grid = tmp_path / "grid.png"
    r = invoke("sample", "--student", run, "--images", images, "--out", grid, "--seed", SEED, "--device", "cpu")
    assert r.exit_code == 0, r.output
    meta = json.loads(grid.with_name("grid.png.json").read_text())
    columns = meta["columns"]
    assert columns == ["image", "teacher", "student"] and meta["rows"] == 3
    assert meta["images"] == [str(images.parent / f"img{i}.png") for i in range(3)]
    img = Image.open(grid)
    assert img.size == grid_layout(columns, SIDE * FRAMES, SIDE).size(3, 3)
    s = meta["settings"]
    pipe = WanImageToVideoPipeline.from_pretrained(teacher)
    shape = (1, pipe.vae.config.z_dim, 2, SIDE // pipe.vae_scale_factor_spatial, SIDE // pipe.vae_scale_factor_spatial)
    for row in (0, 2):
        image = Image.open(images.parent / f"img{row}.png").convert("RGB")
        # the first column is the input image at the sampled size
        cell = crop(img, columns, row, 0)
        np.testing.assert_array_equal(cell[:, :SIDE], np.asarray(image.resize((SIDE, SIDE)), dtype=np.int16))
        assert (cell[:, SIDE:] == 255).all()
        # the teacher's column: diffusers' own image-to-video call from the same image and noise (seed + row)
        g2 = {"guidance_scale_2": s["guidance_2"]} if s["guidance_2"] is not None else {}
        ref = pipe(image=image, prompt=meta["prompts"][row], negative_prompt=NEG, height=SIDE, width=SIDE,
                   num_frames=FRAMES, num_inference_steps=s["steps"], guidance_scale=s["guidance"], **g2,
                   latents=initial_latents(SEED + row, shape), max_sequence_length=MSL, output_type="np").frames
        ref_cell = np.asarray(frame_strip(to_clips(ref)[0]), dtype=np.int16)
        assert np.abs(crop(img, columns, row, 1) - ref_cell).max() <= 1
    assert not np.array_equal(crop(img, columns, 0, 1), crop(img, columns, 0, 2))

    # export: the student in the pipeline diffusers loads as WanImageToVideoPipeline, drawing the grid's clip
    out = tmp_path / "pipe"
    r = invoke("export", "--student", run, "--out", out)
    assert r.exit_code == 0, r.output
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == ("WanImageToVideoPipeline" if variant == "i2v" else "WanPipeline")
    assert index["_wandistiller"]["condition"] == (CONCAT if variant == "i2v" else FIRST_FRAME)
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-to-video" in card and "WanImageToVideoPipeline.from_pretrained(" in card
    assert 'pipe(image=load_image("first_frame.png"), prompt="a lighthouse at night", num_frames=5' in card
    exported = WanImageToVideoPipeline.from_pretrained(out)
    assert exported.transformer.config.num_layers == 1 and exported.transformer_2 is None
    image = Image.open(images.parent / "img0.png").convert("RGB")
    frames = exported(image=image, prompt=meta["prompts"][0], height=SIDE, width=SIDE, num_frames=FRAMES,
                      num_inference_steps=s["student_steps"], guidance_scale=1.0, max_sequence_length=MSL,
                      latents=initial_latents(SEED, shape), output_type="np").frames
    assert np.abs(crop(img, columns, 0, 2) - np.asarray(frame_strip(to_clips(frames)[0]), dtype=np.int16)).max() <= 1


@pytest.mark.slow
def test_the_wrong_input_and_the_wrong_teacher_are_one_line(runs, tiny_teacher_factory, prompts_file, tmp_path):
    _, images, _, run = runs["i2v"]
    grid = tmp_path / "g.png"
    one_line_error(invoke("sample", "--student", run, "--prompts", prompts_file, "--out", grid),
                   "image-to-video student", "give --images FILE")
    one_line_error(invoke("sample", "--student", run, "--prompts", prompts_file, "--images", images, "--out", grid),
                   "give one of --prompts FILE")
    t2v = tmp_path / "t2v"  # the same run, its record saying its cache had no images
    shutil.copytree(run, t2v)
    distill = json.loads((t2v / "distill.json").read_text())
    del distill["condition"]
    (t2v / "distill.json").write_text(json.dumps(distill))
    one_line_error(invoke("sample", "--student", t2v, "--images", images, "--out", grid),
                   "text-to-video student", "give --prompts FILE instead of --images")
    one_line_error(invoke("export", "--student", t2v, "--out", tmp_path / "p"),
                   "does not fit teacher", "trained on image condition none", "takes concat")
    wan = tiny_teacher_factory("wan2.2")  # a text-to-video teacher: 16 input channels, not 36
    one_line_error(invoke("sample", "--student", run, "--teacher", wan, "--images", images, "--out", grid,
                          "--device", "cpu"), "does not fit teacher", "latent channels 36->16")
    assert not grid.exists()


def test_check_compatible_names_the_input_rule_the_student_did_not_learn(tmp_path):
    config = {"in_channels": 36, "out_channels": 16, "text_dim": 32, "patch_size": [1, 2, 2]}
    student = Student(root=tmp_path, path=tmp_path, weights="raw", config=config, kind=CompactStudent,
                      distill=dataclasses.replace(sample_distill(), condition=CONCAT))
    fit = dict(in_channels=36, out_channels=16, text_dim=32, latent_hw=(8, 8), against="teacher T")
    check_compatible(student, rule=InputRule(condition=CONCAT), **fit)
    check_compatible(student, rule=None, **fit)  # (nothing to compare with)
    with pytest.raises(UserError, match="trained on image condition concat, teacher T takes none$"):
        check_compatible(student, rule=InputRule(), **fit)
    with pytest.raises(UserError, match="trained with expand_timesteps=False, teacher T uses True; trained on image "
                                        "condition concat, teacher T takes first_frame"):
        check_compatible(student, rule=InputRule(per_token=True, condition=FIRST_FRAME), **fit)
    bare = Student(root=tmp_path, path=tmp_path, weights="folder", config=config, kind=CompactStudent)
    check_compatible(bare, rule=InputRule(), **fit)  # a bare folder records no rule


def test_an_image_to_video_cards_call_and_comfyui_workflow_start_from_an_image():
    hints = {"num_frames": 9, "width": 64, "height": 64, "guidance_scale": 1.0}
    assert hub_card.draw(hints, "guidance_scale=1.0")[1].startswith('frames = pipe("a lighthouse at night"')
    imports, call = hub_card.draw(hints | {"condition": CONCAT}, "guidance_scale=1.0")
    assert imports == "from diffusers.utils import export_to_video, load_image\n"
    assert call.startswith('frames = pipe(image=load_image("first_frame.png"), prompt="a lighthouse at night", '
                           "num_frames=9, guidance_scale=1.0")
    assert hub_card.pipeline_class(hints, "WanPipeline") == "WanPipeline"
    assert hub_card.pipeline_class(hints | {"condition": FIRST_FRAME}, "WanPipeline") == "WanImageToVideoPipeline"
    sched = comfyui.Schedule(4, 2, 5.0, False, "euler", [1.0, 0.9, 0.7, 0.4], [1.0, 0.9, 0.7, 0.4])
    experts, adapters = ["transformer", "transformer_2"], {"transformer": "a.safetensors"}
    files = comfyui.model_files("Wan-AI/Wan2.2-I2V-A14B-Diffusers", 2, "x")
    assert files[0] == ("wan2.2_i2v_high_noise_14B_fp16.safetensors", "wan2.2_i2v_low_noise_14B_fp16.safetensors")
    for condition, per_token in ((CONCAT, False), (FIRST_FRAME, True), (NONE, False)):
        given = hints | ({"condition": condition} if condition != NONE else {})
        nodes = comfyui.workflow(sched, experts, adapters, given, files, InputRule(per_token=per_token))
        kind = {k: n["class_type"] for k, n in nodes.items()}
        samplers = [n["inputs"] for n in nodes.values() if n["class_type"] == "KSamplerAdvanced"]
        loads = [k for k, c in kind.items() if c == "LoadImage"]
        assert len(loads) == (condition != NONE)
        if condition == CONCAT:  # WanImageToVideo's conditioning and latent feed the first sampler
            i2v = next(k for k, c in kind.items() if c == "WanImageToVideo")
            assert nodes[i2v]["inputs"]["start_image"] == [loads[0], 0]
            first = samplers[0]
            assert (first["positive"], first["negative"], first["latent_image"]) == ([i2v, 0], [i2v, 1], [i2v, 2])
        elif condition == FIRST_FRAME:
            latent = next(n for n in nodes.values() if n["class_type"] == "Wan22ImageToVideoLatent")
            assert latent["inputs"]["start_image"] == [loads[0], 0]
        else:
            assert "EmptyHunyuanLatentVideo" in kind.values()
        for link in (v for n in nodes.values() for v in n["inputs"].values() if isinstance(v, list)):
            assert link[0] in nodes
    card = comfyui.card(sched, experts, adapters, 900.0, hints | {"condition": CONCAT}, files, "x", True)
    assert "`first_frame.png`" in card and "WanImageToVideo as its start_image" in card


@pytest.mark.slow
def test_a_lora_of_the_i2v_teacher_exports_an_image_to_video_card_and_fused_pipeline(runs, tmp_path):
    teacher, _, cache, _ = runs["i2v"]
    lora = train(cache, tmp_path / "lora", lora_of=str(teacher), max_steps=1)
    out = tmp_path / "adapters"
    assert invoke("export", "--student", lora, "--out", out).exit_code == 0
    card = (out / "README.md").read_text()
    assert "from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline" in card
    assert "pipe = WanImageToVideoPipeline.from_pretrained(" in card
    assert 'image=load_image("first_frame.png")' in card and "pipeline_tag: image-to-video" in card
    kinds = [n["class_type"] for n in json.loads((out / comfyui.WORKFLOW).read_text()).values()]
    assert "WanImageToVideo" in kinds and "LoadImage" in kinds and "EmptyHunyuanLatentVideo" not in kinds
    fused = tmp_path / "fused"
    assert invoke("export", "--student", lora, "--out", fused, "--fuse").exit_code == 0
    assert json.loads((fused / "model_index.json").read_text())["_class_name"] == "WanImageToVideoPipeline"
    assert "WanImageToVideoPipeline.from_pretrained(" in (fused / "README.md").read_text()
