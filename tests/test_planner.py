"""The placement planner: sizes from configs alone, and its decision on made-up machines."""

from __future__ import annotations

import json
from pathlib import Path

import re

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import RunShape
from pipeline.errors import UserError
from stages.teacher_cache import placement_choice, placements
from stages.teacher_cache.placements.device_map import device_map_for, map_bytes
from stages.teacher_cache.plan_report import make_plan
from stages.teacher_cache.placement_choice import GiB, Inventory, Needs, decide

A14B = Path(__file__).parent / "data" / "wan22-a14b-configs"
# Wan-AI/Wan2.2-T2V-A14B-Diffusers: transformer/diffusion_pytorch_model.safetensors.index.json lists
# metadata.total_size = 57,153,966,336 bytes of float32 tensors per expert, i.e. 14,288,491,584 parameters.
A14B_EXPERT_PARAMS = 57_153_966_336 // 4


@pytest.fixture(scope="module")
def a14b_bf16():
    return placement_choice.teacher_sizes(A14B, "bfloat16")


@pytest.fixture(scope="module")
def a14b_needs(a14b_bf16):
    act = placement_choice.activation_bytes(a14b_bf16, RunShape())
    return Needs.of(a14b_bf16, act)


def test_a14b_sizes_from_configs_alone(a14b_bf16):
    assert not list(A14B.rglob("*.safetensors"))  # configs only
    s = a14b_bf16
    assert s.experts == ("transformer", "transformer_2")
    for e in s.experts:
        c = s.components[e]
        assert abs(c.params - A14B_EXPERT_PARAMS) / A14B_EXPERT_PARAMS < 0.01
        assert c.params == A14B_EXPERT_PARAMS  # exact, in fact
        assert c.blocks == 40 and c.checkpoint_bytes is None
        # bfloat16, but the modules diffusers keeps in float32 (norms, time embedder, modulation) are counted so
        assert 2 * c.params < c.bytes < 2.01 * c.params
        assert c.blocks * c.block_bytes < c.bytes
    # umt5-xxl encoder: the embedding is shared with the encoder stack (counted once), 5.68 B parameters
    assert s.components["text_encoder"].params == 5_680_910_336
    assert 120e6 < s.components["vae"].params < 135e6
    assert placement_choice.tokens_per_sample(s, 480, 832, 1) == 30 * 52


def _inv(gpus=(), ram=0, disk=0, ranks=1):
    return Inventory(tuple(int(g * GiB) for g in gpus), (), int(ram * GiB), int(disk * GiB), ranks, "assumed")


@pytest.mark.parametrize("inv, placement, order", [
    (_inv([80], 256, 2000), "cuda", "step"),  # both experts (53 GiB) fit an 80 GB GPU
    (_inv([48], 256, 2000), "cuda", "expert"),  # one expert fits a 48 GB GPU, both do not
    (_inv([24] * 4, 256, 2000), "balanced", "step"),  # 4 x 24 GB hold both, no block split
    (_inv([24] * 2, 256, 2000), "balanced", "expert"),  # 2 x 24 GB hold one expert at a time
    (_inv([16] * 2, 256, 2000), "offload", "step"),  # GPUs too small: weights in RAM, blocks streamed
    (_inv([16], 48, 2000), "offload", "expert"),  # RAM holds one expert
    (_inv([16], 16, 2000), "disk", "step"),  # RAM holds no expert
    (_inv([24] * 4, 256, 2000, ranks=4), "offload", "step"),  # torchrun: never balanced; RAM split 4 ways
    (_inv([24] * 4, 100, 2000, ranks=4), "disk", "step"),
    (_inv([80] * 8, 256, 2000, ranks=8), "cuda", "step"),  # one replica per GPU
])
def test_decide_on_made_up_machines(a14b_needs, inv, placement, order):
    d = decide(a14b_needs, inv)
    assert (d.placement, d.expert_order) == (placement, order), d.reasons
    assert d.reasons


