"""teacher-cache and cache commands through the CLI: bad input ends in one clear line and exit 2."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from pipeline.cli import main

from conftest import TINY_CACHE_ARGS


def _args(teacher, prompts, out, **over):
    kw = dict(TINY_CACHE_ARGS, placement="cpu")
    kw.update(over)
    args = ["teacher-cache", "--teacher", str(teacher), "--prompts", str(prompts), "--out", str(out)]
    for k, v in kw.items():
        if v is not None:
            args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, result.output
    assert "Traceback" not in result.output
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.fixture
def bad_prompts(tmp_path):
    def make(content: bytes):
        p = tmp_path / "bad.txt"
        p.write_bytes(content)
        return p

    return make


def test_missing_prompt_file(tiny_teacher, tmp_path):
    assert_one_line_error(invoke(_args(tiny_teacher, tmp_path / "nope.txt", tmp_path / "c")), "nope.txt",
                          "does not exist")


def test_empty_prompt_file(tiny_teacher, tmp_path, bad_prompts):
    assert_one_line_error(invoke(_args(tiny_teacher, bad_prompts(b"\n# c\n"), tmp_path / "c")), "holds no prompts")


def test_non_utf8_prompt_file_names_the_line(tiny_teacher, tmp_path, bad_prompts):
    r = invoke(_args(tiny_teacher, bad_prompts(b"ok\nstill ok\n\xe9t\xe9\n"), tmp_path / "c"))
    assert_one_line_error(r, "not UTF-8", "line 3")


def test_teacher_that_is_not_a_wan_pipeline(prompts_file, tmp_path):
    fake = tmp_path / "teacher"
    fake.mkdir()
    assert_one_line_error(invoke(_args(fake, prompts_file, tmp_path / "c")), "model_index.json is missing")
    (fake / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                       "transformer": ["diffusers", "WanTransformer3DModel"]}))
    assert_one_line_error(invoke(_args(fake, prompts_file, tmp_path / "c")), "missing tokenizer", "text_encoder",
                          "vae", "scheduler")


def test_teacher_missing_weights(tiny_teacher, prompts_file, tmp_path):
    import shutil

    broken = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, broken)
    (broken / "transformer_2" / "diffusion_pytorch_model.safetensors").unlink()
    assert_one_line_error(invoke(_args(broken, prompts_file, tmp_path / "c")), "transformer_2/*.safetensors")


def test_teacher_path_that_does_not_exist(prompts_file, tmp_path):
    assert_one_line_error(invoke(_args(tmp_path / "no/such/dir", prompts_file, tmp_path / "c")), "does not exist")


def test_part_out_of_range(tiny_teacher, prompts_file, tmp_path):
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, tmp_path / "c", part=2, num_parts=2)),
                          "part must be in [0, num-parts)")


@pytest.mark.parametrize("over,needle", [
    (dict(height=70), "--height 70 is not divisible by 16"),
    (dict(width=40), "--width 40 is not divisible by 16"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(frames=3), "--frames 3 must be 1 or 4k+1"),
    (dict(batch_size=-1), "batch-size must be an integer >= 1"),
])
def test_nonsensical_sizes(tiny_teacher, prompts_file, tmp_path, over, needle):
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, tmp_path / "c", **over)), needle)


def test_guidance_2_needs_two_experts(tiny_teacher_factory, prompts_file, tmp_path):
    r = invoke(_args(tiny_teacher_factory("wan2.1"), prompts_file, tmp_path / "c", guidance_2=3.0))
    assert_one_line_error(r, "--guidance-2 applies only to two-expert")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output(tiny_teacher, prompts_file, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, ro / "c")), "cannot write")


def test_output_under_a_file_cannot_be_created(tiny_teacher, prompts_file, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, f / "cache")), "cannot write to output directory")


def test_output_that_is_a_file_or_foreign_dir(tiny_teacher, prompts_file, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, f)), "is a file")
    d = tmp_path / "home"
    d.mkdir()
    (d / "thesis.tex").write_text("precious")
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, d)), "not a WanDistiller cache")
    assert (d / "thesis.tex").read_text() == "precious"


def test_unknown_toml_key_and_bad_toml(tiny_teacher, prompts_file, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[teacher_cache]\nstepz = 3\n")
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, tmp_path / "c") + ["--config", cfg]),
                          "unknown key 'stepz'")
    cfg.write_text("steps = [\n")
    assert_one_line_error(invoke(_args(tiny_teacher, prompts_file, tmp_path / "c") + ["--config", cfg]),
                          "not valid TOML")


def test_cli_flags_override_toml(tmp_path):
    from pipeline.config import TeacherCacheConfig
    from pipeline.config_types import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('steps = 9\n[teacher_cache]\nheight = 32\nnegative-prompt = "x"\n')
    c = load_config(TeacherCacheConfig, cfg, {"teacher": "t", "prompts": "p", "out": "o", "steps": 3, "width": None})
    assert (c.steps, c.height, c.width, c.negative_prompt) == (3, 32, 832, "x")


def test_existing_cache_with_other_fingerprint_is_refused(tiny_cache, tiny_teacher, prompts_file):
    before = {p: p.stat().st_mtime_ns for p in tiny_cache.rglob("*") if p.is_file()}
    r = invoke(_args(tiny_teacher, prompts_file, tiny_cache, steps=5))
    assert_one_line_error(r, "other settings", "--overwrite")
    assert {p: p.stat().st_mtime_ns for p in tiny_cache.rglob("*") if p.is_file()} == before


def test_rerun_of_a_complete_cache_is_a_no_op(tiny_cache, tiny_teacher, prompts_file):
    before = {p: p.stat().st_mtime_ns for p in (tiny_cache / "shards").iterdir()}
    r = invoke(_args(tiny_teacher, prompts_file, tiny_cache))
    assert r.exit_code == 0, r.output
    assert "already complete" in r.output
    assert {p: p.stat().st_mtime_ns for p in (tiny_cache / "shards").iterdir()} == before


def test_duplicates_dropped_with_a_count(tiny_teacher, tmp_path):
    p = tmp_path / "dup.txt"
    p.write_text("a red circle\na blue square\na red circle\na red circle\n")
    r = invoke(_args(tiny_teacher, p, tmp_path / "c", steps=2))
    assert r.exit_code == 0, r.output
    assert "dropped 2 duplicate prompt(s); 2 unique" in r.output
    info = json.loads(invoke(["cache", "info", tmp_path / "c", "--json"]).output)
    assert info["prompts"] == 2 and info["samples"] == 4


def test_cache_info_json(tiny_cache):
    r = invoke(["cache", "info", tiny_cache, "--json"])
    assert r.exit_code == 0
    info = json.loads(r.output)
    assert {"samples", "shards", "prompts", "steps", "latent_shape", "bytes", "fingerprint"} <= set(info)
    assert info["samples"] == 7 * 4 and info["latent_shape"] == [16, 1, 8, 8] and info["steps"] == 4


def test_cache_info_counts_a_video_caches_frames(tiny_video_cache, tiny_cache):
    """A 5-frame cache: its decoded and latent frames beside its latent shape (an image cache's summary as it was)."""
    r = invoke(["cache", "info", tiny_video_cache])
    assert r.exit_code == 0, r.output
    assert "      latent_shape: [16, 2, 8, 8]\n            frames: 5\n     latent_frames: 2\n" in r.output
    info = json.loads(invoke(["cache", "info", tiny_video_cache, "--json"]).output)
    assert info["frames"] == 5 and info["latent_frames"] == 2 and info["samples"] == 2 * 4
    assert not {"frames", "latent_frames"} & set(json.loads(invoke(["cache", "info", tiny_cache, "--json"]).output))


def test_cache_info_on_missing_cache(tmp_path):
    assert_one_line_error(invoke(["cache", "info", tmp_path / "none"]), "does not exist")


def test_help_shows_a_runnable_example():
    r = invoke(["teacher-cache", "--help"])
    assert r.exit_code == 0 and "Example: wandistiller teacher-cache" in r.output.replace("\n", " ")
