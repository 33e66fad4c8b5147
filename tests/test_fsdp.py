"""`train-student --strategy fsdp` (PyTorch FSDP2) on the CPU with gloo: one process equals DDP bit for bit, two
processes equal one process, a killed run resumes bit-equal (past a damaged sharded checkpoint, and into one
process), checkpoints are DCP-sharded, and a checkpoint resumes only with the strategy that wrote it."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from pipeline.errors import UserError
from stages.train_student import checkpoint
from test_train_student import TINY, assert_same_students, invoke, max_rel_diff, metrics, train, weights
from test_train_student_dist import ARGS, torchrun

# A killed run: 7 prompts, 1 held out, steps 0,1,2 -> 18 training samples; batch 1 x 2 ranks x 2 micro-steps =
# global 4: 5 steps per epoch (the last one short), 10 steps = 2 epochs. The 3 held-out samples split 2:1 over the
# ranks, so rank 1 runs a discarded evaluation forward to keep FSDP's collectives in step.
KILL = dict(train_steps="0,1,2", batch_size=1, grad_accum=2, max_steps=10, checkpoint_every=3, warmup_steps=2,
            ema_decay=0.8, holdout_prompts=1, eval_every=4, val_every=5, lr=1e-3, seed=3, report_to="none")


def _val(out) -> list[tuple[int, float]]:
    return [(r["step"], r["final_latent_mse"]) for r in metrics(out, "val")]


def test_strategy_is_a_checked_choice(tiny_cache, tmp_path):
    base = ["--cache", str(tiny_cache), "--student-config", TINY, "--out", str(tmp_path / "out")]
    for args, needle in [(["--strategy", "zero3"], "'zero3' is not one of 'ddp', 'fsdp'"),
                         (["--strategy", "fsdp", "--mixed-precision", "fp16"], "fp16 does not go with strategy fsdp")]:
        result = invoke(*base, *args)
        assert result.exit_code == 2 and needle in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_process_fsdp_equals_ddp_and_checkpoints_keep_their_strategy(tiny_cache, tmp_path, device):
    """On the CPU the same bits; on CUDA (in float32, so that only the strategy differs) within 1e-4, since CUDA
    kernels need not add in the same order in two runs."""
    kw = dict(train_steps="0,1,2", batch_size=4, grad_accum=2, epochs=2, warmup_steps=1, ema_decay=0.9, seed=11,
              holdout_prompts=1, eval_every=2, val_every=3, checkpoint_every=2, report_to="none", device=device,
              mixed_precision="no")
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    train(tiny_cache, ddp, **kw)
    train(tiny_cache, fsdp, strategy="fsdp", **kw)
    losses = {run: [r.get("loss", r.get("heldout_loss")) for kind in ("train", "eval") for r in metrics(run, kind)]
              for run in (ddp, fsdp)}
    if device == "cpu":
        # one rank: the same arithmetic in the same order, so the same bits (evaluation, EMA validation included)
        assert_same_students(fsdp, ddp)
        assert losses[fsdp] == losses[ddp]
        assert _val(fsdp) == _val(ddp) and len(_val(ddp)) == 3
    else:
        for name in ("student", "student_ema"):
            assert max_rel_diff(weights(fsdp / name), weights(ddp / name)) <= 1e-4, name
        assert losses[fsdp] == pytest.approx(losses[ddp], rel=1e-4)
        assert [v for _, v in _val(fsdp)] == pytest.approx([v for _, v in _val(ddp)], rel=1e-4)
    for name in ("student", "student_ema"):  # the artifact: the same files, the same model config
        assert sorted(p.name for p in (fsdp / name).iterdir()) == sorted(p.name for p in (ddp / name).iterdir())
        assert (fsdp / name / "config.json").read_text() == (ddp / name / "config.json").read_text()
    assert json.loads((fsdp / "distill.json").read_text()) == json.loads((ddp / "distill.json").read_text())
    assert json.loads((fsdp / "config.json").read_text())["strategy"] == "fsdp"

    # a checkpoint resumes with its own strategy only: one line naming the one to use
    with pytest.raises(UserError, match="written with --strategy fsdp .*resume with --strategy fsdp"):
        train(tiny_cache, fsdp, resume=True, strategy="ddp", **kw)
    with pytest.raises(UserError, match="written with --strategy ddp .*resume with --strategy ddp"):
        train(tiny_cache, ddp, resume=True, strategy="fsdp", **kw)


@pytest.fixture(scope="module")
def fsdp_two(tiny_cache, tmp_path_factory):
    """The uninterrupted two-process fsdp run (KILL's settings) that both tests below compare against."""
    out = tmp_path_factory.mktemp("fsdp-two") / "run"
    t0 = time.time()
    proc = torchrun(tiny_cache, out, {}, 300, strategy="fsdp", **KILL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"fsdp two processes: {time.time() - t0:.0f}s")
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_two_processes_fsdp_equal_one_process_and_checkpoints_are_sharded(fsdp_two, tiny_cache, tmp_path):
    out2, out1 = fsdp_two, tmp_path / "one"
    train(tiny_cache, out1, **(KILL | dict(batch_size=2, num_workers=0)))  # one process, plain (no wrapping)

    l2, l1 = [r["loss"] for r in metrics(out2)], [r["loss"] for r in metrics(out1)]
    assert len(l2) == len(l1) == 10 and max(abs(a - b) / b for a, b in zip(l2, l1)) < 1e-5
    diffs = {name: max_rel_diff(weights(out2 / name), weights(out1 / name)) for name in ("student", "student_ema")}
    print(f"fsdp two processes vs one process, max relative difference: {diffs}")
    # 10 AdamW steps of two ranks' sums in another order: 1.2e-5 measured on an AVX2 machine, 2.9e-5 on an AVX-512/AMX
    # one (the same code: the commit of 2026-12-02 that passed with 2e-5 measures 2.9e-5 there)
    assert max(diffs.values()) <= 5e-5
    for name in ("student", "student_ema"):
        assert (out2 / name / "config.json").read_text() == (out1 / name / "config.json").read_text()

    # checkpoints: torch.distributed.checkpoint folders, one shard file per rank, every file in the digest record
    names = sorted(p.name for p in (out2 / "checkpoints").iterdir())
    assert names == ["step-00000009", "step-00000010"]  # the newest two kept (10: the last step's)
    ckpt = out2 / "checkpoints" / names[-1]
    assert sorted(p.name for p in ckpt.iterdir()) == ["digests.json", "sharded", "trainer_state.json"]
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    files = json.loads((ckpt / "digests.json").read_text())["files"]
    assert sorted(files) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "trainer_state.json"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["strategy"] == "fsdp" and state["world_size"] == 2 and state["step"] == 10
    assert checkpoint.sharded_keys(ckpt) == {"model", "optimizer", "ema"}
    assert checkpoint.pick(out2) == (ckpt, [])  # verified and trusted like a whole checkpoint


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_kill_and_resume_is_bit_equal(fsdp_two, tiny_cache, tmp_path):
    full, cut = fsdp_two, tmp_path / "cut"
    # every rank SIGKILLs itself as optimizer step 8 begins: checkpoints 3 and 6 are on disk
    proc = torchrun(tiny_cache, cut, {"WANDISTILLER_KILL_AT": "train_step:8"}, 300, strategy="fsdp", **KILL)
    assert proc.returncode != 0 and not (cut / "student").exists()
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    one = tmp_path / "one"  # the same checkpoints, resumed below by one process
    shutil.copytree(cut, one)

    # damage rank 1's shard of the newest checkpoint: the resume falls back to step 3 and says so
    shard = cut / "checkpoints" / "step-00000006" / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = torchrun(tiny_cache, cut, {}, 300, strategy="fsdp", resume=True, **KILL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "checkpoint step-00000006 is damaged (sharded/__1_0.distcp: sha256 mismatch); resuming from " \
           "step-00000003" in out, out[-3000:]

    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    assert metrics(cut, "eval") == metrics(full, "eval") and len(metrics(full, "eval")) == 4
    assert _val(cut) == _val(full) and len(_val(full)) == 3
    assert_same_students(cut, full)

    # DCP reshards on load: one process (batch 2: the same global batch) continues the two-process run
    train(tiny_cache, one, strategy="fsdp", resume=True, num_workers=0, **(KILL | dict(batch_size=2)))
    diffs = {name: max_rel_diff(weights(one / name), weights(full / name)) for name in ("student", "student_ema")}
    print(f"fsdp resumed by one process vs two, max relative difference: {diffs}")
    assert max(diffs.values()) <= 1e-5


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_with_an_objectives_heads(tiny_teacher, prompts_file, tmp_path):
    """velocity+feature's projection heads stay whole on every rank (their gradients all-reduced by the strategy)
    and are checkpointed in the sharded checkpoint with the student: two processes equal one, and one process
    resumes the two-process run's checkpoint to the same weights."""
    from conftest import make_cache

    cache = make_cache(tiny_teacher, prompts_file, tmp_path / "cache", record_features="0,1", feature_dim=8)
    heads = dict(objective="velocity+feature", feature_pairs="0:0,0:1", feature_weight=0.5)
    two, one = tmp_path / "two", tmp_path / "one"
    proc = torchrun(cache, two, {}, 300, strategy="fsdp", **(ARGS | heads | dict(checkpoint_every=2)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train(cache, one, **(ARGS | heads | dict(batch_size=4)))
    l2, l1 = [r["loss_feature"] for r in metrics(two)], [r["loss_feature"] for r in metrics(one)]
    assert max(abs(a - b) / b for a, b in zip(l2, l1)) < 1e-5
    for name in ("student", "student_ema"):
        assert max_rel_diff(weights(two / name), weights(one / name)) <= 1e-5, name
    # steps 5 and 6 again, in one process, from the two-process checkpoint of step 4 (heads and their moments too)
    train(cache, two, strategy="fsdp", resume=True, **(ARGS | heads | dict(batch_size=4, checkpoint_every=2)))
    assert [r["step"] for r in metrics(two)] == list(range(1, 7))
    for name in ("student", "student_ema"):
        assert max_rel_diff(weights(two / name), weights(one / name)) <= 1e-5, name


@pytest.mark.gpu
def test_fsdp_on_cuda_with_bf16(tiny_cache, tmp_path):
    """One GPU: FSDP2 over a mesh of one with the bf16 MixedPrecisionPolicy, gradient checkpointing, EMA."""
    out = tmp_path / "cuda"
    summary = train(tiny_cache, out, device="cuda", strategy="fsdp", mixed_precision="bf16",
                    gradient_checkpointing=True, max_steps=4, ema_decay=0.9, checkpoint_every=2, num_workers=1)
    assert summary["peak_cuda_gib"] is not None and len(metrics(out)) == 4
    assert all(torch.isfinite(t).all() for t in weights(out / "student").values())
    train(tiny_cache, out, device="cuda", strategy="fsdp", mixed_precision="bf16", gradient_checkpointing=True,
          max_steps=6, ema_decay=0.9, checkpoint_every=2, num_workers=1, resume=True)
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))
