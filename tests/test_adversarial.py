"""The segment objective's adversarial term (issue 44; stages/train_student/adversarial.py): each gradient reaches
only its own side, the discriminator is checkpointed and resumed bit for bit but never exported, two ranks equal one
process, and a run without it is what it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import UserError
from stages.train_student.adversarial import AdversarialTerm, build
from stages.train_student.checkpoint import HEADS
from stages.train_student.objective_base import Batch
from stages.students.compact import build_student, load_student_config
from test_train_student import TINY, assert_same_students, max_rel_diff, metrics, train, weights

ADV = dict(objective="segment", student_steps=1, segment_adversarial_weight=0.5, segment_disc_warmup=1)


@pytest.fixture(scope="module")
def velocity_student(tiny_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adv") / "velocity"
    train(tiny_cache, out, max_steps=2)
    return out / "student"


def _batch(b: int = 3) -> Batch:
    cfg = load_student_config(TINY)
    x = torch.randn(b, cfg["in_channels"], 1, 4, 4)
    return Batch({}, torch.full((b,), 500.0), torch.randn(b, 8, cfg["text_dim"]), torch.ones(b),
                 {"sample": torch.arange(b, dtype=torch.int64) + 7}), x


def test_each_loss_reaches_only_its_own_side(velocity_student):
    """The discriminator's loss moves only the discriminator; the student's adversarial term moves only the student
    (through its output), and its noise is a function of the sample and the batch count alone."""
    disc = build(load_student_config(TINY), str(velocity_student))
    trunk_ref = build_student(load_student_config(TINY), TINY, 0)
    assert torch.equal(disc.trunk.blocks[0].attn1.to_q.weight,
                       weights(velocity_student)["blocks.0.attn1.to_q.weight"])  # copied from the velocity student
    assert not torch.equal(disc.trunk.blocks[0].attn1.to_q.weight, trunk_ref.blocks[0].attn1.to_q.weight)
    batch, real = _batch()
    fake = torch.randn_like(real, requires_grad=True)
    terms = AdversarialTerm(1.0, 1.0, 0).terms(disc, real, fake, batch, _no_autocast)
    assert set(terms) == {"discriminator", "adversarial"} and int(disc.calls) == 1
    terms["discriminator"].sum().backward(retain_graph=True)
    assert fake.grad is None and disc.head.weight.grad is not None
    disc.zero_grad(set_to_none=True)
    terms["adversarial"].sum().backward()
    assert fake.grad is not None and fake.grad.abs().sum() > 0
    assert all(p.grad is None for p in disc.parameters())
    a = AdversarialTerm.noise(batch.meta["sample"], 3, real)
    b = AdversarialTerm.noise(batch.meta["sample"][[2, 0, 1]], 3, real)
    assert torch.equal(a[1][[2, 0, 1]], b[1])  # per sample, wherever it sits in a batch (any rank, any batch size)
    assert not torch.equal(a[1], AdversarialTerm.noise(batch.meta["sample"], 4, real)[1])  # a new draw each batch


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


def test_the_term_is_refused_without_a_trunk_or_beside_a_lora(tiny_cache, tmp_path, velocity_student):
    with pytest.raises(UserError, match="needs --segment-disc-init PATH"):
        train(tiny_cache, tmp_path / "a", max_steps=1, **ADV)
    with pytest.raises(UserError, match=r"--segment-disc-init .*nope"):
        train(tiny_cache, tmp_path / "b", max_steps=1, **ADV, segment_disc_init=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="segment-disc-init does not go with --lora-of: the adversarial term's "
                                         "discriminator trains beside a compact student only"):
        train(tiny_cache, tmp_path / "c", max_steps=1, **ADV, segment_disc_init=str(velocity_student),
              student_config=None, lora_of="x")


@pytest.mark.slow
def test_discriminator_is_resumed_bit_equal_and_never_exported(tiny_cache, tmp_path, monkeypatch, velocity_student):
    kw = dict(max_steps=6, checkpoint_every=2, ema_decay=0.9, **ADV, segment_disc_init=str(velocity_student))
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(tiny_cache, full, **kw)
    monkeypatch.setenv("WANDISTILLER_FAIL_AT", "0:5")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(tiny_cache, cut, **kw)
    monkeypatch.delenv("WANDISTILLER_FAIL_AT")
    ckpt = sorted((cut / "checkpoints").glob("step-*"))[-1]
    heads = load_file(ckpt / HEADS)
    assert {"calls", "head.weight", "trunk.blocks.0.attn1.to_q.weight"} <= set(heads) and int(heads["calls"]) == 4
    train(tiny_cache, cut, resume=True, **kw)
    rows = metrics(full)
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in rows]
    assert rows[0]["loss_adversarial"] == 0 and rows[-1]["loss_adversarial"] > 0  # after the 1-batch warm-up
    assert rows[-1]["loss_discriminator"] > 0
    assert_same_students(cut, full)
    student_keys = set(build_student(load_student_config(TINY), TINY, 0).state_dict())
    for name in ("student", "student_ema"):
        assert set(weights(full / name)) == student_keys  # nothing of the discriminator's
    settings = json.loads((full / "distill.json").read_text())["objective_settings"]
    assert settings["adversarial_weight"] == 0.5 and settings["disc_init"] == str(velocity_student)
    # Off (the default), the term leaves no trace in the record: a run from before it resumes as it was.
    train(tiny_cache, tmp_path / "plain", max_steps=1, objective="segment", student_steps=1)
    plain = json.loads((tmp_path / "plain" / "distill.json").read_text())["objective_settings"]
    assert not {"adversarial_weight", "disc_init", "disc_r1", "disc_warmup"} & set(plain)


@pytest.mark.dist
@pytest.mark.slow
def test_adversarial_term_on_two_ranks_matches_one_process(tiny_cache, tmp_path, velocity_student):
    from test_train_student_dist import ARGS, torchrun

    extra = ADV | dict(segment_disc_init=str(velocity_student))
    args = {k: v for k, v in ARGS.items() if k != "train_steps"}  # (every step: the final segment's are in)
    proc = torchrun(tiny_cache, tmp_path / "two", {}, 240, **args, **extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train(tiny_cache, tmp_path / "one", **(args | extra | dict(batch_size=4, log_every=1)))
    assert metrics(tmp_path / "one")[-1]["loss_adversarial"] > 0
    # 1e-4, not the 1e-5 of the objectives without a discriminator: through it, the summation order of two ranks' half
    # batches reaches the cross-attention keys, whose gradients are the smallest and which Adam scales up most (3e-5
    # there, at most 3e-6 elsewhere, measured). A rank drawing other noise would differ in every tensor.
    for name in ("student", "student_ema"):
        assert max_rel_diff(weights(tmp_path / "two" / name), weights(tmp_path / "one" / name)) <= 1e-4, name
