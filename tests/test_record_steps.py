"""Bounded cache size (issue 20): `teacher-cache --record-steps N` records N of the teacher's steps per trajectory,
and `cache info`, `plan` and stage one's disk check project the cache's bytes from one piece of arithmetic
(cache/size.py)."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cache import format as F
from cache.manifest import load_manifest, summarize
from cache.prompt_store import open_prompt_store, prompt_store_path, read_latents
from cache.reader import open_index
from cache.size import embeds_bytes, project, prompt_bytes
from cache.verify import verify_cache
from conftest import TEST_PROMPTS, make_cache, read_all_samples
from pipeline.cli import main
from pipeline.config import TeacherCacheConfig
from pipeline.errors import UserError
from cache.records import choose_recorded_steps
from stages.train_student.objective_velocity import Segment, check_cache
from test_teacher_cache_cli import _args, assert_one_line_error, invoke
from test_train_student import metrics, train

STEPS = 8
# One shard per cache: the byte comparison then sees one tar end (<= 10 KiB) per cache, not one per block.
ARGS = dict(steps=STEPS, samples_per_shard=1000)


@pytest.fixture(scope="module")
def caches(tiny_teacher, prompts_file, tmp_path_factory) -> dict:
    """The same prompts and seeds at 8 steps: every step, --record-steps 4 (seeded), --record-steps 2 keeping
    step 4 (a 2-step segment student's boundaries are 0 and 4)."""
    root = tmp_path_factory.mktemp("record-steps")
    return {"full": make_cache(tiny_teacher, prompts_file, root / "full", **ARGS),
            "n4": make_cache(tiny_teacher, prompts_file, root / "n4", record_steps=4, **ARGS),
            "n2": make_cache(tiny_teacher, prompts_file, root / "n2", record_steps=2, keep_steps=(4,), **ARGS)}


def disk_bytes(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(folder) for f in files)


def test_recorded_steps_are_seeded_and_keep_step_zero():
    a = choose_recorded_steps(40, 8, seed=0)
    assert a == choose_recorded_steps(40, 8, seed=0) and len(a) == 8 and a[0] == 0 and a == sorted(a)
    assert choose_recorded_steps(40, 8, seed=1) != a
    assert {0, 10, 20, 30} <= set(choose_recorded_steps(40, 5, seed=0, keep=(10, 20, 30)))
    assert choose_recorded_steps(40, 40, seed=0) == choose_recorded_steps(40, None, seed=0) == list(range(40))
    base = dict(teacher="t", prompts="p", out="o", steps=8)
    for bad, match in [(dict(record_steps=9), "exceeds --steps 8"), (dict(record_steps=0), "record-steps"),
                       (dict(record_steps=2, keep_steps="3,5"), "more than --record-steps 2"),
                       (dict(record_steps=2, keep_steps="8"), "from 0 to 7"), (dict(record_seed=3), "--record-steps")]:
        with pytest.raises(ValueError, match=match):
            TeacherCacheConfig(**base, **bad)


def test_cache_bytes_scale_with_record_steps(caches, tiny_cache):
    # several shards per part (12 samples each, closed at block boundaries): the arithmetic follows them too
    m = load_manifest(tiny_cache)
    assert len(m.shards) == 3 and m.bytes == project(m, 7, batch_size=3, samples_per_shard=12).shard_bytes
    ms = {k: load_manifest(c) for k, c in caches.items()}
    assert "recorded_steps" not in ms["full"].to_json()  # a cache of every step keeps its fingerprint
    assert ms["n4"].recorded_steps[0] == 0 and len(ms["n4"].recorded_steps) == 4
    assert ms["n2"].recorded_steps == [0, 4]
    per_sample = {k: summarize(c)["bytes_per_sample"] for k, c in caches.items()}
    assert len(set(per_sample.values())) == 1
    for k, n in (("full", STEPS), ("n4", 4), ("n2", 2)):
        m = ms[k]
        assert m.samples == len(TEST_PROMPTS) * n
        # the arithmetic is exact: the shards are what cache/size.py says, byte for byte
        assert m.bytes == project(m, len(TEST_PROMPTS), batch_size=3, samples_per_shard=1000).shard_bytes
        # and proportional to N, up to the one 10 KiB tar record that ends each shard
        assert m.bytes / ms["full"].bytes == pytest.approx(n / STEPS, rel=0.06)
    assert len({m.fingerprint for m in ms.values()}) == 3


def test_recorded_targets_are_bit_identical_to_the_full_cache(caches):
    full = read_all_samples(caches["full"])
    trajs = [(p, 0) for p in range(len(TEST_PROMPTS))]
    noise, finals = read_latents(caches["full"], 1, trajs)
    for name in ("n4", "n2"):
        m = load_manifest(caches[name])
        part = read_all_samples(caches[name])
        assert sorted({F.parse_key(k)[2] for k in part}) == m.recorded_steps
        for key, (tensors, meta) in part.items():
            want, want_meta = full[key]
            assert tensors.keys() == want.keys() and meta == want_meta, key
            assert all(torch.equal(tensors[t], want[t]) for t in tensors), key
        n, f = read_latents(caches[name], 1, trajs)  # every step ran: the same final latents
        assert torch.equal(n, noise) and torch.equal(f, finals)
        assert verify_cache(caches[name], progress=False) == []


def test_resume_with_other_record_steps_is_refused(tiny_teacher, prompts_file, caches):
    out = caches["n2"]
    r = invoke(_args(tiny_teacher, prompts_file, out, **ARGS, record_steps=4, keep_steps="4"))
    assert_one_line_error(r, "other settings", "--overwrite")
    r = invoke(_args(tiny_teacher, prompts_file, out, **ARGS, record_steps=2, keep_steps="4"))
    assert r.exit_code == 0 and "already complete" in r.output


def test_segment_student_needs_its_boundaries_recorded(caches):
    m2 = load_manifest(caches["n2"])
    ok = Segment({"student_steps": 2, "velocity_weight": 0.0})
    check_cache(ok, m2, str(caches["n2"]), num_layers=1)  # boundaries 0 and 4: kept
    assert ok.record()["boundaries"] == [0, 4]
    item = ok.dataset(open_index([caches["n2"]]), 8)[(0, 1.0)]
    assert torch.isfinite(item["fields"]["segment_velocity"]).all()
    with pytest.raises(UserError) as e:
        check_cache(Segment({"student_steps": 4, "velocity_weight": 0.0}), m2, str(caches["n2"]), num_layers=1)
    msg = str(e.value)
    assert "\n" not in msg and "records only steps 0,4" in msg and "not 2,6" in msg
    assert "--record-steps 2" in msg and "--for-students 4" in msg and "--student-steps 1,2" in msg
    assert "GPU-hours" in msg  # what the rebuild would cost


def test_velocity_student_trains_from_a_record_steps_cache(caches, tmp_path):
    train(caches["n4"], tmp_path / "out", max_steps=3)
    rows = metrics(tmp_path / "out")
    assert rows and all(r["loss"] == r["loss"] for r in rows)


def test_a_run_that_would_not_fit_the_disk_is_refused_up_front(tiny_teacher, prompts_file, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 50_000, 50_000))
    out = tmp_path / "c"
    r = invoke(_args(tiny_teacher, prompts_file, out, **ARGS))
    assert_one_line_error(r, "has 48.8 KiB free", "would write", "--record-steps N (now 8 of 8", "another --out")
    assert not (out / F.PARTS_DIR / "part-00000" / F.PROMPTS_ZARR).exists()  # refused before encoding


