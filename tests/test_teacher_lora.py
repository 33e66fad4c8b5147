"""`teacher-cache --teacher-lora`: a user's LoRA fused into the teacher before stage one (pipeline/teacher_lora.py).

The fuse is exact (each adapted Linear becomes W + scale * B A alpha / rank, the same model peft runs with the adapter
on); a LoRA at scale 0 caches the plain teacher's bytes under another fingerprint, at scale 1 another trajectory;
the header records each file by sha256 (its path unfingerprinted) and is absent when the flag is; sample refuses in
one line when the file a student's cache was made with has moved or changed; and a file that is not a LoRA of this
teacher, or that is a FIFO, is refused in one line before any model runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from cache.manifest import load_manifest
from pipeline import teacher_lora
from pipeline.cli import main
from pipeline.config import TeacherCacheConfig
from pipeline.errors import UserError
from pipeline.lora_experts import add_adapter, wan_state
from pipeline.registries import LORA_TARGETS

from conftest import TEST_PROMPTS, make_cache, read_all_samples, sample_header

ROOT = Path(__file__).resolve().parents[1]


def transformer(teacher: Path, comp: str = "transformer"):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(teacher, subfolder=comp, torch_dtype=torch.float32).eval()


def lora_file(teacher: Path, out: Path, comp: str = "transformer", seed: int = 0, rank: int = 4,
              alpha: float = 2.0, wan: bool = True) -> tuple[Path, dict]:
    """A rank-`rank` LoRA of `comp` with random A and B (peft starts B at zero), saved in Wan's or diffusers' keys;
    returns its path and its diffusers-keyed tensors."""
    from peft.utils import get_peft_model_state_dict

    model = transformer(teacher, comp)
    add_adapter(model, rank, alpha, tuple(LORA_TARGETS.split(",")))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.3
    state = {f"transformer.{k}": v.detach().float().contiguous()
             for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
    if wan:
        save_file(wan_state(state, alpha), str(out))
    else:  # (as diffusers saves one: its LoraConfig, alpha included, in the header)
        from diffusers import WanPipeline

        config = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()}
        WanPipeline.save_lora_weights(out.parent, transformer_lora_layers={k.removeprefix("transformer."): v
                                                                             for k, v in state.items()},
                                      weight_name=out.name, transformer_lora_adapter_metadata=config)
    return out, state


@pytest.fixture(scope="module")
def style(tiny_teacher, tmp_path_factory) -> Path:
    return lora_file(tiny_teacher, tmp_path_factory.mktemp("lora") / "style.safetensors")[0]


def test_the_flag_reads_expert_file_and_scale():
    assert teacher_lora.parse("style.safetensors") == ("style.safetensors", 1.0, None)
    assert teacher_lora.parse("high=a/style.safetensors:0.5") == ("a/style.safetensors", 0.5, (1,))
    assert teacher_lora.parse("2=style.safetensors:-1") == ("style.safetensors", -1.0, (2,))
    assert teacher_lora.parse("x=y:z.safetensors") == ("x=y:z.safetensors", 1.0, None)  # (names holding = and :)
    for bad in ("low=", "style.safetensors:nan", "style.safetensors:1e9"):
        with pytest.raises(ValueError, match="teacher-lora"):
            teacher_lora.parse(bad)
    with pytest.raises(ValueError, match="teacher-lora"):
        TeacherCacheConfig(teacher="t", out="o", prompts="p.txt", teacher_lora=("s.safetensors:inf",))


@pytest.mark.parametrize("wan", [True, False], ids=["wan-keys", "diffusers-keys"])
def test_the_fuse_is_the_adapted_model(tiny_teacher, tmp_path, wan):
    """Each adapted weight becomes W + s B A alpha / r exactly, and the fused model's output is peft's with the
    adapter on at that scale."""
    path, state = lora_file(tiny_teacher, tmp_path / "l.safetensors", wan=wan)
    loaded = teacher_lora.read(f"high={path}:0.5", 2)
    assert loaded.record.experts == [1] and loaded.record.scale == 0.5
    plain, fused = transformer(tiny_teacher), teacher_lora.fuse(transformer(tiny_teacher), [loaded], 1)
    assert not any("lora" in n for n, _ in fused.named_parameters())  # plain Linear layers: no cost per step
    a, b = state["transformer.blocks.0.attn1.to_q.lora_A.weight"], state["transformer.blocks.0.attn1.to_q.lora_B.weight"]
    want = plain.blocks[0].attn1.to_q.weight + 0.5 * (b @ a) * 2.0 / 4
    assert torch.allclose(fused.blocks[0].attn1.to_q.weight, want, atol=1e-6)

    from peft import set_peft_model_state_dict

    adapted = transformer(tiny_teacher)
    add_adapter(adapted, 4, 2.0, tuple(LORA_TARGETS.split(",")))
    set_peft_model_state_dict(adapted, {k.removeprefix("transformer."): v for k, v in state.items()}, "default")
    for module in adapted.modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, dict):
            module.scaling["default"] *= 0.5
    g = torch.Generator().manual_seed(1)
    cfg = plain.config
    x = torch.randn(1, cfg.in_channels, 1, 8, 8, generator=g)
    text = torch.randn(1, 6, cfg.text_dim, generator=g)
    t = torch.tensor([600.0])
    with torch.no_grad():
        ours = fused(x, t, text, return_dict=False)[0]
        peft_out = adapted(x, t, text, return_dict=False)[0]
        base = plain(x, t, text, return_dict=False)[0]
    assert torch.allclose(ours, peft_out, atol=1e-5) and not torch.allclose(ours, base, atol=1e-3)


def test_a_cache_records_the_lora_by_content(tiny_teacher, tiny_cache, style, prompts_file, tmp_path):
    """Scale 0 caches the plain teacher's samples bit for bit under its own fingerprint; scale 1 another trajectory;
    the plain cache's header has no LoRA fields at all."""
    zero = make_cache(tiny_teacher, prompts_file, tmp_path / "zero", teacher_lora=(f"{style}:0",))
    one = make_cache(tiny_teacher, prompts_file, tmp_path / "one", teacher_lora=(str(style),))
    plain_m, zero_m, one_m = (load_manifest(c) for c in (tiny_cache, zero, one))
    assert "teacher_loras" not in json.loads((tiny_cache / "manifest.json").read_text())
    assert zero_m.teacher_loras[0].file == "style.safetensors" and zero_m.teacher_loras[0].experts == [1, 2]
    assert zero_m.teacher_lora_paths == [str(style)]
    from cache.manifest import summarize  # (`cache info`)

    assert summarize(zero)["teacher_loras"].startswith("style.safetensors x0 (experts 1, 2, sha256 ")
    assert "teacher_loras" not in summarize(tiny_cache)
    assert len({plain_m.fingerprint, zero_m.fingerprint, one_m.fingerprint}) == 3
    latents = lambda c: {k: v[0] for k, v in read_all_samples(c).items()}  # noqa: E731
    plain_s, zero_s, one_s = latents(tiny_cache), latents(zero), latents(one)
    assert plain_s.keys() == zero_s.keys() == one_s.keys()
    for k in plain_s:
        for name, t in plain_s[k].items():
            assert torch.equal(t, zero_s[k][name]), (k, name)
    assert any(not torch.equal(t, one_s[k][n]) for k in plain_s for n, t in plain_s[k].items() if t.is_floating_point())

    lora = zero_m.teacher_loras[0]
    fp = lambda **kw: sample_header(**kw).settings_fingerprint()  # noqa: E731
    moved = fp(teacher_loras=[lora], teacher_lora_paths=["/elsewhere/style.safetensors"])
    assert moved == fp(teacher_loras=[lora], teacher_lora_paths=["/here/style.safetensors"])  # where: not a setting
    other = type(lora)(**{**lora.to_json(), "sha256": "0" * 64})
    assert fp(teacher_loras=[other], teacher_lora_paths=["/here"]) != moved != fp()


