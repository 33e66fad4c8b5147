"""The guidance scale as a student's input (pipeline/guidance_input.py, train-student --guidance-range): an embedding
beside the timestep's that starts as a no-op, learns the teacher over a range of scales from one cache's two
branches, is asked for the teacher's scale by sample and eval, and is baked exactly into a plain transformer by
export --guidance-scale."""

from __future__ import annotations

import copy
import json

import torch
from click.testing import CliRunner
from diffusers import WanTransformer3DModel

from conftest import ROOT, make_cache
from pipeline import guidance_input
from pipeline.cli import main
from pipeline.model_call import Inputs, predict
from stages.sample.models import find_student

TINY = str(ROOT / "configs" / "student-tiny.json")


def _tiny() -> WanTransformer3DModel:
    cfg = {k: v for k, v in json.loads(open(TINY).read()).items() if not k.startswith("_")}
    torch.manual_seed(0)
    return WanTransformer3DModel(**cfg).eval()


def _out(model, w: float | None, per_token: bool = False) -> torch.Tensor:
    torch.manual_seed(1)
    x, text = torch.randn(2, 16, 1, 8, 8), torch.randn(2, 6, 32)
    t = torch.tensor([700.0, 200.0])
    if per_token:  # one timestep per latent token (Wan2.2-TI2V's layout): the time embedding is [B, tokens, D]
        t = t[:, None].expand(-1, 16)
    scale = None if w is None else torch.full((2,), w)
    with torch.no_grad():
        return predict(model, Inputs(x, t, text, guidance_input=scale)).guided


def test_the_embedding_starts_as_a_no_op_and_bakes_exactly():
    """Attached, the untrained embedding changes nothing at any scale; trained, scales differ, on scalar and per-token
    timesteps alike; `bake` at w gives a plain WanTransformer3DModel (no embedding, no config key) whose output is the
    conditioned one's at w."""
    plain = _tiny()
    model = guidance_input.attach(copy.deepcopy(plain), 1.5, 3.0)
    assert guidance_input.trained_range(model.config) == (1.5, 3.0)
    assert torch.equal(_out(model, 2.0), _out(plain, None)) and torch.equal(_out(model, 3.0), _out(plain, None))
    torch.nn.init.normal_(model.guidance_embedder.embed.linear_2.weight, std=0.2)  # as if trained
    assert (_out(model, 2.0) - _out(model, 3.0)).abs().max() > 1e-3
    assert torch.allclose(_out(model, 2.5, per_token=True), _out(model, 2.5), atol=1e-5)
    baked = guidance_input.bake(copy.deepcopy(model), 2.5)
    assert not hasattr(baked, guidance_input.NAME) and guidance_input.CONFIG_KEY not in baked.config
    assert torch.allclose(_out(baked, None), _out(model, 2.5), atol=1e-5)


def test_guidance_range_trains_samples_evaluates_and_exports(tiny_teacher, prompts_file, tmp_path):
    """From a --save-cond-uncond cache, --guidance-range 1.5,3 trains a compact student with the embedding, recorded in
    its config.json and distill.json; loaded again it answers each scale differently; sample and eval ask it for the
    teacher's scale; export refuses it without --guidance-scale (one line, exit 2) and with one writes a plain
    transformer equal to the student at that scale. --target-guidance with it, a LoRA student and a backwards range
    are each refused in one line."""
    cache = make_cache(tiny_teacher, prompts_file, tmp_path / "cache", save_cond_uncond=True)
    out, run = tmp_path / "range", CliRunner()
    base = ["train-student", "--cache", str(cache), "--batch-size", "4", "--warmup-steps", "0", "--max-steps", "3",
            "--num-workers", "0", "--val-every", "0", "--checkpoint-every", "0", "--lr", "1e-2"]
    r = run.invoke(main, [*base, "--student-config", TINY, "--out", str(out), "--guidance-range", "1.5,3"])
    assert r.exit_code == 0, r.output
    record = json.loads((out / "distill.json").read_text())
    assert record["objective_settings"] == {"guidance_range": [1.5, 3.0]}, record["objective_settings"]
    student = find_student(str(out), "raw")
    model = student.kind.load(student, torch.float32, torch.device("cpu"))
    assert hasattr(model, guidance_input.NAME) and (_out(model, 1.5) - _out(model, 3.0)).abs().max() > 1e-4
    r = run.invoke(main, ["sample", "--student", str(out), "--teacher", str(tiny_teacher), "--prompts",
                          str(prompts_file), "--out", str(tmp_path / "grid.png"), "--max-prompts", "1",
                          "--guidance", "2.5"])
    assert r.exit_code == 0 and (tmp_path / "grid.png").is_file(), r.output
    r = run.invoke(main, ["eval", "--student", str(out), "--cache", str(cache), "--report", str(tmp_path / "e.json"),
                          "--no-teacher-timing", "--max-prompts", "2"])
    assert r.exit_code == 0 and "guidance" not in r.stderr, r.output
    r = run.invoke(main, ["export", "--student", str(out), "--weights", "raw", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "--guidance-scale" in r.stderr, r.output
    r = run.invoke(main, ["export", "--student", str(out), "--weights", "raw", "--out", str(tmp_path / "x"),
                          "--guidance-scale", "2"])
    assert r.exit_code == 0, r.output
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "x" / "transformer").eval()
    assert guidance_input.CONFIG_KEY not in exported.config
    assert torch.allclose(_out(exported, None), _out(model, 2.0), atol=1e-5)
    assert "2 baked in" in (tmp_path / "x" / "README.md").read_text()
    for extra, said in ((["--student-config", TINY, "--target-guidance", "2"], "drop one"),
                        (["--lora-of", str(tiny_teacher)], "compact student"),
                        (["--student-config", TINY, "--guidance-range", "3,1.5"], "LO,HI")):
        args = [*base, *extra, "--out", str(tmp_path / "no")]
        if "--guidance-range" not in extra:
            args += ["--guidance-range", "1.5,3"]
        r = run.invoke(main, args)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, (extra, r.output)
