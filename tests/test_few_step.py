"""Few-step students from the same cache (issue 18): the `segment` objective, its K-step Euler schedule on the
teacher's sigma grid, and the one sampler (pipeline/sampling.py) that sample, eval and export share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import read_latents
from cache.reader import open_index
from conftest import ROOT, read_all_samples
from pipeline.artifact import DistillRecord
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.sampling import (
    euler_config, sample_latents, scheduler_from_config, segment_boundaries, student_scheduler, student_steps,
)
from stages.train_student.data import SEGMENT_VELOCITY
from stages.train_student.objective_velocity import Segment, check_cache
from test_train_student import TINY, assert_same_students, metrics, train, weights

SEG = dict(objective="segment", student_steps=2)


def _scheduler_conf(manifest: dict) -> dict:
    return dict(manifest.scheduler)


def test_k_step_euler_schedule_lands_on_the_cached_steps(tiny_cache):
    m = load_manifest(tiny_cache)
    conf, steps = _scheduler_conf(m), int(m.steps)
    assert steps == 4 and conf["_class_name"] == "UniPCMultistepScheduler"
    for k, want in ((1, [0]), (2, [0, 2]), (4, [0, 1, 2, 3])):
        bounds, exact = segment_boundaries(conf, steps, k, m.sigmas)
        assert (bounds, exact) == (want, True)
        s = scheduler_from_config(euler_config(conf))
        s.set_timesteps(k)
        # exactly the cached sigmas and timesteps at the boundaries, then the final latent's 0
        assert [float(v) for v in s.sigmas] == [m.sigmas[b] for b in bounds] + [0.0]
        assert [float(t) for t in s.timesteps] == [float(m.timesteps[b]) for b in bounds]
    assert segment_boundaries(conf, steps, 3, m.sigmas)[1] is False  # 3 does not divide 4


def test_segment_targets_are_average_velocities_of_the_cached_states(tiny_cache):
    m = load_manifest(tiny_cache)
    obj = Segment({"student_steps": 2, "velocity_weight": 0.0})
    check_cache(obj, m, str(tiny_cache), num_layers=1)
    assert obj.record()["boundaries"] == [0, 2] and obj.end_step == [2, 2, 4, 4]
    index = open_index([tiny_cache])
    ds = obj.dataset(index, 8)
    samples = read_all_samples(tiny_cache)
    trajs = sorted({(meta[F.M_PROMPT_IDX], meta[F.M_SEED_IDX]) for _, meta in samples.values()})
    _, finals = read_latents(tiny_cache, int(m.num_parts), trajs)
    final = dict(zip(trajs, finals))
    for row in range(len(index)):
        item = ds[(row, 1.0)]
        p, s, k = F.parse_key(item["key"])
        x_k, meta_k = samples[item["key"]][0][F.T_X_T], samples[item["key"]][1]
        j = obj.end_step[k]
        if j < 4:
            x_j, sigma_j = samples[F.sample_key(p, s, j)][0][F.T_X_T], samples[F.sample_key(p, s, j)][1][F.M_SIGMA]
        else:
            x_j, sigma_j = final[(p, s)], 0.0
        want = (x_j.float() - x_k.float()) / (sigma_j - meta_k[F.M_SIGMA])
        assert torch.equal(item["fields"][SEGMENT_VELOCITY], want), item["key"]
        assert torch.equal(item["fields"][F.T_X_T], x_k)
    # the last step's segment ends at the final latent: one Euler step of the target lands on it exactly
    row = next(r for r in range(len(index)) if index.key(r).endswith("k003"))
    item = ds[(row, 1.0)]
    p, s, _ = F.parse_key(item["key"])
    landed = item["fields"][F.T_X_T] + (0.0 - item["sigma"]) * item["fields"][SEGMENT_VELOCITY]
    assert torch.allclose(landed, final[(p, s)], atol=1e-5)


def test_segment_start_weight_weighs_the_states_the_sampler_queries(tiny_cache):
    from stages.train_student.objective_velocity import Batch, Outputs

    m = load_manifest(tiny_cache)
    plain, weighted = Segment({"student_steps": 2}), Segment({"student_steps": 2, "start_weight": 4.0})
    for obj in (plain, weighted):
        check_cache(obj, m, str(tiny_cache), num_layers=1)
    target = torch.randn(4, 2, 1, 4, 4)
    batch = Batch({SEGMENT_VELOCITY: target}, torch.zeros(4), torch.zeros(4, 3, 8), torch.ones(4),
                  {"step": torch.tensor([0, 1, 2, 3])})
    out = Outputs(target + 1.0)
    a, b = plain.terms(out, batch, None)["segment"], weighted.terms(out, batch, None)["segment"]
    # steps 0 and 2 start the two segments (the K=2 sampler's queries); 1 and 3 lie inside them
    assert torch.equal(b, a * torch.tensor([4.0, 1.0, 4.0, 1.0]))


def _one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_cache_without_the_needed_states_is_refused_in_one_line(tiny_cache, tmp_path):
    base = ["train-student", "--student-config", TINY, "--objective", "segment"]
    line = _one_line_error(base + ["--cache", str(tiny_cache), "--out", str(tmp_path / "a"), "--student-steps", "5"])
    assert "--student-steps 5" in line and "1 to 4" in line
    line = _one_line_error(base + ["--cache", str(tiny_cache), "--out", str(tmp_path / "b")])
    assert "needs --student-steps" in line
    # a cache whose prompt store lost its final latents (the last segment's end)
    broken = tmp_path / "cache"
    shutil.copytree(tiny_cache, broken)
    shutil.rmtree(broken / F.PARTS_DIR / F.part_dirname(0) / F.PROMPTS_ZARR / F.Z_FINAL_LATENTS)
    line = _one_line_error(base + ["--cache", str(broken), "--out", str(tmp_path / "c"), "--student-steps", "2"])
    assert "final latent" in line and "teacher-cache" in line
    # a cache that does not record its sigmas
    m = json.loads((broken / F.MANIFEST).read_text())
    shutil.copytree(tiny_cache / F.PARTS_DIR, broken / F.PARTS_DIR, dirs_exist_ok=True)
    del m["sigmas"]
    (broken / F.MANIFEST).write_text(json.dumps(m))
    line = _one_line_error(base + ["--cache", str(broken), "--out", str(tmp_path / "d"), "--student-steps", "2"])
    assert "sigma" in line
    for out in "abcd":
        assert not (tmp_path / out).exists()
    with pytest.raises(ValueError, match="student-steps applies"):
        train(tiny_cache, tmp_path / "e", student_steps=2)


@pytest.mark.slow
def test_segment_run_records_its_steps_and_resumes_bit_for_bit(tiny_cache, tmp_path, monkeypatch):
    kw = dict(SEG, max_steps=10, checkpoint_every=3, warmup_steps=2, ema_decay=0.8, holdout_prompts=1, eval_every=4)
    full = tmp_path / "full"
    train(tiny_cache, full, **kw)
    d = DistillRecord.read(full / "distill.json")
    assert d.objective == "segment" and d.student_steps == 2 and d.sampling_steps == 2
    assert d.objective_settings["boundaries"] == [0, 2] and d.objective_settings["exact_schedule"] is True
    assert student_steps(d) == 2 and student_scheduler(d).config.solver_order == 1
    assert all("loss_segment" not in r for r in metrics(full))  # one term: logged as the loss itself
    cut = tmp_path / "cut"
    monkeypatch.setenv("WANDISTILLER_FAIL_AT", "0:8")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(tiny_cache, cut, **kw)
    monkeypatch.delenv("WANDISTILLER_FAIL_AT")
    with pytest.raises(UserError, match="objective"):  # another K is another run
        train(tiny_cache, cut, resume=True, **(kw | {"student_steps": 4}))
    train(tiny_cache, cut, resume=True, **kw)
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    assert metrics(cut, "eval") == metrics(full, "eval")
    assert_same_students(cut, full)


@pytest.mark.dist
@pytest.mark.slow
def test_segment_on_two_ranks_matches_one_process(tiny_cache, tmp_path, monkeypatch):
    from test_train_student_dist import ARGS, assert_ranks_match_one, two_ranks_and_one
    from test_train_student import max_rel_diff

    out2, out1, ranks, one = two_ranks_and_one(tiny_cache, tmp_path, monkeypatch,
                                               ARGS | {"objective": "segment", "student_steps": 2})
    assert_ranks_match_one(out2, out1, ranks, one)
    # The losses agree to float32 rounding (and the partition exactly); the weights a little less closely than the
    # velocity run's (1e-5): AdamW's normalised step turns reduction-order rounding into visible steps where a
    # gradient is ~0 (the cross-attention value weights, on the tiny cache's zero-padded text tokens).
    assert max_rel_diff(weights(out2 / "student"), weights(out1 / "student")) <= 1e-4


@pytest.fixture(scope="module")
def segment_run(tiny_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("segment") / "run"
    train(tiny_cache, out, **SEG, max_steps=3, holdout_prompts=2)
    return out


@pytest.mark.slow
def test_exported_pipeline_at_k_steps_equals_the_sampler(segment_run, tiny_cache, tmp_path):
    from diffusers import DiffusionPipeline, WanTransformer3DModel

    out = tmp_path / "pipe"
    r = CliRunner().invoke(main, ["export", "--student", str(segment_run), "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    record = DistillRecord.read(segment_run / "distill.json")
    card = (out / "README.md").read_text()
    assert "num_inference_steps=2" in card and "guidance_scale=1.0" in card and "max_sequence_length=32" in card
    assert not (out / "scheduler").is_symlink()  # the student's own schedule, not the teacher's
    pipe = DiffusionPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    m = load_manifest(tiny_cache)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(3, *m.latent_shape, generator=g)
    embeds = torch.randn(3, int(m.max_sequence_length), int(m.text_dim), generator=g)
    got = pipe(prompt_embeds=embeds, latents=init.clone(), num_inference_steps=2, guidance_scale=1.0,
               height=int(m.height), width=int(m.width), num_frames=1, output_type="latent").frames
    student = WanTransformer3DModel.from_pretrained(segment_run / "student").eval()
    want = sample_latents(student, student_scheduler(record), init, embeds, student_steps(record))
    assert torch.equal(got, want)
    assert [float(s) for s in pipe.scheduler.sigmas] == [m.sigmas[0], m.sigmas[2], 0.0]


def test_sampler_equals_wan_pipeline_with_cfg(tiny_teacher):
    """The one sampler is WanPipeline's loop op for op, CFG included (two forwards per step)."""
    from diffusers import WanPipeline

    teacher = WanPipeline.from_pretrained(tiny_teacher, text_encoder=None, tokenizer=None, vae=None)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=teacher.transformer,
                       transformer_2=None, scheduler=teacher.scheduler, boundary_ratio=None)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    cfg = teacher.transformer.config
    init = torch.randn(2, cfg.in_channels, 1, 8, 8, generator=g)
    emb, neg = torch.randn(2, 32, cfg.text_dim, generator=g), torch.randn(1, 32, cfg.text_dim, generator=g)
    got = pipe(prompt_embeds=emb, negative_prompt_embeds=neg.expand(2, -1, -1), latents=init.clone(),
               num_inference_steps=3, guidance_scale=3.0, height=64, width=64, num_frames=1, output_type="latent").frames
    conf = {"_class_name": type(teacher.scheduler).__name__, **teacher.scheduler.config}
    want = sample_latents(teacher.transformer, scheduler_from_config(conf), init, emb, 3, guidance=3.0,
                          negative_embeds=neg)
    assert torch.equal(got, want)


