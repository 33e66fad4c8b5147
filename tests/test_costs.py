"""What stage one costs before it runs: how `plan` lays it over the machine it is told about (one replica per GPU
where one fits), the command it prints, and its GPU-hours and wall time (from the measured table, a step measured
here or one given)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from click.testing import CliRunner

from conftest import ROOT
from hub_cache import A14B_CONFIGS
from pipeline import flops
from pipeline.cli import main
from pipeline.errors import UserError
from stages.teacher_cache.costs import STEP_TABLE, StepFigure, StepTime, flop, project, step_flops, table_step_time
from stages.teacher_cache.launch import plan_launch, teacher_cache_words

# What the FLOP model is checked against here (docs/costs.md shows it), not calibrated by: public, not measured by this repo.
CHECKS = (
    StepFigure((5120, 40, 13824), "Wan2.1-I2V-14B-480P (36 input channels, 257 image tokens)", 480, 832, 81, 9.15,
               "H200", "issue 45's public figure: 40 CFG steps in 366 s, the whole generation", image_tokens=257),
)
A14B_EXPERT = json.loads((A14B_CONFIGS / "transformer" / "config.json").read_text())
WORDS = teacher_cache_words("Wan-AI/Wan2.2-T2V-A14B-Diffusers", None, "cuda", {"--batch-size": 8})


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def parses(argv: list[str]) -> None:
    """`argv` (as `plan` prints it, torchrun's part dropped, $VARS filled in) is a valid `wandistiller` command."""
    argv = [{"$SLURM_ARRAY_TASK_ID": "3"}.get(w, w) for w in argv]
    args = argv[argv.index("wandistiller") + 1:]
    ctx = main.make_context("wandistiller", list(args))
    name, cmd, rest = main.resolve_command(ctx, ctx.protected_args + ctx.args)
    cmd.make_context(name, rest)


def test_the_step_table_is_the_one_docs_costs_shows():
    rows = re.findall(r"^\| (Wan[^|]*) \| (\d+)x(\d+)x(\d+) \| (\w+) \| ([\d.]+) \| ([^|]*) \|$",
                      (ROOT / "docs" / "costs.md").read_text(), flags=re.M)
    assert len(rows) == len(STEP_TABLE)
    for row, fig in zip(rows, STEP_TABLE):
        teacher, h, w, f, gpu, seconds, source = (c.strip() for c in row)
        assert teacher.startswith(fig.teacher.split(" (")[0]) and (int(h), int(w), int(f)) == (
            fig.height, fig.width, fig.frames)
        assert gpu == fig.gpu and float(seconds) == fig.seconds and source == fig.source


def test_the_table_figure_by_shape_size_and_placement():
    cuda = table_step_time(A14B_EXPERT, 1560, "cuda")
    assert cuda.seconds == 0.20 and "docs/costs.md" in cuda.source and "FLOP model" not in cuda.source
    assert "8.42e13 FLOP a step, 43% of its bf16 peak" in cuda.source
    assert table_step_time(A14B_EXPERT, 1560, "offload").seconds == pytest.approx(0.20 / 0.71)
    assert table_step_time(A14B_EXPERT, 1560, "balanced").seconds == 0.20
    assert table_step_time(A14B_EXPERT, 1560, "disk") is None  # not measured at this size: --measure, not a guess
    assert table_step_time(A14B_EXPERT | {"num_layers": 30}, 1560, "cuda") is None  # another teacher
    video = table_step_time(A14B_EXPERT, 32760, "cuda")  # 81 frames at 480x832: attention is half the step
    assert video.seconds == pytest.approx(7.97, abs=0.01) and video.source.startswith(
        "FLOP model: 3.36e15 FLOP a step, 39.9x the table's (linear 47%, attention 53%); calibrated by the table")
    assert table_step_time(A14B_EXPERT, 32760, "offload").seconds == pytest.approx(video.seconds / 0.71)


def test_the_table_figure_on_another_gpu_is_scaled_by_its_peak():
    rtx = table_step_time(A14B_EXPERT, 32760, "cuda", on=flops.gpu("RTX 4090"))
    assert rtx.seconds == pytest.approx(table_step_time(A14B_EXPERT, 32760, "cuda").seconds * 989 / 165)
    assert "; on RTX 4090: 165 TFLOPS dense bf16 (Ada Lovelace whitepaper" in rtx.source
    assert "x 43% (the efficiency the table of docs/costs.md reaches on H100's 989), 5.99x the H100's time" in \
        rtx.source
    h100 = table_step_time(A14B_EXPERT, 1560, "cuda", on=flops.gpu("h100"))
    assert h100 == table_step_time(A14B_EXPERT, 1560, "cuda")
    offload = table_step_time(A14B_EXPERT, 1560, "offload", on=flops.gpu(tflops=494.5))
    assert offload.seconds == pytest.approx(0.40 / 0.71) and "a 494.5-TFLOPS GPU: 494.5 TFLOPS" in offload.source


def test_the_flop_model_counts_a14b_as_docs_costs_does():
    one = step_flops(A14B_EXPERT, 1560)
    assert one["total"] == pytest.approx(8.4e13, rel=0.01)  # docs/costs.md's count, and 43% of the H100's peak
    assert one["total"] == sum(v for k, v in one.items() if k != "total")
    video = step_flops(A14B_EXPERT, 21 * 30 * 52)
    assert video["total"] == pytest.approx(3.36e15, rel=0.01) and video["total"] / one["total"] == pytest.approx(
        39.9, abs=0.05)
    assert video["self_attention"] / video["total"] == pytest.approx(0.52, abs=0.01)
    assert step_flops(A14B_EXPERT, 1560, cfg=False)["total"] == one["total"] / 2
    assert step_flops(A14B_EXPERT, 1560, image_tokens=257)["cross_attention"] > one["cross_attention"]


# The model's error against each check point may be at most this (the figures are in docs/costs.md and the report).
CHECK_TOLERANCE = 0.15


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.teacher.split(" (")[0])
def test_the_flop_model_predicts_a_second_measured_point(check):
    table = STEP_TABLE[0]
    assert check.shape == table.shape and table.gpu == "H100" and check.gpu == "H200"  # the same dense bf16 peak
    # the I2V model's 36 input channels change only the patch embedding (not counted); its image tokens are counted
    flops = step_flops(A14B_EXPERT, check.tokens, image_tokens=check.image_tokens)["total"]
    predicted = table.seconds * flops / step_flops(A14B_EXPERT, table.tokens)["total"]
    assert predicted == pytest.approx(8.01, abs=0.01)  # 12% under the public 9.15 s
    assert abs(predicted / check.seconds - 1) <= CHECK_TOLERANCE


