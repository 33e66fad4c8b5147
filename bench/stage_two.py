"""Stage-two benchmarks on the tiny teacher's caches, each measured against its baseline in the same process:

- loader_vs_consumption: samples/s of the stage-two reader (pread + decode + prompt embedding + collate, in
  epoch order, page cache dropped first) vs the samples/s the student trains at;
- stage_two_cost_exponent: train-student's training-loop time (one epoch) at 1x, 2x, 4x prompts.

The step overhead and the loader against a raw read are measured at real sizes, with the pieces defined here
(`StepBench`, `overhead`): bench/real_size.py.

Run: python -m bench.stage_two [--prompts 64] [--device auto] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    cli_results_path, drop_page_cache, exponent, interleaved, pick_device, prompt_file, result, save, stage_one_placement,
    table, timed,
)
from cache import format as F
from cache.manifest import load_manifest
from pipeline.config import TeacherCacheConfig, TrainStudentConfig
from pipeline.tiny_teacher import write_tiny_teacher

ROOT = Path(__file__).resolve().parents[1]


def build_cache(teacher: Path, prompts: Path, out: Path, device: torch.device, steps: int, height: int, width: int,
                max_len: int = 64, batch_size: int = 8) -> Path:
    from stages import teacher_cache

    if not (out / F.MANIFEST).exists():
        teacher_cache.run(TeacherCacheConfig(
            teacher=str(teacher), prompts=str(prompts), out=str(out), placement=stage_one_placement(device),
            steps=steps, height=height, width=width, max_sequence_length=max_len, batch_size=batch_size,
            samples_per_shard=256, guidance=4.0, negative_prompt="blurry", overwrite=True))
    return out


class StepBench:
    """A stage-two Trainer on one cache (no DDP, no EMA, no checkpoints), built as `train_student.run` builds
    it, plus the bare step on in-memory batches of the same student, optimizer and batch size."""

    def __init__(self, cache: Path, student_json: Path, out: Path, device: torch.device, batch_size: int,
                 num_workers: int):
        from cache.reader import open_caches
        from pipeline.runtime import dist_env
        from stages.train_student import data as D
        from stages.train_student import loop as L
        from stages.train_student.data import collate
        from stages.train_student.epoch import EpochPlan, RankBatches
        from stages.train_student.index import prepare
        from stages.train_student.objective_velocity import Velocity
        from stages.students.student_kind import student_kind
        from stages.train_student.strategy import get_strategy
        from stages.train_student.train_plan import MIXED, TrainPlan, mixed_mode
        from pipeline.artifact import RunLayout

        # the package re-exports run() under the module's name
        TR = importlib.import_module("stages.train_student.train")

        self.device, self.num_workers = device, num_workers
        self.cfg = TrainStudentConfig(cache=(str(cache),), student_config=str(student_json), out=str(out),
                                      batch_size=batch_size, num_workers=num_workers, warmup_steps=0, eval_every=0,
                                      checkpoint_every=0, verify="size", device=device.type)
        self.num_workers = self.cfg.num_workers  # None resolves to the stage's default for this machine
        env = dist_env()
        data = prepare(open_caches([cache]), env, device, "size", None, 0)
        self.plan = EpochPlan(len(data.train_rows), 1, batch_size)
        student = student_kind(self.cfg)
        self.model = student.build(0, torch.float32).to(device).train()
        self.optimizer = TR.make_optimizer(self.model, self.cfg, device)
        mixed = MIXED[mixed_mode(self.cfg, device)]
        scaler = torch.amp.GradScaler(device.type, enabled=False)
        out.mkdir(parents=True, exist_ok=True)
        plan = TrainPlan(self.cfg, env, device, mixed, RunLayout(out), student, Velocity(), data, self.plan,
                         10**9, None, get_strategy("ddp", env, device, mixed))
        plan.strategy.wrap(self.model, None, student)
        self.trainer = L.Trainer(plan, L.Parts(self.model, None, self.optimizer, scaler), L.TrainState(), out)
        self.data = data
        self._stream = self._batches()
        self._k = 0
        # The bare step's inputs: the first batches of epoch 0, collated once and moved to the device.
        sampler = RankBatches(self.plan, data.train_rows, 0, 0, 0)
        ds = D.SampleDataset(data.index, self.cfg.embedding_cache_size)
        self.memory = [L.to_batch(collate([ds[i] for i in items]), device, self.trainer.rule)
                       for items in itertools.islice(iter(sampler), 4)]
        self._m = 0

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _batches(self):
        """The stage's loader, epoch after epoch (a new DataLoader per epoch, as `Trainer.fit` makes)."""
        from stages.train_student.data import make_loader
        from stages.train_student.epoch import RankBatches

        for epoch in itertools.count():
            sampler = RankBatches(self.plan, self.data.train_rows, 0, epoch, 0)
            yield from make_loader(self.trainer.dataset, sampler, self.num_workers, self.device.type == "cuda")

    def stage_steps(self, n: int) -> None:
        """`n` optimizer steps exactly as train-student runs them."""
        for _ in range(n):
            self.trainer.step(self._stream, self._k % self.plan.steps)
            self._k += 1

    def bare_steps(self, n: int) -> None:
        """`n` steps of the same model math on batches already on the device: forward, MSE, backward,
        clip, AdamW, zero_grad; nothing else."""
        params = self.trainer.params
        objective = self.trainer.objective
        for _ in range(n):
            b = self.memory[self._m % len(self.memory)]
            self._m += 1
            objective.loss(self.model, b, self.trainer.autocast)[0].mean().backward()
            torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def overhead(bench: StepBench, steps_per_rep: int, reps: int) -> dict:
    bench.stage_steps(2)  # warm-up: the loader's workers start, the allocator settles
    bench.bare_steps(2)
    t = interleaved({"stage": lambda: bench.stage_steps(steps_per_rep),
                     "bare": lambda: bench.bare_steps(steps_per_rep)}, reps, bench.device)
    return {k: min(v) / steps_per_rep for k, v in t.items()}


