"""sample / export / eval: the grid, the exported pipeline and the eval report, on the tiny teacher and cache.

Stage two's output is stood in for by a tiny student built here (1 layer, 2 heads x 8), briefly fitted to the
cached targets, saved as OUT/student/ with a distill.json like train-student's.
"""

from __future__ import annotations

import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import EmbeddingCache
from cache.reader import decode_sample
from pipeline.artifact import DistillRecord
from pipeline.cli import main
from pipeline.prompts import read_prompt_file
from stages.sample.sample import GridLayout, draw_grid, frame_strip, grid_layout, initial_latents, to_clips

from conftest import TEST_PROMPTS, TINY_CACHE_ARGS, make_cache

INIT_SEED = 3
# Each exactness check runs on the CPU, where it is bit-exact (float32, deterministic kernels), and again as a gpu
# test on CUDA in its default bfloat16, against the CPU-made cache and reference: there the bounds are CUDA's
# arithmetic, about ten times what an H200 showed (pixels 2-4 apart, the teacher's final latents 7.2e-5 MSE from
# the CPU's, the TI2V teacher as its own student 1.4e-5).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PIXELS = {"cpu": 1, "cuda": 8}  # largest difference of a 0-255 channel between two images of the same noise
TEACHER_MSE = {"cpu": 1e-8, "cuda": 1e-3}  # the teacher re-run against its cached final latents
SELF_MSE = {"cpu": 1e-10, "cuda": 1e-3}  # the teacher's transformer as the student, against the cache
SIDE = TINY_CACHE_ARGS["height"]  # 64 px images, 8x8 latents
LATENT = (1, 16, 1, SIDE // 8, SIDE // 8)


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for n in needles:
        assert n in errors[0], errors[0]


def tiny_student(text_dim: int = 32, in_channels: int = 16, seed: int = INIT_SEED):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=in_channels,
        out_channels=in_channels, text_dim=text_dim, freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def cached_samples(cache):
    """Every (tensors, meta) of a cache, read with tarfile like any outside reader."""
    out = []
    for rec in load_manifest(cache).shards:
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(cache / rec.path) as tar:
            for info in tar:
                key, _, ext = info.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(info).read()
        out += [decode_sample(m) for m in members.values()]
    return out


def fit(model, cache, steps: int = 60):
    """A few full-batch Adam steps on the cached guided targets: enough to beat the untrained twin."""
    samples = cached_samples(cache)
    emb = EmbeddingCache(cache, 1, 16)
    x = torch.stack([s[F.T_X_T] for s, _ in samples])
    target = torch.stack([s[F.T_TARGET] for s, _ in samples])
    t = torch.tensor([m[F.M_TIMESTEP] for _, m in samples])
    enc = torch.stack([emb.get(m[F.M_PROMPT_IDX]) for _, m in samples])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x, t, enc, return_dict=False)[0], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def write_run(out, model, cache, teacher, **distill_over):
    """OUT/student/ + OUT/distill.json, as train-student writes them."""
    m = load_manifest(cache)
    model.save_pretrained(out / "student")
    record = DistillRecord.of_cache(m, caches=[], fingerprints=[m.fingerprint], train_steps=list(range(m.steps)),
                                    train_timesteps=m.timesteps, heldout_prompts=[], init_seed=INIT_SEED,
                                    objective="velocity", objective_settings={})
    distill = record.to_json() | {"teacher": str(teacher), **distill_over}
    (out / "distill.json").write_text(json.dumps(distill))
    (out / "config.json").write_text(json.dumps({"cache": [str(cache)], "lr": 3e-3}))  # the run's own settings
    return out


@pytest.fixture(scope="module")
def trained_run(tiny_cache, tiny_teacher, tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run") / "trained", fit(tiny_student(), tiny_cache), tiny_cache,
                     tiny_teacher)


@pytest.fixture(scope="module")
def grid_prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("grid-prompts") / "three.txt"
    p.write_text("\n".join(TEST_PROMPTS[:3]) + "\n")
    return p


@pytest.fixture(scope="module", params=DEVICES)
def grid(request, trained_run, tiny_teacher, grid_prompts, tmp_path_factory):
    """The grid `sample` draws on each device (the device is the path's parent folder's name)."""
    out = tmp_path_factory.mktemp("grid") / request.param / "grid.png"
    r = invoke(["sample", "--student", trained_run, "--teacher", tiny_teacher, "--prompts", grid_prompts,
                "--out", out, "--seed", 5, "--device", request.param])
    assert r.exit_code == 0, r.output
    return out


