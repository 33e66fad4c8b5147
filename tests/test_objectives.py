"""Objectives as plug-ins over the declared cache schema, and the run artifact that records them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cache import format as F
from cache.manifest import load_manifest
from cache.schema import SAMPLE_FIELDS, sample_fields, sample_problems
from cache.writer import encode_sample
from conftest import ROOT, sample_distill
from pipeline.artifact import DistillRecord, RunLayout
from pipeline.cli import main
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from stages import train_student
from stages.train_student.checkpoint import HEADS, complete
from stages.train_student.objective_velocity import (
    OBJECTIVES, Batch, Objective, Outputs, Velocity, block_output, mse, registered,
)

TINY = str(ROOT / "configs" / "student-tiny.json")


def train(cache, out, **kw) -> dict:
    args = dict(cache=(str(cache),), student_config=TINY, out=str(out), num_workers=0, warmup_steps=0, log_every=1,
                eval_every=0, checkpoint_every=0, lr=1e-3, batch_size=4)
    args.update(kw)
    return train_student.run(TrainStudentConfig(**args))


class NeedsCond(Objective):
    """A toy objective reading a field the tiny cache does not record (it was made without --save-cond-uncond)."""

    name = "toy-needs-cond"
    help = "toy"
    fields = (F.T_X_T, F.T_TARGET_COND)

    def terms(self, out, batch, heads):
        return {"cond": mse(out.prediction, batch.fields[F.T_TARGET_COND])}


class Projected(Objective):
    """A toy objective with a trainable head on a student block: checkpointed, resumed, never exported."""

    name = "toy-projected"
    help = "toy"
    fields = (F.T_X_T, F.T_TARGET)
    outputs = ("prediction", block_output(0))

    def heads(self, student_config, manifest):
        dim = student_config["num_attention_heads"] * student_config["attention_head_dim"]
        return torch.nn.Linear(dim, 4)

    def terms(self, out, batch, heads):
        feat = heads(out.blocks[0].float()).mean(1)  # [B, 4]
        return {"velocity": mse(out.prediction, batch.fields[F.T_TARGET]),
                "feature": 0.1 * feat.pow(2).mean(1)}  # pulls the projected block output towards 0


def test_toy_objective_needing_a_missing_field_is_refused_in_one_line(tiny_cache, tmp_path):
    assert F.T_TARGET_COND not in sample_fields(load_manifest(tiny_cache))
    with registered(NeedsCond):
        r = CliRunner().invoke(main, ["train-student", "--cache", str(tiny_cache), "--student-config", TINY,
                                      "--out", str(tmp_path / "out"), "--objective", "toy-needs-cond"],
                               catch_exceptions=False)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "toy-needs-cond needs cache field(s) target_cond" in lines[0]
    assert "teacher-cache --save-cond-uncond" in lines[0]
    assert not (tmp_path / "out").exists()  # refused before anything was written
    assert "toy-needs-cond" not in OBJECTIVES


def test_unknown_objective_and_undeclared_fields_are_refused(tiny_cache, tmp_path):
    with pytest.raises(UserError, match="--objective 'nope' is not one of .*velocity"):
        train(tiny_cache, tmp_path / "x", objective="nope", max_steps=1)

    class Undeclared(Objective):
        name, help, fields = "toy-undeclared", "toy", ("features_of_block_7",)

    with pytest.raises(ValueError, match="undeclared cache field"):
        with registered(Undeclared):
            pass
    with pytest.raises(ValueError, match="not declared in cache/schema.py"):
        encode_sample({"x_t": torch.zeros(1), "feature": torch.zeros(1)}, {})


def test_schema_checks_what_the_reader_and_verify_check(tiny_cache):
    m = load_manifest(tiny_cache)
    assert m.sample_fields == [F.T_X_T, F.T_TARGET]  # written by stage one, from the schema
    assert sample_fields(m.header()) == (F.T_X_T, F.T_TARGET)  # stage one's header: derived from its settings
    cond = dataclasses.replace(m.header(), save_cond_uncond=True)
    assert sample_fields(cond)[2:] == (F.T_TARGET_COND, F.T_TARGET_UNCOND)
    shape, dtype = m.latent_shape, F.DTYPES[m.dtype]
    key = F.sample_key(1, 0, 2)
    meta = {F.M_PROMPT_IDX: 1, F.M_SEED_IDX: 0, F.M_STEP: 2, F.M_TIMESTEP: 500.0, F.M_SIGMA: 0.5, F.M_EXPERT: 1,
            F.M_GUIDANCE: 4.0}
    good = {F.T_X_T: torch.zeros(shape, dtype=dtype), F.T_TARGET: torch.zeros(shape, dtype=dtype)}
    assert sample_problems(key, good, meta, m) == []
    bad = sample_problems(key, {F.T_X_T: torch.zeros(2, dtype=dtype)}, meta | {F.M_STEP: "2"}, m)
    assert any("lacks tensor target" in p for p in bad) and any("x_t is" in p for p in bad)
    assert any("metadata step" in p for p in bad)
    assert sample_problems(F.sample_key(2, 0, 2), good, meta, m) == [f"sample {F.sample_key(2, 0, 2)} metadata "
                                                                     "names another sample"]
    assert set(SAMPLE_FIELDS) >= {F.T_X_T, F.T_TARGET, F.T_TARGET_COND, F.T_TARGET_UNCOND}


def test_velocity_is_the_per_sample_mse_of_the_prediction():
    pred, target = torch.randn(3, 4, 1, 2, 2), torch.randn(3, 4, 1, 2, 2)
    batch = Batch({F.T_X_T: torch.zeros_like(target), F.T_TARGET: target}, torch.zeros(3), torch.zeros(3, 2, 8),
                  torch.ones(3))
    terms = Velocity().terms(Outputs(pred), batch, None)
    assert list(terms) == ["velocity"]
    assert torch.equal(terms["velocity"], (pred.float() - target).pow(2).flatten(1).mean(1))


@pytest.mark.slow
def test_objective_heads_are_checkpointed_resumed_and_never_exported(tiny_cache, tmp_path, monkeypatch):
    kw = dict(max_steps=6, checkpoint_every=2, objective="toy-projected", ema_decay=0.9)
    with registered(Projected):
        full = tmp_path / "full"
        train(tiny_cache, full, **kw)
        cut = tmp_path / "cut"
        monkeypatch.setenv("WANDISTILLER_FAIL_AT", "0:4")  # dies as step 4 begins: checkpoint 2 is the newest
        with pytest.raises(RuntimeError, match="injected failure"):
            train(tiny_cache, cut, **kw)
        monkeypatch.delenv("WANDISTILLER_FAIL_AT")
        ckpt = complete(cut)[-1]
        assert (ckpt / HEADS).is_file() and sorted(load_file(ckpt / HEADS)) == ["bias", "weight"]
        train(tiny_cache, cut, resume=True, **kw)
    rows = [json.loads(line) for line in RunLayout(full).metrics.read_text().splitlines()]
    train_rows = [r for r in rows if r["type"] == "train"]
    assert {"loss_velocity", "loss_feature"} <= set(train_rows[-1])  # each term logged
    assert abs(train_rows[-1]["loss_velocity"] + train_rows[-1]["loss_feature"] - train_rows[-1]["loss"]) < 1e-6
    cut_rows = [json.loads(line) for line in RunLayout(cut).metrics.read_text().splitlines()]
    assert [r["loss"] for r in cut_rows if r["type"] == "train"] == [r["loss"] for r in train_rows]
    for name in ("student", "student_ema"):
        a = load_file(cut / name / "diffusion_pytorch_model.safetensors")
        b = load_file(full / name / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert not any("weight" == k or k.startswith("heads") for k in a)  # the head is not part of the export
    record = DistillRecord.read(RunLayout(full).distill)
    assert record.objective == "toy-projected" and record.student_steps is None
    # Another objective cannot resume this run.
    with pytest.raises(UserError, match="another objective"):
        train(tiny_cache, full, resume=True, max_steps=8, checkpoint_every=2)


def test_distill_record_has_one_spelling_per_key(tmp_path):
    r = sample_distill()
    path = tmp_path / "distill.json"
    path.write_text(json.dumps(r.to_json()))
    assert DistillRecord.read(path) == r and r.sampling_steps == 4
    path.write_text(json.dumps(r.to_json() | {"cache_fingerprints": ["abc"]}))
    with pytest.raises(ValueError, match="unknown field 'cache_fingerprints'"):
        DistillRecord.read(path)
    assert sample_distill(student_steps=2).sampling_steps == 2
    assert Path(RunLayout(tmp_path).student).name == "student"


def test_target_guidance_mixes_the_recorded_branches(tiny_teacher, prompts_file, tiny_cache, tmp_path):
    """velocity --target-guidance w learns u + w (c - u) from the cache's two branches (--save-cond-uncond): at each
    sample's own guidance that is the guided target the cache holds (to its dtype's rounding), at another it is
    another; distill.json then records w as the guidance the student learned (sample draws the teacher at it). A
    cache without the branches is refused in one line naming the flag that records them."""
    from conftest import make_cache, read_all_samples

    cache = make_cache(tiny_teacher, prompts_file, tmp_path / "cache", save_cond_uncond=True)
    for key, (t, meta) in read_all_samples(cache).items():
        fields = {k: t[k][None] for k in (F.T_X_T, F.T_TARGET, F.T_TARGET_COND, F.T_TARGET_UNCOND)}
        batch = Batch(fields, torch.zeros(1), torch.zeros(1, 2, 8), torch.ones(1))
        guided = Outputs(fields[F.T_TARGET].float())  # a prediction equal to the cached guided target
        own = Velocity({"target_guidance": meta[F.M_GUIDANCE]}).terms(guided, batch, None)["velocity"]
        other = Velocity({"target_guidance": meta[F.M_GUIDANCE] + 2.0}).terms(guided, batch, None)["velocity"]
        c, u = fields[F.T_TARGET_COND].float(), fields[F.T_TARGET_UNCOND].float()
        two_more = (2.0 * (c - u)).pow(2).mean()  # what 2 more of guidance adds to the target, squared
        assert own.item() < 1e-3 * fields[F.T_TARGET].float().pow(2).mean(), key
        assert torch.allclose(other, two_more, rtol=0.05), key
    report = train(cache, tmp_path / "w3", target_guidance=3.0, max_steps=1)
    record = json.loads((tmp_path / "w3" / "distill.json").read_text())
    assert record["guidance"] == 3.0 and record["objective_settings"] == {"target_guidance": 3.0}, report
    assert record["guidance_2"] in (None, 3.0)
    r = CliRunner().invoke(main, ["train-student", "--cache", str(tiny_cache), "--student-config", TINY, "--out",
                                  str(tmp_path / "no"), "--target-guidance", "3"])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "target_cond, target_uncond" in r.stderr and "--save-cond-uncond" in r.stderr
