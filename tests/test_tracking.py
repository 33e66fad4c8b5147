"""Watching a run (issue 22): the tracker's curves match metrics.jsonl, W&B offline, one step axis across a
resume, and validation by sampling that agrees with `eval`."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.artifact import RunLayout
from pipeline.faults import KILL_AT_ENV
from stages.train_student.tracking import scalars

from test_train_student import ROOT, TINY, metrics, train, weights


def event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of a TensorBoard run folder, as TensorBoard itself reads it (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in RunLayout(out).metrics.read_text().splitlines()]


def test_tensorboard_scalars_match_metrics_jsonl(tiny_cache, tmp_path):
    out = tmp_path / "run"
    train(tiny_cache, out, max_steps=4, holdout_prompts=1, eval_every=2)
    got = event_scalars(RunLayout(out).tensorboard)
    want: dict[str, list[tuple[int, float]]] = {}
    for r in records(out):
        for tag, v in scalars(r).items():
            want.setdefault(tag, []).append((r["step"], v))
    assert set(got) == set(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/data_wait_frac",
                "train/peak_mem_gib", "eval/heldout_loss"):
        assert tag in got, tag
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    assert all(0 <= r["data_wait_frac"] <= 1 and r["peak_mem_gib"] > 0 for r in metrics(out))


@pytest.mark.parametrize("device, rel", [("cpu", 1e-5), pytest.param("cuda", 1e-2, marks=pytest.mark.gpu)])
def test_validation_sampling_matches_eval(tiny_cache, tmp_path, device, rel):
    """On CUDA validation samples under autocast and eval in bfloat16: an H200 had them 6.6e-4 apart."""
    from pipeline.config import EvalConfig
    from stages.sample import evaluate

    out = tmp_path / "run"
    train(tiny_cache, out, max_steps=3, holdout_prompts=2, val_every=2, val_max_prompts=2, report_to="none",
          device=device)
    val = [r for r in records(out) if r["type"] == "val"]
    assert [r["step"] for r in val] == [0, 2, 3]
    last = val[-1]
    held = json.loads((out / "distill.json").read_text())["heldout_prompts"]
    report = evaluate.run(EvalConfig(student=str(out), cache=str(tiny_cache), teacher_timing=False,
                                     report=str(tmp_path / "eval.json"), device=device))
    per = {f"p{t['prompt_idx']}_s{t['seed_idx']}": t["student"] for t in report["final_latent_mse"]["per_trajectory"]}
    assert sorted(per) == sorted(last["final_latent_mse_per_prompt"]) and len(per) == len(held) == 2
    for name, err in last["final_latent_mse_per_prompt"].items():
        assert err == pytest.approx(per[name], rel=rel), name
    assert last["final_latent_mse"] == pytest.approx(report["final_latent_mse"]["student"], rel=rel)
    assert val[0]["final_latent_mse"] != last["final_latent_mse"]  # the student moved
    # validating changes nothing of the training: the same run without it ends with the same weights
    train(tiny_cache, tmp_path / "plain", max_steps=3, holdout_prompts=2, report_to="none", device=device)
    a, b = weights(out / "student"), weights(tmp_path / "plain" / "student")
    if device == "cpu":
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:  # CUDA's backward kernels may add in another order from run to run
        assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a)


def test_resume_after_sigkill_continues_one_tensorboard_curve(tiny_cache, tmp_path):
    out = tmp_path / "run"
    kw = dict(max_steps=8, checkpoint_every=4, holdout_prompts=1, eval_every=3)
    # SIGKILL (no cleanup, the writer never closed) as step 7 begins: 5 and 6 came after checkpoint 4
    args = [sys.executable, "-m", "pipeline.cli", "train-student", "--cache", str(tiny_cache), "--student-config",
            TINY, "--out", str(out), "--num-workers", "0", "--warmup-steps", "0", "--log-every", "1", "--lr", "1e-3",
            "--batch-size", "4"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    proc = subprocess.run(args, cwd=ROOT, env={**os.environ, KILL_AT_ENV: "train_step:7"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    before = [s for s, _ in event_scalars(RunLayout(out).tensorboard)["train/loss"]]
    assert before[:4] == [1, 2, 3, 4]  # flushed before the checkpoint: nothing it covers is lost
    train(tiny_cache, out, resume=True, **kw)
    got = event_scalars(RunLayout(out).tensorboard)
    assert len(list(RunLayout(out).tensorboard.iterdir())) == 2  # one run folder, an event file per process
    assert [s for s, _ in got["train/loss"]] == list(range(1, 9))  # nothing twice, nothing missing
    assert [s for s, _ in got["eval/heldout_loss"]] == [0, 3, 6, 8]
    assert [v for _, v in got["train/loss"]] == pytest.approx([r["loss"] for r in metrics(out)], rel=1e-6)


def test_a_resumed_event_file_sorts_after_the_killed_runs(tmp_path):
    """TensorBoard reads event files in name order, and a name starts with the second it was opened: a writer
    opened in the same second as the killed run's file must still sort after it (its purge applies to that file)."""
    from stages.train_student.tracking import TensorBoardTracker

    log_dir = RunLayout(tmp_path).tensorboard
    log_dir.mkdir()
    now = int(time.time())
    killed = log_dir / f"events.out.tfevents.{now}.host.zzzz.0"  # sorts after any pid of this second
    killed.write_bytes(b"")
    tracker = TensorBoardTracker(RunLayout(tmp_path), {"lr": 1.0}, resume_step=4)
    tracker.close()
    newest = sorted(p.name for p in log_dir.iterdir())[-1]
    assert newest != killed.name and int(newest.split(".")[3]) > now


