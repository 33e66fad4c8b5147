"""The cache's disk, up front: `teacher-cache` (its dry run too) and `plan` set what the cache still writes beside the
free space of --out's filesystem, measured there, and refuse in one line a cache it cannot hold, before any weight
loads. A small filesystem is `shutil.disk_usage` answering a small figure, in this process (a tmpfs needs root)."""

from __future__ import annotations

import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cache import format as F
from conftest import ROOT
from test_teacher_cache_cli import _args, assert_one_line_error, invoke

A14B = ROOT / "tests" / "data" / "wan22-a14b-configs"
VIDEO = ROOT / "configs" / "wan2.2-t2v-a14b-video.toml"
TiB = 2**40
Usage = namedtuple("usage", "total used free")


def small_disk(monkeypatch, free: int) -> list[str]:
    """Every filesystem has `free` bytes free; returns the paths asked about."""
    asked = []

    def usage(path):
        asked.append(str(path))
        return Usage(free * 2, free, free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return asked


@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory) -> Path:
    """A14B's public configs as a teacher folder, with a one-tensor safetensors file per component in place of the
    weights: neither stage one's checks before the first weight nor the dry run read a weight file."""
    root = tmp_path_factory.mktemp("a14b") / "teacher"
    shutil.copytree(A14B, root)
    (root / "tokenizer").mkdir()
    for comp in ("text_encoder", "transformer", "transformer_2"):
        save_file({"w": torch.zeros(4)}, root / comp / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def prompts_20k(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("\n".join(f"a clip of scene number {i}" for i in range(20_000)) + "\n")
    return p


def _a14b_video(teacher, prompts, out, *extra):
    return invoke(["teacher-cache", "--config", VIDEO, "--teacher", teacher, "--prompts", prompts, "--out", out,
                   "--placement", "cpu", "--dtype", "bfloat16", *extra])


def test_a_video_cache_larger_than_the_disk_is_refused_by_the_dry_run(a14b_folder, prompts_20k, tmp_path,
                                                                      monkeypatch):
    """20,000 prompts of A14B at 81 frames: 6.4 TiB (each embedding at its text's bound; plan, which reads no
    prompt, takes 512 tokens: 6.5 TiB) beside a 2 TiB disk: the dry run refuses it with the run's own line; on an
    8 TiB disk it prints both figures and where it measured."""
    out = tmp_path / "cache"
    asked = small_disk(monkeypatch, 2 * TiB)
    r = _a14b_video(a14b_folder, prompts_20k, out, "--dry-run")
    assert_one_line_error(r, f"--out {out} has 2.0 TiB free", "would write 6.4 TiB more", "800000 samples",
                          "--record-steps N (now 40 of 40", "another --out")
    assert str(tmp_path) in asked and not out.exists()  # measured where --out will be: its nearest existing folder
    small_disk(monkeypatch, 8 * TiB)
    r = _a14b_video(a14b_folder, prompts_20k, out, "--dry-run")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("  disk "))
    assert re.search(r"6\.4 TiB more to write \(800000 samples at bfloat16: 6\.\d TiB of shards \+ [\d.]+ GiB of "
                     rf"prompt store\); 8\.0 TiB free at {re.escape(str(tmp_path))} \(measured\): it fits", line), line


def test_the_run_refuses_it_before_any_weight_loads(a14b_folder, prompts_20k, tmp_path, monkeypatch):
    """The run itself: one line, exit 2, and nothing encoded (the placeholder weights are never read)."""
    small_disk(monkeypatch, 2 * TiB)
    out = tmp_path / "cache"
    r = _a14b_video(a14b_folder, prompts_20k, out)
    assert_one_line_error(r, "has 2.0 TiB free", "would write 6.4 TiB more")
    assert not (out / F.PARTS_DIR / "part-00000" / F.PROMPTS_ZARR).exists()
    assert "encode prompts" not in r.output


def test_a_resumed_cache_counts_only_what_is_left(tiny_teacher, prompts_file, tmp_path, monkeypatch):
    """Part 0 of 2 written: the dry run of part 1 counts part 1 alone (every part writes into --out), so a disk
    that cannot hold the whole cache holds what is left."""
    def dry(out):
        r = invoke(_args(tiny_teacher, prompts_file, out, part=1, num_parts=2) + ["--dry-run"])
        return r, int(re.search(r"\((\d+) samples at", r.output).group(1)) if r.exit_code == 0 else None

    out, new = tmp_path / "cache", tmp_path / "new"
    r, fresh = dry(new)
    whole = float(re.search(r"  disk       ([\d.]+) KiB more to write", r.output).group(1))
    assert invoke(_args(tiny_teacher, prompts_file, out, part=0, num_parts=2)).exit_code == 0
    r, left = dry(out)
    assert 0 < left < fresh, r.output
    assert float(re.search(r"  disk       ([\d.]+) KiB more to write", r.output).group(1)) < whole / 1.5
    small_disk(monkeypatch, int(whole / 1.5 * 1024))  # less than the whole cache, more than what is left
    assert_one_line_error(dry(new)[0], "would write")
    assert dry(out)[1] == left


def test_plan_measures_the_disk_of_out_and_prints_no_command_where_the_cache_does_not_fit(tmp_path, monkeypatch):
    base = ["plan", "--config", VIDEO, "--teacher", A14B, "--gpus-per-node", "8", "--gpu-memory", "80GiB",
            "--prompts", "20000"]
    asked = small_disk(monkeypatch, 2 * TiB)
    out = tmp_path / "cache"
    r = invoke([*base, "--out", out])
    assert r.exit_code == 2, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("error: the cache would write 6.5 TiB and its disk has 2.0 TiB free at ") and \
        "no command printed" in first, first
    assert f"disk        2.0 TiB free at {tmp_path} (measured): 6.5 TiB to write, it does NOT fit" in r.output
    assert "wandistiller teacher-cache" not in r.output and str(tmp_path) in asked
    small_disk(monkeypatch, 8 * TiB)
    r = invoke([*base, "--out", out])
    assert r.exit_code == 0, r.output
    assert "(measured): 6.5 TiB to write, it fits" in r.output and f"--out {out}" in r.output  # its command's
    # a machine plan is not on: --assume-disk (the offload folder, inside CACHE_DIR, shares the cache's disk)
    r = invoke([*base, "--assume-disk", "2TiB"])
    assert r.exit_code == 2 and "disk        2.0 TiB free (assumed, --assume-disk): 6.5 TiB to write" in r.output
    r = invoke(base)  # neither: said, not guessed
    assert r.exit_code == 0 and "the cache's disk is not checked: give --out CACHE_DIR" in r.output