def crop(img: Image.Image, layout: GridLayout, row: int, col: int) -> np.ndarray:
    x, y = layout.origin(row, col)
    return np.asarray(img.crop((x, y, x + layout.cell_w, y + layout.cell_h)), dtype=np.int16)


def test_grid_geometry_and_labels():
    colors = [(255, 0, 0), (0, 0, 255)]
    rows = [[Image.new("RGB", (48, 40), c) for c in colors] for _ in range(3)]
    layout = GridLayout(cell_w=48, cell_h=40)
    img = draw_grid(["first prompt", "a much longer second prompt " * 4, "third"], rows, ["teacher", "student"])
    assert img.size == layout.size(3, 2) == (layout.label_w + 2 * 52 + 4, layout.header_h + 3 * 44 + 4)
    px = np.asarray(img)
    for r in range(3):
        for c, color in enumerate(colors):
            assert (crop(img, layout, r, c) == color).all()
        _, y = layout.origin(r, 0)
        assert (px[y:y + 40, :layout.label_w] < 128).any(), f"row {r} has no label text"
    for c in range(2):
        x, _ = layout.origin(0, c)
        assert (px[:layout.header_h, x:x + 48] < 128).any(), f"column {c} has no header"
    with pytest.raises(ValueError):
        draw_grid(["one"], [[rows[0][0]]], ["teacher", "student"])


@pytest.mark.parametrize("title", ["student-4step (4 steps)", "student (8 steps)", "lora2-r16-with-a-long-name"])
def test_grid_titles_stay_over_their_own_column(title):
    """At 64-pixel cells a long title wraps (and a long word is cut) instead of running into its neighbours."""
    rows = [[Image.new("RGB", (64, 64), (255, 255, 255)) for _ in range(3)]]
    img = draw_grid(["a prompt"], rows, ["", title, ""])
    layout = grid_layout(["", title, ""], 64, 64)
    assert img.size == layout.size(1, 3) and layout.header_h > GridLayout(64, 64).header_h
    x, _ = layout.origin(0, 1)
    ink = np.nonzero((np.asarray(img)[:layout.header_h] < 128).any(axis=(0, 2)))[0]
    assert ink.size and x - layout.pad <= ink.min() and ink.max() < x + layout.cell_w + layout.pad, (ink.min(), x)


@pytest.mark.slow
def test_sample_grid_rows_columns_and_same_noise(grid, tiny_teacher):
    from diffusers import WanPipeline

    img = Image.open(grid)
    img.load()
    meta = json.loads(grid.with_name(grid.name + ".json").read_text())
    layout = grid_layout(meta["columns"], SIDE, SIDE)
    assert img.format == "PNG" and img.size == layout.size(3, 2)
    assert meta["rows"] == 3 and meta["prompts"] == TEST_PROMPTS[:3]
    s = meta["settings"]
    # distill.json decided what the flags did not: steps, size, guidance 1 for a student of guided targets.
    assert (s["steps"], s["height"], s["width"], s["guidance"], s["student_guidance"]) == (4, 64, 64, 4.0, 1.0)
    assert not np.array_equal(crop(img, layout, 0, 0), crop(img, layout, 0, 1))
    # The teacher column is the teacher's own WanPipeline from the row's noise (seed + row).
    pipe = WanPipeline.from_pretrained(tiny_teacher)
    ref = pipe(TEST_PROMPTS[1], negative_prompt=s["negative_prompt"], latents=initial_latents(5 + 1, LATENT),
               height=SIDE, width=SIDE, num_frames=1, num_inference_steps=4, guidance_scale=4.0,
               max_sequence_length=s["max_sequence_length"], output_type="np").frames
    teacher_cell = crop(img, layout, 1, 0)
    ref_cell = np.asarray(frame_strip(to_clips(ref)[0]), dtype=np.int16)
    assert np.abs(teacher_cell - ref_cell).max() <= PIXELS[grid.parent.name]


