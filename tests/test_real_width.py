"""Real widths, not only tiny ones (issue 20): a Wan2.2-A14B-shaped teacher with one block per expert (dim 5120,
40 heads, ffn 13824, text dim 4096, 16 latent channels, patch 1x2x2) and a one-layer UMT5 at d_model 4096 runs
stage one on the CPU, a one-block student of the Wan2.1-1.3B shape (dim 1536, 12 heads, ffn 8960) trains a few
steps from that cache, and `cache verify` passes it, all through the CLI.

Sizes that are not widths stay small to fit the CI budget: 64x64 images (16 latent tokens), 2 prompts, 2 steps,
64 text tokens, a ~600-word vocabulary. The teacher is bench/a14b_teacher.py's, its weights in bfloat16, loaded by
stage one in float32 (the CPU default): ~4.7 GB of RAM for the two experts.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner

from bench.a14b_teacher import A14B, write_a14b_teacher
from pipeline.cli import main

pytestmark = pytest.mark.slow

STUDENT = dict(dim=1536, heads=12, ffn=8960)


def test_real_width_stage_one_stage_two_verify(tmp_path, prompts_file):
    t0 = time.perf_counter()
    teacher = write_a14b_teacher(tmp_path / "teacher")
    t_teacher = time.perf_counter()
    cache, out = tmp_path / "cache", tmp_path / "student"
    run = lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)  # noqa: E731

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(prompts_file.read_text().splitlines()[1:3]) + "\n")  # two prompts
    r = run("teacher-cache", "--teacher", teacher, "--prompts", prompts, "--out", cache, "--placement", "cpu",
            "--height", 64, "--width", 64, "--steps", 2, "--guidance", 4.0, "--max-sequence-length", 64,
            "--batch-size", 2, "--negative-prompt", "blurry")
    assert r.exit_code == 0, r.output
    t_one = time.perf_counter()
    m = json.loads((cache / "manifest.json").read_text())
    assert m["text_dim"] == A14B["text_dim"] and m["latent_shape"] == [A14B["z_dim"], 1, 8, 8]
    assert m["samples"] == 4 and m["experts"] == [1, 2]  # two steps: one per expert at boundary ratio 0.875

    student = tmp_path / "student.json"
    student.write_text(json.dumps({
        "patch_size": [1, 2, 2], "num_attention_heads": STUDENT["heads"],
        "attention_head_dim": STUDENT["dim"] // STUDENT["heads"], "in_channels": A14B["z_dim"],
        "out_channels": A14B["z_dim"], "text_dim": A14B["text_dim"], "freq_dim": 256, "ffn_dim": STUDENT["ffn"],
        "num_layers": 1, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
        "rope_max_seq_len": 1024}))
    r = run("train-student", "--cache", cache, "--student-config", student, "--out", out, "--max-steps", 3,
            "--batch-size", 2, "--lr", 1e-4, "--warmup-steps", 0, "--eval-every", 0, "--checkpoint-every", 0,
            "--log-every", 1, "--device", "cpu")
    assert r.exit_code == 0, r.output
    t_two = time.perf_counter()
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(ln)["type"] == "train"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert json.loads((out / "student" / "config.json").read_text())["num_attention_heads"] == STUDENT["heads"]

    r = run("cache", "verify", cache)
    assert r.exit_code == 0, r.output
    print(f"\nreal-width test: teacher written in {t_teacher - t0:.0f} s, stage one {t_one - t_teacher:.0f} s, stage "
          f"two {t_two - t_one:.0f} s, verify {time.perf_counter() - t_two:.0f} s, total {time.perf_counter() - t0:.0f} s")