def test_the_flop_model_predicts_a_wan_transformer_timed_here():
    """bench/teacher_flops.py's recorded run: a 1,536-wide WanTransformer3DModel block on this repo's CPU, the model
    calibrated at 390 tokens (attention 5% of the FLOPs) and predicting 4,680 (27%)."""
    rows = json.loads((ROOT / "bench" / "results.json").read_text())
    row = next(r for r in rows if r["name"] == "teacher_flops_model")
    assert "attention 5%" in row["note"] and "attention 27%" in row["note"]
    assert row["ratio"] == pytest.approx(1.055, abs=0.001) and abs(row["ratio"] - 1) <= CHECK_TOLERANCE
    assert "by tokens alone 6.571 s (-8%)" in row["note"]


def test_the_video_table_is_what_plan_prints():
    """docs/costs.md's video table: tokens, FLOP a step, s a step and GPU-hours as `table_step_time` and `project`
    give them (and so `plan`: test_plan_prints_the_flop_models_video_step)."""
    rows = re.findall(r"^\| A14B, (\d+)x(\d+)x(\d+) \| ([\d,]+) \| ([\d.e]+) \| ([\d.]+) \| ([\d,.]+) \| ([\d,.]+) \|$",
                      (ROOT / "docs" / "costs.md").read_text(), flags=re.M)
    assert [r[:3] for r in rows] == [("480", "832", "1"), ("480", "832", "81"), ("720", "1280", "81")]
    for h, w, f, tokens, flops, seconds, small, large in rows:
        n = ((int(f) - 1) // 4 + 1) * (int(h) // 16) * (int(w) // 16)
        step = table_step_time(A14B_EXPERT, n, "cuda")
        assert tokens == f"{n:,}" and flops == flop(step_flops(A14B_EXPERT, n)["total"])
        assert seconds == f"{step.seconds:.2f}"
        for prompts, hours in ((20_000, small), (200_000, large)):
            assert hours == f"{project(prompts, 1, 40, step, 1, 1)['gpu_hours']:,.1f}"
    check = re.search(r"^\| (Wan2.1[^|]*) \| (\d+)x(\d+)x(\d+) \| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([-+\d]+)% \|",
                      (ROOT / "docs" / "costs.md").read_text(), flags=re.M)
    c = CHECKS[0]
    assert check.group(1).strip() == c.teacher and (check.group(5), float(check.group(6))) == (c.gpu, c.seconds)
    assert check.group(7) == "8.01" and check.group(8) == f"{8.01 / c.seconds - 1:+.0%}".rstrip("%")


def test_the_projection_counts_every_step_and_every_gpu_held():
    step = StepTime(0.20, "table")
    per_gpu = project(200_000, 1, 40, step, parts=32, gpus_per_part=1)
    assert per_gpu["teacher_steps"] == 8_000_000
    assert per_gpu["gpu_hours"] == pytest.approx(444.44, abs=0.01) and per_gpu["wall_h"] == pytest.approx(13.89, 0.01)
    spread = project(200_000, 1, 40, step, parts=4, gpus_per_part=8)  # balanced: one GPU of eight busy
    assert spread["gpu_hours"] == pytest.approx(8 * per_gpu["gpu_hours"]) and spread["wall_h"] == 8 * per_gpu["wall_h"]


def test_one_replica_per_gpu_wherever_one_fits():
    one = plan_launch("cuda", 1, 1, None, WORDS)
    assert (one.parts, one.gpus_per_rank) == (1, 1) and [c["argv"] for c in one.commands] == [WORDS]
    node = plan_launch("cuda", 1, 8, None, WORDS)
    assert (node.parts, node.ranks_per_node) == (8, 8)
    assert node.commands[0]["argv"][:6] == ["torchrun", "--standalone", "--nproc-per-node", "8", "--no-python",
                                            "wandistiller"]
    cluster = plan_launch("cuda", 4, 8, None, WORDS)
    run, array = (c["argv"] for c in cluster.commands)
    assert cluster.parts == 32 and run[:5] == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8"]
    assert "$HEAD_HOST:29500" in run and array[-4:] == ["--part", "$SLURM_ARRAY_TASK_ID", "--num-parts", "32"]
    for launch in (one, node, cluster):
        for c in launch.commands:
            parses(c["argv"])
            assert shlex.split(c["command"].replace("\\\n", " ")) == c["argv"]  # the wrapped line is the same words


def test_a_spread_replica_is_one_process_per_node():
    spread = plan_launch("balanced", 4, 4, None, WORDS)
    assert (spread.parts, spread.ranks_per_node, spread.gpus_per_rank) == (4, 1, 4)
    assert "one GPU computes at a time" in spread.how and "--array=0-3" in spread.commands[0]["when"]
    assert plan_launch("offload", 1, 8, None, WORDS).parts == 1  # streamed: RAM is shared, one rank unless told
    assert plan_launch("offload", 1, 8, 8, WORDS).parts == 8
    assert plan_launch("cpu", 2, 0, None, WORDS).gpus_per_rank == 0
    with pytest.raises(UserError, match="--ranks-per-node 9 is more than the 8 GPU"):
        plan_launch("cuda", 1, 8, 9, WORDS)


def test_plan_lays_a14b_over_the_machine_it_is_told_about():
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--prompts",
               "10000", "--record-steps", "8", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["placement"] == "cuda" and p["launch"]["parts"] == 8 and p["launch"]["gpus_per_rank"] == 1
    assert p["launch"]["commands"][0]["argv"][-2:] == ["--record-steps", "8"]  # the cache that was planned
    assert p["time"]["gpu_hours"] == pytest.approx(22.22, abs=0.01) and p["time"]["gpus"] == 8
    assert p["cache"]["total_bytes"] == 82_045_051_632  # every step still runs; 8 of 40 are written
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--assume-gpus", "4x24GiB", "--assume-ram", "256GiB", "--nodes",
               "2", "--prompts", "10000", "--json")
    p = json.loads(r.output)
    assert p["placement"] == "balanced" and p["launch"]["parts"] == 2 and p["launch"]["gpus_per_rank"] == 4
    assert p["time"]["gpu_hours"] == pytest.approx(4 * 22.22, abs=0.05)


