"""Crash safety of stage one: parts and ranks, a full disk, resume, and end with exactly the uninterrupted cache.
SIGKILL at named points and at random moments is `make faults`' stage1-kill scenario (tests/test_faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import open_prompt_store, prompt_store_path
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


def _assert_same_cache(a: Path, b: Path) -> None:
    sa, sb = read_all_samples(a), read_all_samples(b)
    assert sorted(sa) == sorted(sb)
    for key in sa:
        (ta, ma), (tb, mb) = sa[key], sb[key]
        assert ma == mb, key
        assert ta.keys() == tb.keys()
        for name in ta:
            assert torch.equal(ta[name], tb[name]), (key, name)
    ma, mb = load_manifest(a), load_manifest(b)
    assert ma[F.F_FINGERPRINT] == mb[F.F_FINGERPRINT] and ma[F.F_SAMPLES] == mb[F.F_SAMPLES]
    ga, gb = open_prompt_store(prompt_store_path(a, 0)), open_prompt_store(prompt_store_path(b, 0))
    for name in (F.Z_EMBEDS, F.Z_TOKEN_START, F.Z_SEQ_LENS, F.Z_INIT_NOISE, F.Z_FINAL_LATENTS, F.Z_PROMPT_IDX):
        np.testing.assert_array_equal(ga[name][:], gb[name][:], err_msg=name)


def _assert_consistent(out: Path) -> None:
    m = load_manifest(out)
    listed = {s[F.S_PATH] for s in m[F.F_SHARDS]}
    on_disk = {f"{F.SHARDS_DIR}/{p.name}" for p in (out / F.SHARDS_DIR).iterdir()}
    assert on_disk == listed, "orphan or missing shard files"
    assert not [p for p in out.rglob(f"*{F.TMP_SUFFIX}")], "temporary files left behind"
    assert verify_cache(out, progress=False) == []


def test_two_parts_as_processes_equal_one_part(tiny_teacher, many_prompts, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    procs = [subprocess.Popen(_cmd(tiny_teacher, many_prompts, two, part=p, num_parts=2), env=_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in (0, 1)]
    subprocess.run(_cmd(tiny_teacher, many_prompts, one), env=_env(), cwd=ROOT, check=True, capture_output=True)
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    m1, m2 = load_manifest(one), load_manifest(two)
    assert m2[F.F_NUM_PARTS] == 2 and m1[F.F_FINGERPRINT] == m2[F.F_FINGERPRINT]
    s1, s2 = read_all_samples(one), read_all_samples(two)
    assert sorted(s1) == sorted(s2) and len(s1) == 160
    for key in s1:
        for name in s1[key][0]:
            assert torch.equal(s1[key][0][name], s2[key][0][name]), (key, name)
    _assert_consistent(two)


@pytest.mark.dist
def test_torchrun_ranks_are_parts(tiny_teacher, many_prompts, tmp_path):
    """Under torchrun each rank is a part; rank 0 writes the manifest after a barrier."""
    out = tmp_path / "torchrun"
    cmd = _cmd(tiny_teacher, many_prompts, out)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = subprocess.run(torchrun + cmd[1:], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_manifest(out)
    assert m[F.F_NUM_PARTS] == 2 and m[F.F_SAMPLES] == 160
    _assert_consistent(out)
    ref = tmp_path / "ref"
    subprocess.run(_cmd(tiny_teacher, many_prompts, ref), env=_env(), cwd=ROOT, check=True, capture_output=True)
    s1, s2 = read_all_samples(ref), read_all_samples(out)
    assert sorted(s1) == sorted(s2)
    assert all(torch.equal(s1[k][0][F.T_TARGET], s2[k][0][F.T_TARGET]) for k in s1)


def test_full_disk_stops_cleanly_and_resumes(tiny_teacher, many_prompts, tmp_path):
    """A write error (file-size limit standing in for a full disk) ends in one line; the rerun completes."""
    import resource

    out = tmp_path / "full"

    def limit():  # shards are ~100 KB here: the first one cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    r = subprocess.run(_cmd(tiny_teacher, many_prompts, out), env=_env(), cwd=ROOT, capture_output=True, text=True,
                       preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "File too large" in errors[0] and "rerun the same command" in errors[0]
    assert "Traceback" not in r.stderr
    assert not list((out / F.SHARDS_DIR).iterdir()), "a partial shard was left behind"
    r = subprocess.run(_cmd(tiny_teacher, many_prompts, out), env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    _assert_consistent(out)