def test_cache_info_projects_a_finished_cache(tiny_teacher, caches, tmp_path):
    # the cache's own count: every file of it, byte for byte (shards, prompt store, metadata)
    assert summarize(caches["n4"])["total_bytes"] == disk_bytes(caches["n4"])
    # a 3-prompt cache projects the 7-prompt one
    few = tmp_path / "few.txt"
    few.write_text("\n".join(TEST_PROMPTS[:3]) + "\n")
    small = make_cache(tiny_teacher, few, tmp_path / "small", record_steps=2, keep_steps=(4,), **ARGS)
    r = CliRunner().invoke(main, ["cache", "info", str(small), "--prompts", str(len(TEST_PROMPTS)), "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["recorded_steps"] == [0, 4] and info["projected_samples"] == len(TEST_PROMPTS) * 2
    assert info["projected_bytes"] == pytest.approx(disk_bytes(caches["n2"]), rel=0.03)
    text = CliRunner().invoke(main, ["cache", "info", str(small)], catch_exceptions=False).output
    assert "bytes_per_prompt" in text and "KiB" in text


def test_plan_reports_the_cache_bytes(tiny_teacher, caches):
    r = CliRunner().invoke(main, ["plan", "--teacher", str(tiny_teacher), "--placement", "cpu", "--height", "64",
                                  "--width", "64", "--max-sequence-length", "32", "--batch-size", "3", "--steps",
                                  str(STEPS), "--record-steps", "2", "--prompts", "7", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)["cache"]
    info = summarize(caches["n2"])
    assert plan["sample_bytes"] == info["bytes_per_sample"] and plan["recorded_steps"] == 2
    # before a run an embedding is taken at its bound, all 32 tokens; the cache holds only the real ones
    m = load_manifest(caches["n2"])
    tokens = int(open_prompt_store(prompt_store_path(caches["n2"], 0))[F.Z_SEQ_LENS][:].sum())
    assert plan["prompt_store_bytes"] == round(prompt_bytes(m, 32)) > info["bytes_per_prompt"]
    assert plan["total_bytes"] - (info["total_bytes"] - info["fixed_bytes"]) == embeds_bytes(m, 7 * 32) - embeds_bytes(
        m, tokens)
