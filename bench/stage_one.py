"""Stage-one benchmarks: writer overhead, cache size vs a naive cache, cost exponent in the prompt count.

- writer_overhead: stage one's trajectory loop (`loop_s`: inputs, teacher, shard writer thread, final flush)
  vs the teacher's trajectory compute alone on the same blocks, inputs prepared before the clock starts
  and nothing written; interleaved, best of N.
- cache_bytes_vs_naive: bytes per sample of the cache vs a naive one (float32 x_t, target and the padded
  prompt embedding in every sample).
- stage_one_cost_exponent: stage one's trajectory-loop time at 1x, 2x, 4x prompts (wall times in the note).

Run: python -m bench.stage_one [--prompts 64] [--steps 8] [--reps 3] [--device auto]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    cli_results_path, exponent, pick_device, prompt_file, result, save, stage_one_placement, sync, table, wide_teacher,
)
from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import EmbeddingCache
from safetensors.torch import load_file
from pipeline.config import TeacherCacheConfig
from pipeline.tiny_teacher import write_tiny_teacher
from stages import teacher_cache
from stages.teacher_cache.placements import Placement, load_experts
from stages.teacher_cache.teacher import load_scheduler, resolve_teacher
from pipeline.model_call import InputRule
from stages.teacher_cache.trajectory import Schedule, TrajectoryRunner, initial_noise

ROOT = Path(__file__).resolve().parents[1]


_prompts = prompt_file


def _cfg(teacher: Path, prompts: Path, out: Path, args) -> TeacherCacheConfig:
    return TeacherCacheConfig(teacher=str(teacher), prompts=str(prompts), out=str(out),
                              placement=stage_one_placement(args.device),
                              steps=args.steps, height=64, width=64, max_sequence_length=512,
                              batch_size=args.batch_size, samples_per_shard=256, guidance=4.0,
                              negative_prompt="blurry")


def _compute_only(teacher: Path, cache: Path, args) -> float:
    """The teacher's trajectory compute alone: the same blocks, batch size, schedule, CFG and placement as
    stage one, inputs (noise, prompt and negative embeddings) prepared before the clock starts, nothing written."""
    spec = resolve_teacher(str(teacher))
    m = load_manifest(cache)
    dev = args.device
    dtype = F.DTYPES[m.dtype]
    sched = load_scheduler(spec)
    schedule = Schedule.build(sched, args.steps, spec.boundary_ratio, m.guidance, m.guidance_2)
    experts = load_experts(spec, Placement("cpu" if dev.type == "cpu" else "cuda", dev, m.dtype))
    runner = TrajectoryRunner(experts, sched, schedule, args.steps, dtype, dev, InputRule.of(spec))
    emb = EmbeddingCache(cache, m.num_parts, m.prompts)
    neg = load_file(cache / F.NEGATIVE)[F.NEG_EMBEDS].unsqueeze(0)
    n = m.prompts
    blocks = []
    for i in range(0, n, args.batch_size):
        idx = list(range(i, min(i + args.batch_size, n)))
        blocks.append((torch.stack([initial_noise(m.seed, p, 0, m.latent_shape) for p in idx]),
                       torch.stack([emb.get(p) for p in idx]).to(dtype)))
    sync(dev)
    t0 = time.perf_counter()
    for noise, cond in blocks:
        records = []
        runner.run(noise, cond, neg, on_step=records.append)
    sync(dev)
    return time.perf_counter() - t0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale-prompts", type=int, default=256, help="Largest prompt set of the scaling runs (also 1/2, 1/4).")
    ap.add_argument("--teacher-dim", type=int, default=0, help="Wider experts (e.g. 128 with --teacher-ffn 512 "
                    "--teacher-layers 4); 0 = the embedded tiny teacher (dim 32, ffn 64, 2 blocks).")
    ap.add_argument("--teacher-ffn", type=int, default=512)
    ap.add_argument("--teacher-layers", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="Minimal sizes (smoke test).")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.scale_prompts, args.steps, args.batch_size, args.reps = 8, 8, 2, 4, 1
    args.device = pick_device(args.device)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="wandistiller-bench-"))
    try:
        teacher = (wide_teacher(work / "teacher", args.teacher_dim, args.teacher_ffn, args.teacher_layers)
                   if args.teacher_dim else write_tiny_teacher(work / "teacher", "wan2.2"))
        which = (f"teacher dim {args.teacher_dim}, ffn {args.teacher_ffn}, {args.teacher_layers} blocks"
                 if args.teacher_dim else "embedded tiny teacher")
        prompts = _prompts(work, args.prompts)
        # 4. writer overhead: stage one's trajectory loop vs the same compute with nothing written,
        # interleaved and the best of `reps` each, so both see the same machine state.
        loops, computes = [], []
        for r in range(args.reps):
            out = work / f"cache-{r}"
            loops.append(teacher_cache.run(_cfg(teacher, prompts, out, args))["loop_s"])
            computes.append(_compute_only(teacher, out, args))
        results = [result("writer_overhead", min(loops), min(computes), "s", 1.05, "<=",
                          note=f"{which}; {args.prompts} prompts x {args.steps} steps, batch {args.batch_size}, "
                                  f"{torch.get_num_threads()} torch threads, best of {args.reps}")]
        # 6. cache size per sample vs a naive cache
        cache = work / "cache-0"
        m = load_manifest(cache)
        ours = (m.bytes + _dir_bytes(cache / F.PARTS_DIR) + (cache / F.NEGATIVE).stat().st_size) / m.samples
        naive = _naive(cache, work)
        results.append(result("cache_bytes_vs_naive", ours, naive, "bytes/sample", 0.25, "<=",
                              note=f"max_sequence_length 512, text_dim {m.text_dim}, float32"))
        # 7. cost exponent of stage one in the prompt count (1 = linear)
        sizes = [max(1, args.scale_prompts // 4), max(2, args.scale_prompts // 2), args.scale_prompts]
        loops, walls = [], []
        for n in sizes:
            runs = [teacher_cache.run(_cfg(teacher, _prompts(work, n), work / f"scale-{n}-{r}", args))
                    for r in range(1 if args.quick else 2)]
            loops.append(min(s["loop_s"] for s in runs))
            walls.append(min(s["wall_s"] for s in runs))
        # The exponent of the part that grows with the prompts (the trajectory loop); the wall time adds a fixed
        # start-up (imports, loading, encoder) that dominates at these sizes, so its exponent is in the note.
        e = exponent(sizes, loops)
        results.append(result("stage_one_cost_exponent", e, 1.0, "exponent", 1.15, "<=", ratio=e,
                              note=f"trajectory loop at {sizes} prompts: {[round(t, 2) for t in loops]} s; wall "
                                   f"{[round(t, 2) for t in walls]} s (exponent {exponent(sizes, walls):.2f})"))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _naive(cache: Path, work: Path, k: int = 64) -> float:
    """Bytes per sample of a naive cache: float32 x_t and target plus the padded float32 text embedding
    stored in every sample, as webdataset tar members of the first `k` samples (not a WanDistiller cache:
    the schema does not declare an embedding per sample, so this writes the tar itself)."""
    import itertools
    import json

    import webdataset as wds
    from safetensors.torch import save as st_save

    from cache.reader import ShardStream, decode_sample

    m = load_manifest(cache)
    emb = EmbeddingCache(cache, m.num_parts, m.prompts)
    out = work / "naive.tar"
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "wb") as f:
        tar = wds.TarWriter(f, mtime=0, encoder=False)
        for members in itertools.islice(ShardStream(cache, m.shards[0]), k):
            tensors, meta = decode_sample(members)
            naive = {F.T_X_T: tensors[F.T_X_T].float(), F.T_TARGET: tensors[F.T_TARGET].float(),
                     "embeds": emb.get(meta[F.M_PROMPT_IDX]).float()}
            tar.write({"__key__": members["__key__"], F.EXT_TENSORS: st_save(naive),
                       F.EXT_META: json.dumps(meta, sort_keys=True).encode()})
            n += 1
        tar.close()
    return out.stat().st_size / n


if __name__ == "__main__":
    import sys

    res = main()
    save(res, cli_results_path(sys.argv[1:]))
    print(table(res))
