"""The pretrained tiny teacher committed under data/: copied by `tiny-teacher --variant pretrained`, loaded by
WanPipeline like any Wan 2.2 checkpoint, and drawing the held-out shapes captions as its TRAINING.json says."""

from __future__ import annotations

import filecmp
import json

import pytest
import torch
from click.testing import CliRunner

from conftest import assert_recipe_text_encoder
from pipeline import tiny_teacher
from pipeline.cli import main
from pipeline.prompts import read_prompt_file
from stages.sample.attributes import draw, score

DATA = tiny_teacher.PRETRAINED_DIR
MAX_BYTES = 25 * 2**20  # what the repository may carry for it


def test_committed_weights_are_complete_and_small():
    files = [f for f in DATA.rglob("*") if f.is_file()]
    assert {f.relative_to(DATA).parts[0] for f in files} >= {
        "model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer", "transformer_2", "vae",
        "TRAINING.json"}
    assert sum(f.stat().st_size for f in files) <= MAX_BYTES


def test_variant_copies_the_committed_teacher(tmp_path):
    out = tmp_path / "teacher"
    result = CliRunner().invoke(main, ["tiny-teacher", "--out", str(out), "--variant", "pretrained"])
    assert result.exit_code == 0, result.output
    for f in DATA.rglob("*"):
        if f.is_file():
            assert filecmp.cmp(f, out / f.relative_to(DATA), shallow=False), f


def test_missing_weights_end_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_teacher, "PRETRAINED_DIR", tmp_path / "gone")
    result = CliRunner().invoke(main, ["tiny-teacher", "--out", str(tmp_path / "t"), "--variant", "pretrained"])
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "missing" in errors[0] and "make tiny-teacher-train" in errors[0]
    assert not (tmp_path / "t" / "model_index.json").exists()


def test_text_encoder_is_the_recipes():
    """The committed UMT5 is what the recipe in TRAINING.json makes of the tiny teacher's random one: frozen, with
    its relative-position bias scaled by --text-bias-scale and nothing else changed."""
    from transformers import UMT5EncoderModel

    recipe = json.loads((DATA / "TRAINING.json").read_text())["recipe"]
    assert_recipe_text_encoder(UMT5EncoderModel.from_pretrained(DATA / "text_encoder"), recipe)


@pytest.mark.slow
def test_teacher_draws_the_heldout_captions_as_recorded():
    """Every held-out caption drawn as the recipe scored it (seed 0: caption i from noise seed i, the recipe's
    sampling settings): the attribute checker reads what TRAINING.json recorded, within one image."""
    from diffusers import WanPipeline

    report = json.loads((DATA / "TRAINING.json").read_text())
    settings = report["eval_settings"]
    captions = read_prompt_file("data/shapes-heldout.txt")
    assert len(captions) == report["heldout_captions"]
    pipe = WanPipeline.from_pretrained(DATA, torch_dtype=torch.float32)
    got, want = score(draw(pipe, captions, 0, **settings), captions), report["heldout_score"]
    for key in ("background", "shape_colour", "colour"):
        assert abs(got[key] - want[key]) <= 1.5 / len(captions), (key, got, want)