def test_plan_settings_refused_in_one_line():
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--assume-gpus", "4x24GiB", "--gpus-per-node", "8")
    assert r.exit_code == 2 and "give it, or --gpus-per-node and --gpu-memory, not both" in r.output
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--step-time", "0.2", "--measure")
    assert r.exit_code == 2 and "step-time and measure both give the step time" in r.output


def test_plan_measures_a_real_step_or_says_how_to_get_one(tiny_teacher):
    tiny = ["--teacher", tiny_teacher, "--assume-gpus", "none", "--height", "64", "--width", "64", "--steps", "8",
            "--batch-size", "2", "--prompts", "100"]
    r = invoke("plan", *tiny)
    assert r.exit_code == 0 and "time        no measured step time for this teacher and placement" in r.output
    r = invoke("plan", *tiny, "--measure")
    assert r.exit_code == 0, r.output
    assert re.search(r"measured: one step of 2 trajectories in [\d.]+ s with placement cpu on cpu", r.output)
    step = float(re.search(r"= 800 teacher steps x ([\d.e-]+) s", r.output).group(1))
    assert step > 0 and "step time: measured here by --measure" in r.output and "wall on the CPU" in r.output


@pytest.mark.parametrize("size, seconds, hours", [(("480", "832", "1"), "0.20", "44.4"),
                                                  (("480", "832", "81"), "7.97", "1,772.1"),
                                                  (("720", "1280", "81"), "31.00", "6,888.0")])
