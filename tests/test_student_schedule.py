"""The K-step student's schedule as a choice (issue 43): equal segments of the teacher's steps (the default), explicit
boundary timesteps, a shifted flow schedule, a split between the two experts; the sampler, distill.json, the resume
identity and `plan`'s --keep-steps follow the choice."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cache.manifest import load_manifest
from conftest import sample_distill
from pipeline.artifact import DistillRecord
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.sampling import (
    chosen_boundaries, sample_latents, scheduler_from_config, segment_boundaries, student_scheduler, student_steps,
)
from test_planner import A14B
from test_train_student import train

# A14B's text-to-video schedule: 40 UniPC steps on flow sigmas shifted by 12, the high-noise expert while t >= 875
A14B_SCHED = {"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": True, "flow_shift": 12.0,
              "prediction_type": "flow_prediction", "num_train_timesteps": 1000, "final_sigmas_type": "zero"}


def _a14b():
    s = scheduler_from_config(A14B_SCHED)
    s.set_timesteps(40)
    ts = [float(t) for t in s.timesteps]
    return SimpleNamespace(steps=40, timesteps=ts, sigmas=[float(v) for v in s.sigmas[:40]], scheduler=A14B_SCHED,
                           experts=[1 if t >= 875 else 2 for t in ts])


def _timesteps(h, bounds):
    return [int(h.timesteps[b]) for b in bounds]


def test_a14b_boundaries_equal_explicit_shift_and_per_expert():
    h = _a14b()
    every = range(40)
    # today's default: one segment for the low-noise expert (t < 875)
    assert _timesteps(h, segment_boundaries(A14B_SCHED, 40, 4, h.sigmas)[0]) == [999, 973, 923, 800]
    # Wan2.2-Lightning's shift 5 snapped to the teacher's steps: two segments per expert
    shift5 = chosen_boundaries(h, {"student_shift": 5.0, "student_steps": 4}, every)
    assert _timesteps(h, shift5) == [999, 936, 837, 633]
    assert chosen_boundaries(h, {"student_timesteps": (999, 936, 837, 633)}, every) == [0, 18, 28, 35]
    # two steps each: the 26 high-noise steps and the 14 low-noise ones cut equally
    assert _timesteps(h, chosen_boundaries(h, {"student_expert_steps": (2, 2)}, every)) == [999, 961, 866, 719]
    assert _timesteps(h, chosen_boundaries(h, {"student_expert_steps": (1, 3)}, every)) == [999, 866, 777, 633]
    # with a shift, the split is the one Lightning's grid gives at the teacher's boundary (ComfyUI's switch step)
    assert _timesteps(h, chosen_boundaries(h, {"student_expert_steps": (2, 2), "student_shift": 5.0}, every)) == \
        [999, 936, 837, 633]


@pytest.mark.parametrize("choice, recorded, match", [
    ({"student_timesteps": (999, 937)}, range(40), r"student-timesteps 937: not steps of the teacher's schedule; "
                                                   r"choose from its timesteps 999,997,"),
    ({"student_timesteps": (999, 936)}, [0, 5], r"does not record steps 18 \(t 936; it records 0,5\); rebuild it "
                                                r"with --keep-steps 0,18$"),
    ({"student_timesteps": (936, 999)}, range(40), "must fall from the first step.s 999"),
    ({"student_timesteps": (999,), "student_shift": 5.0}, range(40), "drop --student-shift"),
    ({"student_expert_steps": (2, 2)}, [0, 5, 13, 30], r"steps 0,13,26,33 and the cache does not record steps 26,33 "
                                                        r"\(t 866,719;.*--for-students 4:2\+2$"),
    ({"student_expert_steps": (4,)}, range(40), "40 steps are 26 high-noise, 14 low"),
    ({"student_expert_steps": (2, 15)}, range(40), "15 boundaries in the 14 steps of the low-noise expert"),
    ({"student_shift": 5.0, "student_steps": 4}, [0, 1, 2, 3], r"steps 0,18,28,35 and the cache does not record "
                                                               r"steps 18,28,35 .*--for-students 4@shift5$"),
    ({"student_shift": 12.0, "student_expert_steps": (2, 2)}, range(40), r"the 4-step shift-12 grid gives the "
                                                                          r"high-noise expert 3 .*ask for 3,1"),
    ({"student_expert_steps": (2, 2), "student_steps": 3}, range(40), "student-steps 3, but"),
])
def test_a_schedule_the_cache_cannot_train_is_refused_in_one_line(choice, recorded, match):
    with pytest.raises(ValueError, match=match) as e:
        chosen_boundaries(_a14b(), choice, recorded)
    assert "\n" not in str(e.value)


def test_one_expert_refuses_a_split():
    h = _a14b()
    h.experts = [1] * 40
    with pytest.raises(ValueError, match="teacher runs one"):
        chosen_boundaries(h, {"student_expert_steps": (2, 2)}, range(40))


def test_the_k_step_sampler_lands_on_the_chosen_boundaries():
    h = _a14b()
    settings = {"student_steps": 4, "student_shift": 5.0, "boundaries": [0, 18, 28, 35], "sampler": "euler"}
    record = sample_distill(objective="segment", objective_settings=settings, student_steps=4)
    record = DistillRecord.from_json(record.to_json() | {"steps": 40, "scheduler": A14B_SCHED,
                                                         "timesteps": h.timesteps, "sigmas": h.sigmas})
    s = student_scheduler(record)
    s.set_timesteps(4)
    assert [float(v) for v in s.sigmas] == [h.sigmas[b] for b in (0, 18, 28, 35)] + [0.0]
    assert [float(t) for t in s.timesteps] == [h.timesteps[b] for b in (0, 18, 28, 35)]
    s.set_timesteps(2)  # another K (eval --student-steps) walks the Euler grid
    assert len(s.timesteps) == 2


def test_plan_keeps_the_chosen_boundaries():
    def plan(*extra):
        r = CliRunner().invoke(main, ["plan", "--teacher", str(A14B), "--assume-gpus", "1x80GiB", "--assume-ram",
                                      "512GiB", "--assume-disk", "2TiB", "--steps", "40", *extra])
        return r.exit_code, r.output

    assert "--keep-steps 7,15,26" in plan("--record-steps", "8", "--student-shift", "5", "--student-steps", "4")[1]
    assert "--keep-steps 10,20,30" in plan("--record-steps", "8", "--student-steps", "4")[1]
    assert "--keep-steps" not in plan("--student-steps", "4")[1]  # every step recorded
    code, out = plan("--record-steps", "8", "--student-timesteps", "999,937")
    assert code == 2 and "student-timesteps 937: not steps" in out


def test_train_student_with_student_timesteps(tiny_cache, tmp_path, monkeypatch):
    m = load_manifest(tiny_cache)
    chosen = [int(m.timesteps[b]) for b in (0, 1, 3)]
    kw = dict(objective="segment", student_timesteps=",".join(map(str, chosen)), max_steps=4, checkpoint_every=2,
              val_every=2, holdout_prompts=1)  # (validation samples through the chosen schedule too)
    train(tiny_cache, tmp_path / "run", **kw)
    d = DistillRecord.read(tmp_path / "run" / "distill.json")
    assert d.objective_settings["student_timesteps"] == chosen and d.objective_settings["boundaries"] == [0, 1, 3]
    assert d.student_steps == 3 and student_steps(d) == 3
    s = student_scheduler(d)
    s.set_timesteps(3)
    assert [float(t) for t in s.timesteps] == [float(m.timesteps[b]) for b in (0, 1, 3)]
    assert [float(v) for v in s.sigmas] == [m.sigmas[b] for b in (0, 1, 3)] + [0.0]
    # the exported pipeline, its scheduler set as its card says, draws what the sampler draws
    from diffusers import DiffusionPipeline, WanTransformer3DModel

    out = tmp_path / "pipe"
    r = CliRunner().invoke(main, ["export", "--student", str(tmp_path / "run"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    pipe = DiffusionPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    points = json.loads((out / "model_index.json").read_text())["_wandistiller"]["sigmas"]
    assert f"sigmas=numpy.array({points})" in (out / "README.md").read_text()
    pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, sigmas=np.array(points))
    g = torch.Generator().manual_seed(0)
    init = torch.randn(2, *m.latent_shape, generator=g)
    embeds = torch.randn(2, int(m.max_sequence_length), int(m.text_dim), generator=g)
    got = pipe(prompt_embeds=embeds, latents=init.clone(), num_inference_steps=3, guidance_scale=1.0,
               height=int(m.height), width=int(m.width), num_frames=1, output_type="latent").frames
    student = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "student").eval()
    assert torch.equal(got, sample_latents(student, student_scheduler(d), init, embeds, 3))
    # a resume with another schedule is another run
    with pytest.raises(UserError, match="objective"):
        train(tiny_cache, tmp_path / "run", resume=True, **(kw | {"student_timesteps": f"{chosen[0]},{chosen[2]}"}))
    with pytest.raises(UserError, match="student-timesteps"):
        train(tiny_cache, tmp_path / "bad", **(kw | {"student_timesteps": "998"}))
