"""What stage two costs before it runs, and either stage on another GPU: the FLOP model of a training sample
(pipeline/flops.py) counted by hand, the table of GPU peaks it is priced on, `plan`'s stage-two line and
`train-student --dry-run`'s projected GPU-hours, and the measured CPU run that checks the model
(bench/train_flops.py)."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from conftest import ROOT
from hub_cache import A14B_CONFIGS
from pipeline import flops
from pipeline.cli import main
from pipeline.registries import LORA_TARGETS

A14B_EXPERT = json.loads((A14B_CONFIGS / "transformer" / "config.json").read_text())
TARGETS = tuple(LORA_TARGETS.split(","))
TINY_STUDENT = ROOT / "configs" / "student-tiny.json"
# 81 frames at 480x832 for 10,000 prompts, --record-steps 8 on 8 GPUs of 80 GiB: the LoRA recipe of docs/lora.md
A14B_81 = ("plan", "--teacher", A14B_CONFIGS, "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--frames", "81",
           "--prompts", "10000", "--record-steps", "8", "--train-epochs", "2")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_a_training_sample_counted_by_hand():
    """One block of width 4 (2 heads of 2), ffn 8, over 3 latent and 2 text tokens, in multiply-adds x 2."""
    c = {"num_attention_heads": 2, "attention_head_dim": 2, "num_layers": 1, "ffn_dim": 8}
    latent = 3 * (6 * 16 + 2 * 4 * 8)  # q, k, v, o and cross q, o: 6 d^2 a token; the FFN: 2 d ffn
    text = 2 * 2 * 16  # cross-attention's k, v on the text
    attention = 2 * 3 * 3 * 4 + 2 * 3 * 2 * 4  # QK^T and AV over the latent tokens, then over the text
    forward = 2 * (latent + text + attention)
    compact = flops.train_flops(c, 3, 2)
    assert compact == {"forward": forward, "backward": 2 * forward, "recompute": 0, "total": 3 * forward}
    checkpointed = flops.train_flops(c, 3, 2, checkpointing=True)
    assert checkpointed["recompute"] == forward and checkpointed["total"] == 4 * forward
    # a frozen base: dX alone, and none for the text's k, v nor the first block's q, k, v; rank-1 adapters on q, k
    # (attn1 and attn2: q on the latent tokens twice, k on the latent and the text tokens), (in + out) a token
    adapters = 2 * 1 * (2 * 3 * 8 + (3 + 2) * 8)
    lora = flops.train_flops(c, 3, 2, adapter_rank=1, adapter_targets=("to_q", "to_k", "not_a_layer"))
    dx = 2 * (latent - 3 * 3 * 16)
    assert lora["forward"] == forward + adapters
    assert lora["backward"] == dx + 2 * 2 * attention + 2 * adapters
    # the adversarial term's discriminator: 3 sequences trained (3x a forward each), 1 frozen whose dX reaches the fake
    adversarial = flops.train_flops(c, 3, 2, discriminator=True)
    assert adversarial["discriminator"] == 9 * forward + forward + 2 * latent + 2 * 2 * attention
    # the step of stage one is the same forward, twice under CFG
    assert flops.step_flops(c, 3, 2)["total"] == 2 * forward


def test_an_a14b_expert_lora_at_81_frames():
    lora = flops.train_flops(A14B_EXPERT, 32760, 512, adapter_rank=16, adapter_targets=TARGETS, checkpointing=True)
    step = flops.step_flops(A14B_EXPERT, 32760)
    assert lora["forward"] == pytest.approx(step["total"] / 2, rel=0.003)  # one sequence, plus adapters (0.25%)
    assert lora["total"] / lora["forward"] == pytest.approx(3.53, abs=0.01)  # fwd + recompute + dX + 2x attention
    assert flops.seconds(lora["total"], flops.gpu()) == pytest.approx(14.10, abs=0.01)


def test_the_gpu_table_scales_by_peak_at_the_calibrated_efficiency():
    assert flops.EFFICIENCY == pytest.approx(0.4256, abs=1e-4)  # the table's 0.20 s of 8.42e13 FLOP on 989
    h100, rtx = flops.gpu(), flops.gpu("rtx-4090")
    assert (h100.name, h100.tflops, rtx.name, rtx.tflops) == ("H100", 989, "RTX 4090", 165)
    seconds, source = flops.teacher_step_seconds(A14B_EXPERT, 1560)
    assert seconds == pytest.approx(0.20) and "H100: 989 TFLOPS dense bf16" in source and "x 43%" in source
    slow, source = flops.teacher_step_seconds(A14B_EXPERT, 1560, 512, "RTX 4090")
    assert slow / seconds == pytest.approx(989 / 165) and "5.99x the H100's time" in source
    custom = flops.gpu(tflops=500)
    assert custom.tflops == 500 and flops.seconds(1e15, custom) == pytest.approx(1e15 / (500e12 * flops.EFFICIENCY))
    assert "calibrated at width 5120" in flops.teacher_step_seconds(A14B_EXPERT | {"num_attention_heads": 12}, 1560)[1]
    names = {"NVIDIA GeForce RTX 4090": "RTX 4090", "NVIDIA H100 80GB HBM3": "H100", "NVIDIA H100 PCIe": "H100 PCIe",
             "NVIDIA A100-SXM4-80GB": "A100", "NVIDIA L40S": "L40S", "NVIDIA L40": None, "NVIDIA A10": "A10",
             "NVIDIA RTX 6000 Ada Generation": "RTX 6000 Ada", "NVIDIA H200": "H200", "Tesla T4": None}
    assert {n: flops.detected_gpu(n) for n in names} == names


def test_the_narrow_student_check_is_the_measured_h200_row():
    rows = {r["name"]: r for r in json.loads((ROOT / "bench" / "results-cuda.json").read_text())}
    shape, tokens, text, rate, on = flops.NARROW_CHECK
    assert round(rows["loader_vs_h100_student"]["baseline"], 2) == rate and "H200" in (
        ROOT / "docs" / "benchmarks.md").read_text()
    student = json.loads((ROOT / "configs" / "student-1.3b.json").read_text())
    assert {k: student[k] for k in shape} == shape and (tokens, text, on) == (1560, 512, "H200")
    assert "trained at 25% of an H200's" in flops.width_note(student)


def test_plan_refuses_a_gpu_it_does_not_know_in_one_line():
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--gpu", "GTX 1080")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "gpu must be one of H100, H100 PCIe, H200, B200, A100, L40S" in r.output and "RTX 4090" in r.output
    assert "--gpu-tflops N for another GPU, got 'GTX 1080'" in r.output
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--gpu", "H100", "--gpu-tflops", "100")
    assert r.exit_code == 2 and "gpu and gpu-tflops both name the GPU: drop one" in r.output
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--gpu", "h200", "--measure")
    assert r.exit_code == 2 and "measure times a step on this machine's own GPU, and --gpu prices another" in r.output


def test_plan_prices_both_stages_on_h100_and_on_a_4090():
    """The must-show figures of docs/costs.md: A14B at 81 frames, 10,000 prompts; the 4090's step times are the
    H100's x 989 / 165 (the same efficiency at another peak)."""
    h100 = json.loads(invoke(*A14B_81, "--json").output)
    rtx = json.loads(invoke(*A14B_81, "--gpu", "rtx4090", "--json").output)
    assert h100["time"]["gpu_hours"] == pytest.approx(886.1, abs=0.05)  # as before --gpu: 7.97 s a step
    assert rtx["time"]["step_s"] / h100["time"]["step_s"] == pytest.approx(989 / 165)
    assert "on RTX 4090: 165 TFLOPS dense bf16" in rtx["time"]["step_source"]
    two, four = h100["train"], rtx["train"]
    assert two["student"].startswith("a rank-16 LoRA of the teacher's 2 experts") and two["gradient_checkpointing"]
    assert (two["samples_per_epoch"], two["epochs"], two["gpus"]) == (80_000, 2, 8)
    assert two["gpu_hours"] == pytest.approx(626.9, abs=0.05) and two["wall_h"] == two["gpu_hours"] / 8
    assert four["sample_s"] / two["sample_s"] == pytest.approx(989 / 165) and four["gpu"] == "RTX 4090"
    text = invoke(*A14B_81, "--gpu", "RTX 4090").output
    assert re.search(r"^stage two   a rank-16 LoRA of the teacher's 2 experts .*: 80,000 samples x 2 epoch\(s\) x "
                     r"5\.94e15 FLOP \(forward \+ backward \+ the recompute of gradient checkpointing\) = 84\.5 s a "
                     r"sample = 3,757\.7 GPU-hours; 19\.6 days wall on 8 GPUs$", text, flags=re.M), text
    assert "sample time: FLOP model (forward 1.68e15, backward 2.57e15, recompute 1.68e15 FLOP" in text
    assert "x 43% (the efficiency the table of docs/costs.md reaches on H100's 989), 5.99x the H100's time" in text


