"""Prompt files and the embedded tiny teacher."""

from __future__ import annotations

import filecmp
import json

import pytest
import torch

from pipeline.errors import UserError
from pipeline.prompts import dedupe, read_prompt_file
from pipeline.tiny_teacher import VARIANTS, write_tiny_teacher


def test_txt_skips_blank_lines_and_comments(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("# header\n\na cat\n  # indented comment\n  a dog  \n\n")
    assert read_prompt_file(p) == ["a cat", "a dog"]


def test_jsonl(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a cat"}\n\n{"prompt": "a dog", "id": 3}\n')
    assert read_prompt_file(p) == ["a cat", "a dog"]


@pytest.mark.parametrize("name,data,match", [
    ("p.txt", b"a cat\n\xff\xfe broken\n", r"not UTF-8 \(line 2"),
    ("p.txt", b"# only a comment\n\n", "holds no prompts"),
    ("p.jsonl", b'{"prompt": "ok"}\n{"text": "x"}\n', "line 2"),
    ("p.jsonl", b'{"prompt": "ok"}\nnot json\n', "line 2: not valid JSON"),
])
def test_bad_prompt_files(tmp_path, name, data, match):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(UserError, match=match):
        read_prompt_file(p)


def test_dedupe_keeps_first_appearance():
    assert dedupe(["b", "a", "b", "c", "a"]) == (["b", "a", "c"], 2)


def test_default_prompt_set_is_large_and_unique():
    prompts = read_prompt_file("data/prompts.txt")
    assert len(prompts) >= 200 and len(set(prompts)) == len(prompts)


def test_tiny_teacher_is_byte_identical_for_a_seed(tmp_path, tiny_teacher_factory):
    a = tiny_teacher_factory("wan2.2", 0)
    b = write_tiny_teacher(tmp_path / "b", "wan2.2", 0)
    c = write_tiny_teacher(tmp_path / "c", "wan2.2", 1)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert not filecmp.cmp(a / weights, c / weights, shallow=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_teacher_loads_as_wan_pipeline(tiny_teacher_factory, variant):
    from diffusers import DiffusionPipeline, WanPipeline

    path = tiny_teacher_factory(variant)
    pipe = DiffusionPipeline.from_pretrained(path)
    assert isinstance(pipe, WanPipeline)
    index = json.loads((path / "model_index.json").read_text())
    assert (pipe.transformer_2 is not None) == (variant == "wan2.2")
    assert (index["boundary_ratio"] is not None) == (variant == "wan2.2")
    assert index["expand_timesteps"] == (variant == "ti2v")
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    out = pipe("a red circle", height=64, width=64, num_frames=1, num_inference_steps=2, output_type="pt",
               max_sequence_length=16, generator=torch.Generator().manual_seed(0)).frames
    assert out.shape[-2:] == (64, 64) and torch.isfinite(out).all()
