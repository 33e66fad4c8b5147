"""Procedural shapes, the attribute checker and the tiny-teacher training recipe (a few steps of it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_recipe_text_encoder
from pipeline import shapes
from pipeline.prompts import read_prompt_file
from pipeline.tiny_teacher import _WORDS
from stages.sample import attributes


def test_generator_is_reproducible_and_seeded():
    a, caps_a, _ = shapes.batch(0, 10, 16)
    b, caps_b, _ = shapes.batch(0, 10, 16)
    c, caps_c, _ = shapes.batch(1, 10, 16)
    assert a.shape == (16, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and caps_a == caps_b
    assert caps_a != caps_c


def test_splits_are_disjoint_and_captions_parse():
    train = {shapes.scene_for(0, i, "train").caption for i in range(400)}
    held = {shapes.scene_for(0, i, "heldout").caption for i in range(100)}
    assert not train & held
    assert all(shapes.is_heldout(c) for c in held) and not any(shapes.is_heldout(c) for c in train)
    for cap in list(train)[:50] + list(held)[:50]:
        assert shapes.parse_caption(cap).caption == cap


def test_caption_words_are_whole_tokenizer_words():
    words = {w for i in range(300) for w in shapes.scene_for(0, i).caption.split()}
    assert words <= set(_WORDS)


def test_prompt_files_follow_the_split():
    train, held = read_prompt_file("data/shapes-prompts.txt"), read_prompt_file("data/shapes-heldout.txt")
    assert len(train) >= 512 and len(held) >= 64 and not set(train) & set(held)
    assert not any(shapes.is_heldout(c) for c in train) and all(shapes.is_heldout(c) for c in held)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_checker_reads_ground_truth(split):
    images, captions, _ = shapes.batch(3, 0, 300, split)
    s = attributes.score(list(images), captions)
    assert s["images"] == 300
    assert min(s["background"], s["shape_colour"], s["position"], s["all"]) >= 0.99


def test_checker_survives_noise_and_rejects_wrong_captions():
    images, captions, scenes = shapes.batch(4, 0, 200)
    rng = np.random.default_rng(0)
    noisy = np.clip(images.astype(np.float32) + rng.normal(0, 12, images.shape), 0, 255).astype(np.uint8)
    assert attributes.score(list(noisy), captions)["colour"] >= 0.99
    # The same images against the captions of other images: mostly wrong.
    assert attributes.score(list(images), captions[1:] + captions[:1])["colour"] < 0.3


def test_checker_scores_one_and_two_shape_captions_apart():
    images, captions, scenes = shapes.batch(5, 0, 200)
    two = [i for i, s in enumerate(scenes) if len(s.shapes) == 2]
    assert 20 < len(two) < 180
    # Every two-shape image swapped with the next two-shape one: those are wrong, the one-shape ones stay right.
    swapped = list(images)
    for a, b in zip(two, two[1:] + two[:1]):
        swapped[a] = images[b]
    s = attributes.score(swapped, captions)
    assert set(s["by_shapes"]) == {"1", "2"}
    assert s["by_shapes"]["2"]["images"] == len(two) and s["by_shapes"]["1"]["images"] == 200 - len(two)
    assert s["by_shapes"]["1"]["colour"] >= 0.99 and s["by_shapes"]["2"]["colour"] < 0.3
    assert "by_shapes" not in s["by_shapes"]["1"]
    one_share = s["by_shapes"]["1"]["images"] / 200
    assert s["colour"] == pytest.approx(one_share * s["by_shapes"]["1"]["colour"]
                                        + (1 - one_share) * s["by_shapes"]["2"]["colour"])


@pytest.mark.slow
def test_training_recipe_runs_end_to_end(tmp_path):
    """scripts/train_tiny_teacher.py with a handful of steps: VAE, pool, shared phase, both experts, a pipeline
    that WanPipeline loads and its TRAINING.json (the real recipe is the same code with the default counts)."""
    import subprocess
    import sys

    from diffusers import WanPipeline

    held = tmp_path / "held.txt"
    held.write_text("\n".join(read_prompt_file("data/shapes-heldout.txt")[:2]) + "\n")
    out = tmp_path / "teacher"
    subprocess.run([sys.executable, "scripts/train_tiny_teacher.py", "--out", str(out), "--vae-steps", "2",
                    "--vae-batch", "2", "--pool", "8", "--shared-steps", "2", "--expert-steps", "2",
                    "--expert-batch", "4", "--eval-every", "0", "--heldout", str(held), "--threads", "1"],
                   check=True, capture_output=True, text=True)
    report = json.loads((out / "TRAINING.json").read_text())
    assert report["heldout_captions"] == 2 and 0.0 <= report["heldout_score"]["colour"] <= 1.0
    pipe = WanPipeline.from_pretrained(out)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
    assert pipe.vae_scale_factor_spatial == 16 and len(pipe.vae.config.latents_mean) == 16
    # one token per image: the patch covers the whole 4x4 latent, and the width exceeds the patch's output
    cfg = pipe.transformer.config
    assert tuple(cfg.patch_size) == (1, 4, 4) and cfg.num_attention_heads * cfg.attention_head_dim > 16 * 4 * 4
    from safetensors import safe_open

    def saved_dtypes(component: str) -> set:
        with safe_open(next((out / component).glob("*.safetensors")), "pt") as f:
            return {f.get_slice(k).get_dtype() for k in f.keys()}

    assert saved_dtypes("transformer") == saved_dtypes("vae") == {"F16"}  # half the bytes in data/
    assert saved_dtypes("text_encoder") == {"F32"}
    assert pipe.transformer.dtype == torch.float32  # and loaded as float32 unless asked otherwise
    # the frozen text encoder: the tiny teacher's random UMT5, only its relative-position bias scaled up
    assert report["recipe"]["text_bias_scale"] == 16.0 and report["recipe"]["text_encoder_seed"] == 0
    assert_recipe_text_encoder(pipe.text_encoder, report["recipe"])


@pytest.mark.slow
def test_text_binding_probe_compares_bias_scales():
    """scripts/probe_text_binding.py (the measurement behind the recipe's TEXT_BIAS_SCALE) in miniature: one line
    per scale, each with an accuracy per scoring step."""
    import re
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "scripts/probe_text_binding.py", "--scales", "1", "16", "--captions", "64",
                        "--test", "32", "--steps", "4", "--every", "2", "--threads", "1"],
                       check=True, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["bias scale 1", "bias scale 16"], r.stdout
    for ln in lines:
        assert [int(s) for s in re.findall(r"at step (\d+)", ln)] == [2, 4], ln
        assert all(0 <= float(p) <= 100 for p in re.findall(r"([\d.]+)% at step", ln)), ln
