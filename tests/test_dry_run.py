"""`train-student --dry-run`: the student's parameters, memory per GPU, samples/s and the run's time from steps
measured on this machine, and nothing written to --out."""

from __future__ import annotations

import re

from click.testing import CliRunner

from cache.size import human
from conftest import ROOT
from pipeline.cli import main

TINY_STUDENT = str(ROOT / "configs" / "student-tiny.json")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_train_student_dry_run_measures_and_writes_nothing(tiny_cache, tmp_path):
    out = tmp_path / "never"
    r = invoke("train-student", "--cache", tiny_cache, "--student-config", TINY_STUDENT, "--out", out,
               "--batch-size", "4", "--epochs", "2", "--ema-decay", "0.9", "--num-workers", "0", "--device", "cpu",
               "--dry-run")
    assert r.exit_code == 0, r.output
    assert "train-student --dry-run: nothing trained, nothing written to --out" in r.output
    params = int(re.search(r"student     ([\d,]+) parameters", r.output).group(1).replace(",", ""))
    assert params > 0 and f"training state {human(params * 20)} per GPU" in r.output  # 16 B + 4 of EMA
    assert re.search(r"a step of 4 samples in [\d.]+ s after a warm-up step on cpu: [\d.]+ samples/s", r.output)
    assert "28 training samples, 7 steps an epoch, 14 steps:" in r.output
    assert not out.exists()


def test_a_dry_run_on_a_video_cache_counts_its_frames(tiny_video_cache, tmp_path):
    r = invoke("train-student", "--cache", tiny_video_cache, "--student-config", TINY_STUDENT, "--out",
               tmp_path / "never", "--batch-size", "4", "--num-workers", "0", "--device", "cpu", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "run         8 training samples of 5 frames (2 latent), 2 steps an epoch" in r.output