def test_plan_prints_the_flop_models_video_step(size, seconds, hours):
    h, w, f = size
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--gpus-per-node", "1", "--gpu-memory", "80GiB", "--prompts",
               "20000", "--height", h, "--width", w, "--frames", f, "--batch-size", "1")  # 720p's activations
    assert r.exit_code == 0, r.output
    assert f"= 800,000 teacher steps x {seconds} s = {hours} GPU-hours" in r.output
    source = re.search(r"step time: (.*)", r.output).group(1)
    assert source.startswith("FLOP model: " if f != "1" else "the table of docs/costs.md")
    assert "the table of docs/costs.md (Wan2.2-T2V-A14B, 480x832x1, 0.20 s on one H100" in source


def test_cache_info_counts_the_teacher_steps_and_says_where_their_time_is(tiny_cache):
    r = invoke("cache", "info", tiny_cache, "--prompts", "1000", "--json")
    info = json.loads(r.output)
    assert info["projected_teacher_steps"] == 1000 * info["seeds_per_prompt"] * info["steps"]
    assert "no table figure for this teacher's shape: `wandistiller plan --measure" in info["projected_teacher_time"]


@pytest.mark.parametrize("latent, seconds, hours", [([16, 1, 60, 104], 0.20, 44.4), ([16, 21, 60, 104], 7.97, 1772.1)])
def test_cache_info_gives_a_video_caches_compute_as_plan_does(latent, seconds, hours):
    """An A14B cache of 81 frames at 480x832 (21 latent frames): the same FLOP-model figure `plan` prints."""
    from conftest import sample_header
    from stages.teacher_cache.costs import cache_compute

    shape = {k: A14B_EXPERT[k] for k in ("num_attention_heads", "attention_head_dim", "num_layers", "ffn_dim")}
    header = sample_header(steps=40, latent_shape=latent, max_sequence_length=512, teacher_shape=shape)
    got = cache_compute(header, 20_000)
    assert got["projected_teacher_steps"] == 800_000 and round(got["teacher_step_s"], 2) == seconds
    assert got["projected_teacher_gpu_hours"] == hours and "docs/costs.md" in got["teacher_step_source"]
    assert "not recorded" in cache_compute(sample_header(), 10)["projected_teacher_time"]  # an older cache
