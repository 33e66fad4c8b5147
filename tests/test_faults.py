"""The fault-tolerance suite (tests/faults, also `make faults`) under pytest: kills, corruption, full disks
and bad input; every attempt must survive with zero samples lost and zero duplicated. The table of what
was tried is printed at the end of the session."""

from __future__ import annotations

import importlib
import errno
import json
import random
from dataclasses import asdict

import pytest

from faults import FAULT_ROWS, SCENARIOS, Row, Workspace, render
from faults.proc import cleanup
from pipeline import faults


@pytest.fixture(scope="module")
def ws(tiny_teacher, tmp_path_factory):
    yield Workspace(tmp_path_factory.mktemp("faults"), teacher=tiny_teacher)
    cleanup()


@pytest.fixture
def survived(record_property):
    """Check a scenario's rows and put them in the test's report (under pytest-xdist too, where a worker's own
    output never reaches the terminal); the session ends with their table (conftest)."""

    def check(rows: list[Row]) -> list[Row]:
        record_property(FAULT_ROWS, [asdict(r) for r in rows])
        for r in rows:
            assert r.ok, render([r], verbose=True)
            assert r.lost == 0 and r.duplicated == 0
        return rows

    return check


@pytest.mark.slow
def test_stage_one_sigkilled_at_named_points_and_random_moments_resumes_to_the_same_cache(ws, survived):
    rows = SCENARIOS["stage1-kill"](ws, random.Random(0))
    survived(rows)
    assert sum(r.attempts for r in rows) >= 10


@pytest.mark.slow
def test_stage_one_full_disk_stops_with_one_line_lists_nothing_partial_and_resumes(ws, survived):
    survived(SCENARIOS["stage1-disk"](ws, random.Random(0)))


@pytest.mark.slow
def test_stage_two_sigkilled_in_training_or_checkpointing_resumes_to_the_same_weights(ws, survived):
    survived(SCENARIOS["stage2-kill"](ws, random.Random(0)))


@pytest.mark.slow
def test_stage_two_full_disk_at_a_checkpoint_is_one_line_and_resumes(ws, survived):
    survived(SCENARIOS["stage2-disk"](ws, random.Random(0)))


@pytest.mark.slow
def test_stage_one_sigterm_records_the_finished_blocks_exits_143_and_reruns_to_the_same_cache(ws, survived):
    survived(SCENARIOS["stage1-sigterm"](ws, random.Random(0)))


@pytest.mark.slow
def test_stage_two_sigterm_checkpoints_the_step_exits_143_and_resumes_to_the_same_weights(ws, survived):
    survived(SCENARIOS["stage2-sigterm"](ws, random.Random(0)))


@pytest.mark.slow
@pytest.mark.dist
def test_sigterm_under_torchrun_stops_every_rank_at_one_step_and_resumes_to_the_same_result(ws, survived):
    survived(SCENARIOS["sigterm-torchrun"](ws, random.Random(0)))


@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_to_the_newest_sound_one(ws, survived):
    rows = SCENARIOS["checkpoint-corrupt"](ws, random.Random(0))
    survived(rows)
    assert rows[0].attempts >= 7


@pytest.mark.slow
def test_corrupt_caches_are_named_refused_and_repaired_by_the_printed_remedy(ws, survived):
    survived(SCENARIOS["corrupt"](ws, random.Random(0)))


@pytest.mark.slow
def test_bad_inputs_end_in_one_line_exit_2_and_change_nothing(ws, survived):
    rows = SCENARIOS["bad-input"](ws, random.Random(0))
    survived(rows)
    assert rows[0].attempts >= 25


@pytest.mark.slow
def test_config_values_of_the_wrong_type_end_in_one_line_exit_2_and_change_nothing(ws, survived):
    rows = SCENARIOS["config-types"](ws, random.Random(0))
    survived(rows)
    assert rows[0].attempts >= 10


@pytest.mark.slow
def test_a_second_writer_on_one_out_is_refused_naming_the_holder_and_the_first_is_untouched(ws, survived):
    rows = SCENARIOS["concurrent"](ws, random.Random(0))
    survived(rows)
    assert rows[0].attempts >= 4


@pytest.mark.slow
def test_hostile_inputs_run_nothing_touch_nothing_outside_never_hang_and_end_in_one_line(ws, survived):
    rows = SCENARIOS["hostile"](ws, random.Random(0))
    survived(rows)
    assert len(rows) >= 20 and sum(r.attempts for r in rows) >= 40


@pytest.mark.slow
def test_hostile_folders_configs_and_weights_cross_one_trust_boundary(ws, survived):
    rows = SCENARIOS["hostile-folders"](ws, random.Random(0))
    survived(rows)
    assert len(rows) >= 10 and sum(r.attempts for r in rows) >= 30


@pytest.mark.slow
@pytest.mark.dist
def test_a_failing_rank_ends_every_rank_promptly_with_its_cause_once(ws, survived):
    survived(SCENARIOS["rank-failure"](ws, random.Random(0)))


# -- the injection hook itself ----------------------------------------------------------------------

@pytest.fixture
def hook(monkeypatch):
    def arm(spec: str | None):
        if spec is None:
            monkeypatch.delenv(faults.KILL_AT_ENV, raising=False)
        else:
            monkeypatch.setenv(faults.KILL_AT_ENV, spec)
        importlib.reload(faults)  # (reads KILL_AT_ENV afresh)

    yield arm
    monkeypatch.delenv(faults.KILL_AT_ENV, raising=False)
    importlib.reload(faults)  # (reads KILL_AT_ENV afresh)


def test_fault_point_is_a_no_op_unless_armed(hook):
    hook(None)
    for _ in range(3):
        faults.fault_point("mid_shard")


def test_fault_point_fails_exactly_the_nth_time_at_its_point(hook):
    hook("mid_shard:2:enospc")
    faults.fault_point("mid_shard")
    faults.fault_point("after_rename")
    with pytest.raises(OSError) as e:
        faults.fault_point("mid_shard")
    assert e.value.errno == errno.ENOSPC
    faults.fault_point("mid_shard")


@pytest.mark.parametrize("spec", ["nowhere:1", "mid_shard", "mid_shard:0", "mid_shard:1:explode"])
def test_a_bad_fault_spec_is_refused(hook, spec):
    hook(spec)
    with pytest.raises(ValueError, match=faults.KILL_AT_ENV):
        faults.fault_point("mid_shard")


def test_resume_drops_a_metrics_line_torn_by_a_crash(tmp_path):
    from pipeline.artifact import METRICS
    from stages.train_student.loop import truncate_metrics

    lines = [json.dumps({"type": "train", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / METRICS).write_text("\n".join(lines) + '\n{"type": "train", "st')
    truncate_metrics(tmp_path, 2)
    assert (tmp_path / METRICS).read_text() == "".join(line + "\n" for line in lines[:2])
