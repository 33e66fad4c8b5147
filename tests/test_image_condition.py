"""The image-to-video building blocks against diffusers' own WanImageToVideoPipeline: the tiny I2V teachers load and
draw from an image, our condition latent is prepare_latents' to the bit, InputRule lays out a step as the denoising
loop does, and the --images reader refuses every bad line with one line of its own."""

from __future__ import annotations

import filecmp
import json
import os

import numpy as np
import PIL.Image
import pytest
import torch

from pipeline.errors import UserError
from pipeline.image_condition import condition_latent, image_tensor, open_image, read_image_file
from pipeline.model_call import CONCAT, FIRST_FRAME, InputRule
from pipeline.tiny_teacher import I2V_VARIANTS

# variant -> (transformer in/out channels, VAE z_dim, the rule's condition, boundary_ratio)
LAYOUT = {"i2v": ((36, 16), 16, CONCAT, 0.9), "ti2v-i2v": ((48, 48), 48, FIRST_FRAME, None)}
H, W, FRAMES = 64, 96, 9


def _picture(seed: int = 0, size=(W, H)) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=I2V_VARIANTS)
def teacher(request, tiny_teacher_factory):
    from diffusers import DiffusionPipeline

    path = tiny_teacher_factory(request.param)
    return request.param, path, DiffusionPipeline.from_pretrained(path)


def test_tiny_i2v_teacher_is_wan22s_layout_and_draws_from_an_image(teacher, tiny_teacher_factory):
    from diffusers import WanImageToVideoPipeline

    variant, path, pipe = teacher
    channels, z_dim, condition, boundary = LAYOUT[variant]
    index = json.loads((path / "model_index.json").read_text())
    assert isinstance(pipe, WanImageToVideoPipeline) and index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == index["image_processor"] == [None, None]  # as Wan2.2's I2V folders ship
    assert index["boundary_ratio"] == boundary and index["expand_timesteps"] == (condition == FIRST_FRAME)
    assert (pipe.transformer_2 is not None) == (variant == "i2v")
    for t in filter(None, (pipe.transformer, pipe.transformer_2)):
        assert (t.config.in_channels, t.config.out_channels, t.config.image_dim) == (*channels, None)
    assert pipe.vae.config.z_dim == z_dim and pipe.scheduler.config.flow_shift == 5.0
    assert InputRule.of_pipeline(pipe).condition == condition
    if variant == "ti2v-i2v":  # TI2V-5B is one checkpoint for both modes: the ti2v teacher's very weights
        ti2v = tiny_teacher_factory("ti2v")
        for f in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
            assert filecmp.cmp(path / f, ti2v / f, shallow=False)
    loaded = WanImageToVideoPipeline.from_pretrained(path)
    frames = loaded(image=_picture(size=(64, 64)), prompt="a red circle", height=64, width=64, num_frames=5,
                    num_inference_steps=2, output_type="pt", max_sequence_length=16,
                    generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 5, 3, 64, 64) and torch.isfinite(frames).all()


def _prepared(pipe, image, batch):
    return pipe.prepare_latents(image, batch, pipe.vae.config.z_dim, H, W, FRAMES, torch.float32, torch.device("cpu"),
                                torch.Generator().manual_seed(0))


def test_condition_latent_is_prepare_latents(teacher):
    variant, _, pipe = teacher
    rule = InputRule.of_pipeline(pipe)
    picture = _picture()
    image = image_tensor(picture, H, W)
    assert torch.equal(image, pipe.video_processor.preprocess(picture, height=H, width=W).float())
    assert image.shape == (1, 3, H, W) and -1 <= image.min() < image.max() <= 1
    for batch in (1, 2):
        theirs = _prepared(pipe, image, batch)[1]
        ours = condition_latent(pipe.vae, image.expand(batch, -1, -1, -1), FRAMES, rule)
        assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
        if batch == 1:
            assert torch.equal(ours, theirs)
        else:  # the pipeline encodes once and repeats; we encode the batch
            assert (ours - theirs).abs().max() <= 1e-6
    z, f, h, w = pipe.vae.config.z_dim, (FRAMES - 1) // 4 + 1, H // pipe.vae_scale_factor_spatial, \
        W // pipe.vae_scale_factor_spatial
    if rule.condition == CONCAT:  # the mask: pixel frame 0 kept (its 4 channels of latent frame 0), none after it
        assert ours.shape == (2, 4 + z, f, h, w)
        assert (ours[:, :4, 0] == 1).all() and (ours[:, :4, 1:] == 0).all()
    else:
        assert ours.shape == (2, z, 1, h, w)
        mask = _prepared(pipe, image, 1)[2]
        assert (mask[:, :, 0] == 0).all() and (mask[:, :, 1:] == 1).all()
    assert condition_latent(pipe.vae, image, FRAMES, InputRule()) is None
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4"):
        condition_latent(pipe.vae, image, 8, rule)