@pytest.fixture(scope="module")
def a14b_fp32_needs():
    s = placement_choice.teacher_sizes(A14B, "float32")
    return Needs.of(s, placement_choice.activation_bytes(s, RunShape()))


@pytest.mark.parametrize("ram, placement, order", [(256, "cpu", "step"), (128, "cpu", "expert"), (32, "disk", "step")])
def test_decide_without_gpu(a14b_fp32_needs, ram, placement, order):
    d = decide(a14b_fp32_needs, _inv([], ram, 2000))
    assert (d.placement, d.expert_order) == (placement, order), d.reasons


def test_decide_refuses_when_nothing_fits(a14b_needs):
    with pytest.raises(UserError, match="fits nowhere"):
        decide(a14b_needs, _inv([8], 16, 20))


def test_decide_is_pure(a14b_needs):
    inv = _inv([24] * 4, 256, 2000)
    assert decide(a14b_needs, inv) == decide(a14b_needs, inv)


def test_expert_order_for_explicit_placements(a14b_needs):
    order = lambda name, inv: placements.get(name).expert_order(a14b_needs, inv)  # noqa: E731
    assert order("cuda", _inv([80], 256, 0)) == "step"
    assert order("cuda", _inv([40], 256, 0)) == "expert"
    assert order("offload", _inv([24], 40, 0)) == "expert"
    assert order("disk", _inv([24], 1, 0)) == "step"


def test_balanced_map_never_splits_a_block(a14b_needs):
    import torch

    from stages.teacher_cache.group_offload import meta_transformer

    model = meta_transformer(A14B, "transformer", real_buffers=False)
    cap = 20 * GiB
    dmap = device_map_for(model, True, {0: cap, 1: cap, 2: cap, 3: cap, "cpu": 100 * GiB}, torch.bfloat16)
    assert all(not k.startswith("blocks.") or k.count(".") == 1 for k in dmap), "a WanTransformerBlock was split"
    per_dev = map_bytes(model, dmap, torch.bfloat16)
    assert set(per_dev) == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}
    assert sum(per_dev.values()) == a14b_needs.experts[0]
    assert max(per_dev.values()) < 1.5 * min(per_dev.values())  # balanced, not filled in order


def test_plan_reports_layout(a14b_bf16):
    p = make_plan(str(A14B), "offload", RunShape(dtype="bfloat16"), inventory=_inv([24], 256, 2000))
    comps = {c["name"]: c for c in p.components}
    one = comps["transformer"]["bytes"]
    assert p.placement == "offload" and p.expert_order == "step"
    assert p.streamed_bytes_per_step == one
    assert p.resident_bytes["cpu"] == 2 * one
    # leaf-level streaming: the layer computing and the one prefetched, the largest being the time projection
    # (dim -> 6 x dim, bf16), + activations; not a block (0.65 GiB) or the whole rest (0.49 GiB)
    layer = 2 * (5120 * 6 * 5120 + 6 * 5120)
    assert a14b_bf16.components["transformer"].layer_bytes == layer
    assert p.resident_bytes["cuda:0"] == 2 * layer + p.activations_bytes
    assert "one layer at a time on cuda:0" in comps["transformer"]["where"]
    assert "not loaded in stage one" in comps["vae"]["where"]
    d = make_plan(str(A14B), "disk", RunShape(dtype="bfloat16"), inventory=_inv([], 64, 2000))
    assert d.resident_bytes["cpu"] < 4 * GiB and d.resident_bytes["disk"] == 2 * one