def test_a_failing_validation_warns_and_training_goes_on(tiny_cache, tmp_path, monkeypatch, capsys):
    from stages.train_student.validation import Validator

    def broken(self, model, step):
        raise RuntimeError("sampler exploded\nsecond line")

    monkeypatch.setattr(Validator, "run", broken)
    out = tmp_path / "run"
    train(tiny_cache, out, max_steps=2, holdout_prompts=1, val_every=1, report_to="none")
    assert (out / "student").is_dir() and not [r for r in records(out) if r["type"] == "val"]
    warned = [line for line in capsys.readouterr().out.splitlines() if "validation at step" in line]
    assert len(warned) == 3 and warned[0] == ("warning: validation at step 0 failed, training goes on: "
                                              "RuntimeError: sampler exploded")


def test_val_decode_logs_a_teacher_student_grid(tiny_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(tiny_cache, out, max_steps=2, holdout_prompts=2, val_every=2, val_decode=True)
    acc = EventAccumulator(str(RunLayout(out).tensorboard), size_guidance={"images": 0})
    acc.Reload()
    images = acc.Images("val/teacher_vs_student")
    assert [i.step for i in images] == [0, 2]
    # two held-out trajectories of 64x64 images: 2 rows, teacher | student, 2-pixel gaps
    assert (images[0].height, images[0].width) == (2 * 64 + 3 * 2, 2 * 64 + 3 * 2)
    val = [r for r in records(out) if r["type"] == "val"]
    assert all(r["vae_mib"] > 0 for r in val)


def test_missing_wandb_is_refused_naming_the_extra(tiny_cache, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from pipeline.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    r = CliRunner().invoke(main, ["train-student", "--cache", str(tiny_cache), "--student-config",
                                  str(Path(__file__).parents[1] / "configs" / "student-tiny.json"), "--out",
                                  str(tmp_path / "run"), "--report-to", "wandb"])
    assert r.exit_code == 2
    assert 'pip install wandb (or the wandb extra, from the WanDistiller checkout: pip install -e ".[wandb]")' \
        in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason='the wandb extra is not installed (pip install -e ".[wandb]")')
def test_wandb_offline_writes_a_run_folder_and_resume_keeps_its_id(tiny_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for k in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    kw = dict(max_steps=4, checkpoint_every=2, report_to="wandb")
    monkeypatch.setenv("WANDISTILLER_FAIL_AT", "0:4")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(tiny_cache, out, **kw)
    monkeypatch.delenv("WANDISTILLER_FAIL_AT")
    run_id = json.loads(RunLayout(out).wandb_run.read_text())["id"]
    train(tiny_cache, out, resume=True, **kw)
    assert json.loads(RunLayout(out).wandb_run.read_text())["id"] == run_id
    runs = sorted(RunLayout(out).wandb.glob("offline-run-*"))
    assert len(runs) == 2 and all((r / f"run-{run_id}.wandb").is_file() for r in runs)


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_rank_zero_alone_tracks_and_validates(tiny_cache, tmp_path):
    from test_train_student_dist import torchrun

    out = tmp_path / "two"
    proc = torchrun(tiny_cache, out, {}, 240, max_steps=4, batch_size=2, holdout_prompts=2, val_every=2,
                    checkpoint_every=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list(RunLayout(out).tensorboard.iterdir())) == 1  # one writer: rank 0's
    got = event_scalars(RunLayout(out).tensorboard)
    assert [s for s, _ in got["val/final_latent_mse"]] == [0, 2, 4]
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]


def test_config_refuses_validation_it_cannot_do():
    from pipeline.config import TrainStudentConfig

    base = dict(cache=("c",), student_config="s.json", out="o")
    for bad, match in [(dict(report_to="mlflow"), "report-to"), (dict(val_every=5), "holdout-prompts"),
                       (dict(val_every=-1), "val-every"), (dict(holdout_prompts=2, val_every=5, val_max_prompts=0),
                                                           "val-max-prompts"),
                       (dict(val_decode=True), "val-every"),
                       (dict(holdout_prompts=2, val_every=5, val_decode=True, report_to="none"), "report-to")]:
        with pytest.raises(ValueError, match=match):
            TrainStudentConfig(**base, **bad)
    assert TrainStudentConfig(**base).report_to == "tensorboard"
