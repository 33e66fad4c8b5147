"""A LoRA pair: the two one-expert runs of a two-expert teacher (train-student --lora-experts 1, and 2) as one student.
`export --student RUN1 --student RUN2` writes one folder that diffusers' WanPipeline draws from with two
load_lora_weights calls, as `sample` of RUN1+RUN2 draws it; its ComfyUI workflow carries the run's own schedule;
runs that are not one student's halves are refused in one line. On the tiny video teacher (two experts, boundary
0.875, 9-frame 64x64 clips)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageSequence

from conftest import ROOT, make_cache, sample_distill
from pipeline.clips import clip_for
from stages.sample import comfyui
from test_lora import lora_train
from test_sample import assert_one_line_error, invoke

TEACHER = ROOT / "data" / "tiny-video-teacher-pretrained"
CACHE = dict(steps=8, guidance=2.0, guidance_2=2.0, frames=9, max_sequence_length=32, negative_prompt="blurry",
             batch_size=4)  # (configs/clips-teacher-cache.toml's sampling, 4 captions, one seed)
RUN = dict(max_steps=2, student_steps=4, lora_rank=4, batch_size=4, holdout_prompts=1)
FILES = ("high_noise_model.safetensors", "low_noise_model.safetensors")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A cache of the tiny video teacher and its two one-expert runs (`lora-1`, `lora-2`), two steps each."""
    root = tmp_path_factory.mktemp("pair")
    prompts = root / "clips.txt"
    prompts.write_text("\n".join(clip_for(0, i).caption for i in range(4)) + "\n")
    cache = make_cache(TEACHER, prompts, root / "cache", **CACHE)
    runs = {"cache": cache, "root": root}
    for e in (1, 2):
        runs[f"lora-{e}"] = root / f"lora-{e}"
        lora_train(cache, TEACHER, runs[f"lora-{e}"], lora_experts=str(e), **RUN)
    return runs


def _frames(pipe, prompt: str, **kw) -> np.ndarray:
    from stages.sample.sample import initial_latents, to_clips

    latents = initial_latents(0, (1, 16, 3, 4, 4))  # (sample's noise of its first prompt: seed 0)
    out = pipe(prompt, latents=latents, num_frames=9, guidance_scale=1.0, num_inference_steps=4, height=64, width=64,
               max_sequence_length=32, output_type="np", **kw).frames
    return to_clips(out)[0]


@pytest.mark.slow
def test_the_pair_export_draws_in_diffusers_what_sample_of_the_pair_draws(pair, tmp_path):
    """One folder of both experts' files, the student's scheduler, lora.json/distill.json of the pair; WanPipeline
    of the teacher + two load_lora_weights draws from it, uint8 frame for frame, what `sample --student RUN1+RUN2`
    draws (its lossless WebP), and `--compare RUN1+RUN2` is the same column again."""
    from diffusers import UniPCMultistepScheduler, WanPipeline
    import imageio.v2 as imageio

    out = tmp_path / "export"
    r = invoke(["export", "--student", pair["lora-2"], "--student", pair["lora-1"], "--out", out])  # (either order)
    assert r.exit_code == 0, r.output
    assert "transformer from" in r.output and "switch at step 2" in r.output
    assert {p.name for p in out.iterdir()} >= {*FILES, "lora.json", "distill.json", "README.md", "scheduler",
                                              comfyui.WORKFLOW}
    lora = json.loads((out / "lora.json").read_text())
    assert lora["trained"] == ["transformer", "transformer_2"] and list(lora["files"]) == lora["trained"]
    runs = lora["_wandistiller"]["runs"]
    assert runs["transformer"]["student_run"] == "lora-1" and runs["transformer_2"]["student_run"] == "lora-2"
    distill = json.loads((out / "distill.json").read_text())
    trained = [json.loads((pair[f"lora-{e}"] / "distill.json").read_text())["train_steps"] for e in (1, 2)]
    assert distill["train_steps"] == sorted(trained[0] + trained[1]) and distill["lora"]["trained"] == lora["trained"]
    for name in FILES:  # each expert's file is its own run's, byte for byte
        run = pair["lora-1" if name == FILES[0] else "lora-2"]
        assert (out / name).read_bytes() == (run / "student" / name).read_bytes()

    prompts = tmp_path / "p.txt"
    prompt = clip_for(0, 1).caption
    prompts.write_text(prompt + "\n")
    spelled = f"{pair['lora-1']}+{pair['lora-2']}"
    grid = tmp_path / "s" / "grid.png"
    r = invoke(["sample", "--student", spelled, "--compare", spelled, "--prompts", prompts, "--out", grid,
                "--device", "cpu"])
    assert r.exit_code == 0, r.output
    meta = json.loads(grid.with_name("grid.png.json").read_text())
    assert meta["columns"] == ["teacher", "student (4 steps)", "lora-1+lora-2 (4 steps)"]
    drawn = {n: np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(paths[0]))])
             for n, paths in meta["videos"].items()}
    assert np.array_equal(drawn["student"], drawn["lora-1+lora-2"])
    for name, paths in meta["mp4"].items():  # beside each WebP, an mp4 of as many frames
        assert imageio.get_reader(paths[0]).count_frames() == 9, name

    pipe = WanPipeline.from_pretrained(TEACHER)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = UniPCMultistepScheduler.from_pretrained(out, subfolder="scheduler")
    base = _frames(pipe, prompt)
    pipe.load_lora_weights(str(out), weight_name=FILES[0])
    pipe.load_lora_weights(str(out), weight_name=FILES[1], load_into_transformer_2=True)
    got = _frames(pipe, prompt)
    diff = int(np.abs(got.astype(int) - drawn["student"]).max())
    print(f"max pixel difference, diffusers + the pair export vs sample of RUN1+RUN2: {diff} of 255")
    assert got.shape == (9, 64, 64, 3) and diff <= 1
    assert int(np.abs(base.astype(int) - got).max()) > 0  # the adapters are loaded, and they matter


