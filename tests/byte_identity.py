"""What the pipeline writes, reduced to one sha256 per file, so that a refactor can prove it changed no byte.

The flows are the demo's (stage one with two seeds per prompt; a compact student, a 2-step segment student and a
2-step LoRA with the demo's objective flags; both exports) at the tiny teacher's size, through the CLI only, so that
the figures do not depend on any internal API. `python -m tests.byte_identity record` rewrites
tests/data/byte_identity.json; tests/test_byte_identity.py runs the flows again and compares.

Digested: every file of the cache, of each run's student/, student_ema/ and distill.json, and of each export. Left out, because
they say when and where a run happened rather than what it computed: the manifest's `created`, the absolute paths a
run records (its teacher's folder, --cache, --out), and the timing and log files (metrics.jsonl, TensorBoard, loss.png).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "byte_identity.json"
# AVX2 kernels in torch, MKL and oneDNN, whatever the CPU: an AVX-512 machine picks wider ones, which sum in another
# order (the record was taken with AVX2). Read when torch loads: set for the commands the flows run.
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# What else decides these bytes: the libraries' versions and the CPU's widest instructions (the pins above do not
# reach every kernel: the record of 2026-12-02 fails whole on an AMX machine of 2026-12-03 with the same code). The
# record holds them; on another environment the test says so and compares nothing.
PACKAGES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors", "numpy", "zarr", "accelerate", "peft")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
SKIPPED = {"metrics.jsonl", "loss.png", "tensorboard", "checkpoints", "writer.lock", "locks", "progress.json"}
VOLATILE_KEYS = {"created"}
PROMPTS = ["a red circle on a blue background", "a small green square in the top left",
           "a lighthouse at night under the stars", "two yellow triangles", "a blue square", "a white ring"]
CACHE = ["--config", "configs/tiny-teacher-cache.toml", "--placement", "cpu", "--seeds-per-prompt", "2"]
TRAIN = ["--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "2", "--ema-decay", "0.9", "--max-steps", "6",
         "--holdout-prompts", "1", "--val-every", "0", "--report-to", "none", "--seed", "3"]
FEW = ["--objective", "segment", "--student-steps", "2", "--segment-start-weight", "4"]


def _scrub(value, places: tuple[str, ...]):
    """A JSON value with this run's folders replaced by names that do not depend on where it ran."""
    if isinstance(value, dict):
        return {k: _scrub(v, places) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [_scrub(v, places) for v in value]
    if isinstance(value, str):
        for i, place in enumerate(places):
            value = value.replace(place, f"<{i}>")
    return value


def digest(folder: Path, places: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_dir() or SKIPPED & set(rel.parts):
            continue
        data = path.read_bytes()
        if path.suffix == ".json" and path.parent.name != "shards":
            data = json.dumps(_scrub(json.loads(data), places), sort_keys=False).encode()
        out[str(rel)] = hashlib.sha256(data).hexdigest()
    return out


def environment() -> dict:
    """The packages' versions, the machine and which of CPU_FLAGS its CPU has (Linux: /proc/cpuinfo)."""
    from importlib.metadata import version

    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.exists() else set()
    return {"packages": {p: version(p) for p in PACKAGES}, "machine": platform.machine(),
            "cpu": [f for f in CPU_FLAGS if f in flags]}


def _cli(*args, cwd: Path = ROOT) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               **KERNELS)  # (one thread and these kernels: the sums of a matmul in one order on any x86 machine)
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=cwd, env=env, text=True,
                       capture_output=True)
    if r.returncode:
        raise RuntimeError(f"wandistiller {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}")


def run_flows(work: Path) -> dict[str, dict[str, str]]:
    """Run the demo's flows at the tiny teacher's size under `work`; {what: {file: sha256}}."""
    teacher, prompts, cache = work / "teacher", work / "prompts.txt", work / "cache"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    _cli("tiny-teacher", "--out", teacher, "--variant", "wan2.2")
    _cli("teacher-cache", "--teacher", teacher, "--prompts", prompts, "--out", cache, *CACHE)
    runs = {"student": ["--student-config", "configs/student-tiny.json"],
            "few-step": ["--student-config", "configs/student-tiny.json", *FEW],
            "lora": ["--lora-of", teacher, "--lora-rank", "4", *FEW]}
    for name, extra in runs.items():
        _cli("train-student", "--cache", cache, "--out", work / name, *TRAIN, *extra)
    for name in ("student", "lora"):
        _cli("export", "--student", work / name, "--out", work / f"{name}-export")
    places = (str(work.resolve()), str(work), str(ROOT))
    found = {"cache": digest(cache, places)}
    for name in runs:
        run = work / name
        found[name] = {f"{kind}/{f}": d for kind in ("student", "student_ema")
                       for f, d in digest(run / kind, places).items()}
        found[name]["distill.json"] = digest(run, places)["distill.json"]
    for name in ("student", "lora"):
        found[f"{name}-export"] = digest(work / f"{name}-export", places)
    return found


def main() -> None:
    import tempfile

    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python -m tests.byte_identity record")
    with tempfile.TemporaryDirectory() as tmp:
        found = run_flows(Path(tmp))
    RECORD.write_text(json.dumps({"environment": environment(), **found}, indent=1, sort_keys=True) + "\n")
    print(f"{sum(map(len, found.values()))} files recorded in {RECORD.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
