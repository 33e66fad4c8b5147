"""Placement benchmark: throughput of `disk` and `offload` relative to in-memory, and the RSS of `disk`.

One run prints, side by side on the same machine:
- samples/s (one sample = one trajectory step) of `cpu` (weights in RAM), `offload` and `disk` at batch
  sizes 1, 8 and 32, through the real placement loaders and the stage's TrajectoryRunner;
- the peak RSS of a full `teacher-cache` run during its trajectory loop, per placement, in a fresh process.

The teacher is the embedded tiny Wan 2.2 pipeline with wider transformers (≥ 300 MB of float32 weights
for the two experts by default), so weight traffic is large enough to measure on a CPU.

    python bench/placements.py                 # defaults: dim 512, ffn 2048, 12 layers, batches 1,8,32
    python bench/placements.py --quick         # smaller and shorter, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_wide_teacher(out: Path, dim: int = 768, ffn: int = 3072, layers: int = 4, head_dim: int = 64,
                       seed: int = 0) -> Path:
    """The tiny Wan 2.2 teacher with both experts replaced by wider `WanTransformer3DModel`s (same text
    encoder, VAE, scheduler and tokenizer). Seeded: the same arguments write the same bytes."""
    import torch
    from diffusers import WanTransformer3DModel

    from pipeline.tiny_teacher import SPECS, TEXT_DIM, write_tiny_teacher

    out = Path(out)
    if (out / "model_index.json").is_file() and (out / "wide.json").is_file():
        if json.loads((out / "wide.json").read_text()) == [dim, ffn, layers, head_dim, seed]:
            return out
    write_tiny_teacher(out, "wan2.2", seed)
    z = SPECS["wan2.2"].z_dim
    for i, comp in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(seed + 100 + i)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=dim // head_dim, attention_head_dim=head_dim, in_channels=z,
            out_channels=z, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        for f in (out / comp).iterdir():
            f.unlink()
        model.save_pretrained(out / comp, safe_serialization=True)
    (out / "wide.json").write_text(json.dumps([dim, ffn, layers, head_dim, seed]))
    return out


def weight_bytes(teacher: Path) -> int:
    return sum(f.stat().st_size for c in ("transformer", "transformer_2") for f in (teacher / c).glob("*.safetensors"))


# --- throughput ---------------------------------------------------------------------------------------------------

def throughput_child(args: dict) -> dict:
    """In a fresh process: load one placement through the stage's loaders and time TrajectoryRunner.run at
    each batch size (best of `repeats` after a warm-up pass). Returns {batch: [wall_s, cpu_s]}."""
    import torch

    torch.set_num_threads(args["threads"])
    from stages.teacher_cache.placements import Placement, load_experts
    from stages.teacher_cache.teacher import load_scheduler, resolve_teacher
    from stages.teacher_cache.trajectory import Schedule, TrajectoryRunner

    spec = resolve_teacher(args["teacher"])
    steps = args["steps"]
    scheduler = load_scheduler(spec)
    schedule = Schedule.build(scheduler, steps, spec.boundary_ratio, 4.0, 3.0)
    dev, dtype = torch.device("cpu"), torch.float32
    p = Placement(args["placement"], dev, "float32", offload_dir=Path(args["work"]) / "offload")
    runner = TrajectoryRunner(load_experts(spec, p, log=lambda m: None), scheduler, schedule, steps, dtype, dev)
    text_dim = spec.transformer_config["text_dim"]
    out = {}
    for bs in args["batch_sizes"]:
        g = torch.Generator().manual_seed(bs)  # the same inputs in every placement's process
        noise = torch.randn(bs, 16, 1, 8, 8, generator=g)
        cond = torch.randn(bs, 32, text_dim, generator=g)
        neg = torch.randn(1, 32, text_dim, generator=g)
        runner.run(noise, cond, neg)  # warm-up: first read of the files, allocator, kernels
        wall = cpu = float("inf")
        for _ in range(args["repeats"]):
            t, c = time.perf_counter(), time.process_time()
            runner.run(noise, cond, neg)
            wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
        out[bs] = [wall, cpu]
    return out


def throughput(teacher: Path, placements: list[str], batch_sizes: list[int], steps: int, repeats: int,
               work: Path, threads: int) -> list[dict]:
    """samples/s of each placement at each batch size, each placement in its own fresh process (so one
    placement's allocator settings or page cache state does not bias another's)."""
    res = {name: _child("throughput_child", {"teacher": str(teacher), "placement": name, "batch_sizes": batch_sizes,
                                              "steps": steps, "repeats": repeats, "work": str(work),
                                              "threads": threads})
           for name in placements}
    rows = []
    for bs in batch_sizes:
        base_wall, base_cpu = res["cpu"][str(bs)]
        for name in placements:
            wall, cpu = res[name][str(bs)]
            n = bs * steps
            row = {"placement": name, "batch": bs, "samples_per_s": round(n / wall, 2),
                   "vs_in_memory": round(base_wall / wall, 3), "samples_per_cpu_s": round(n / cpu, 2),
                   "vs_in_memory_cpu_time": round(base_cpu / cpu, 3)}
            rows.append(row)
            print(f"  {name:<8} batch {bs:>3}: {row['samples_per_s']:8.2f} samples/s ({row['vs_in_memory']:.2f}x "
                  f"in-memory) | {row['samples_per_cpu_s']:8.2f} samples per CPU-second "
                  f"({row['vs_in_memory_cpu_time']:.2f}x)", flush=True)
    return rows


def _child(fn: str, args: dict) -> dict:
    """Run bench.placements.`fn`(args) in a fresh CPU-only interpreter; return its JSON result."""
    code = ("import json, sys; sys.path.insert(0, %r); import bench.placements as b; "
            "print('BENCH-JSON ' + json.dumps(getattr(b, sys.argv[1])(json.loads(sys.argv[2]))))" % str(ROOT))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")  # a CPU measurement
    res = subprocess.run([sys.executable, "-c", code, fn, json.dumps(args)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("BENCH-JSON ")]
    if res.returncode or not line:
        raise RuntimeError(f"{fn} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(line[-1].removeprefix("BENCH-JSON "))


# --- peak RSS during the trajectory loop (child process) ----------------------------------------------------------

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_child(args: dict) -> dict:
    """Run stage one in this (fresh) process and report RSS: before the experts load, at the loop's first
    step, and the peak from there to the loop's end (VmHWM reset through /proc/self/clear_refs)."""
    import torch

    torch.set_num_threads(args.get("threads", 2))
    from pipeline.config import TeacherCacheConfig
    from stages import teacher_cache
    import importlib

    run_mod = importlib.import_module("stages.teacher_cache.make_cache")  # the package re-exports run() under this name
    from stages.teacher_cache.trajectory import TrajectoryRunner

    marks: dict = {}
    load = run_mod.load_experts

    def load_experts(*a, **k):
        marks.setdefault("before_experts", _status("VmRSS"))
        return load(*a, **k)

    step = TrajectoryRunner.run

    def run(self, *a, **k):
        if "loop_start" not in marks:
            marks["peak_before_loop"] = _status("VmHWM")
            try:  # "5" resets the peak RSS to the current RSS (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                marks["hwm_reset"] = True
            except OSError:
                marks["hwm_reset"] = False
            marks["loop_start"] = _status("VmRSS")
        out = step(self, *a, **k)
        marks["loop_peak"] = _status("VmHWM")
        marks["loop_end_anon"], marks["loop_end_file"] = _status("RssAnon"), _status("RssFile")
        return out

    run_mod.load_experts = load_experts
    TrajectoryRunner.run = run
    summary = teacher_cache.run(TeacherCacheConfig(**args["cfg"]))
    return marks | {"placement": summary["placement"], "samples": summary["samples"]}