def test_plan_prices_a_compact_student_and_says_its_width_is_off_the_calibration():
    r = invoke("plan", "--teacher", A14B_CONFIGS, "--gpus-per-node", "1", "--gpu-memory", "80GiB", "--prompts", "100",
               "--student-config", ROOT / "configs" / "student-1.3b.json", "--no-gradient-checkpointing", "--json")
    t = json.loads(r.output)["train"]
    assert t["student"].endswith("student-1.3b.json") and t["samples_per_epoch"] == 100 * 40
    assert t["flops_per_sample"]["total"] == flops.train_flops(
        json.loads((ROOT / "configs" / "student-1.3b.json").read_text()), 1560, 512)["total"]
    assert "calibrated at width 5120" in t["source"]


def test_a_dry_run_prices_its_run_by_the_flop_model(tiny_cache, tmp_path):
    common = ("train-student", "--cache", tiny_cache, "--out", tmp_path / "never", "--batch-size", "4", "--epochs",
              "2", "--num-workers", "0", "--device", "cpu", "--dry-run")
    r = invoke(*common, "--student-config", TINY_STUDENT, "--gpu", "l40s")
    assert r.exit_code == 0, r.output
    student = json.loads(TINY_STUDENT.read_text())
    per = flops.train_flops(student, 16, 32)  # the tiny cache: 16x1x16x16 latents, patch 4: 16 tokens; 32 text
    seconds = flops.seconds(per["total"], flops.gpu("L40S"))
    line = re.search(r"^FLOP model  (.*)$", r.output, flags=re.M).group(1)
    assert line.startswith(f"{flops.flop(per['total'])} FLOP a sample (forward {flops.flop(per['forward'])}")
    assert f"{seconds:.3g} s a sample on L40S, the run's 56 samples" in line and "wall on 1 GPU" in line
    assert "at L40S: 362 TFLOPS dense bf16" in r.output
    r = invoke(*common, "--student-config", TINY_STUDENT, "--gradient-checkpointing")
    assert re.search(r"recompute [\d.e]+\): [\d.e-]+ s a sample on H100", r.output), r.output  # no CUDA: H100