# --- loader -------------------------------------------------------------------------------------------------------

def _cache_files(cache: Path) -> list[Path]:
    return [f for f in cache.rglob("*") if f.is_file()]


def raw_read(cache: Path, chunk: int = 1 << 20) -> tuple[float, int]:
    """Seconds to read every shard of `cache` sequentially (page cache dropped first), and the bytes read."""
    shards = [cache / s.path for s in load_manifest(cache).shards]
    for s in shards:
        drop_page_cache(s)
    n = 0
    t = time.perf_counter()
    for s in shards:
        with open(s, "rb", buffering=0) as f:
            while True:
                b = f.read(chunk)
                if not b:
                    break
                n += len(b)
    return time.perf_counter() - t, n


def reader_read(bench: StepBench) -> tuple[float, int]:
    """Seconds for the stage-two reader to deliver one epoch as collated batches, in the epoch's order, from
    a cold start: new reader and embedding LRU, page cache of every cache file (shards, zarr) dropped."""
    from stages.train_student.data import collate
    from stages.train_student.data import SampleDataset
    from stages.train_student.epoch import RankBatches

    for f in _cache_files(bench.data.index.caches[0].path):
        drop_page_cache(f)
    ds = SampleDataset(bench.data.index, bench.cfg.embedding_cache_size)
    n = 0
    t = time.perf_counter()
    for items in RankBatches(bench.plan, bench.data.train_rows, 0, 0, 0):
        n += len(collate([ds[i] for i in items])["keys"])
    return time.perf_counter() - t, n


def loader(bench: StepBench, reps: int) -> dict:
    samples = len(bench.data.train_rows)
    times: dict[str, list[float]] = {"raw": [], "reader": []}
    nbytes = 0
    for r in range(reps):
        for name in (["raw", "reader"] if r % 2 == 0 else ["reader", "raw"]):
            if name == "raw":
                dt, nbytes = raw_read(bench.data.index.caches[0].path)
            else:
                dt, _ = reader_read(bench)
            times[name].append(dt)
    bench.bare_steps(1)
    bare = min(timed(lambda: bench.bare_steps(1), bench.device) for _ in range(max(3, reps)))
    return {"raw_sps": samples / min(times["raw"]), "reader_sps": samples / min(times["reader"]),
            "consume_sps": bench.cfg.batch_size / bare, "bytes_per_sample": nbytes / samples}


# --- cost exponent ------------------------------------------------------------------------------------------------

