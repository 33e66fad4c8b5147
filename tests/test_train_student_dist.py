"""Stage two under torchrun with two CPU processes (gloo): the exact partition, DDP equivalence with one
process. (A failure on one rank ending the whole job with its message: the faults `rank-failure` scenario.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_student import TINY, max_rel_diff, metrics, train, weights

ROOT = Path(__file__).resolve().parents[1]

# 7 prompts x steps 0,1,2 = 21 samples; batch 2 on 2 ranks = global 4: the last window of each epoch
# holds a single sample, so rank 1 runs that micro-step with an empty share.
ARGS = dict(train_steps="0,1,2", batch_size=2, grad_accum=2, epochs=2, lr=1e-3, warmup_steps=1, ema_decay=0.9,
            seed=11)


def torchrun(cache: Path, out: Path, env_extra: dict, timeout: float, **kw) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "pipeline.cli", "train-student", "--cache", str(cache), "--out", str(out),
            "--num-workers", "1", "--log-every", "1", "--eval-every", "0", "--checkpoint-every", "0",
            "--device", "cpu"]  # two gloo ranks on the CPU: a GPU box refuses two ranks on one GPU
    if kw.get("lora_of") is None:  # a LoRA student (--lora-of) instead of the compact one
        args += ["--student-config", TINY]
    for k, v in kw.items():
        if v is None:
            continue
        flag = k.replace("_", "-")
        args += [f"--{flag}" if v else f"--no-{flag}"] if isinstance(v, bool) else [f"--{flag}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _debug(folder: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in folder.glob("rank-*.json"))}


def two_ranks_and_one(cache: Path, tmp_path: Path, monkeypatch, args: dict) -> tuple[Path, Path, dict, dict]:
    """Train with `args` on two torchrun ranks and in one process with the same global batch (batch_size x 2):
    (two's run folder, one's, the two ranks' debug records by rank, the one process's record)."""
    out2, dbg2 = tmp_path / "two", tmp_path / "debug-two"
    proc = torchrun(cache, out2, {"WANDISTILLER_DEBUG_DIR": str(dbg2)}, 240, **args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out1, dbg1 = tmp_path / "one", tmp_path / "debug-one"
    monkeypatch.setenv("WANDISTILLER_DEBUG_DIR", str(dbg1))
    train(cache, out1, **(args | dict(batch_size=2 * args["batch_size"])))
    return out2, out1, _debug(dbg2), _debug(dbg1)[0]


def assert_ranks_match_one(out2: Path, out1: Path, ranks: dict, one: dict) -> None:
    """Two ranks took the steps one process took, on the same weights, each micro-step's samples split between them,
    with the same losses to float32 rounding."""
    assert ranks[0]["steps"] == ranks[1]["steps"] == one["steps"]
    assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]
    for i, ref in enumerate(one["micro_batches"]):
        assert sorted(ranks[0]["micro_batches"][i] + ranks[1]["micro_batches"][i]) == sorted(ref)
    l2, l1 = [r["loss"] for r in metrics(out2)], [r["loss"] for r in metrics(out1)]
    assert max(abs(a - b) / b for a, b in zip(l2, l1)) < 1e-5


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_partition_exactly_and_match_one_process(tiny_cache, tmp_path, monkeypatch):
    out2, out1, ranks, one = two_ranks_and_one(tiny_cache, tmp_path, monkeypatch, ARGS)
    assert sorted(ranks) == [0, 1]
    # equal optimizer and micro-step counts on both ranks, identical weights
    assert ranks[0]["steps"] == ranks[1]["steps"] == one["steps"] == 6
    assert len(ranks[0]["micro_batches"]) == len(ranks[1]["micro_batches"]) == len(one["micro_batches"]) == 12
    assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]
    # per epoch (6 micro-steps each): disjoint ranks, union = the whole epoch; per micro-step: union = one process
    all_keys = {k for b in one["micro_batches"][:6] for k in b}
    assert len(all_keys) == 21
    for epoch in range(2):
        sl = slice(6 * epoch, 6 * epoch + 6)
        k0 = [k for b in ranks[0]["micro_batches"][sl] for k in b]
        k1 = [k for b in ranks[1]["micro_batches"][sl] for k in b]
        assert not set(k0) & set(k1) and len(k0) + len(k1) == 21 and set(k0) | set(k1) == all_keys
        assert (len(k0), len(k1)) == (11, 10)  # rank 1's last share of the epoch is empty
    for i, ref in enumerate(one["micro_batches"]):
        assert sorted(ranks[0]["micro_batches"][i] + ranks[1]["micro_batches"][i]) == sorted(ref)
    # same global batch, same numbers: losses and final weights agree to float32 rounding
    l2, l1 = [r["loss"] for r in metrics(out2)], [r["loss"] for r in metrics(out1)]
    assert max(abs(a - b) / b for a, b in zip(l2, l1)) < 1e-5
    diffs = {name: max_rel_diff(weights(out2 / name), weights(out1 / name)) for name in ("student", "student_ema")}
    print(f"one vs two processes, max relative difference: {diffs}")
    assert max(diffs.values()) <= 1e-5
