"""Grid-exact caches (issue 54): `teacher-cache --for-students` records the boundaries of every student grid it is
made for, so one stage one serves Lightning's 4-step shift-5 2+2 split and the teacher's own shift-12 grid; the dry
runs print each grid's steps and experts, a grid between the teacher's steps says by how much, and a student the
cache was not made for is refused naming the steps it lacks and what a rebuild costs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pipeline.artifact import DistillRecord
from pipeline.cli import main
from pipeline.registries import grid_choice, grid_spec, student_grids
from pipeline.sampling import scheduler_from_config, student_grid
from test_planner import A14B
from test_student_schedule import _a14b

VIDEO_TEACHER = Path(__file__).parent.parent / "data" / "tiny-video-teacher-pretrained"
SHAPE = ["--frames", "5", "--height", "64", "--width", "64", "--steps", "40", "--guidance", "2",
         "--max-sequence-length", "16"]


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def shift12(tmp_path_factory) -> Path:
    """The tiny video teacher (two experts, boundary 0.875) sampling on A14B's shift-12 flow schedule."""
    t = tmp_path_factory.mktemp("shift12") / "teacher"
    shutil.copytree(VIDEO_TEACHER, t)
    conf = t / "scheduler" / "scheduler_config.json"
    conf.write_text(json.dumps(json.loads(conf.read_text()) | {"flow_shift": 12.0}, indent=2))
    return t


def test_grid_spellings():
    assert student_grids("for-students", "4@shift5:2+2, 4@shift12,8@shift5.0,4,4@shift12") == \
        ("4@shift5:2+2", "4@shift12", "8@shift5", "4")
    assert grid_choice("4:1+3")["student_expert_steps"] == (1, 3)
    assert grid_spec({"student_steps": None, "student_shift": 5.0, "student_expert_steps": [2, 2]}) == "4@shift5:2+2"
    for bad in ("4@shift", "shift5", "4:2+3", "0", "4@shift0", "4:0+4"):
        with pytest.raises(ValueError, match="for-students") as e:
            grid_choice(bad)
        assert "\n" not in str(e.value)


def test_lightning_on_a14b_schedule_and_the_split_it_gives():
    h = _a14b()
    g = student_grid(h, grid_choice("4@shift5:2+2"))
    assert (g.bounds, g.timesteps, g.experts) == ([0, 18, 28, 35], [999, 936, 837, 633], [1, 1, 2, 2])
    assert 0.005 < g.off < 0.01 and "off by up to 0.0084" in g.describe()  # Lightning's .9375/.833/.625, snapped
    own = student_grid(h, grid_choice("4@shift12"))
    assert own.experts == [1, 1, 1, 2] and own.split() == "3+1"
    with pytest.raises(ValueError, match=r"gives the high-noise expert 3 of its steps and the low-noise one 1 .*ask "
                                         r"for 3,1"):
        student_grid(h, grid_choice("4@shift12:2+2"))


def test_a_grid_on_the_teachers_own_steps_is_exact():
    s = scheduler_from_config({"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": True, "flow_shift": 5.0,
                               "prediction_type": "flow_prediction", "num_train_timesteps": 1000,
                               "final_sigmas_type": "zero"})
    s.set_timesteps(40)
    h = SimpleNamespace(steps=40, timesteps=[float(t) for t in s.timesteps], sigmas=[float(v) for v in s.sigmas[:40]],
                        experts=[1 if t >= 875 else 2 for t in s.timesteps], scheduler=dict(s.config))
    g = student_grid(h, grid_choice("4@shift5:2+2"))  # Lightning's grid is steps 0/10/20/30 of a shift-5 40-step run
    assert g.bounds == [0, 10, 20, 30] and g.off < 1e-3


def test_plan_prints_each_grid_and_records_their_union():
    code, out = cli("plan", "--teacher", A14B, "--assume-gpus", "1x80GiB", "--assume-ram", "512GiB", "--assume-disk",
                    "2TiB", "--steps", "40", "--for-students", "4@shift5:2+2,4", "--prompts", "10", "--json")
    assert code == 0, out
    p = json.loads(out)
    assert [g["spec"] for g in p["students"]] == ["4@shift5:2+2", "4"]
    assert p["students"][1]["steps"] == [0, 10, 20, 30] and p["students"][1]["off_sigma"] < 1e-4
    union = sorted({*p["students"][0]["steps"], 10, 20, 30})
    assert p["cache"]["recorded_steps"] == len(union)
    assert "--for-students 4@shift5:2+2,4" in json.dumps(p["launch"])  # the command makes the same cache