@pytest.mark.slow
def test_the_cards_code_runs_as_written_and_writes_an_mp4(pair, tmp_path, monkeypatch):
    """The pair export's card, its python block run as written (on the CPU in float32, the base and export named
    as the card names them), draws a 9-frame clip and export_to_video writes it as an mp4 that reads back."""
    import imageio.v2 as imageio

    monkeypatch.chdir(tmp_path)
    assert invoke(["export", "--student", f"{pair['lora-1']}+{pair['lora-2']}", "--out", "export"]).exit_code == 0
    card = Path("export/README.md").read_text()
    code = card.split("```python\n")[1].split("```")[0]
    assert 'from_pretrained("tiny-video-teacher-pretrained"' in code and code.count("load_lora_weights") == 2
    os.symlink(TEACHER, "tiny-video-teacher-pretrained")  # (where the user's copy of the base lies)
    exec(code.replace('"cuda"', '"cpu"').replace("torch.bfloat16", "torch.float32"), {})
    reader = imageio.get_reader("student.mp4")
    assert reader.count_frames() == 9 and reader.get_meta_data()["size"] == (64, 64)


@pytest.mark.slow
def test_the_comfyui_workflow_carries_the_runs_own_schedule(pair, tmp_path):
    """API-format JSON: both experts' models, each through a LoraLoaderModelOnly of its file (strength 1) and a
    ModelSamplingSD3, two KSamplerAdvanced splitting the K steps at the switch step the recorded boundaries give
    (t >= boundary_ratio x 1000: the high-noise expert's); the card's table says the same numbers. The run chose no
    shift: the teacher's flow_shift, and the card says that ComfyUI's schedule only approximates the trained one."""
    out = tmp_path / "wan"
    assert invoke(["export", "--student", pair["lora-1"], "--student", pair["lora-2"], "--out", out,
                   "--lora-format", "wan"]).exit_code == 0
    nodes = json.loads((out / comfyui.WORKFLOW).read_text())
    kinds = [n["class_type"] for n in nodes.values()]
    for kind, count in (("UNETLoader", 2), ("LoraLoaderModelOnly", 2), ("ModelSamplingSD3", 2),
                        ("KSamplerAdvanced", 2), ("CLIPLoader", 1), ("VAELoader", 1), ("CLIPTextEncode", 2),
                        ("EmptyHunyuanLatentVideo", 1), ("VAEDecode", 1), ("SaveAnimatedWEBP", 1)):
        assert kinds.count(kind) == count, kind
    of = lambda kind: [n["inputs"] for n in nodes.values() if n["class_type"] == kind]  # noqa: E731
    assert [n["lora_name"] for n in of("LoraLoaderModelOnly")] == list(FILES)
    assert {n["strength_model"] for n in of("LoraLoaderModelOnly")} == {1.0}
    assert {n["shift"] for n in of("ModelSamplingSD3")} == {3.0}  # the teacher's flow_shift
    distill = json.loads((pair["lora-1"] / "distill.json").read_text())
    bounds = distill["objective_settings"]["boundaries"]
    switch = sum(distill["timesteps"][b] >= 875 for b in bounds)
    assert len(bounds) == 4 and switch == 2
    high, low = of("KSamplerAdvanced")
    assert (high["start_at_step"], high["end_at_step"], low["start_at_step"], low["end_at_step"]) == (0, 2, 2, 4)
    assert (high["add_noise"], high["return_with_leftover_noise"], low["add_noise"]) == ("enable", "enable",
                                                                                         "disable")
    assert {(s["steps"], s["cfg"], s["sampler_name"], s["scheduler"]) for s in (high, low)} == {(4, 1.0, "euler",
                                                                                                "simple")}
    assert low["latent_image"] == [next(k for k, n in nodes.items() if n["inputs"] is high), 0]
    assert of("EmptyHunyuanLatentVideo") == [{"width": 64, "height": 64, "length": 9, "batch_size": 1}]
    for link in (v for n in nodes.values() for v in n["inputs"].values() if isinstance(v, list)):
        assert link[0] in nodes  # every link names a node of the workflow
    card = (out / "README.md").read_text()
    for needle in ("| sampler / scheduler | euler / simple |", "| steps | 4 |", "| switch step | 2 (", "| CFG | 1.0",
                   "| shift | 3 (ModelSamplingSD3 on each expert) |", "length 9 (frames)", "That is an approximation",
                   f"trained at sigmas {[round(distill['sigmas'][b], 4) for b in bounds]}",
                   "`high_noise_model.safetensors` on the high-noise model", "stand for your own conversions"):
        assert needle in card, needle


