"""Stage-one benchmarks: writer overhead, cache size vs a naive cache, cost exponent in the prompt count.

Run: python -m bench.stage_one [--prompts 64] [--steps 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import exponent, result, save, table
from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import EmbeddingCache
from cache.writer import ShardWriter
from pipeline.config import TeacherCacheConfig
from pipeline.prompts import read_prompt_file
from pipeline.tiny_teacher import write_tiny_teacher
from stages import teacher_cache
from stages.teacher_cache.placement import load_experts, load_scheduler
from stages.teacher_cache.teacher import resolve_teacher
from stages.teacher_cache.trajectory import Schedule, TrajectoryRunner, initial_noise

ROOT = Path(__file__).resolve().parents[1]


def _prompts(work: Path, n: int) -> Path:
    base = read_prompt_file(ROOT / "data" / "prompts.txt")
    p = work / f"prompts-{n}.txt"
    p.write_text("\n".join(f"{base[i % len(base)]} (variation {i // len(base)})" if i >= len(base) else base[i]
                           for i in range(n)) + "\n")
    return p


def _cfg(teacher: Path, prompts: Path, out: Path, args) -> TeacherCacheConfig:
    return TeacherCacheConfig(teacher=str(teacher), prompts=str(prompts), out=str(out), placement="cpu",
                              steps=args.steps, height=64, width=64, max_sequence_length=512,
                              batch_size=args.batch_size, samples_per_shard=256, guidance=4.0,
                              negative_prompt="blurry")


def _compute_only(teacher: Path, cache: Path, args) -> float:
    """The teacher's trajectory compute alone: the same blocks, nothing written."""
    spec = resolve_teacher(str(teacher))
    m = load_manifest(cache)
    sched = load_scheduler(spec)
    schedule = Schedule.build(sched, args.steps, spec.boundary_ratio, 4.0, None)
    experts = load_experts(spec, torch.float32, torch.device("cpu"))
    runner = TrajectoryRunner(experts, sched, schedule, args.steps, torch.float32, torch.device("cpu"), False)
    emb = EmbeddingCache(cache, 1)
    neg = torch.zeros(1, 512, m[F.F_TEXT_DIM])
    n = m[F.F_PROMPTS]
    t0 = time.perf_counter()
    for i in range(0, n, args.batch_size):
        idx = list(range(i, min(i + args.batch_size, n)))
        cond = torch.stack([emb.get(p) for p in idx])
        noise = torch.stack([initial_noise(0, p, 0, m[F.F_LATENT_SHAPE]) for p in idx])
        records = []
        runner.run(noise, cond, neg, on_step=records.append)
    return time.perf_counter() - t0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="wandistiller-bench-"))
    try:
        teacher = write_tiny_teacher(work / "teacher", "wan2.2")
        prompts = _prompts(work, args.prompts)
        # 4. writer overhead: stage one's trajectory loop vs the same compute with nothing written,
        # interleaved and the best of `reps` each, so both see the same machine state.
        loops, computes = [], []
        for r in range(args.reps):
            out = work / f"cache-{r}"
            loops.append(teacher_cache.run(_cfg(teacher, prompts, out, args))["loop_s"])
            computes.append(_compute_only(teacher, out, args))
        results = [result("writer_overhead", min(loops), min(computes), "s", 1.05, "<=",
                          note=f"{args.prompts} prompts x {args.steps} steps, batch {args.batch_size}")]
        # 6. cache size per sample vs a naive cache
        cache = work / "cache-0"
        m = load_manifest(cache)
        ours = (m[F.F_BYTES] + _dir_bytes(cache / F.PARTS_DIR) + (cache / F.NEGATIVE).stat().st_size) / m[F.F_SAMPLES]
        naive = _naive(cache, work)
        results.append(result("cache_bytes_vs_naive", ours, naive, "bytes/sample", 0.25, "<=",
                              note=f"max_sequence_length 512, text_dim {m[F.F_TEXT_DIM]}, float32"))
        # 7. cost exponent of stage one in the prompt count (1 = linear)
        sizes = [args.prompts // 4, args.prompts // 2, args.prompts]
        times = []
        for n in sizes:
            best = min(teacher_cache.run(_cfg(teacher, _prompts(work, n), work / f"scale-{n}-{r}", args))["wall_s"]
                       for r in range(2))
            times.append(best)
        e = exponent(sizes, times)
        results.append(result("stage_one_cost_exponent", e, 1.0, "exponent", 1.15, "<=", ratio=e,
                              note=f"wall time at {sizes} prompts: {times} s"))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _naive(cache: Path, work: Path, k: int = 64) -> float:
    """Bytes per sample of a naive cache: float32 x_t and target plus the padded float32 text embedding
    stored in every sample, written with the same shard writer from the first `k` samples."""
    import tarfile

    from cache.writer import decode_sample

    m = load_manifest(cache)
    emb = EmbeddingCache(cache, m[F.F_NUM_PARTS])
    w = ShardWriter(work / "naive", part=0, index=0)
    with tarfile.open(cache / m[F.F_SHARDS][0][F.S_PATH]) as tar:
        members: dict[str, dict[str, bytes]] = {}
        for info in tar:
            key, _, ext = info.name.partition(".")
            members.setdefault(key, {})[ext] = tar.extractfile(info).read()
            if len(members) > k:
                break
    keys = [key for key, mem in members.items() if len(mem) == 2][:k]
    for key in keys:
        tensors, meta = decode_sample(members[key])
        w.write(key, {F.T_X_T: tensors[F.T_X_T].float(), F.T_TARGET: tensors[F.T_TARGET].float(),
                      "embeds": emb.get(meta[F.M_PROMPT_IDX]).float()}, meta)
    return w.close()[F.S_BYTES] / len(keys)


if __name__ == "__main__":
    res = main()
    save(res)
    print(table(res))
