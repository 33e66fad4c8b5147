"""The teacher's speed options (issue 45): attention backend, regional compile, TF32 and torchao quantization are
checked against the machine before a weight loads, recorded in the cache header's `numerics` (fingerprinted) so a
resume with another option is refused naming it, and drift from the plain teacher's targets by what docs/costs.md
says; cache-skipping hooks are refused, by flag and on a loaded transformer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import TINY_CACHE_ARGS, make_cache, read_all_samples
from test_refused_inputs import _cli, one_line
from pipeline.errors import UserError
from stages.teacher_cache.speed import TeacherSpeed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _stage_one(teacher, prompts, out, *extra):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_CACHE_ARGS.items()]
    return _cli("teacher-cache", "--teacher", teacher, "--prompts", prompts, "--out", out, "--placement", "cpu",
                *args, *extra)


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("speed-prompts") / "two.txt"
    p.write_text("a red circle on a blue background\na small green square in the top left\n")
    return p


@pytest.fixture(scope="module")
def plain(tiny_teacher, two_prompts, tmp_path_factory) -> Path:
    return make_cache(tiny_teacher, two_prompts, tmp_path_factory.mktemp("speed") / "plain")


def _targets(cache: Path) -> dict[str, torch.Tensor]:
    return {k: t["target"].float() for k, (t, _) in read_all_samples(cache).items()}


def _drift(a: Path, b: Path) -> float:
    """Largest |target difference| over every sample, relative to the largest |target| of `a`."""
    ta, tb = _targets(a), _targets(b)
    assert ta.keys() == tb.keys()
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta) / max(float(t.abs().max()) for t in ta.values())


def test_only_the_options_given_are_recorded():
    assert TeacherSpeed().numerics(torch.device("cpu")) is None
    assert TeacherSpeed(tf32=True).numerics(torch.device("cpu")) is None  # TF32 touches CUDA matmuls only
    assert TeacherSpeed(tf32=True).numerics(torch.device("cuda")) == {"tf32": True}
    assert TeacherSpeed(compile=True, teacher_quant="int8").numerics(torch.device("cpu")) == {
        "compile": True, "teacher_quant": "int8"}


def test_a_plain_run_records_no_numerics(plain):
    manifest = json.loads((plain / "manifest.json").read_text())
    assert "numerics" not in manifest  # so a cache made before the options keeps its fingerprint


def test_int8_is_recorded_fingerprinted_and_drifts_a_little(plain, tiny_teacher, two_prompts, tmp_path):
    pytest.importorskip("torchao")
    int8 = make_cache(tiny_teacher, two_prompts, tmp_path / "int8", teacher_quant="int8")
    m, p = (json.loads((c / "manifest.json").read_text()) for c in (int8, plain))
    assert m["numerics"] == {"teacher_quant": "int8"} and m["fingerprint"] != p["fingerprint"]
    assert 0 < _drift(plain, int8) < 0.1  # measured 0.0x on the tiny teacher; docs/costs.md has the shapes teacher's


@pytest.mark.slow
def test_compile_warms_up_outside_the_steps_and_keeps_the_targets(plain, tiny_teacher, two_prompts, tmp_path,
                                                                  capsys):
    compiled = make_cache(tiny_teacher, two_prompts, tmp_path / "compiled", compile=True)
    out = capsys.readouterr().out
    assert out.count("compiled the teacher's repeated blocks") == 2  # one warm-up per expert, before the bar
    assert out.index("compiled the teacher's repeated blocks") < out.index("part 0: shards/")
    assert json.loads((compiled / "manifest.json").read_text())["numerics"] == {"compile": True}
    assert _drift(plain, compiled) < 1e-4  # float32 on the CPU: fused kernels, the same arithmetic


def test_a_resume_with_another_option_is_refused_naming_it(plain, tiny_teacher, two_prompts, tmp_path):
    pytest.importorskip("torchao")
    before = sorted(p.name for p in plain.rglob("*"))
    one_line(_stage_one(tiny_teacher, two_prompts, plain, "--teacher-quant", "int8"),
             'other settings', '--teacher-quant "none" then, "int8" now', "--overwrite")
    assert sorted(p.name for p in plain.rglob("*")) == before


@pytest.mark.parametrize("extra, needles", [
    (["--teacher-quant", "fp8"], ["fp8 needs a CUDA GPU of compute capability 8.9", "use int8"]),
    (["--attention-backend", "flash"], ["--attention-backend flash runs on CUDA", "leave it out (native)"]),
    (["--attention-backend", "fastest"], ["attention-backend must be one of", "native", "_flash_3_hub"]),
    (["--step-cache", "first-block"], ["step-cache first-block is refused for stage one",
                                       "targets stage one would write at the skipped steps are not the teacher's"]),
    (["--compile", "--placement", "offload"], ["--compile needs the teacher's weights resident",
                                               "placement offload moves them"]),
])
def test_an_option_this_run_cannot_use_is_refused_in_one_line(tiny_teacher, two_prompts, tmp_path, extra, needles):
    one_line(_stage_one(tiny_teacher, two_prompts, tmp_path / "c", *extra), *needles)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_quantizing_without_torchao_says_how_to_install_it(tiny_teacher, two_prompts, tmp_path, monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find(name, *a))
    one_line(_stage_one(tiny_teacher, two_prompts, tmp_path / "c", "--teacher-quant", "int8"),
             "torchao, which is not installed", "pip install 'wandistiller[quant]'")


def test_a_transformer_carrying_a_cache_hook_is_refused(tiny_teacher):
    from diffusers import WanTransformer3DModel
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    model = WanTransformer3DModel.from_pretrained(tiny_teacher, subfolder="transformer")
    TeacherSpeed().prepare(model)  # the plain expert passes
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.1))
    with pytest.raises(UserError, match="carries diffusers' first-block hook, refused for stage one"):
        TeacherSpeed().prepare(model)


def test_plan_measure_times_the_step_with_the_options_the_run_will_use(tiny_teacher):
    pytest.importorskip("torchao")
    r = _cli("plan", "--teacher", tiny_teacher, "--placement", "cpu", "--height", 64, "--width", 64,
             "--max-sequence-length", 32, "--batch-size", 2, "--prompts", 100, "--measure", "--teacher-quant", "int8")
    assert r.exit_code == 0, r.output[-2000:]
    assert "measured here by --measure" in r.output and "teacher-quant int8" in r.output
    assert "--teacher-quant int8" in r.output  # the printed teacher-cache command carries it


def test_a_refusal_names_an_option_it_does_not_know_instead_of_failing():
    """A header from someone else's cache may carry numerics this version never wrote: named as they are."""
    from conftest import sample_header
    from stages.teacher_cache.make_cache import _changed

    said = _changed(sample_header(numerics={"evil": True, "compile": True}), sample_header())
    assert "--compile true then, false now" in said and "evil true then, null now" in said
