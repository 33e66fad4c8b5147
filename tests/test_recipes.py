"""docs/architecture.md's "how to add" recipes, followed to the letter on a copy of the project, editing only the
files each recipe names, then run through the CLI: a placement, a cache field (and a toy objective with a setting of
its own that reads it: stage one records the field, `cache verify` checks it, stage two trains the objective from
it, `--help` shows the setting), an objective with a sampler of its own, and a strategy with capabilities of its
own. When a refactor moves what a recipe relies on, this test fails at the edit that no longer applies: change the
recipe and the edit here together.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY_CACHE_ARGS

pytestmark = pytest.mark.slow

# The files each recipe names (docs/architecture.md, "Extension points: how to add"), and what the toy adds to each:
# (file, the line it goes after, the lines added). A line added at the end of a file has anchor None.
CACHE_FIELD = [
    ("cache/format.py", None, 'T_X0 = "x0"  # toy field: x_t - sigma * target\n'),
    ("cache/schema.py", '    SampleField(F.T_X_T, "the noisy latent the teacher saw at this step", _latent),\n',
     '    SampleField(F.T_X0, "toy: the clean latent the step predicts", _latent, when="record_x0",\n'
     '                recorded_by="teacher-cache --record-x0"),\n'),
    ("pipeline/config.py",
     '    save_cond_uncond: bool = setting(False, help="Also store the conditional and unconditional predictions.")\n',
     '    record_x0: bool = setting(False, help="Toy: also store x_t - sigma * target.")\n'),
    ("cache/records.py", "    teacher_identity: dict  # hashes of the teacher's configs and weight files (fingerprinted)\n",
     "    record_x0: bool | None = optional()\n"),
    ("cache/records.py",
     "            cfg=schedule.cfg, save_cond_uncond=cfg.save_cond_uncond, **_features(cfg, teacher, latent),\n",
     "            record_x0=cfg.record_x0 or None,\n"),
    ("stages/teacher_cache/blocks.py",
     "                          (F.T_TARGET_UNCOND, rec.target_uncond), (F.T_FEATURES, rec.features)]\n",
     "                if self.prog.header.record_x0:\n"
     "                    fields.append((F.T_X0, rec.x_t - rec.sigma * rec.target))\n"),
]
OBJECTIVE = [
    ("pipeline/registries.py", None,
     '\n\n@OBJECTIVES.settings("toy-x0", "toy: learn the cached x0 field", impl=_OBJ + "ToyX0")\n'
     "@dataclass(frozen=True, kw_only=True)\n"
     "class ToyX0Settings:\n"
     '    x0_weight: float = setting(1.0, check=positive(), help="toy-x0: weight of its one term.")\n'),
    ("stages/train_student/objective_velocity.py", None,
     "\n\nfrom pipeline.registries import ToyX0Settings  # noqa: E402\n\n\n"
     "class ToyX0(Objective):\n"
     '    """Toy: the prediction against the cached x0 field, weighted by its own setting."""\n\n'
     "    Config = ToyX0Settings\n"
     "    fields = (F.T_X_T, F.T_X0)\n\n"
     "    def terms(self, out, batch, heads):\n"
     '        return {"x0": self.settings["x0_weight"] * mse(out.prediction, batch.fields[F.T_X0])}\n'),
]


def follow(repo: Path, recipe) -> set[str]:
    touched = set()
    for rel, anchor, added in recipe:
        path = repo / rel
        text = path.read_text()
        if anchor is None:
            text += added
        else:
            assert text.count(anchor) == 1, f"{rel}: the recipe's anchor is gone or ambiguous: {anchor!r}"
            text = text.replace(anchor, anchor + added)
        path.write_text(text)
        touched.add(rel)
    return touched


def test_a_cache_field_recipe_is_recorded_verified_planned_and_read_by_a_toy_objective(tiny_teacher, prompts_file,
                                                                                        tmp_path):
    repo = _applied(tmp_path, CACHE_FIELD + OBJECTIVE)
    cli = _cli_in(repo)
    cache, run = tmp_path / "cache", tmp_path / "run"
    cli("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", cache, "--placement", "cpu",
        "--record-x0", *_tiny_flags())
    manifest = json.loads((cache / "manifest.json").read_text())
    assert "x0" in manifest["sample_fields"] and manifest["record_x0"] is True
    cli("cache", "verify", cache)

    def planned(*extra):  # `plan` counts the field's bytes
        return json.loads(cli("plan", "--teacher", tiny_teacher, "--placement", "cpu", "--prompts", 7,
                              *_tiny_flags(plan=True), *extra, "--json"))["cache"]

    plain, with_x0 = planned(), planned("--record-x0")
    c, f, h, w = manifest["latent_shape"]
    assert with_x0["sample_bytes"] - plain["sample_bytes"] >= c * f * h * w * 4  # one more float32 latent

    assert "--x0-weight FLOAT" in cli("train-student", "--help")
    cli("train-student", "--cache", cache, "--student-config", repo / "configs" / "student-tiny.json", "--out", run,
        "--objective", "toy-x0", "--x0-weight", 0.5, "--max-steps", 2, "--batch-size", 4, "--num-workers", 0,
        "--warmup-steps", 0, "--checkpoint-every", 0, "--log-every", 1, "--device", "cpu", "--report-to", "none")
    distill = json.loads((run / "distill.json").read_text())
    assert distill["objective"] == "toy-x0" and distill["objective_settings"] == {"x0_weight": 0.5}
    losses = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if r["type"] == "train"] == [1, 2]
    assert all(0 < r["loss"] < float("inf") for r in losses if r["type"] == "train")


# --- the placement recipe (docs/placements.md, "How to add a placement") -----------------------------------------

TOY_PLACEMENT_MODULE = '''"""Toy: a whole replica in RAM, computed on the CPU (as `cpu`)."""

from __future__ import annotations

from .base import ENCODER_FREED, Layout, PlacementKind, PlanInput


class Toy(PlacementKind):  # loads each expert whole on the execution device: PlacementKind's own load_expert
    def layout(self, x: PlanInput) -> Layout:
        where = {"text_encoder": f"cpu, {ENCODER_FREED}"} | {e: "cpu (toy)" for e in x.sizes.experts}
        return Layout(where, {"cpu": x.resident_experts + x.needs.activations})
'''
PLACEMENT = [
    ("stages/teacher_cache/placements/toy.py", None, TOY_PLACEMENT_MODULE),
    ("pipeline/registries.py", None,
     '\nPLACEMENTS.declare("toy", "toy: RAM, computed on the CPU", caps=PlacementCaps(auto=False),\n'
     '                   impl="stages.teacher_cache.placements.toy:Toy")\n'),
]


def _copy_project(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for top in ("pipeline", "cache", "stages", "configs"):
        shutil.copytree(ROOT / top, repo / top, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def _applied(tmp_path: Path, recipe, new_module: bool = False) -> Path:
    """A copy of the project with `recipe` applied (its first file a new module if `new_module`); the recipe must
    touch exactly its own files."""
    repo = _copy_project(tmp_path)
    if new_module:
        (repo / recipe[0][0]).write_text("")
    assert follow(repo, recipe) == {rel for rel, _, _ in recipe}
    return repo


def _cli_in(repo: Path):
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return r.stdout

    return cli


def _tiny_flags(plan: bool = False) -> list[str]:
    """The tiny run's flags; `plan` takes the run's own (not the negative prompt, nor the shard size)."""
    own = ("negative_prompt", "samples_per_shard") if plan else ()
    return [x for k, v in TINY_CACHE_ARGS.items() if k not in own for x in (f"--{k.replace('_', '-')}", v)]


def test_a_placement_recipe(tiny_teacher, tiny_cache, prompts_file, tmp_path):
    repo = _applied(tmp_path, PLACEMENT, new_module=True)
    cli = _cli_in(repo)

    assert "| disk | toy | a device-map .json" in " ".join(cli("teacher-cache", "--help").split())
    cache = tmp_path / "cache"
    cli("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", cache, "--placement", "toy",
        *_tiny_flags())
    from cache import format as F

    ours, cpu = (json.loads((c / F.MANIFEST).read_text()) for c in (cache, tiny_cache))
    assert ours["fingerprint"] == cpu["fingerprint"] and ours["samples"] == cpu["samples"]  # the cpu cache

    resolved = json.loads((cache / F.PARTS_DIR / F.part_dirname(0) / F.RESOLVED_CONFIG).read_text())
    assert resolved["placement"] == "toy"

    plan = json.loads(cli("plan", "--teacher", tiny_teacher, "--placement", "toy", "--prompts", 7,
                          *_tiny_flags(plan=True), "--json"))
    assert plan["placement"] == "toy" and plan["launch"]["placement"] == "toy"
    assert {c["where"] for c in plan["components"] if c["name"].startswith("transformer")} == {"cpu (toy)"}
    assert plan["launch"]["gpus_per_rank"] == 0  # the launch read its capabilities: no GPU
    assert "--placement toy" in plan["launch"]["commands"][0]["command"]


# --- the objective and strategy recipes (docs/architecture.md, "An objective", "A strategy") ----------------

def run_cli(repo: Path, *args, code: int = 0) -> str:
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == code, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


def train_args(repo: Path, cache: Path, run: Path, *more) -> list:
    return ["train-student", "--cache", cache, "--student-config", repo / "configs" / "student-tiny.json", "--out",
            run, "--max-steps", 2, "--batch-size", 4, "--num-workers", 0, "--warmup-steps", 0, "--log-every", 1,
            "--device", "cpu", "--report-to", "none", *more]


# An objective with a sampler of its own (docs/architecture.md, "An objective"): its declaration names its
# implementation and its sampler (a capability), the implementation, and the sampler in pipeline/sampling.py.
OWN_SAMPLER = [
    ("pipeline/registries.py", None,
     '\n\n@OBJECTIVES.settings("toy-flow", "toy: velocity, sampled by its own sampler", impl=_OBJ + "ToyFlow",\n'
     '                     caps=ObjectiveCaps(sampler="toy-flow-euler"))\n'
     "@dataclass(frozen=True, kw_only=True)\n"
     "class ToyFlowSettings:\n"
     '    toy_weight: float = setting(1.0, check=positive(), help="toy-flow: weight of its one term.")\n'),
    ("stages/train_student/objective_velocity.py", None,
     "\n\nfrom pipeline.registries import ToyFlowSettings  # noqa: E402\n\n\n"
     "class ToyFlow(Objective):\n"
     '    """Toy: the velocity loss, weighted by its own setting; sampled by FlowMatchEuler."""\n\n'
     "    Config = ToyFlowSettings\n"
     "    fields = (F.T_X_T, F.T_TARGET)\n\n"
     "    def terms(self, out, batch, heads):\n"
     '        return {"velocity": self.settings["toy_weight"] * mse(out.prediction, batch.fields[F.T_TARGET])}\n'),
    ("pipeline/sampling.py", None,
     '\n\nSAMPLERS["toy-flow-euler"] = lambda conf: {"_class_name": FLOW_EULER, "num_train_timesteps": 1000}\n'),
]


def test_an_objective_recipe(tiny_cache, tmp_path):
    repo, run = _applied(tmp_path, OWN_SAMPLER), tmp_path / "run"
    assert "--toy-weight FLOAT" in run_cli(repo, "train-student", "--help")  # its setting, a flag of the stage
    run_cli(repo, *train_args(repo, tiny_cache, run, "--objective", "toy-flow", "--toy-weight", 0.5,
                              "--checkpoint-every", 0))
    distill = json.loads((run / "distill.json").read_text())
    assert distill["objective"] == "toy-flow"
    assert distill["objective_settings"] == {"toy_weight": 0.5, "sampler": "toy-flow-euler"}
    probe = ("import json, sys; from pipeline.sampling import student_scheduler; "
             "print(type(student_scheduler(json.load(open(sys.argv[1])))).__name__)")
    r = subprocess.run([sys.executable, "-c", probe, run / "distill.json"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(repo)), timeout=300)
    assert r.stdout.strip() == "FlowMatchEulerDiscreteScheduler", r.stderr[-2000:]


# A strategy (docs/architecture.md, "A strategy"): DDP under another name, declared with capabilities of its own.
STRATEGY = [
    ("pipeline/registries.py", None,
     '\n\nSTRATEGIES.declare("toy", "toy: ddp under another name", impl=_STRATEGY + "Toy",\n'
     "                   caps=StrategyCaps(shards=False, fp16=False))\n"),
    ("stages/train_student/strategy.py", None,
     '\n\nclass Toy(DDP):\n    """Toy: a full replica per rank, as ddp."""\n'),
]


def test_a_strategy_recipe(tiny_cache, tmp_path):
    repo = _applied(tmp_path, STRATEGY)
    assert "toy (toy: ddp under another name)" in " ".join(run_cli(repo, "train-student", "--help").split())
    run = tmp_path / "run"
    refused = run_cli(repo, *train_args(repo, tiny_cache, run, "--strategy", "toy", "--mixed-precision", "fp16"),
                      code=2)
    assert "fp16 does not go with strategy toy" in refused  # its capability, read
    run_cli(repo, *train_args(repo, tiny_cache, run, "--strategy", "toy", "--checkpoint-every", 1))
    state = json.loads((run / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    assert state["strategy"] == "toy"
    refused = run_cli(repo, *train_args(repo, tiny_cache, run, "--resume", "--max-steps", 3), code=2)
    assert "written with --strategy toy (its weights are whole); resume with --strategy toy" in refused


# The setting recipe (docs/architecture.md, "A setting"): a toy train-student setting, AdamW's eps, which changes what a
# run computes: the field, the line of the stage that reads it, and its entry in the resume identity. (file, the text
# replaced, its replacement)
SETTING = [
    ("pipeline/config.py",
     '    max_grad_norm: float = setting(1.0, help="Clip the global gradient norm; 0 disables clipping.",\n'
     '                                   check=positive(allow_zero=True))\n',
     '    max_grad_norm: float = setting(1.0, help="Clip the global gradient norm; 0 disables clipping.",\n'
     '                                   check=positive(allow_zero=True))\n'
     '    toy_adam_eps: float = setting(1e-8, help="Toy: AdamW\'s eps.", check=positive())\n'),
    ("stages/train_student/train.py", "eps=1e-8,", "eps=cfg.toy_adam_eps,"),
    ("stages/train_student/run_identity.py", "    holdout_prompts: int\n", "    holdout_prompts: int\n    toy_adam_eps: float\n"),
]


def test_a_setting_recipe(tiny_cache, tmp_path):
    repo = _copy_project(tmp_path)
    for rel, old, new in SETTING:
        text = (repo / rel).read_text()
        assert text.count(old) == 1, f"{rel}: the recipe's anchor is gone or ambiguous: {old!r}"
        (repo / rel).write_text(text.replace(old, new))
    assert "--toy-adam-eps FLOAT" in run_cli(repo, "train-student", "--help")
    run = tmp_path / "run"
    args = ["--cache", tiny_cache, "--student-config", repo / "configs" / "student-tiny.json", "--out", run,
            "--batch-size", 4, "--num-workers", 0, "--warmup-steps", 0, "--checkpoint-every", 1, "--device", "cpu",
            "--report-to", "none"]
    run_cli(repo, "train-student", *args, "--max-steps", 2, "--toy-adam-eps", 0.001)  # (a checkpoint at step 1 of 2)
    assert json.loads((run / "config.json").read_text())["toy_adam_eps"] == 0.001
    ckpt = run / "checkpoints" / "step-00000001"
    import torch

    assert torch.load(ckpt / "optimizer.pt", weights_only=True)["param_groups"][0]["eps"] == 0.001  # honoured
    refusal = run_cli(repo, "train-student", *args, "--max-steps", 3, "--resume", "--toy-adam-eps", 0.01, code=2)
    assert "--toy-adam-eps 0.001 then, 0.01 now" in refusal  # in the resume identity


# The condition recipe (docs/architecture.md, "A condition"): a toy image-to-video condition, TI2V's image as the
# clip's last latent frame instead of its first: its name, its layout, the teachers that take it, how its latent is
# made. Stage one stores it, the loader, the student's loss and validation pass it on through Inputs.condition.
CONDITION = [
    ("cache/format.py", "CONDITIONS = (NO_CONDITION, CONCAT, FIRST_FRAME)\n",
     'CONDITIONS = (*CONDITIONS, "last_frame")  # toy\n'),
    ("pipeline/model_call.py",
     "LAYOUTS = {NONE: Layout(), CONCAT: Layout(channels=True), FIRST_FRAME: Layout(frames=slice(0, 1))}\n",
     'LAYOUTS["last_frame"] = Layout(frames=slice(-1, None))  # toy\n'),
    ("stages/teacher_cache/teacher.py", "        if not images:\n            return NONE\n",
     '        if self.expand_timesteps:\n            return "last_frame"  # toy: TI2V\'s image, last\n'),
    ("pipeline/image_condition.py", "    if rule.condition == FIRST_FRAME:\n        return latent\n",
     '    if rule.condition == "last_frame":\n        return latent  # toy: the image alone, as first_frame\'s\n'),
]


def test_a_condition_recipe(tiny_teacher_factory, tmp_path):
    import numpy as np
    from PIL import Image

    repo = _applied(tmp_path, CONDITION)
    cli = _cli_in(repo)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        lines.append(f"{i}.png\ttoy prompt {i}")
    (tmp_path / "images.tsv").write_text("\n".join(lines) + "\n")
    cache, run = tmp_path / "cache", tmp_path / "run"
    cli("teacher-cache", "--teacher", tiny_teacher_factory("ti2v"), "--images", tmp_path / "images.tsv", "--out",
        cache, "--placement", "cpu", "--height", 64, "--width", 64, "--frames", 9, "--steps", 4,
        "--max-sequence-length", 16)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["condition"] == "last_frame" and manifest["condition_shape"] == [48, 1, 4, 4]
    cli("cache", "verify", cache)
    import zarr

    store = zarr.open_group(str(cache / "parts" / "part-00000" / "prompts.zarr"), mode="r")
    final, condition = store["final_latents"][:], store["condition"][:]
    np.testing.assert_array_equal(final[:, :, :, -1:], condition)  # the last frame re-imposed, as the layout says
    assert not np.array_equal(final[:, :, :, :1], condition)
    teacher = json.loads((tiny_teacher_factory("ti2v") / "transformer" / "config.json").read_text())
    student = {k: v for k, v in teacher.items() if not k.startswith("_")} | {"num_layers": 1}
    (tmp_path / "student.json").write_text(json.dumps(student))
    cli("train-student", "--cache", cache, "--student-config", tmp_path / "student.json", "--out", run, "--max-steps", 2, "--batch-size", 4, "--num-workers", 0, "--warmup-steps", 0, "--checkpoint-every", 0,
        "--log-every", 1, "--device", "cpu", "--report-to", "none")
    losses = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["loss"] < float("inf") for r in losses if r["type"] == "train")
