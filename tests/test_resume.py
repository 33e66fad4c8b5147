"""Crash safety of stage one: parts and ranks, resume, and end with exactly the uninterrupted cache. SIGKILL at
named points and at random moments, and a full disk, are `make faults`' stage1-kill and stage1-disk scenarios
(tests/test_faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache import format as F
from cache.manifest import load_manifest
from cache.verify import verify_cache
from conftest import ROOT, TINY_CACHE_ARGS, read_all_samples

pytestmark = pytest.mark.slow

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["circle", "square", "triangle", "star", "heart"]


@pytest.fixture(scope="module")
def many_prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("many") / "prompts.txt"
    p.write_text("\n".join(f"a {c} {s} on a {COLOURS[(i + 3) % 8]} background"
                           for i, (c, s) in enumerate((c, s) for c in COLOURS for s in SHAPES)) + "\n")
    return p


def _cmd(teacher, prompts, out, **over):
    kw = dict(TINY_CACHE_ARGS, placement="cpu", batch_size=2, samples_per_shard=8)
    kw.update(over)
    args = [sys.executable, "-m", "pipeline.cli", "teacher-cache", "--teacher", str(teacher), "--prompts",
            str(prompts), "--out", str(out)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def one_part(tiny_teacher, many_prompts, tmp_path_factory) -> Path:
    """The cache the tests' parts and ranks must add up to: one process, one part."""
    out = tmp_path_factory.mktemp("one-part") / "cache"
    subprocess.run(_cmd(tiny_teacher, many_prompts, out), env=_env(), cwd=ROOT, check=True, capture_output=True)
    return out


def _assert_consistent(out: Path) -> None:
    m = load_manifest(out)
    listed = {s.path for s in m.shards}
    on_disk = {f"{F.SHARDS_DIR}/{p.name}" for p in (out / F.SHARDS_DIR).iterdir()}
    assert on_disk == listed, "orphan or missing shard files"
    assert not [p for p in out.rglob(f"*{F.TMP_SUFFIX}")], "temporary files left behind"
    assert verify_cache(out, progress=False) == []


def test_two_parts_as_processes_equal_one_part(tiny_teacher, many_prompts, one_part, tmp_path):
    one, two = one_part, tmp_path / "two"
    procs = [subprocess.Popen(_cmd(tiny_teacher, many_prompts, two, part=p, num_parts=2), env=_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    m1, m2 = load_manifest(one), load_manifest(two)
    assert m2.num_parts == 2 and m1.fingerprint == m2.fingerprint
    s1, s2 = read_all_samples(one), read_all_samples(two)
    assert sorted(s1) == sorted(s2) and len(s1) == 160
    for key in s1:
        for name in s1[key][0]:
            assert torch.equal(s1[key][0][name], s2[key][0][name]), (key, name)
    _assert_consistent(two)


@pytest.mark.dist
def test_torchrun_ranks_are_parts(tiny_teacher, many_prompts, one_part, tmp_path):
    """Under torchrun each rank is a part; rank 0 writes the manifest after a barrier."""
    out = tmp_path / "torchrun"
    cmd = _cmd(tiny_teacher, many_prompts, out)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = subprocess.run(torchrun + cmd[1:], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_manifest(out)
    assert m.num_parts == 2 and m.samples == 160
    _assert_consistent(out)
    s1, s2 = read_all_samples(one_part), read_all_samples(out)
    assert sorted(s1) == sorted(s2)
    assert all(torch.equal(s1[k][0][F.T_TARGET], s2[k][0][F.T_TARGET]) for k in s1)