def test_a_changed_or_moved_lora_is_refused_where_it_is_fused_again(style, tmp_path):
    record = teacher_lora.read(str(style), 2).record
    copy = tmp_path / "style.safetensors"
    shutil.copy(style, copy)
    assert teacher_lora.recorded([record], [str(copy)], "the cache c")[0].record == record
    save_file({"x": torch.zeros(2)}, str(copy))
    with pytest.raises(UserError, match="is not the one the cache c was made with"):
        teacher_lora.recorded([record], [str(copy)], "the cache c")
    with pytest.raises(UserError, match="put the file"):
        teacher_lora.recorded([record], [str(tmp_path / "gone.safetensors")], "the cache c")
    with pytest.raises(UserError, match="no paths to them"):
        teacher_lora.recorded([record], None, "the cache c")


def _stage_one(args) -> object:
    return CliRunner().invoke(main, ["teacher-cache", *map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize("kind", ["pickle", "fifo", "other-model", "no-layers", "one-expert", "disk"])
def test_what_is_not_a_lora_of_this_teacher_is_refused_in_one_line(kind, tiny_teacher, tiny_teacher_factory, style,
                                                                   prompts_file, tmp_path):
    path, teacher, extra = tmp_path / "bad.safetensors", tiny_teacher, []
    if kind == "pickle":
        torch.save({"a": torch.zeros(2)}, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "other-model":  # a LoRA of a wider model: its shapes do not fit
        save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 999),
                   "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(999, 4)}, str(path))
    elif kind == "no-layers":  # a LoRA of layers this teacher lacks
        save_file({"transformer.blocks.77.attn1.to_q.lora_A.weight": torch.zeros(4, 32),
                   "transformer.blocks.77.attn1.to_q.lora_B.weight": torch.zeros(32, 4)}, str(path))
    elif kind == "one-expert":
        path, teacher = Path(f"low={style}"), tiny_teacher_factory("wan2.1")
    else:
        path, extra = style, ["--placement", "disk", "--offload-dir", tmp_path / "offload"]
    r = _stage_one(["--teacher", teacher, "--prompts", prompts_file, "--out", tmp_path / "cache", "--steps", 2,
                    "--height", 64, "--width", 64, "--max-sequence-length", 32, "--teacher-lora", path,
                    *(extra or ["--placement", "cpu"])])
    needle = {"pickle": "not a safetensors file", "fifo": "FIFO", "other-model": "does not fit expert 1",
              "no-layers": "does not fit expert 1", "one-expert": "the teacher has one expert",
              "disk": "--teacher-lora with --placement disk"}[kind]
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output, r.output
    assert "encode prompts" not in r.output and not (tmp_path / "cache").exists()  # (refused before anything ran)


def test_the_dry_run_names_the_loras(tiny_teacher, style, prompts_file, tmp_path):
    r = _stage_one(["--teacher", tiny_teacher, "--prompts", prompts_file, "--out", tmp_path / "c", "--steps", 2,
                    "--height", 64, "--width", 64, "--teacher-lora", f"high={style}:0.8", "--dry-run",
                    "--placement", "cpu"])
    assert r.exit_code == 0, r.output
    assert "LoRAs      style.safetensors x0.8 (expert 1, sha256" in r.output and not (tmp_path / "c").exists()


def test_sample_fuses_the_recorded_lora_and_refuses_a_changed_one(tiny_teacher, style, prompts_file, tmp_path):
    """A student of a LoRA'd cache: `sample` draws beside it the teacher with the LoRA fused (load_teacher's, whose
    weights are the fused ones), and refuses in one line once the file has changed."""
    from test_train_student import train

    lora = tmp_path / "mine.safetensors"
    shutil.copy(style, lora)
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    cache = make_cache(tiny_teacher, prompts, tmp_path / "cache", teacher_lora=(str(lora),), steps=2)
    run = tmp_path / "run"
    train(cache, run, max_steps=1, holdout_prompts=0)
    assert json.loads((run / "distill.json").read_text())["teacher_lora_paths"] == [str(lora)]
    grid = tmp_path / "grid.png"
    r = CliRunner().invoke(main, ["sample", "--student", str(run), "--prompts", str(prompts), "--out", str(grid),
                                  "--teacher", str(tiny_teacher)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    from stages.sample.models import load_teacher

    distill = json.loads((run / "distill.json").read_text())
    records = [teacher_lora.TeacherLora(**d) for d in distill["teacher_loras"]]
    fused = load_teacher(tiny_teacher, torch.float32, torch.device("cpu"), text=False, vae=False,
                         teacher_loras=teacher_lora.recorded(records, [str(lora)], "the run"))
    plain = transformer(tiny_teacher)
    assert not torch.equal(fused.transformer.blocks[0].attn1.to_q.weight, plain.blocks[0].attn1.to_q.weight)
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32)}, str(lora))
    r = CliRunner().invoke(main, ["sample", "--student", str(run), "--prompts", str(prompts), "--out", str(grid),
                                  "--teacher", str(tiny_teacher)], catch_exceptions=False)
    assert r.exit_code == 2 and "is not the one" in r.output and "Traceback" not in r.output, r.output


def test_the_hybrid_workflow_and_the_cards_carry_the_teachers_loras():
    """The ComfyUI hybrid's teacher passes load each LoRA of its expert at its scale (the run's own pass does not);
    the card says the student carries the style and which files the teacher had."""
    from cache.records import TeacherLora
    from pipeline.model_call import InputRule
    from stages.sample import comfyui, hub_card

    style = TeacherLora(file="style.safetensors", sha256="a" * 64, scale=0.8, experts=[1, 2])
    high = TeacherLora(file="sky.safetensors", sha256="b" * 64, scale=1.0, experts=[1])
    sched = comfyui.Schedule(4, 2, 5.0, False, "euler", [1.0, 0.9, 0.7, 0.4], [1.0, 0.9, 0.7, 0.4])
    experts, adapters = ["transformer", "transformer_2"], {"transformer_2": "low.safetensors"}
    passes = [comfyui.Pass("transformer", False, 5.0, "uni_pc", 3.5, 8, 0, 4, "teacher"),
              comfyui.Pass("transformer_2", False, 5.0, "uni_pc", 3.0, 8, 4, 5, "teacher"),
              comfyui.Pass("transformer_2", True, 5.0, "euler", 1.0, 4, 2, 4)]
    files = comfyui.model_files("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 2, "x")
    hints = {"width": 64, "height": 64, "guidance_scale": 1.0}
    nodes = comfyui.workflow(sched, experts, adapters, hints, files, InputRule(), passes=passes,
                             teacher_loras=[style, high])
    loras = [(n["_meta"]["title"], n["inputs"]["lora_name"], n["inputs"]["strength_model"]) for n in nodes.values()
             if n["class_type"] == "LoraLoaderModelOnly"]
    assert loras == [("Teacher LoRA style.safetensors (high-noise)", "style.safetensors", 0.8),
                     ("Teacher LoRA sky.safetensors (high-noise)", "sky.safetensors", 1.0),
                     ("Teacher LoRA style.safetensors (low-noise)", "style.safetensors", 0.8),
                     ("LoRA (low-noise)", "low.safetensors", 1.0)]
    plain = comfyui.workflow(sched, experts, adapters, hints, files, InputRule(), passes=passes)
    assert sum(n["class_type"] == "LoraLoaderModelOnly" for n in plain.values()) == 1
    assert "style.safetensors, sky.safetensors" in comfyui.hybrid_card(passes, [style, high])
    assert "no adapter" in comfyui.hybrid_card(passes)

    from conftest import sample_distill

    record = sample_distill(teacher_loras=[style], teacher_lora_paths=["/private/style.safetensors"])
    card = hub_card.carried_teacher_loras(record, "The student")
    assert "style.safetensors x0.8 (experts 1, 2, sha256 aaaaaaaaaaaa)" in card and "/private" not in card
    assert hub_card.carried_teacher_loras(sample_distill(), "The student") == ""
    public = hub_card.public_record(record, "tiny")  # (an export's distill.json: no local path)
    assert "teacher_lora_paths" not in public and public["teacher_loras"][0]["file"] == "style.safetensors"