def test_plan_cli_json_on_config_only_folder():
    res = CliRunner().invoke(main, ["plan", "--teacher", str(A14B), "--assume-gpus", "1x80GiB", "--assume-ram",
                                    "256GiB", "--assume-disk", "2TiB", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    p = json.loads(res.output)
    assert p["placement"] == "cuda" and p["expert_order"] == "step" and p["dtype"] == "bfloat16"
    assert {c["name"] for c in p["components"]} == {"text_encoder", "transformer", "transformer_2", "vae"}
    assert p["decision"] and p["activations_bytes"] > 0


def test_plan_cli_text_on_tiny_teacher(tiny_teacher):
    res = CliRunner().invoke(main, ["plan", "--teacher", str(tiny_teacher), "--assume-gpus", "none",
                                    "--batch-size", "2", "--height", "64", "--width", "64"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "placement   cpu (step-major order), picked by auto" in res.output
    assert "checkpoint on disk" in res.output  # safetensors headers read when weights are there


def test_plan_counts_a_video_runs_frames(tiny_teacher):
    """--frames 9: the run line gives the decoded and the latent frames (the tiny VAE's 4x in time), the JSON its
    latent_frames; an image run's line and JSON as they were."""
    def plan(*extra):
        res = CliRunner().invoke(main, ["plan", "--teacher", str(tiny_teacher), "--assume-gpus", "none",
                                        "--batch-size", "2", "--height", "64", "--width", "64", *extra],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res.output

    assert "run         dtype float32, batch 2 x 64x64, 9 frames (3 latent), 48 tokens per sample, CFG doubles" \
        in plan("--frames", "9")
    assert json.loads(plan("--frames", "9", "--json"))["latent_frames"] == 3
    assert "batch 2 x 64x64x1 (16 tokens per sample, CFG doubles the forward batch)" in plan()
    assert "latent_frames" not in json.loads(plan("--json"))


def test_sizes_and_gpus_parse():
    assert placement_choice.parse_size("24GiB") == 24 * GiB and placement_choice.parse_size("80GB") == 80 * 10**9
    assert placement_choice.parse_size("2TiB") == 2 * 2**40 and placement_choice.parse_size("1.5GiB") == int(1.5 * GiB)
    with pytest.raises(UserError, match="cannot read the size"):
        placement_choice.parse_size("big")
    assert placement_choice._parse_gpus("4x24GiB") == (24 * GiB,) * 4
    assert placement_choice._parse_gpus("80GiB,40GiB") == (80 * GiB, 40 * GiB)
    assert placement_choice._parse_gpus("none") == ()


# -- a layout that does not fit prints no command; a smaller batch before streaming ---------------------------------

TI2V_5B = Path(__file__).parent / "data" / "wan22-ti2v-5b-configs"  # Wan2.2-TI2V-5B-Diffusers' configs, no weights
CONFIGS = Path(__file__).parents[1] / "configs"


def _plan(*args):
    return CliRunner().invoke(main, ["plan", *map(str, args)], catch_exceptions=False)


def test_auto_takes_a_smaller_batch_on_cuda_before_streaming():
    """TI2V-5B at 704x1280x121 on one 24 GiB GPU: batch 4's activations (27 GiB) fit no placement there, batch 1
    fits whole on cuda: plan's command says --batch-size 1; a run's auto keeps the user's batch and names it."""
    ti2v = placement_choice.teacher_sizes(TI2V_5B, "bfloat16")
    shape = RunShape(height=704, width=1280, frames=121, batch_size=4)
    needs = Needs.of(ti2v, placement_choice.activation_bytes(ti2v, shape), 4)
    inv = _inv([24], 64, 2000)
    d = decide(needs, inv, smaller_batches=True)
    assert (d.placement, d.batch_size) == ("cuda", 1), d.reasons
    assert "batch 4 fits no placement on this GPU (20.58 GiB usable): batch 1 does on cuda" in d.reasons[-1]
    with pytest.raises(UserError, match="fits nowhere.*--batch-size 1 fits on placement cuda"):
        decide(needs, inv)  # (the run: its --batch-size is the user's)
    r = _plan("--teacher", TI2V_5B, "--assume-gpus", "1x24GiB", "--assume-ram", "64GiB", "--height", "704",
              "--width", "1280", "--frames", "121")
    assert r.exit_code == 0, r.output
    assert "batch 1 x 704x1280, 121 frames (31 latent), 27280 tokens per sample" in r.output
    assert "the command uses --batch-size 1" in r.output and "--placement cuda" in r.output
    assert "--frames 121 --batch-size 1" in re.sub(r" \\\n +", " ", r.output)  # (wherever the clone's path wraps it)
    # A14B on a 32 GiB card: batch 4 fits only streamed (offload); one expert + batch 2's activations fit cuda
    a14b = placement_choice.teacher_sizes(A14B, "bfloat16")
    d = decide(Needs.of(a14b, placement_choice.activation_bytes(a14b, RunShape()), 4), _inv([32], 256, 2000), True)
    assert (d.placement, d.expert_order, d.batch_size) == ("cuda", "expert", 2), d.reasons
    assert "batch 4 fits only with the weights streamed (offload): batch 2 does on cuda" in d.reasons[-1]


def test_a_layout_that_does_not_fit_prints_no_command():
    """An explicit placement is held to the bounds auto keeps: disk at batch 4 needs 27.9 GiB of the 24 GiB GPU
    (two blocks + activations): no command, exit 2, the figures and the batch that fits; JSON says "fits": false."""
    args = ["--teacher", TI2V_5B, "--assume-gpus", "1x24GiB", "--assume-ram", "64GiB", "--height", "704", "--width",
            "1280", "--frames", "121", "--placement", "disk"]
    r = _plan(*args)
    assert r.exit_code == 2
    first = r.output.splitlines()[0]
    assert first.startswith("error: placement disk at batch 4: 27.94 GiB does not fit cuda:0 (20.58 GiB usable); "
                            "--batch-size 2 fits it; no command printed"), first
    assert "stage one   no command: placement disk at batch 4" in r.output and "teacher-cache" not in r.output
    assert "resident during the trajectory loop: disk 9.33 GiB; cpu 0.49 GiB; cuda:0 27.94 GiB" in r.output
    p = json.loads(_plan(*args, "--json").stdout)
    assert p["fits"] is False and p["unfit"] and p["placement"] == "disk"
    assert _plan(*args, "--batch-size", "2").exit_code == 0
    # an image run's JSON that fits keeps its keys as they were
    p = json.loads(_plan("--teacher", A14B, "--assume-gpus", "1x80GiB", "--assume-ram", "256GiB", "--json").stdout)
    assert "unfit" not in p and "fits" not in p


@pytest.mark.parametrize("config, teacher, tokens", [
    ("wan2.2-t2v-a14b-video.toml", A14B, ["batch 1 x 480x832, 81 frames (21 latent), 32760 tokens per sample",
                                          "40 steps", "--config configs/wan2.2-t2v-a14b-video.toml"]),
    ("wan2.2-ti2v-5b.toml", TI2V_5B, ["batch 1 x 704x1280, 121 frames (31 latent), 27280 tokens per sample",
                                      "50 steps", "--config configs/wan2.2-ti2v-5b.toml"]),
    ("wan2.2-t2v-a14b.toml", A14B, ["batch 4 x 480x832x1 (1560 tokens per sample", "40 steps",
                                    "frames 1: this cache trains an image student or LoRA of a video teacher",
                                    "pass --frames 81 (or configs/wan2.2-t2v-a14b-video.toml) for a video one"]),
])
def test_the_real_teachers_configs_plan(config, teacher, tokens, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # the printed command names the file as given
    r = _plan("--config", f"configs/{config}", "--teacher", teacher, "--gpus-per-node", "8", "--gpu-memory", "80GiB",
              "--prompts", "1000", "--step-time", "1")
    assert r.exit_code == 0, r.output
    for token in tokens:
        assert token in r.output, token
    assert ("frames 1:" in r.output) == (config == "wan2.2-t2v-a14b.toml")  # the note: one-frame caches alone
