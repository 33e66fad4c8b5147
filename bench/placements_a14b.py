"""Placements at real A14B widths on CUDA: stage one's samples/s with the teacher's weights resident on the GPU
(`cuda`), streamed from pinned RAM (`offload`) and read from disk (`disk`), side by side in one run, and whether the
three caches hold the same bytes.

The teacher is bench/a14b_teacher.py's (`--blocks` transformer blocks per expert at dim 5120 / 40 heads / ffn
13824, text dim 4096, 16 channels, bf16; no download), run as a user runs stage one at A14B sizes: 480x832, 512
text tokens, batch 4, CFG. Each placement runs `teacher-cache` in a fresh process (its own CUDA context and peak
memory) over the same prompts; the figure is the trajectory loop's samples/s (the encode phase is the same for all).

    python -m bench.placements_a14b                          # 2 blocks per expert, 32 prompts x 8 steps
    python -m bench.placements_a14b --blocks 4 --prompts 64

Rows (CUDA only): offload_vs_cuda (target >= 0.5) and disk_vs_cuda (target: below offload_vs_cuda, i.e. offload
beats disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, pick_device, prompt_file, result, results_path, save, table

PLACEMENTS = ("cuda", "offload", "disk")
OFFLOAD_TARGET = 0.5


def child(cfg: dict) -> dict:
    """In a fresh process: stage one with `cfg`; the closing summary and the peak CUDA memory."""
    import torch

    from pipeline.config import TeacherCacheConfig
    from stages import teacher_cache

    summary = teacher_cache.run(TeacherCacheConfig(**cfg))
    return {"loop_s": summary["loop_s"], "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30}


def run_placement(cfg: dict) -> dict:
    cmd = [sys.executable, "-m", "bench.placements_a14b", "--child", json.dumps(cfg)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if res.returncode:
        raise RuntimeError(f"placement {cfg['placement']} failed (exit {res.returncode}):\n"
                           f"{(res.stdout + res.stderr)[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def shard_records(cache: Path) -> list[dict]:
    from cache.manifest import load_manifest

    return load_manifest(cache).shards


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2, help="Transformer blocks per expert.")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="Teacher steps per trajectory (samples per prompt).")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--max-sequence-length", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cuda[:i]: the placements measured are GPU placements.")
    ap.add_argument("--work", type=Path, default=None, help="Folder for the teacher and caches (default: temp).")
    ap.add_argument("--quick", action="store_true", help="1 block, 4 prompts x 2 steps at 240x416 (smoke test).")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return []
    if args.quick:
        args.blocks, args.prompts, args.steps, args.height, args.width = 1, 4, 2, 240, 416
    device = pick_device(args.device)
    if device.type != "cuda":
        raise SystemExit("bench.placements_a14b measures GPU placements: run it with --device cuda on a GPU")
    from bench.a14b_teacher import write_a14b_teacher

    work = args.work or Path(tempfile.mkdtemp(prefix="wandistiller-bench-a14b-"))
    try:
        teacher = write_a14b_teacher(work / "teacher", blocks=args.blocks)
        prompts = prompt_file(work, args.prompts)
        base = dict(teacher=str(teacher), prompts=str(prompts), dtype="bfloat16", device=device.index or 0,
                    steps=args.steps, height=args.height, width=args.width, batch_size=args.batch_size,
                    max_sequence_length=args.max_sequence_length, guidance=4.0, negative_prompt="blurry",
                    overwrite=True)
        runs, shards = {}, {}
        for p in PLACEMENTS:
            out = work / f"cache-{p}"
            runs[p] = run_placement(base | dict(placement=p, out=str(out), offload_dir=str(work / "offload")))
            shards[p] = shard_records(out)
        samples = args.prompts * args.steps
        rate = {p: samples / runs[p]["loop_s"] for p in PLACEMENTS}
        same = {p: shards[p] == shards["cuda"] for p in ("offload", "disk")}
        loops = ", ".join(f"{p} {r['loop_s']:.1f} s" for p, r in runs.items())
        peaks = ", ".join(f"{p} {r['peak_cuda_gib']:.1f} GiB" for p, r in runs.items())
        shape = (f"{args.blocks} blocks per expert at A14B widths, bf16, {args.height}x{args.width}, "
                 f"{args.max_sequence_length} tokens, batch {args.batch_size}, {args.prompts} prompts x {args.steps} "
                 f"steps; trajectory loop {loops}; peak CUDA {peaks}")
        offload = result("offload_vs_cuda", rate["offload"], rate["cuda"], "samples/s", OFFLOAD_TARGET, ">=",
                         note=f"{shape}; shards bit-identical to cuda's: {same['offload']}")
        disk = result("disk_vs_cuda", rate["disk"], rate["cuda"], "samples/s", offload["ratio"], "<=",
                      note=f"target: below offload_vs_cuda (offload beats disk); shards bit-identical to cuda's: "
                           f"{same['disk']}")
        for r in (offload, disk):
            key = "offload" if r is offload else "disk"
            r["met"] = r["met"] and same[key]  # a faster placement that writes other bytes has not met anything
        return [offload, disk]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    res = main()
    if res:  # (a --child run returns none)
        import torch

        save(res, results_path(torch.device("cuda"), quick="--quick" in sys.argv))
        print(table(res))
