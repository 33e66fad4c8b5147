"""Settings declared once (issue 34): the registries' declarations are the names the stages run, the CLI's options
and their help come from the config fields, and a setting of another objective is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from click.testing import CliRunner

from pipeline import registries as R
from pipeline.cli import main
from pipeline.config import TrainStudentConfig
from pipeline.options import help_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_declared_name_is_implemented_and_nothing_else():
    from cache.feature_projection import POOLS
    from stages.train_student import tracking
    from stages.train_student.objective_base import Objective
    from stages.train_student.strategy import Strategy

    from stages.teacher_cache.placements import PlacementKind

    assert all(issubclass(e.load(), PlacementKind) for e in R.PLACEMENTS.entries())
    for e in R.OBJECTIVES.entries():  # each declaration's import path names its implementation
        cls = e.load()
        assert issubclass(cls, Objective) and cls.name == e.name and cls.Config is e.settings, e.name
    assert all(issubclass(e.load(), Strategy) for e in R.STRATEGIES.entries())
    trackers = {c.name for c in vars(tracking).values() if isinstance(c, type) and issubclass(c, tracking.Tracker)}
    assert trackers == set(R.TRACKERS.names())
    assert tuple(POOLS) == tuple(R.FEATURE_POOLS.names())


def test_help_shows_each_fields_own_default():
    r = CliRunner().invoke(main, ["train-student", "--help"], terminal_width=400)
    assert r.exit_code == 0
    for f in dataclasses.fields(TrainStudentConfig):
        if "help" in f.metadata:
            assert " ".join(help_of(f).split()) in " ".join(r.output.split()), f.name
    assert "[default: 0.0001]" in r.output and "[default: 1024]" in r.output
    assert "default:" not in (ROOT / "pipeline" / "cli.py").read_text()  # none copied by hand


def test_a_setting_of_another_objective_is_refused_in_one_line(tmp_path):
    r = CliRunner().invoke(main, ["train-student", "--cache", str(tmp_path), "--student-config", "s.json", "--out",
                                  str(tmp_path / "o"), "--feature-weight", "2"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == ["error: feature-weight applies to --objective velocity+feature only, and "
                                             "this run's --objective is velocity; drop it or choose --objective "
                                             "velocity+feature"]


def test_objective_settings_are_their_own_dataclass():
    cfg = TrainStudentConfig(cache=["c"], student_config="s.json", out="o", objective="segment", student_steps=2,
                             segment_start_weight=2.0)
    assert cfg.objective_settings == R.SegmentSettings(student_steps=2, velocity_weight=0.0, start_weight=2.0)
    assert dataclasses.asdict(cfg.objective_settings) == {"student_steps": 2, "student_timesteps": None,
                                                          "student_shift": None, "student_expert_steps": None,
                                                          "velocity_weight": 0.0, "start_weight": 2.0,
                                                          "loss": "mse", "huber_c": 0.01, "adversarial_weight": 0.0,
                                                          "disc_init": None, "disc_r1": 1.0, "disc_warmup": 0}
