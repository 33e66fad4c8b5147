"""Stage one shows where it is: prompts/s, samples/s, bytes written, projected size and ETA, on the bar, in a
line per shard and (--report-to tensorboard) as TensorBoard scalars."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cache import format as F
from cache.manifest import load_manifest
from conftest import TINY_CACHE_ARGS
from pipeline.cli import main


@pytest.mark.slow
def test_teacher_cache_reports_progress_and_projects_the_cache_size(tiny_teacher, prompts_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "cache"
    args = ["teacher-cache", "--teacher", str(tiny_teacher), "--prompts", str(prompts_file), "--out", str(out),
            "--placement", "cpu", "--samples-per-shard", "8", "--report-to", "tensorboard"]
    for k, v in TINY_CACHE_ARGS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    m = load_manifest(out)
    lines = [x for x in r.stdout.splitlines() if " written (" in x]
    assert len(lines) == len(m.shards) and "prompts/s" in lines[0] and "cache ~" in lines[0]
    acc = EventAccumulator(str(out / F.PARTS_DIR / F.part_dirname(0) / F.TENSORBOARD))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"teacher_cache/samples_per_s", "teacher_cache/prompts_per_s", "teacher_cache/bytes_written",
            "teacher_cache/projected_cache_bytes", "teacher_cache/eta_s"} <= tags
    written = acc.Scalars("teacher_cache/bytes_written")
    assert written[-1].value == m.bytes and written[-1].step == m.samples
    projected = [e.value for e in acc.Scalars("teacher_cache/projected_cache_bytes")]
    assert abs(projected[-1] - m.bytes) / m.bytes < 1e-9  # the last projection is the cache's size
