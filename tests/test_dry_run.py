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


def test_teacher_cache_notes_a_one_frame_cache_of_a_video_teacher(tiny_teacher, prompts_file, tmp_path):
    """Every Wan VAE compresses time: a frames-1 cache of one trains an image student, which the dry run, the run
    and plan say in a note (not an error); a video run says nothing."""
    from test_teacher_cache_cli import _args

    note = "frames 1: this cache trains an image student or LoRA of a video teacher (it samples single frames)"
    r = invoke(*_args(tiny_teacher, prompts_file, tmp_path / "c"), "--dry-run")
    assert r.exit_code == 0 and f"  note       {note}; pass --frames 4k+1" in r.output, r.output
    assert re.search(r"  disk       [\d.]+ KiB more to write \(\d+ samples at float32: ", r.output)
    r = invoke(*_args(tiny_teacher, prompts_file, tmp_path / "c", frames=5, height=32, width=32), "--dry-run")
    assert r.exit_code == 0 and "frames 1:" not in r.output, r.output
    r = invoke(*_args(tiny_teacher, prompts_file, tmp_path / "c", steps=2))
    assert r.exit_code == 0 and f"note: {note}" in r.output, r.output
    r = invoke("plan", "--teacher", tiny_teacher, "--assume-gpus", "none", "--height", "64", "--width", "64")
    assert r.exit_code == 0 and f"  - {note}" in r.output, r.output