@pytest.mark.slow
def test_export_loads_with_from_pretrained_and_matches_the_grid(trained_run, tiny_teacher, grid, tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "pipe"
    r = invoke(["export", "--student", trained_run, "--out", out])  # the teacher comes from distill.json
    assert r.exit_code == 0, r.output
    index = json.loads((out / "model_index.json").read_text())
    assert index["transformer_2"] == [None, None] and index["boundary_ratio"] is None
    assert index["_wandistiller"]["guidance_scale"] == 1.0 and "guidance_scale=1.0" in (out / "README.md").read_text()
    assert not any(p.is_symlink() for p in out.rglob("*"))  # copies by default: a folder that stands alone

    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == "WanPipeline" and pipe.transformer_2 is None
    assert pipe.transformer.config.num_layers == 1
    frames = pipe(TEST_PROMPTS[0], latents=initial_latents(5, LATENT), height=SIDE, width=SIDE, num_frames=1,
                  num_inference_steps=4, guidance_scale=1.0, max_sequence_length=TINY_CACHE_ARGS["max_sequence_length"],
                  output_type="np").frames
    # Same student, same noise, same settings: the exported pipeline reproduces the grid's student column.
    grid_img = Image.open(grid)
    columns = json.loads(grid.with_name(grid.name + ".json").read_text())["columns"]
    student_cell = crop(grid_img, grid_layout(columns, SIDE, SIDE), 0, 1)
    export_cell = np.asarray(frame_strip(to_clips(frames)[0]), dtype=np.int16)
    assert np.abs(student_cell - export_cell).max() <= PIXELS[grid.parent.name]

    # --link: the teacher's components symlinked, loading the same way; --overwrite replaces only an earlier export.
    assert_one_line_error(invoke(["export", "--student", trained_run, "--out", out]), "earlier export", "--overwrite")
    r = invoke(["export", "--student", trained_run, "--out", out, "--link", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert all((out / c).is_symlink() for c in ("text_encoder", "tokenizer", "vae", "scheduler"))
    assert not (out / "transformer").is_symlink()
    assert (tiny_teacher / "transformer_2").is_dir(), "replacing the export must not touch the teacher"
    linked = DiffusionPipeline.from_pretrained(out)
    img = linked(TEST_PROMPTS[0], height=SIDE, width=SIDE, num_frames=1, num_inference_steps=2, guidance_scale=1.0,
                 output_type="pil").frames[0][0]
    assert img.size == (SIDE, SIDE)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_eval_report_on_held_out_prompts(trained_run, tiny_cache, tmp_path, device):
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(f"{TEST_PROMPTS[4]}\na prompt the cache never saw\n{TEST_PROMPTS[2]}\n")
    report_path = tmp_path / "ev" / "eval.json"
    r = invoke(["eval", "--student", trained_run, "--cache", tiny_cache, "--prompts", heldout,
                "--report", report_path, "--timing-runs", 1, "--device", device])
    assert r.exit_code == 0, r.output
    rep = json.loads(report_path.read_text())
    assert rep["selection"]["prompts"] == 2 and rep["selection"]["heldout_not_in_cache"] == 1
    assert rep["trajectories"] == 2 and rep["target"] == F.T_TARGET and rep["student_guidance"] == 1.0
    per_step = rep["velocity_mse"]["per_step"]
    assert [p["step"] for p in per_step] == [0, 1, 2, 3] and all(p["samples"] == 2 for p in per_step)
    vel, fin = rep["velocity_mse"]["mean"], rep["final_latent_mse"]
    assert 0 < vel["student"] < vel["untrained"], vel
    assert fin["student"] > 0 and fin["untrained"] > 0 and len(fin["per_trajectory"]) == 2
    t = rep["timing"]
    assert t["student_s_per_image"] > 0 and t["teacher_s_per_image"] > 0 and t["teacher_forwards_per_step"] == 2
    assert t["teacher_final_mse"] < TEACHER_MSE[device], "re-running the teacher must reproduce the cached latents"
    assert rep["cache"]["in_training_cache"] is True and any("not held out" in w for w in rep["warnings"])
    plot = Image.open(report_path.with_suffix(".png"))
    assert plot.format == "PNG" and plot.size[0] > 400


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_eval_untrained_twin_is_the_initial_student(tiny_cache, tiny_teacher, tmp_path, device):
    """A student saved at its initial weights scores exactly like the re-instantiated untrained one; on the
    training cache, eval defaults to the prompts train-student held out."""
    run = write_run(tmp_path / "run", tiny_student(), tiny_cache, tiny_teacher, heldout_prompts=[5, 1])
    # The bare student folder: distill.json is found one level up.
    r = invoke(["eval", "--student", run / "student", "--cache", tiny_cache, "--no-teacher-timing", "--device", device])
    assert r.exit_code == 0, r.output
    rep = json.loads((run / "eval.json").read_text())
    assert rep["selection"]["source"] == "heldout_prompts of distill.json" and rep["trajectories"] == 2
    assert [t["prompt_idx"] for t in rep["final_latent_mse"]["per_trajectory"]] == [1, 5]
    assert rep["cache"]["in_training_cache"] is True and rep["warnings"] == []
    assert rep["timing"] is None and rep["student"]["init"]["seed"] == INIT_SEED and rep["student"]["init"]["exact"]
    pairs = [(p["student"], p["untrained"]) for p in rep["velocity_mse"]["per_step"]]
    pairs.append((rep["final_latent_mse"]["student"], rep["final_latent_mse"]["untrained"]))
    if device == "cpu":
        assert all(a == b for a, b in pairs), pairs
    else:  # the same weights, loaded once from the saved folder and once built from the seed, then cast to bf16
        assert all(a == pytest.approx(b, rel=1e-2) for a, b in pairs), pairs


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_eval_of_the_teacher_itself_is_exact_on_ti2v(tiny_teacher_factory, tmp_path, device):
    """The teacher's own transformer as the student, on a CFG-free TI2V cache (per-token timesteps, 48-channel
    latents): eval's forward inputs and sampler are the teacher's, so both errors are exactly zero."""
    teacher = tiny_teacher_factory("ti2v")
    prompts = tmp_path / "two.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    cache = make_cache(teacher, prompts, tmp_path / "cache", guidance=1.0)
    r = invoke(["eval", "--student", teacher / "transformer", "--cache", cache, "--report", tmp_path / "e.json",
                "--timing-runs", 1, "--device", device])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "e.json").read_text())
    assert rep["cache"]["cfg"] is False and rep["student_guidance"] == 1.0
    assert rep["velocity_mse"]["mean"]["student"] < SELF_MSE[device] < rep["velocity_mse"]["mean"]["untrained"]
    assert rep["final_latent_mse"]["student"] < SELF_MSE[device]
    assert rep["timing"]["teacher_final_mse"] < TEACHER_MSE[device]


@pytest.fixture(scope="module")
def narrow_run(tiny_cache, tiny_teacher, tmp_path_factory):
    """A student whose text embeddings are 16-wide: it cannot read this teacher's 32-wide ones."""
    return write_run(tmp_path_factory.mktemp("narrow") / "run", tiny_student(text_dim=16), tiny_cache, tiny_teacher)


def test_bad_inputs_end_in_one_line(tiny_teacher, tiny_cache, prompts_file, narrow_run, tmp_path):
    missing = tmp_path / "no-such-run"
    assert_one_line_error(invoke(["sample", "--student", missing, "--teacher", tiny_teacher, "--prompts",
                                  prompts_file, "--out", tmp_path / "g.png"]), "no-such-run", "does not exist")
    assert_one_line_error(invoke(["export", "--student", missing, "--teacher", tiny_teacher, "--out",
                                  tmp_path / "p"]), "does not exist")
    assert_one_line_error(invoke(["eval", "--student", missing, "--cache", tiny_cache]), "does not exist")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert_one_line_error(invoke(["eval", "--student", empty, "--cache", tiny_cache]), "holds no student")
    unfinished = tmp_path / "unfinished-run"  # killed after distill.json, before student/ was renamed in
    shutil.copytree(narrow_run, unfinished)
    shutil.rmtree(unfinished / "student")
    assert_one_line_error(invoke(["sample", "--student", unfinished, "--teacher", tiny_teacher, "--prompts",
                                  prompts_file, "--out", tmp_path / "g.png"]), "no finished student", "--resume")
    assert_one_line_error(invoke(["sample", "--student", narrow_run, "--teacher", tiny_teacher, "--prompts",
                                  tmp_path / "nope.txt", "--out", tmp_path / "g.png"]), "nope.txt", "does not exist")
    assert_one_line_error(invoke(["export", "--student", narrow_run, "--out", tmp_path / "p"]),
                          "does not fit teacher", "text_dim 16")
    assert_one_line_error(invoke(["eval", "--student", narrow_run, "--cache", tiny_cache]),
                          "does not fit cache", "text_dim 16")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert_one_line_error(invoke(["export", "--student", narrow_run, "--teacher", tiny_teacher, "--out", foreign,
                                  "--overwrite"]), "does not fit")  # compatibility is checked before the folder
    assert (foreign / "keep.txt").exists()
    assert_one_line_error(invoke(["eval", "--student", narrow_run, "--cache", tmp_path / "no-cache"]),
                          "does not exist")


@pytest.mark.slow
def test_bad_inputs_that_need_a_model(trained_run, narrow_run, tiny_teacher, tiny_cache, grid_prompts, tmp_path):
    assert_one_line_error(invoke(["sample", "--student", narrow_run, "--teacher", tiny_teacher, "--prompts",
                                  grid_prompts, "--out", tmp_path / "g.png"]), "does not fit teacher", "text_dim 16")
    unseen = tmp_path / "unseen.txt"
    unseen.write_text("nothing the cache holds\n")
    assert_one_line_error(invoke(["eval", "--student", trained_run, "--cache", tiny_cache, "--prompts", unseen]),
                          "none of the 1 prompts")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert_one_line_error(invoke(["export", "--student", trained_run, "--out", foreign, "--overwrite"]),
                          "did not write")
    assert (foreign / "keep.txt").read_text() == "mine"
    assert_one_line_error(invoke(["sample", "--student", trained_run, "--prompts", grid_prompts, "--out",
                                  tmp_path / "g.png", "--height", 72]), "--height 72")


@pytest.mark.slow
def test_eval_attributes_scores_teacher_and_student_on_shapes_captions(trained_run, tiny_cache, tmp_path):
    """--attributes: both models draw the shapes captions with the cache's settings and the checker scores
    them (this random teacher draws noise, so only the report's shape is asserted, not the accuracy)."""
    caps = read_prompt_file("data/shapes-heldout.txt")[:3]
    captions = tmp_path / "caps.txt"
    captions.write_text("\n".join(caps) + "\n")
    report_path = tmp_path / "ev" / "eval.json"
    r = invoke(["eval", "--student", trained_run, "--cache", tiny_cache, "--report", report_path,
                "--no-teacher-timing", "--attributes", captions, "--attribute-grid", 2])
    assert r.exit_code == 0, r.output
    assert "colour accuracy teacher" in r.output
    att = json.loads(report_path.read_text())["attributes"]
    assert att["captions"] == 3 and att["settings"]["steps"] == 4 and att["settings"]["student_guidance"] == 1.0
    for who in ("teacher", "student"):
        assert att[who]["images"] == 3
        assert all(0.0 <= att[who][k] <= 1.0 for k in ("background", "shape_colour", "position", "colour", "all"))
    grid = Image.open(att["grid"])
    assert att["grid"] == str(report_path.with_name("eval-attributes.png"))
    assert grid.size == grid_layout(["teacher", "student"], SIDE, SIDE).size(2, 2)


@pytest.fixture(scope="module")
def video_cache(tiny_teacher, tmp_path_factory):
    """A cache of 5 frames (2 latent frames through the tiny VAE's 4x temporal factor) on two prompts."""
    prompts = tmp_path_factory.mktemp("video-prompts") / "two.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    return make_cache(tiny_teacher, prompts, tmp_path_factory.mktemp("video-cache") / "cache", frames=5)


@pytest.mark.slow
def test_eval_scores_motion_on_a_video_cache(trained_run, video_cache, tiny_cache, tmp_path):
    """--attributes with clip captions on a video cache: the teacher and the student draw whole clips from the same
    noise and the motion checker scores them; each entry's motion_right, kept and speed_ratio beside its
    name, the table's motion columns, a grid of frame strips (a random teacher draws noise: keys and types, not
    values). Clip captions on a one-frame cache and shapes captions on a video cache end in one line."""
    m = load_manifest(video_cache)
    assert m.frames == 5 and m.latent_shape[1] == 2
    clip_caps, shape_caps = tmp_path / "clips.txt", tmp_path / "shapes.txt"
    clip_caps.write_text("\n".join(read_prompt_file("data/clips-heldout.txt")[:2]) + "\n")
    shape_caps.write_text("\n".join(read_prompt_file("data/shapes-heldout.txt")[:2]) + "\n")
    report_path = tmp_path / "ev" / "eval.json"
    r = invoke(["eval", "--student", trained_run, "--cache", video_cache, "--report", report_path,
                "--no-teacher-timing", "--attributes", clip_caps, "--attribute-grid", 1, "--attribute-seeds", 2,
                "--teacher-redraw", 2])
    assert r.exit_code == 0, r.output
    assert "motion on 4 clips of 5 frames" in r.output and "optical flow on 4 clips" in r.output
    assert all(h in r.output for h in ("kept (95%)", "speed x", "flow x (95%)", "dyn deg", "flicker", "passes"))
    report = json.loads(report_path.read_text())
    att = report["attributes"]
    assert att["frames"] == 5 and att["captions"] == 2 and att["seeds"] == 2 and "clip_reads" not in att["teacher"]
    for who in ("teacher", "student", "teacher@2"):
        assert att[who]["clips"] == 4 and att[who]["dynamic_degree_of"] == 4 and att[who]["flicker"] >= 0
        assert all(0.0 <= att[who][k] <= 1.0 for k in ("background", "shape_colour", "attributes", "motion_right",
                                                           "all"))
    s = att["student"]
    assert s["kept"] is None or 0.0 <= s["kept"] <= 1.0
    assert s["speed_ratio"] is None or s["speed_ratio"] > 0.0
    # every share with its denominator and 95% interval: all right over the clips, kept over the teacher's right ones
    assert all(0 <= att[w]["all_interval"][0] <= att[w]["all"] <= att[w]["all_interval"][1] for w in ("teacher",
                                                                                                     "student"))
    n = s["kept_of"]
    assert (s["kept_interval"] is None) == (n == 0) and n == round(att["teacher"]["all"] * 4)
    teacher_row, row, redraw = report["table"]
    assert row["label"] == "student" and {"motion_right", "kept", "speed_ratio", "flow_ratio", "latent_motion",
                                          "all_right_ratio"} <= row.keys()
    assert "kept" not in teacher_row and isinstance(teacher_row["motion_right"], float)
    # the teacher re-drawn at 2 steps from the same noise: a row like a student's, its passes counted with CFG
    assert redraw["label"] == "teacher@2" and redraw["objective"] == "teacher redraw" and "kept" in redraw
    assert (teacher_row["passes"], row["passes"], redraw["passes"]) == (2 * m.steps * m.cfg + m.steps * (not m.cfg),
                                                                        row["steps"], 4 if m.cfg else 2)
    assert Image.open(att["grid"]).size == grid_layout(["teacher", "student", "teacher@2"], 5 * SIDE,
                                                       SIDE).size(1, 3)
    # --motion: prompts of any wording, scored by the optical flow alone
    plain = tmp_path / "plain.txt"
    plain.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    r = invoke(["eval", "--student", trained_run, "--cache", video_cache, "--report", report_path,
                "--no-teacher-timing", "--motion", plain, "--attribute-grid", 0])
    assert r.exit_code == 0, r.output
    att = json.loads(report_path.read_text())["attributes"]
    assert not att["checked"] and "motion_right" not in att["student"] and "kept" not in att["student"]
    assert {"dynamic_degree", "flow_ratio", "flow_ratio_interval", "direction", "flicker"} <= att["student"].keys()
    assert "optical flow on 2 clips" in r.output and "flow x (95%)" in r.output and "all right" not in r.output
    assert_one_line_error(invoke(["eval", "--student", trained_run, "--cache", tiny_cache, "--motion", clip_caps,
                                  "--no-teacher-timing"]), "holds images (1 frame)", "video cache")
    assert_one_line_error(invoke(["eval", "--student", trained_run, "--cache", video_cache, "--motion", plain,
                                  "--attributes", clip_caps]), "--attributes", "--motion", "not both")
    assert_one_line_error(invoke(["eval", "--student", trained_run, "--cache", video_cache, "--attributes", shape_caps,
                                  "--no-teacher-timing"]), "shapes captions on a 5-frame cache", "clips-heldout.txt")
    assert_one_line_error(invoke(["eval", "--student", trained_run, "--cache", tiny_cache, "--attributes", clip_caps,
                                  "--no-teacher-timing"]), "clip captions on a one-frame cache", "--frames")


def test_eval_attributes_refuses_captions_outside_the_grammar(trained_run, tiny_cache, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("a red circle somewhere nice\n")
    assert_one_line_error(invoke(["eval", "--student", trained_run, "--cache", tiny_cache, "--attributes", bad,
                                  "--no-teacher-timing"]), "bad.txt", "not a shapes caption", "grammar")