def test_record_steps_fewer_than_the_grids_need_is_refused(shift12, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle moving from left to right on a blue background\n")
    code, out = cli("teacher-cache", "--teacher", shift12, "--prompts", prompts, "--out", tmp_path / "c",
                    "--placement", "cpu", *SHAPE, "--for-students", "4@shift5:2+2,4@shift12", "--record-steps", "5",
                    "--dry-run")
    assert code == 2 and "--record-steps 5 is fewer than the 7 steps the student grids" in out


def test_one_cache_trains_lightning_and_shift12_students(shift12, tmp_path):
    """The issue's check: on the tiny video teacher with a shift-12 schedule, one cache made for 4@shift5:2+2 and
    4@shift12 trains both students without a rebuild, and a grid it was not made for is refused with its cost."""
    prompts = tmp_path / "clips.txt"
    prompts.write_text("a red circle moving from left to right on a blue background\n"
                       "a white square moving from top to bottom on a green background\n")
    cache = tmp_path / "cache"
    make = ["teacher-cache", "--teacher", shift12, "--prompts", prompts, "--out", cache, "--placement", "cpu", *SHAPE,
            "--for-students", "4@shift5:2+2,4@shift12"]
    code, out = cli(*make, "--dry-run")
    assert code == 0, out
    assert "4@shift5:2+2  steps 0,18,28,35 (t 999,936,837,633), experts 1,1,2,2 (2+2)" in out
    assert "4@shift12     steps 0,10,20,30 (t 999,973,923,800), experts 1,1,1,2 (3+1)" in out
    assert "records steps 0,10,18,20,28,30,35 of 40" in out
    code, out = cli(*make)
    assert code == 0, out
    m = json.loads((cache / "manifest.json").read_text())
    assert m["recorded_steps"] == [0, 10, 18, 20, 28, 30, 35] and m["for_students"] == ["4@shift5:2+2", "4@shift12"]
    base = ["train-student", "--cache", cache, "--objective", "segment", "--max-steps", "1", "--batch-size", "2",
            "--device", "cpu", "--report-to", "none", "--holdout-prompts", "0", "--num-workers", "0"]
    lora = [*base, "--lora-of", shift12, "--lora-rank", "4", "--student-shift", "5", "--student-expert-steps", "2,2"]
    code, out = cli(*lora, "--out", tmp_path / "dry", "--dry-run")
    assert code == 0, out
    assert "4@shift5:2+2 steps 0,18,28,35 (t 999,936,837,633), experts 1,1,2,2 (2+2)" in out
    for name, args in (("lightning", lora), ("own", [*base, "--student-config", "configs/student-clips.json",
                                                      "--student-shift", "12", "--student-steps", "4"])):
        code, out = cli(*args, "--out", tmp_path / name)
        assert code == 0, out
    assert DistillRecord.read(tmp_path / "lightning" / "distill.json").objective_settings["boundaries"] == \
        [0, 18, 28, 35]
    assert DistillRecord.read(tmp_path / "own" / "distill.json").objective_settings["boundaries"] == [0, 10, 20, 30]
    code, out = cli(*base, "--student-config", "configs/student-clips.json", "--student-shift", "5", "--student-steps",
                    "8", "--out", tmp_path / "eight")
    assert code == 2 and out.count("\n") == 1, out
    assert "does not record steps" in out and "rebuild it with --for-students 4@shift5:2+2,4@shift12,8@shift5" in out
    assert "GPU-hours on an H100" in out


def test_plan_prints_stage_twos_commands_for_the_grid():
    """plan's stage two: one LoRA run per expert on the --for-students grid, and one export of the pair."""
    code, out = cli("plan", "--teacher", A14B, "--assume-gpus", "8x80GiB", "--assume-ram", "1TiB", "--assume-disk",
                    "4TiB", "--frames", "81", "--batch-size", "1", "--record-steps", "8", "--for-students",
                    "4@shift5:2+2", "--prompts", "10000", "--train-epochs", "2")
    assert code == 0, out
    flat = out.replace("\\\n", "").replace("  ", " ")
    for e in (1, 2):
        assert (f"--lora-rank 16 --lora-experts {e} --objective segment --student-shift 5 --student-expert-steps 2,2 "
                f"--mixed-precision bf16 --epochs 2 --gradient-checkpointing --batch-size 1 --out RUN_{e}") in \
            " ".join(flat.split()), out
    assert "wandistiller export --student RUN_1 --student RUN_2 --out EXPORT" in out