def train_times(cache: Path, student_json: Path, out: Path, device: torch.device, batch_size: int) -> tuple[float, float]:
    """(training-loop seconds, wall seconds) of a one-epoch train-student run; the loop time is the last
    metrics.jsonl record's wall_s (from the first step to the last)."""
    import json

    from stages import train_student

    shutil.rmtree(out, ignore_errors=True)
    wall = train_student.run(TrainStudentConfig(
        cache=(str(cache),), student_config=str(student_json), out=str(out), epochs=1, batch_size=batch_size,
        lr=2e-3, warmup_steps=10, eval_every=0, checkpoint_every=0, log_every=1, device=device.type))["wall_s"]
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    return train[-1]["wall_s"], wall


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="Prompts of the base cache (also a scaling size).")
    ap.add_argument("--scale-prompts", type=int, default=256, help="Largest cache of the scaling runs (also 1/2, 1/4).")
    ap.add_argument("--steps", type=int, default=8, help="Teacher steps per trajectory (samples per prompt).")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="Image side of the step and scaling caches (64 -> 8x8 latents).")
    ap.add_argument("--loader-height", type=int, default=512, help="Images of the loader cache: 512x512 gives "
                    "16x64x64 float32 latents, 512 KiB a sample, about a real Wan 2.x sample (16x60x104 bf16: "
                    "390 KiB); the tiny teacher's rope table stops at 64 latents a side.")
    ap.add_argument("--loader-width", type=int, default=512)
    ap.add_argument("--loader-prompts", type=int, default=16)
    ap.add_argument("--student-config", type=Path, default=ROOT / "configs" / "student-tiny.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="Minimal sizes (smoke test).")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.scale_prompts, args.steps, args.batch_size, args.reps = 8, 8, 2, 4, 2
        args.loader_height, args.loader_width, args.loader_prompts = 128, 128, 4
    device = pick_device(args.device)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="wandistiller-bench2-"))
    try:
        teacher = write_tiny_teacher(work / "teacher", "wan2.2")
        student = args.student_config
        results = []

        cache = build_cache(teacher, prompt_file(work, args.prompts), work / "cache", device, args.steps, args.size,
                            args.size)

        # loader throughput vs the student's consumption, on a cache whose samples have a real latent shape
        lcache = build_cache(teacher, prompt_file(work, args.loader_prompts), work / "cache-loader", device, args.steps,
                             args.loader_height, args.loader_width, batch_size=4)
        lbench = StepBench(lcache, student, work / "out-loader", device, min(args.batch_size, 8), 0)
        ld = loader(lbench, args.reps)
        shape = "x".join(map(str, load_manifest(lcache).latent_shape))
        results.append(result("loader_vs_consumption", ld["reader_sps"], ld["consume_sps"], "samples/s", 10.0, ">=",
                              note=f"one reader process vs the student's training rate (batch {lbench.cfg.batch_size}, "
                                   f"same cache; latents {shape} float32, {ld['bytes_per_sample'] / 1024:.0f} "
                                   "KiB/sample, page cache dropped before each pass)"))
        del lbench

        # 7. cost exponent of train-student (one epoch) in the prompt count
        sizes = [max(1, args.scale_prompts // 4), max(2, args.scale_prompts // 2), args.scale_prompts]
        caches = {n: cache if n == args.prompts else build_cache(teacher, prompt_file(work, n), work / f"scale-{n}",
                                                                 device, args.steps, args.size, args.size)
                  for n in sizes}
        runs = [[train_times(caches[n], student, work / f"train-{n}", device, args.batch_size) for _ in range(2)]
                for n in sizes]
        loops, walls = [min(r[0] for r in rs) for rs in runs], [min(r[1] for r in rs) for rs in runs]
        e = exponent(sizes, loops)
        results.append(result("stage_two_cost_exponent", e, 1.0, "exponent", 1.15, "<=", ratio=e,
                              note=f"train-student training loop (1 epoch, batch {args.batch_size}) at {sizes} "
                                   f"prompts: {[round(t, 2) for t in loops]} s; wall {[round(t, 2) for t in walls]} s "
                                   f"(exponent {exponent(sizes, walls):.2f})"))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import sys

    res = main()
    save(res, cli_results_path(sys.argv[1:]))
    print(table(res))
