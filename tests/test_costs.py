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
from pipeline.cli import main
from pipeline.errors import UserError
from stages.teacher_cache.costs import STEP_TABLE, StepTime, project, table_step_time
from stages.teacher_cache.launch import plan_launch, teacher_cache_words

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
    assert cuda.seconds == 0.20 and "docs/costs.md" in cuda.source and "scaled" not in cuda.source
    assert table_step_time(A14B_EXPERT, 1560, "offload").seconds == pytest.approx(0.20 / 0.71)
    assert table_step_time(A14B_EXPERT, 1560, "balanced").seconds == 0.20
    assert table_step_time(A14B_EXPERT, 1560, "disk") is None  # not measured at this size: --measure, not a guess
    assert table_step_time(A14B_EXPERT | {"num_layers": 30}, 1560, "cuda") is None  # another teacher
    big = table_step_time(A14B_EXPERT, 3600, "cuda")  # 720x1280
    assert big.seconds == pytest.approx(0.20 * 3600 / 1560) and "scaled by tokens 3600/1560 (rough)" in big.source


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
