"""The teacher's speed options (issue 45; docs/costs.md, "A faster teacher step") against the plain teacher, side by
side in one run, on whatever this machine can run (an option it cannot is said and skipped, never guessed):

- fidelity: stage one itself (`stages.teacher_cache.run`) with the pretrained shapes teacher on the held-out shapes
  captions at the demo's settings (configs/shapes-teacher-cache.toml), plain and once per option. Per option: the
  largest |difference| of the cached targets and of the final latents against the plain run (absolute, and over the
  largest |value|), the checker's all-right share of the decoded final images, the share of the plain teacher's
  all-right images it keeps, and the teacher loop's seconds against the plain loop's.
- step: one CFG step of the A14B-width teacher (bench/a14b_teacher.py: dim 5120, ffn 13824, --blocks blocks) at
  --height x --width, bf16 on CUDA: seconds against the plain step, and the prediction's drift.

    python -m bench.teacher_speed [--device cuda] [--quick] [--only fidelity,step]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.common import ROOT, cli_results_path, pick_device, result, save, table

SHAPES_TEACHER = ROOT / "data" / "tiny-teacher-pretrained"
CAPTIONS = ROOT / "data" / "shapes-heldout.txt"


def options(device: torch.device) -> dict[str, dict]:
    """name -> speed settings of every option worth a row on `device` (checked against the machine when run)."""
    rows = {"compile": {"compile": True}, "int8": {"teacher_quant": "int8"}}
    if device.type == "cuda":
        rows = {"tf32": {"tf32": True}, "flash": {"attention_backend": "flash"},
                "flash-3 (hub)": {"attention_backend": "_flash_3_hub"}, "sage": {"attention_backend": "sage"},
                **rows, "compile+tf32": {"compile": True, "tf32": True}, "fp8": {"teacher_quant": "fp8"}}
    return rows


def _usable(speed, device: torch.device) -> str | None:
    """Why `speed` cannot run on `device` (its own check, as stage one's placement cuda or cpu), or None."""
    from pipeline.errors import UserError
    from pipeline.registries import PLACEMENTS

    kind = "cuda" if device.type == "cuda" else "cpu"
    try:
        speed.check(SimpleNamespace(device=device, entry=SimpleNamespace(caps=PLACEMENTS[kind].caps), name=kind))
    except UserError as e:
        return str(e)
    return None


# -- fidelity: stage one with each option on the shapes teacher ---------------------------------------------------

def _stage_one(teacher: Path, prompts: Path, out: Path, device: torch.device, **speed) -> tuple[dict, float]:
    from pipeline.config import TeacherCacheConfig
    from pipeline.config_types import load_config
    from stages import teacher_cache

    cfg = load_config(TeacherCacheConfig, str(ROOT / "configs" / "shapes-teacher-cache.toml"),
                      dict(teacher=str(teacher), prompts=str(prompts), out=str(out),
                           placement="cuda" if device.type == "cuda" else "cpu", **speed))
    summary = teacher_cache.run(cfg)
    return _read(out), summary["loop_s"]


def _read(cache: Path) -> dict:
    """The targets (every sample, by key) and final latents (by prompt) of a one-part, one-seed cache."""
    from cache import format as F
    from cache.manifest import load_manifest
    from cache.prompt_store import PartRows
    from cache.reader import SampleReader, open_index

    m, index = load_manifest(cache), open_index([cache])
    reader, targets = SampleReader(index), {}
    for i in range(len(index)):
        tensors, meta = reader.read(i)
        targets[(meta["prompt_idx"], meta["seed_idx"], meta["step"])] = tensors[F.T_TARGET].float()
    reader.close()
    rows = PartRows(cache, 0, 1)
    return {"targets": targets,
            "finals": torch.stack([torch.from_numpy(np.asarray(rows.latent(F.Z_FINAL_LATENTS, r, 0))).float()
                                   for r in range(m.prompts)])}


def _all_right(teacher: Path, finals: torch.Tensor, captions: list[str]) -> list[bool]:
    from diffusers import AutoencoderKLWan

    from pipeline.sampling import decode_latents
    from stages.sample.attributes import score

    vae = AutoencoderKLWan.from_pretrained(teacher, subfolder="vae", torch_dtype=torch.float32)
    frames = torch.cat([decode_latents(vae, finals[i:i + 32]) for i in range(0, len(finals), 32)])
    images = list((frames[:, 0].numpy() * 255).round().astype(np.uint8))
    return [score([img], [cap])["all"] == 1.0 for img, cap in zip(images, captions)]


def _diff(a: dict[str, torch.Tensor] | torch.Tensor, b) -> tuple[float, float, float]:
    """(largest |a - b|, that over the largest |a|, RMS of a - b over the RMS of a) over matching tensors."""
    pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else [(a, b)]
    worst = max(float((x - y).abs().max()) for x, y in pairs)
    rms = (sum(float((x - y).pow(2).sum()) for x, y in pairs) / sum(float(x.pow(2).sum()) for x, _ in pairs)) ** 0.5
    return worst, worst / max(float(x.abs().max()) for x, _ in pairs), rms


def fidelity(device: torch.device, quick: bool, work: Path) -> list[dict]:
    from pipeline.prompts import read_prompt_file
    from stages.teacher_cache.speed import TeacherSpeed

    captions = read_prompt_file(str(CAPTIONS))[:16 if quick else None]
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "captions.txt"
    prompts.write_text("\n".join(captions) + "\n")
    _stage_one(SHAPES_TEACHER, prompts, work / "warm", device)  # first-run costs (kernels, files) stay out
    plain, plain_s = _stage_one(SHAPES_TEACHER, prompts, work / "plain", device)
    right = _all_right(SHAPES_TEACHER, plain["finals"], captions)
    print(f"plain teacher: {sum(right)}/{len(right)} all right, loop {plain_s:.2f}s", flush=True)
    records = []
    # the yardstick: the plain teacher in the other dtype (bf16 on the CPU, whose default is float32; float32 on CUDA)
    other = "bfloat16" if device.type == "cpu" else "float32"
    for name, speed in {f"dtype {other} (yardstick)": {"dtype": other}, **options(device)}.items():
        why = _usable(replace(TeacherSpeed(), **{k: v for k, v in speed.items() if k != "dtype"}), device)
        if why is not None:
            print(f"fidelity {name}: skipped: {why}", flush=True)
            continue
        try:
            got, seconds = _stage_one(SHAPES_TEACHER, prompts, work / name.replace(" ", "_"), device, **speed)
        except Exception as e:  # (a backend whose kernel cannot be fetched here, ...): the other rows still count
            print(f"fidelity {name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        t_abs, t_rel, t_rms = _diff(plain["targets"], got["targets"])
        f_abs, f_rel, _ = _diff(plain["finals"], got["finals"])
        ok = _all_right(SHAPES_TEACHER, got["finals"], captions)
        kept = sum(a and b for a, b in zip(right, ok)) / max(sum(right), 1)
        note = (f"targets max |diff| {t_abs:.3g} ({t_rel:.2%} of max, RMS {t_rms:.2%}), final latents {f_abs:.3g} ({f_rel:.2%}); all "
                f"right {sum(ok)}/{len(ok)} vs plain {sum(right)}/{len(right)}, kept {kept:.1%}; loop {seconds:.2f}s vs "
                f"{plain_s:.2f}s (compile warm-up not counted); shapes teacher, {len(captions)} held-out captions, "
                f"configs/shapes-teacher-cache.toml, {device.type}")
        print(f"fidelity {name}: {note}", flush=True)
        slug = (other if "dtype" in speed else name.split(" ")[0]).replace("+", "_").replace("-", "")
        records.append(result(f"teacher_fidelity_{slug}_kept", kept, 1.0, "share", None, "info", note=note))
        records.append(result(f"teacher_fidelity_{slug}_target_drift", t_rel, 0.0, "of max |target|", None, "info",
                              ratio=t_rel, note=f"absolute {t_abs:.3g}"))
    return records


# -- step: one CFG step at A14B width --------------------------------------------------------------------------

def step(device: torch.device, quick: bool, work: Path, blocks: int, height: int, width: int, reps: int) -> list[dict]:
    from diffusers import WanTransformer3DModel

    from bench.a14b_teacher import write_a14b_teacher
    from pipeline.model_call import Inputs, predict
    from stages.teacher_cache.speed import TeacherSpeed
    from stages.teacher_cache.trajectory import Schedule, TrajectoryRunner

    work.mkdir(parents=True, exist_ok=True)
    teacher = write_a14b_teacher(work / "a14b", blocks=blocks)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 16, 1, height // 8, width // 8, generator=g).to(device, dtype)
    text = (torch.randn(2, 512, 4096, generator=g) * 0.1).to(device, dtype)
    runner = TrajectoryRunner([], None, Schedule([999.0], [1.0], [1], [4.0], True), 1, dtype, device)
    t = torch.full((1,), 999.0, device=device)
    tokens = (height // 16) * (width // 16)

    def run(speed, dt: torch.dtype = dtype) -> tuple[float, torch.Tensor]:
        torch.backends.cuda.matmul.allow_tf32 = False  # each row starts from the plain numerics
        model = WanTransformer3DModel.from_pretrained(teacher, subfolder="transformer", torch_dtype=dt)
        model = speed.prepare(model.to(device).eval().requires_grad_(False))
        x, ctx, r = lat.to(dt), text.to(dt), replace(runner, dtype=dt)
        with torch.inference_mode():
            speed.warm_up(r, model, [1], x.shape[1:], (512, 4096))  # compiles here, untimed
            times = []
            for _ in range(reps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                out = predict(model, Inputs(x, t, ctx[:1], ctx[1:]), 4.0, r.rule, batched=True).guided
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return min(times), out.float().cpu()

    plain_s, plain = run(TeacherSpeed())
    print(f"step plain: {plain_s:.4f}s ({blocks} A14B blocks, {tokens} tokens, CFG, {device})", flush=True)
    _, exact = run(TeacherSpeed(), torch.float32)  # bf16's own drift: the yardstick of "within bf16 noise"
    noise = _diff(exact, plain)
    print(f"step bf16 vs float32 (the yardstick): max |diff| {noise[0]:.3g} ({noise[1]:.2%}), RMS {noise[2]:.2%}",
          flush=True)
    records = [result("teacher_step_bf16_noise", noise[2], 0.0, "RMS of the bf16 step's difference from float32's",
                      None, "info", ratio=noise[2], note=f"max |diff| {noise[0]:.3g} ({noise[1]:.2%} of max); "
                      f"{blocks} A14B-width blocks at {height}x{width}, CFG")]
    for name, speed in options(device).items():
        chosen = replace(TeacherSpeed(), **speed)
        why = _usable(chosen, device)
        if why is not None:
            print(f"step {name}: skipped: {why}", flush=True)
            continue
        try:
            seconds, out = run(chosen)
        except Exception as e:
            print(f"step {name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        d_abs, d_rel, d_rms = _diff(plain, out)
        note = (f"{blocks} A14B-width blocks at {height}x{width} ({tokens} tokens), CFG, bf16, best of {reps}; "
                f"prediction max |diff| {d_abs:.3g} ({d_rel:.2%} of max, RMS {d_rms:.2%}; bf16 vs float32: RMS "
                f"{noise[2]:.2%})")
        print(f"step {name}: {seconds:.4f}s vs {plain_s:.4f}s; {note}", flush=True)
        slug = name.split(" ")[0].replace("+", "_").replace("-", "")
        records.append(result(f"teacher_step_{slug}", plain_s / seconds, 1.0, "x plain step speed", None, "info",
                              note=note))
    return records


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="fidelity,step")
    ap.add_argument("--blocks", type=int, default=None, help="A14B blocks of the step's teacher (CUDA 4, CPU 1).")
    ap.add_argument("--height", type=int, default=None, help="(CUDA 480, CPU 128)")
    ap.add_argument("--width", type=int, default=None, help="(CUDA 832, CPU 128)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    cuda = device.type == "cuda"
    only = args.only.split(",")
    records = []
    with tempfile.TemporaryDirectory(prefix="wandistiller-bench-teacher-speed-") as tmp:
        if "fidelity" in only:
            records += fidelity(device, args.quick, Path(tmp) / "fidelity")
        if "step" in only:
            records += step(device, args.quick, Path(tmp) / "step", args.blocks or (4 if cuda else 1),
                            args.height or (480 if cuda and not args.quick else 128),
                            args.width or (832 if cuda and not args.quick else 128), 1 if args.quick else args.reps)
    return records


if __name__ == "__main__":
    import sys

    out = main(sys.argv[1:])
    save(out, cli_results_path(sys.argv[1:]))
    print(table(out))
    print(json.dumps([r["name"] for r in out]))