def test_readme_few_step_recipe_names_real_flags():
    text = (ROOT / "README.md").read_text()
    assert "--objective segment --student-steps" in text


def test_segment_pseudo_huber_is_the_rms_error_above_c_and_quadratic_below(tiny_cache):
    from pipeline.sampling import mse, pseudo_huber
    from stages.train_student.objective_velocity import Batch, Outputs

    a, b = torch.zeros(3, 256), torch.tensor([1e-4, 0.1, 1.0]).unsqueeze(1).expand(3, 256)
    got, c = pseudo_huber(a, b, 0.01), 0.01
    assert torch.allclose(got, (mse(a, b) + c * c).sqrt() - c)
    assert got[0] == pytest.approx(1e-8 / (2 * c), rel=1e-3)  # quadratic: mse / 2c
    assert got[2] == pytest.approx(1.0 - c, rel=1e-4)  # linear: the RMS error, less c
    # mse, the default, is not recorded: a segment run from before the setting resumes and its distill.json is unchanged
    assert not {"loss", "huber_c"} & Segment({"student_steps": 2, "loss": "mse", "huber_c": 0.01}).settings.keys()
    m = load_manifest(tiny_cache)
    seg = Segment({"student_steps": 2, "loss": "pseudo-huber", "huber_c": 0.01})
    check_cache(seg, m, str(tiny_cache), num_layers=1)
    target = torch.randn(4, 2, 1, 4, 4)
    batch = Batch({SEGMENT_VELOCITY: target}, torch.zeros(4), torch.zeros(4, 3, 8), torch.ones(4),
                  {"step": torch.tensor([0, 1, 2, 3])})
    out = Outputs(target + 0.5)
    assert torch.allclose(seg.terms(out, batch, None)["segment"], torch.full((4,), (0.25 + 1e-4) ** 0.5 - 0.01))