def test_the_schedule_of_a_chosen_shift_is_comfyuis_own():
    """Lightning's split on a shift-5 teacher of 40 steps (A14B's boundary 0.875): the 4-step shift-5 grid is its
    steps 0, 10, 20, 30, and ComfyUI's simple schedule at shift 5 visits those sigmas; the high-noise expert takes
    2 steps. An A14B base gets ComfyUI's own file names."""
    from pipeline.sampling import schedule_sigmas

    config = json.loads((TEACHER / "scheduler" / "scheduler_config.json").read_text()) | {"flow_shift": 5.0}
    sigmas = schedule_sigmas(config, 40)
    record = replace(sample_distill(objective="segment", student_steps=4, objective_settings={
        "sampler": "euler", "student_steps": 4, "student_shift": 5.0, "student_expert_steps": [2, 2],
        "boundaries": [0, 10, 20, 30]}), steps=40, sigmas=sigmas, timesteps=[s * 1000 for s in sigmas],
        scheduler=config)
    sched = comfyui.schedule(record, ["transformer", "transformer_2"], 875.0)
    assert (sched.steps, sched.switch, sched.shift, sched.sampler, sched.exact) == (4, 2, 5.0, "euler", True)
    assert sched.comfy == [1.0, 0.9375, 0.8333, 0.625] and sched.difference < 1e-3
    models, clip, vae, known = comfyui.model_files("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 2, "x")
    assert known and models == ("wan2.2_t2v_high_noise_14B_fp16.safetensors",
                                "wan2.2_t2v_low_noise_14B_fp16.safetensors") and vae == "wan_2.1_vae.safetensors"
    card = comfyui.card(sched, ["transformer", "transformer_2"], dict(zip(["transformer", "transformer_2"], FILES)),
                        875.0, {"guidance_scale": 1.0, "width": 832, "height": 480, "num_frames": 81},
                        (models, clip, vae, known), "Wan-AI/Wan2.2-T2V-A14B-Diffusers", wan=True)
    assert "the points the student was trained at" in card and "approximation" not in card
    assert "| shift | 5 (ModelSamplingSD3 on each expert) |" in card and "length 81 (frames)" in card


@pytest.mark.slow
def test_runs_that_are_not_one_students_halves_are_refused_in_one_line(pair, tiny_teacher, tiny_video_cache,
                                                                        tmp_path):
    """The same expert twice, a run of both experts, runs of other caches, schedules or adapters, a compact student,
    three runs, and a teacher whose other expert differs: each one line (exit 2), nothing written; eval too."""
    from test_train_student import train as train_compact

    root, one, two = pair["root"], pair["lora-1"], pair["lora-2"]
    both = tmp_path / "both"
    lora_train(pair["cache"], TEACHER, both, **RUN)
    other_cache = make_cache(TEACHER, root / "clips.txt", tmp_path / "cache2", **CACHE | {"steps": 4})
    other = tmp_path / "other-cache"
    lora_train(other_cache, TEACHER, other, lora_experts="2", **RUN | {"student_steps": 2})
    steps = tmp_path / "steps"
    lora_train(pair["cache"], TEACHER, steps, lora_experts="2", **RUN | {"student_steps": 2})
    rank = tmp_path / "rank"
    lora_train(pair["cache"], TEACHER, rank, lora_experts="2", **RUN | {"lora_rank": 2})
    compact = tmp_path / "compact"
    train_compact(tiny_video_cache, compact, max_steps=1)
    twin = tmp_path / "twin-teacher"  # the teacher with another high-noise expert: its low-noise one still the cache's
    shutil.copytree(TEACHER, twin)
    weights = "diffusion_pytorch_model.safetensors"
    shutil.copy(TEACHER / "transformer_2" / weights, twin / "transformer" / weights)
    twin_run = tmp_path / "twin"
    lora_train(pair["cache"], twin, twin_run, lora_experts="2", **RUN)
    out = tmp_path / "refused"
    for students, needle in (
            ((one, one), "both runs trained expert 1 (transformer)"),
            ((one, both), "trained both experts (--lora-experts all) and is one student already"),
            ((one, other), "they were trained on different caches"),
            ((one, steps), "their schedules differ: 4 euler steps from the teacher's steps"),
            ((one, rank), "their adapters differ: rank 4, alpha 4"),
            ((compact, two), "is a compact student, and a pair joins two LoRA runs"),
            ((one, twin_run), "their teachers differ"),
            ((one, two, one), "a pair is two")):
        flags = ([a for s in students for a in ("--student", s)] if len(students) == 2 else
                 ["--student", "+".join(map(str, students))])
        assert_one_line_error(invoke(["export", *flags, "--out", out]), needle)
        assert not out.exists()
    assert_one_line_error(invoke(["eval", "--student", f"{one}+{steps}", "--cache", pair["cache"],
                                  "--no-teacher-timing", "--device", "cpu"]), "their schedules differ")


@pytest.mark.slow
def test_eval_takes_the_pair_and_writes_beside_its_runs(pair):
    """eval of RUN1+RUN2: its report beside the runs (in neither run's folder), on the prompts both held out."""
    spelled = f"{pair['lora-1']}+{pair['lora-2']}"
    r = invoke(["eval", "--student", spelled, "--cache", pair["cache"], "--no-teacher-timing", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = pair["root"] / "lora-1+lora-2-eval.json"
    rep = json.loads(report.read_text())
    assert rep["trajectories"] == 1 and rep["student"]["path"] == f"{pair['lora-1']}/student+{pair['lora-2']}/student"
    assert not (pair["lora-1"] / "eval.json").exists() and not (pair["lora-2"] / "eval.json").exists()
    assert rep["final_latent_mse"]["student"] != rep["final_latent_mse"]["untrained"]  # (the untrained: the teacher)


@pytest.mark.slow
def test_eval_draws_the_teacher_then_the_pair_as_a_hybrid(pair, tmp_path):
    """--hybrid RUN1+RUN2: the teacher, guided, over its steps before the pair's first boundary on the low-noise
    expert (equal segments 0,2,4,6 of 8 steps; experts 1,1,1,2,...: boundary 4, so the teacher's steps 0-3), then the
    pair's last 2 steps, from the same noise; closer to the teacher than the pair alone, its passes counted (4 guided
    steps and 2: 10). --hybrid-steps leaving the run no step ends in one line."""
    spelled = f"{pair['lora-1']}+{pair['lora-2']}"
    report_path = tmp_path / "eval.json"
    r = invoke(["eval", "--student", spelled, "--cache", pair["cache"], "--report", report_path, "--hybrid", spelled,
                "--device", "cpu", "--timing-runs", 1])
    assert r.exit_code == 0, r.output
    rep = json.loads(report_path.read_text())
    row = next(e for e in rep["entries"] if e["objective"] == "hybrid")
    assert row["label"] == "teacher:2+lora-1+lora-2"
    assert (row["teacher_steps"], row["steps"], row["passes"], row["guidance"]) == (4, 6, 10, 2.0)
    finals = rep["final_latent_mse"]
    assert finals[row["label"]] < finals["student"]
    assert rep["timing"]["entries"][row["label"]]["passes"] == 10
    assert_one_line_error(invoke(["eval", "--student", spelled, "--cache", pair["cache"], "--hybrid", spelled,
                                  "--hybrid-steps", 4, "--no-teacher-timing", "--report", report_path]),
                          "the teacher would draw 4 of the run's 4 steps")


@pytest.mark.slow
def test_sample_draws_the_hybrid_as_a_column(pair, tmp_path):
    """sample --hybrid RUN1+RUN2: a column of the teacher's first 4 steps (guided) and the pair's last 2, from the
    same noise: unlike the pair's own clip, and nearer the teacher's than it."""
    prompts = tmp_path / "p.txt"
    prompts.write_text(clip_for(0, 1).caption + "\n")
    spelled = f"{pair['lora-1']}+{pair['lora-2']}"
    grid = tmp_path / "grid.png"
    r = invoke(["sample", "--student", spelled, "--hybrid", spelled, "--prompts", prompts, "--out", grid,
                "--device", "cpu"])
    assert r.exit_code == 0, r.output
    meta = json.loads(grid.with_name("grid.png.json").read_text())
    assert meta["columns"] == ["teacher", "student (4 steps)", "teacher:2+lora-1+lora-2 (4+2 steps)"]
    assert meta["students"]["teacher:2+lora-1+lora-2"]["hybrid_teacher_steps"] == 4
    clip = {n: np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(paths[0]))])
            .astype(float) for n, paths in meta["videos"].items()}
    hybrid = clip["teacher:2+lora-1+lora-2"]
    assert np.abs(hybrid - clip["teacher"]).mean() < np.abs(clip["student"] - clip["teacher"]).mean()