def test_input_rule_lays_out_a_step_as_the_denoising_loop(teacher):
    _, _, pipe = teacher
    rule = InputRule.of_pipeline(pipe)
    image = image_tensor(_picture(1), H, W)
    out = _prepared(pipe, image, 2)
    latents = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(1))
    condition = condition_latent(pipe.vae, image.expand(2, -1, -1, -1), FRAMES, rule)
    pipe.scheduler.set_timesteps(4)
    t = pipe.scheduler.timesteps[1]
    timestep = rule.timestep(t.expand(2), latents.shape[2:])
    if rule.condition == CONCAT:
        assert torch.equal(rule.hidden(latents, condition), torch.cat([latents, condition], dim=1))
        assert torch.equal(timestep, t.expand(latents.shape[0]))
        assert torch.equal(rule.finish(latents, condition), latents)
    else:
        first_frame_mask = out[2]
        blended = (1 - first_frame_mask) * condition + first_frame_mask * latents
        assert torch.equal(rule.hidden(latents, condition), blended)
        assert torch.equal(rule.finish(latents, condition), blended)
        temp_ts = (first_frame_mask[0][0][:, ::2, ::2] * t).flatten()
        assert timestep.shape == (2, temp_ts.numel())
        assert torch.equal(timestep.to(temp_ts.dtype), temp_ts.unsqueeze(0).expand(latents.shape[0], -1))


def test_read_image_file(tmp_path):
    _picture(0).save(tmp_path / "a.png")
    (tmp_path / "sub").mkdir()
    _picture(1).convert("L").save(tmp_path / "sub" / "b.jpg")
    listing = tmp_path / "images.tsv"
    listing.write_text(f"# image\tprompt\n\na.png\ta red circle\n{tmp_path / 'sub' / 'b.jpg'}\t a cat \tin a hat\n"
                       "a.png\ta red circle\n")
    assert read_image_file(listing) == [(tmp_path / "a.png", "a red circle"),
                                        (tmp_path / "sub" / "b.jpg", "a cat \tin a hat"),
                                        (tmp_path / "a.png", "a red circle")]
    image = open_image(tmp_path / "sub" / "b.jpg", "here")
    assert image.mode == "RGB" and image.size == (W, H)


def _refusal(tmp_path, text: str) -> str:
    listing = tmp_path / "images.txt"
    listing.write_text(text)
    with pytest.raises(UserError) as e:
        read_image_file(listing)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_image_file_refusals(tmp_path):
    _picture().save(tmp_path / "ok.png")
    (tmp_path / "text.png").write_text("not a picture")
    _picture(size=(256, 256)).save(tmp_path / "big.png")
    full = (tmp_path / "big.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(full[:len(full) // 2])
    (tmp_path / "folder.png").mkdir()
    ok = "ok.png\ta cat\n"
    assert "line 2: the image" in (m := _refusal(tmp_path, ok + "gone.png\ta dog\n")) and "does not exist" in m
    assert "line 2: " + str(tmp_path / "text.png") + " is not an image (of no format PIL knows)" in _refusal(
        tmp_path, ok + "text.png\ta dog\n")
    assert "line 1:" in (m := _refusal(tmp_path, "cut.png\ta dog\n")) and "not an image (PIL: image file is trunc" in m
    assert "line 1:" in (m := _refusal(tmp_path, "folder.png\ta dog\n")) and "is a folder" in m
    for bad in ("ok.png a cat\n", "ok.png\t  \n", "\ta cat\n"):
        assert "line 2 is not <image path><TAB><prompt>" in _refusal(tmp_path, "# c\n" + bad)
    assert "line 1 holds the control character U+001B" in _refusal(tmp_path, "ok.png\ta \x1b cat\n")
    assert "holds no images" in _refusal(tmp_path, "# nothing\n\n")
    with pytest.raises(UserError, match="image list .* does not exist; pass --images"):
        read_image_file(tmp_path / "absent.txt")
    if os.geteuid() != 0:  # root reads a file whatever its mode
        (tmp_path / "locked.png").write_bytes(full)
        (tmp_path / "locked.png").chmod(0)
        assert "cannot be read (Permission denied)" in _refusal(tmp_path, "locked.png\ta dog\n")
