"""Config values are checked against their declared types: a quoted boolean, a number for a string, NaN or
infinity is refused with one line naming the key and the file (issue 21), never taken as something else."""

from __future__ import annotations

import shutil

import pytest

from conftest import TINY_CACHE_ARGS
from pipeline.config import TeacherCacheConfig, TrainStudentConfig
from pipeline.config_types import load_config
from pipeline.errors import UserError
from test_teacher_cache_cli import invoke

STAGE_ONE = dict(teacher="t", prompts="p.txt", out="o")
STAGE_TWO = dict(cache=["c"], student_config="s.json", out="o")


@pytest.mark.parametrize("cls, required, toml, needle", [
    (TeacherCacheConfig, STAGE_ONE, 'overwrite = "false"', "overwrite must be true or false"),
    (TeacherCacheConfig, STAGE_ONE, "placement = 5", "placement must be a string (quoted), got 5"),
    (TeacherCacheConfig, STAGE_ONE, "negative_prompt = 5", "negative-prompt must be a string (quoted), got 5"),
    (TeacherCacheConfig, STAGE_ONE, "guidance = nan", "guidance must be a finite number, got nan"),
    (TeacherCacheConfig, STAGE_ONE, "guidance_2 = inf", "guidance-2 must be a finite number, got inf"),
    (TeacherCacheConfig, STAGE_ONE, "save_cond_uncond = 1", "save-cond-uncond must be true or false"),
    (TeacherCacheConfig, STAGE_ONE, "seeds_per_prompt = \"two\"", "seeds-per-prompt must be an integer >= 1"),
    (TrainStudentConfig, STAGE_TWO, 'resume = "no"', "resume must be true or false"),
    (TrainStudentConfig, STAGE_TWO, "lr = inf", "lr must be a finite number, got inf"),
    (TrainStudentConfig, STAGE_TWO, "gradient_checkpointing = \"true\"", "gradient-checkpointing must be true"),
    (TrainStudentConfig, STAGE_TWO, "train_steps = [0.5]", "train-steps"),
])
def test_wrong_type_in_toml_is_one_line_naming_key_and_file(tmp_path, cls, required, toml, needle):
    p = tmp_path / "c.toml"
    p.write_text(toml + "\n")
    with pytest.raises(UserError) as e:
        load_config(cls, p, required)
    assert needle in str(e.value) and str(p) in str(e.value), str(e.value)


def test_values_of_the_right_type_still_load(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("overwrite = false\nguidance = 4\nrecord_features = [1, 2]\n")
    cfg = load_config(TeacherCacheConfig, p, STAGE_ONE)
    assert cfg.overwrite is False and cfg.guidance == 4 and tuple(cfg.record_features) == (1, 2)
    p.write_text('train_steps = "0,2"\nresume = true\n')
    assert load_config(TrainStudentConfig, p, STAGE_TWO).resume is True


def test_verify_takes_checksum_or_size_only(tmp_path):
    """`sha256`, the check's name before crc32c, is refused like any other unknown name (no alias at 0.1)."""
    p = tmp_path / "c.toml"
    for bad in ("sha256", "md5"):
        p.write_text(f'verify = "{bad}"\n')
        with pytest.raises(UserError, match="verify must be one of checksum, size"):
            load_config(TrainStudentConfig, p, STAGE_TWO)


def test_nan_from_a_flag_is_refused_without_blaming_the_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("seed = 1\n")
    with pytest.raises(UserError) as e:
        load_config(TrainStudentConfig, p, dict(STAGE_TWO, lr=float("nan")))
    assert str(e.value) == "lr must be a finite number, got nan"


def test_quoted_false_overwrite_leaves_a_finished_cache_alone(tiny_cache, tiny_teacher, prompts_file, tmp_path):
    out = tmp_path / "cache"
    shutil.copytree(tiny_cache, out)
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    toml = tmp_path / "o.toml"
    toml.write_text('overwrite = "false"\n')
    args = ["teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", out, "--config", toml]
    for k, v in dict(TINY_CACHE_ARGS, placement="cpu").items():
        args += [f"--{k.replace('_', '-')}", v]
    r = invoke(args)
    assert r.exit_code == 2 and "overwrite must be true or false" in r.output and "Traceback" not in r.output
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before