@pytest.mark.slow
def test_the_hybrid_workflow_runs_the_teacher_then_the_low_noise_adapter(pair, tmp_path):
    """export of the pair also writes comfyui-hybrid-workflow.json, eval's --hybrid as ComfyUI runs it: the teacher's
    own models (no adapter) at the cache's CFG 2 and its UniPC schedule over its 8-step schedule's steps 0-3 (high-noise)
    and 3-4 (low-noise, up to the pair's first low-noise boundary, step 4), then the low-noise adapter over steps 2-4
    of its own 4 at CFG 1, the latent handed on with its leftover noise; the negative prompt is the cache's; the card
    says where ComfyUI's two schedules hand over."""
    out = tmp_path / "export"
    assert invoke(["export", "--student", pair["lora-1"], "--student", pair["lora-2"], "--out", out]).exit_code == 0
    nodes = json.loads((out / comfyui.HYBRID_WORKFLOW).read_text())
    of = lambda kind: [n["inputs"] for n in nodes.values() if n["class_type"] == kind]  # noqa: E731
    runs = [(s["steps"], s["start_at_step"], s["end_at_step"], s["cfg"], s["sampler_name"], s["add_noise"],
             s["return_with_leftover_noise"]) for s in of("KSamplerAdvanced")]
    teacher = json.loads((pair["lora-1"] / "distill.json").read_text())["scheduler"]
    uni = "uni_pc_bh2" if teacher.get("solver_type") == "bh2" else "uni_pc"
    assert runs == [(8, 0, 3, 2.0, uni, "enable", "enable"), (8, 3, 4, 2.0, uni, "disable", "enable"),
                    (4, 2, 4, 1.0, "euler", "disable", "disable")]
    assert [n["lora_name"] for n in of("LoraLoaderModelOnly")] == [FILES[1]] and len(of("UNETLoader")) == 2
    assert [n["text"] for n in of("CLIPTextEncode")][1] == CACHE["negative_prompt"]
    for link in (v for n in nodes.values() for v in n["inputs"].values() if isinstance(v, list)):
        assert link[0] in nodes
    card = (out / "README.md").read_text()
    assert f"`{comfyui.HYBRID_WORKFLOW}` is the hybrid" in card and "hands over at sigma" in card