def measure_rss(teacher: Path, prompts: Path, out: Path, placement: str, batch_size: int = 4, steps: int = 4,
                threads: int = 2) -> dict:
    """`rss_child` in a fresh interpreter (so earlier work in this process does not count)."""
    cfg = dict(teacher=str(teacher), prompts=str(prompts), out=str(out), placement=placement, steps=steps,
               height=64, width=64, max_sequence_length=32, batch_size=batch_size, overwrite=True)
    return _child("rss_child", {"cfg": cfg, "threads": threads})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None, help="Folder for the teacher and caches (default: a temp dir).")
    ap.add_argument("--quick", action="store_true", help="dim 384, batches 1,8, one repeat.")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: idle OpenMP threads spin, which inflates CPU time on a shared box).")
    ap.add_argument("--json", type=Path, help="Also write the results here.")
    a = ap.parse_args()
    if a.quick:
        a.dim, a.ffn, a.batch_sizes, a.repeats = 384, 1536, "1,8", 1
    import torch

    torch.set_num_threads(a.threads)
    work = a.work or Path(tempfile.mkdtemp(prefix="wd-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    teacher = build_wide_teacher(work / "teacher", a.dim, a.ffn, a.layers)
    wbytes = weight_bytes(teacher)
    print(f"teacher: 2 experts x (dim {a.dim}, ffn {a.ffn}, {a.layers} blocks) = {wbytes / 2**20:.0f} MiB float32 "
          f"weights; {torch.get_num_threads()} CPU threads; 64x64 images (16 tokens), CFG on, {a.steps} steps")

    print("\nthroughput, each placement in a fresh process (best of %d after a warm-up pass; one sample = one\n"
          "trajectory step; wall clock, and process CPU time, which other processes on the cores do not inflate):"
          % a.repeats)
    rows = throughput(teacher, ["cpu", "offload", "disk"], [int(b) for b in a.batch_sizes.split(",")], a.steps,
                      a.repeats, work, a.threads)

    print("\npeak RSS during the trajectory loop of `teacher-cache` (fresh process each, batch 8):")
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i}: a red circle on a blue background" for i in range(8)) + "\n")
    rss = {}
    for name in ("cpu", "disk"):
        m = measure_rss(teacher, prompts, work / f"cache-{name}", name, batch_size=8, steps=a.steps, threads=a.threads)
        rss[name] = m
        grow = m["loop_peak"] - m["before_experts"]
        print(f"  {name:<8} RSS before experts {m['before_experts'] / 2**20:7.1f} MiB | at loop start "
              f"{m['loop_start'] / 2**20:7.1f} MiB | loop peak {m['loop_peak'] / 2**20:7.1f} MiB | "
              f"peak - before experts = {grow / 2**20:6.1f} MiB = {grow / wbytes:.1%} of the weights "
              f"(absolute peak = {m['loop_peak'] / wbytes:.0%})")
    if a.json:
        a.json.write_text(json.dumps({"weights_bytes": wbytes, "throughput": rows, "rss": rss}, indent=2))


if __name__ == "__main__":
    main()