def test_the_gpu_table_is_the_one_docs_costs_shows():
    rows = re.findall(r"^\| ([\w ]+) \| ([\d.]+) \| ([^|]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      (ROOT / "docs" / "costs.md").read_text(), flags=re.M)
    assert [r[0] for r in rows] == [g.name for g in flops.GPUS]
    lora = flops.train_flops(A14B_EXPERT, 32760, 512, adapter_rank=16, adapter_targets=TARGETS, checkpointing=True)
    for (name, tflops, source, step, sample), g in zip(rows, flops.GPUS):
        assert (float(tflops), source.strip()) == (g.tflops, g.source)
        assert step == f"{flops.teacher_step_seconds(A14B_EXPERT, 32760, 512, g)[0]:.2f}"
        assert sample == f"{flops.seconds(lora['total'], g):.1f}"


def test_both_stages_of_the_recipe_are_what_docs_costs_shows():
    rows = re.findall(r"^\| (H100|RTX 4090) \| ([\d.]+) \| ([\d,.]+) \| ([\d.]+) \| ([\d,.]+) \| ([^|]+) \|$",
                      (ROOT / "docs" / "costs.md").read_text(), flags=re.M)
    assert [r[0] for r in rows] == ["H100", "RTX 4090"]
    for gpu, step, hours, sample, train_hours, wall in rows:
        text = invoke(*A14B_81, "--gpu", gpu).output
        assert f"teacher steps x {step} s = {hours} GPU-hours; {wall.split(' + ')[0]} wall on 8 GPUs" in text
        assert f"= {sample} s a sample = {train_hours} GPU-hours; {wall.split(' + ')[1].strip()} wall on 8 GPUs" in text


@pytest.mark.parametrize("name", ["train_flops_compact", "train_flops_lora"])
def test_the_training_flop_model_predicts_steps_timed_here(name):
    """bench/train_flops.py's recorded run (docs/costs.md): calibrated by the compact student at 780 tokens, the model's
    prediction of the compact student and of the LoRA'd transformer with gradient checkpointing at 2,340."""
    row = next(r for r in json.loads((ROOT / "bench" / "results.json").read_text()) if r["name"] == name)
    assert "calibrated by the compact student at 5x240x416 (780 tokens" in row["note"] and "2,340 tokens" in row["note"]
    assert abs(row["ratio"] - 1) <= 0.15
    text = (ROOT / "docs" / "costs.md").read_text()
    shown = {"train_flops_compact": "the compact student at 9x480x416", "train_flops_lora": "gradient checkpointing"}
    assert f"{shown[name]} ({row['baseline']:.3f} s measured, {row['value']:.3f} s predicted: " \
           f"{row['ratio'] - 1:+.1%})" in text
