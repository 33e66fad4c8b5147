"""Stage two and eval on image-to-video caches: a compact student takes the teacher's 36 input channels and trains,
each sample carrying its trajectory's cached condition; validation and eval sample it with that condition, as the
teacher was (the teacher's own transformer scores exactly zero where it is the cache's model), and eval reports the
first frame's fidelity to the image; under TI2V's image mode the loss ignores latent frame 0, which sampling
re-imposes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cache import format as F
from pipeline.cli import main
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from pipeline.model_call import CONCAT, FIRST_FRAME, NONE, InputRule
from stages import train_student
from stages.train_student.objective_base import Batch
from stages.train_student.objective_velocity import Velocity

from conftest import make_cache
from test_i2v import image_list

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "configs" / "student-tiny.json").read_text())


def student_config(folder: Path, in_channels: int, out_channels: int) -> str:
    path = folder / f"student-{in_channels}.json"
    path.write_text(json.dumps(TINY | {"in_channels": in_channels, "out_channels": out_channels}))
    return str(path)


def train(cache: Path, out: Path, config: str, **kw) -> None:
    args = dict(cache=(str(cache),), student_config=config, out=str(out), num_workers=0, warmup_steps=0, log_every=1,
                eval_every=0, checkpoint_every=0, lr=3e-3, batch_size=4, device="cpu")
    train_student.run(TrainStudentConfig(**(args | kw)))


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def evaluate(student: Path, cache: Path, report: Path, *args: str) -> tuple[str, dict]:
    r = CliRunner().invoke(main, ["eval", "--student", str(student), "--cache", str(cache), "--report", str(report),
                                  "--device", "cpu", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output, json.loads(report.read_text())


@pytest.fixture(scope="module")
def image_caches(tiny_teacher_factory, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """variant -> (teacher, cache): 3 images x 1 seed x 4 steps of 5 frames (2 latent frames), without CFG."""
    folder = tmp_path_factory.mktemp("i2v-train")
    images = image_list(folder / "images")
    out = {}
    for variant in ("i2v", "ti2v"):
        teacher = tiny_teacher_factory(variant)
        out[variant] = teacher, make_cache(teacher, None, folder / variant, images=str(images), frames=5,
                                           guidance=1.0)
    return out


def test_compact_student_trains_validates_and_evaluates_on_an_i2v_cache(image_caches, tmp_path):
    _, cache = image_caches["i2v"]
    out = tmp_path / "run"
    # (one loader worker: the condition travels through collate's shared memory too)
    train(cache, out, student_config(tmp_path, 36, 16), max_steps=12, holdout_prompts=1, val_every=6, num_workers=1)
    losses = [r["loss"] for r in records(out, "train")]
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0], losses
    vals = records(out, "val")
    assert len(vals) >= 2 and vals[-1]["final_latent_mse"] < vals[0]["final_latent_mse"], vals
    # eval samples the student from each trajectory's noise and condition, as validation did: the same figure
    output, rep = evaluate(out, cache, tmp_path / "eval.json")
    last = vals[-1]["final_latent_mse_per_prompt"]
    for t in rep["final_latent_mse"]["per_trajectory"]:
        assert t["student"] == pytest.approx(last[f"p{t['prompt_idx']}_s{t['seed_idx']}"], rel=1e-6)
    # the latent frame-difference ratio to the teacher's final latents: validation's and eval's, of the same clips
    assert rep["final_latent_mse"]["latent_motion"]["student"] == pytest.approx(vals[-1]["latent_motion"], rel=1e-5)
    first = rep["final_latent_mse"]["first_frame"]
    assert set(first) == {"teacher", "student", "untrained"} and all(v > 0 for v in first.values()), first
    assert [r["first_frame_mse"] for r in rep["table"]] == [first["teacher"], first["student"]]
    assert "frame 0 MSE" in output and f"frame-0 latent MSE against the image {first['student']:.4g}" in output
    assert rep["timing"] is None and any("teacher timing" in w for w in rep["warnings"])


def test_a_lora_of_the_i2v_teacher_starts_as_the_teacher(image_caches, tmp_path):
    """At its first step a LoRA student is the teacher's two experts: given each sample's cached condition it
    predicts the cached targets and validation samples the cached final latents, to float32 round-off."""
    teacher, cache = image_caches["i2v"]
    out = tmp_path / "lora"
    train(cache, out, None, lora_of=str(teacher), max_steps=1, holdout_prompts=1, val_every=1)
    assert records(out, "train")[0]["loss"] < 1e-10
    assert records(out, "val")[0]["step"] == 0 and records(out, "val")[0]["final_latent_mse"] < 1e-10
    assert records(out, "val")[0]["latent_motion"] == pytest.approx(1, abs=1e-4)  # the teacher's own motion


def test_a_student_that_does_not_take_the_condition_is_refused(image_caches, tmp_path):
    _, cache = image_caches["i2v"]
    with pytest.raises(UserError, match="in_channels 16 but the cache's teacher takes 36"):
        train(cache, tmp_path / "run", student_config(tmp_path, 16, 16), max_steps=1)


@pytest.mark.parametrize("variant", ["i2v", "ti2v"])
def test_the_teachers_own_transformer_scores_zero_with_the_cached_condition(variant, image_caches, tmp_path):
    """eval's inputs are the teacher's: its first transformer, given each trajectory's condition, predicts the cached
    targets of the steps it ran (Wan2.2-I2V's high-noise expert: the first two of four), and on the one-transformer
    TI2V cache it samples the cached final latents, latent frame 0 the image's."""
    teacher, cache = image_caches[variant]
    _, rep = evaluate(teacher / "transformer", cache, tmp_path / "eval.json")
    ran = [r for r in rep["velocity_mse"]["per_step"] if r["expert"] == 1]
    assert len(ran) == (2 if variant == "i2v" else 4)
    assert all(r["student"] < 1e-10 < r["untrained"] for r in ran), ran
    if variant == "ti2v":
        assert rep["final_latent_mse"]["student"] < 1e-10
        assert all(v == 0 for v in rep["final_latent_mse"]["first_frame"].values())


class FrameZero(torch.nn.Module):
    """A transformer stand-in: its input's first 4 channels (the noisy latent's) scaled, plus `bias` on latent frame 0
    of its prediction."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.bias = torch.nn.Parameter(torch.zeros(()))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        out = hidden_states[:, :4] * self.scale
        return (torch.cat([out[:, :, :1] + self.bias, out[:, :, 1:]], dim=2),)


@pytest.mark.parametrize("condition", [FIRST_FRAME, CONCAT, NONE])
def test_the_loss_ignores_latent_frame_0_only_under_a_first_frame_condition(condition):
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    fields = {F.T_X_T: x, F.T_TARGET: target}
    if condition != NONE:
        fields[F.T_CONDITION] = torch.randn(2, 4, 1 if condition == FIRST_FRAME else 3, 4, 4, generator=g)
    batch = Batch(fields, torch.tensor([500.0, 250.0]), torch.zeros(2, 3, 8), torch.ones(2),
                  rule=InputRule((1, 2, 2), condition == FIRST_FRAME, condition))
    model = FrameZero()

    def loss(bias: float) -> torch.Tensor:
        with torch.no_grad():
            model.bias.fill_(bias)
        return Velocity().loss(model, batch, contextlib.nullcontext)[0]

    moved = not torch.equal(loss(0.0), loss(3.0))
    assert moved == (condition != FIRST_FRAME)
    model.zero_grad()
    loss(1.0).sum().backward()
    assert (float(model.bias.grad) != 0) == (condition != FIRST_FRAME) and float(model.scale.grad) != 0
    if condition == FIRST_FRAME:  # the distance of frames 1 and 2 alone, their mean
        pred = torch.cat([fields[F.T_CONDITION][:, :, :1], x[:, :, 1:]], dim=2) * 0.5
        expect = (pred[:, :, 1:] - target[:, :, 1:]).pow(2).flatten(1).mean(1)
        assert torch.allclose(loss(0.0), expect)


def test_a_ti2v_image_cache_of_one_latent_frame_is_refused(image_caches, tmp_path):
    teacher, _ = image_caches["ti2v"]
    cache = make_cache(teacher, None, tmp_path / "one", images=str(image_list(tmp_path / "images")), guidance=1.0)
    with pytest.raises(UserError, match="one latent frame, which sampling takes from the image whole"):
        train(cache, tmp_path / "run", student_config(tmp_path, 48, 48), max_steps=1)
