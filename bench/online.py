"""Offline (cache, then train) vs the seed design's online distillation, same teacher, student and batch.

The online step is what the single-script design ran on every rank at every optimizer step: draw a batch
of prompts and one timestep of the teacher's schedule, make x_t by noising (the cheapest choice: no
trajectory roll-out), run the teacher's conditional + unconditional forward as one batch to get the guided
target, then the student's forward, backward, clip and AdamW step. Prompt embeddings are encoded once up
front, also a concession to the online design, so the figures below are lower bounds on the offline win.

- offline_vs_online_step: time per optimizer step, stage two (train-student's own step reading the cache)
  vs the online step, interleaved in one process, best of N. ratio = online / offline (the speed-up).
- offline_vs_online_total: wall time of stage one + train-student for `epochs` epochs vs the online loop
  over the same number of samples, each in a fresh process. ratio = online / offline.
- stage_two_vs_online_peak_rss: peak RSS of the train-student process vs the online process (both fresh).

The teacher is the embedded tiny Wan 2.2 pipeline with wider, deeper experts, so that one expert has at
least 4x the student's parameters (the ratio is in the notes).

Run: python -m bench.online [--prompts 64] [--teacher-dim 128 --teacher-layers 4] [--device auto]
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    cli_results_path, in_child, interleaved, n_params, peak_rss, pick_device, prompt_file, result, save, stage_one_placement,
    student_config, table, wide_teacher,
)
from pipeline.config import TeacherCacheConfig, TrainStudentConfig

ROOT = Path(__file__).resolve().parents[1]
NEGATIVE = "blurry"
GUIDANCE = 4.0


def cache_config(teacher: str, prompts: str, out: str, device: str, steps: int, size: int, max_len: int,
                 batch_size: int) -> TeacherCacheConfig:
    return TeacherCacheConfig(teacher=teacher, prompts=prompts, out=out, placement=stage_one_placement(
        torch.device(device)), steps=steps, height=size, width=size, max_sequence_length=max_len,
        batch_size=batch_size, samples_per_shard=512, guidance=GUIDANCE, negative_prompt=NEGATIVE, overwrite=True)


def train_config(cache: str, student: str, out: str, device: str, batch_size: int, epochs: int) -> TrainStudentConfig:
    return TrainStudentConfig(cache=(cache,), student_config=student, out=out, epochs=epochs, batch_size=batch_size,
                              lr=2e-3, warmup_steps=10, eval_every=0, checkpoint_every=0,
                              device=torch.device(device).type)


class Online:
    """The online distillation step: teacher (both experts, CFG) and student in one process."""

    def __init__(self, teacher: str, prompts: str, student: str, device: torch.device, steps: int, size: int,
                 max_len: int, batch_size: int, seed: int = 0):
        from stages.teacher_cache.teacher import encode_prompts
        from stages.teacher_cache.placements import Placement, default_dtype, load_experts
        from stages.teacher_cache.teacher import load_scheduler, load_text_encoder, resolve_teacher
        from stages.teacher_cache.trajectory import Schedule
        from stages.students.compact import build_student, load_student_config
        from stages.train_student.train_plan import MIXED, mixed_mode
        from pipeline.prompts import read_prompt_file

        TR = importlib.import_module("stages.train_student.train")  # the package re-exports run() under this name
        self.device, self.batch_size = device, batch_size
        spec = resolve_teacher(teacher)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[default_dtype(device)]
        # Prompts encoded once, as stage one does; the encoder is freed before training starts.
        tokenizer, encoder = load_text_encoder(spec, self.dtype, device)
        texts = read_prompt_file(prompts)
        self.cond, _ = encode_prompts(tokenizer, encoder, texts, max_len, self.dtype, device, progress=False)
        self.uncond, _ = encode_prompts(tokenizer, encoder, [NEGATIVE], max_len, self.dtype, device, progress=False)
        self.cond, self.uncond = self.cond.to(device), self.uncond.to(device)
        del tokenizer, encoder
        scheduler = load_scheduler(spec)
        self.schedule = Schedule.build(scheduler, steps, spec.boundary_ratio, GUIDANCE, None)
        self.experts = load_experts(spec, Placement("cpu" if device.type == "cpu" else "cuda", device,
                                                    str(self.dtype).removeprefix("torch.")))
        self.latent_shape = spec.latent_shape(size, size, 1)
        cfg = load_student_config(student)
        self.student = build_student(cfg, student, seed).to(device).train()
        tcfg = train_config("unused", student, "unused", str(device), batch_size, 1)
        self.optimizer = TR.make_optimizer(self.student, tcfg, device)
        mixed = MIXED[mixed_mode(tcfg, device)]
        self.autocast = (lambda: torch.autocast(device.type, dtype=mixed)) if mixed else _null
        self.max_grad_norm = tcfg.max_grad_norm
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def teacher_params(self) -> int:
        return n_params(self.experts[0])

    def step(self) -> None:
        from cache import format as F
        from pipeline.model_call import Inputs, predict
        from stages.train_student.objective_velocity import Batch, Velocity

        b, dev = self.batch_size, self.device
        prompts = torch.randint(len(self.cond), (b,), generator=self.gen)
        k = int(torch.randint(len(self.schedule.timesteps), (1,), generator=self.gen))
        sigma, t = self.schedule.sigmas[k], self.schedule.timesteps[k]
        x0 = torch.randn(b, *self.latent_shape, generator=self.gen)
        noise = torch.randn(b, *self.latent_shape, generator=self.gen)
        x_t = ((1 - sigma) * x0 + sigma * noise).to(dev)
        cond = self.cond[prompts.to(dev)]
        timestep = torch.full((b,), t, device=dev)
        with torch.no_grad():
            x_in = x_t.to(self.dtype)
            target = predict(self.experts[self.schedule.experts[k] - 1], Inputs(x_in, timestep, cond, self.uncond),
                             self.schedule.guidance[k], batched=True).guided.float()
        inputs = Batch({F.T_X_T: x_t, F.T_TARGET: target}, timestep, cond.float(), torch.ones(b, device=dev))
        Velocity().loss(self.student, inputs, self.autocast)[0].mean().backward()
        torch.nn.utils.clip_grad_norm_(list(self.student.parameters()), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# --- child processes (fresh interpreters: their peak RSS is theirs alone) -----------------------------------------

def _threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)


def stage_one_child(cfg: dict, threads: int | None = None) -> dict:
    from stages import teacher_cache

    _threads(threads)
    t = time.perf_counter()
    s = teacher_cache.run(TeacherCacheConfig(**cfg))
    return {"wall_s": time.perf_counter() - t, "peak_rss": peak_rss(), "samples": s["samples"]}


def stage_two_child(cfg: dict, threads: int | None = None) -> dict:
    from stages import train_student

    _threads(threads)
    cfg["cache"] = tuple(cfg["cache"])
    t = time.perf_counter()
    s = train_student.run(TrainStudentConfig(**cfg))
    return {"wall_s": time.perf_counter() - t, "peak_rss": peak_rss(), "steps": s["steps"]}


def online_child(args: dict, steps: int, threads: int | None = None) -> dict:
    """The online design end to end: load the teacher and student, encode the prompts, train `steps` steps."""
    _threads(threads)
    device = torch.device(args.pop("device"))
    t = time.perf_counter()
    online = Online(device=device, **args)
    for _ in range(steps):
        online.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"wall_s": time.perf_counter() - t, "peak_rss": peak_rss()}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="Teacher steps per trajectory.")
    ap.add_argument("--size", type=int, default=64, help="Image side (64 -> 8x8 latents).")
    ap.add_argument("--max-sequence-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--teacher-dim", type=int, default=128)
    ap.add_argument("--teacher-ffn", type=int, default=512)
    ap.add_argument("--teacher-layers", type=int, default=4)
    ap.add_argument("--student-dim", type=int, default=64)
    ap.add_argument("--student-ffn", type=int, default=256)
    ap.add_argument("--student-layers", type=int, default=2)
    ap.add_argument("--num-workers", type=int, default=TrainStudentConfig.__dataclass_fields__["num_workers"].default)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="Minimal sizes (smoke test).")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.steps, args.batch_size, args.epochs, args.reps = 8, 2, 4, 1, 2
        args.teacher_dim, args.teacher_ffn, args.teacher_layers = 64, 256, 2
        args.student_dim, args.student_ffn, args.student_layers = 32, 64, 2
    device = pick_device(args.device)
    threads = torch.get_num_threads()
    work = Path(tempfile.mkdtemp(prefix="wandistiller-bench-online-"))
    try:
        teacher = wide_teacher(work / "teacher", args.teacher_dim, args.teacher_ffn, args.teacher_layers)
        prompts = prompt_file(work, args.prompts)
        student = student_config(work / "student.json", args.student_dim, args.student_ffn, args.student_layers)
        cache_cfg = cache_config(str(teacher), str(prompts), str(work / "cache"), str(device), args.steps, args.size,
                                 args.max_sequence_length, min(args.batch_size, 16))

        # total: stage one + train-student (each in its own process) vs the online loop over as many samples
        one = in_child("bench.online:stage_one_child", cfg=_asdict(cache_cfg), threads=threads)
        two = in_child("bench.online:stage_two_child", threads=threads, cfg=_asdict(train_config(
            cache_cfg.out, str(student), str(work / "train"), str(device), args.batch_size, args.epochs)))
        online_args = dict(teacher=str(teacher), prompts=str(prompts), student=str(student), device=str(device),
                           steps=args.steps, size=args.size, max_len=args.max_sequence_length,
                           batch_size=args.batch_size)
        on = in_child("bench.online:online_child", args=dict(online_args), steps=two["steps"], threads=threads)

        # per step, interleaved in this process
        from bench.stage_two import StepBench

        online = Online(**(online_args | {"device": device}))
        offline = StepBench(Path(cache_cfg.out), student, work / "out-step", device, args.batch_size,
                            args.num_workers)
        ratio_p = online.teacher_params / offline.params
        offline.stage_steps(2)
        online.step()
        k = max(2, min(8, offline.plan.steps))
        t = interleaved({"offline": lambda: offline.stage_steps(k), "online": lambda: [online.step() for _ in range(k)]},
                        args.reps, device)
        off_s, on_s = min(t["offline"]) / k, min(t["online"]) / k
        sizes = (f"teacher expert {online.teacher_params / 1e6:.2f}M params (dim {args.teacher_dim}, ffn "
                 f"{args.teacher_ffn}, {args.teacher_layers} blocks) = {ratio_p:.1f}x the student's "
                 f"{offline.params / 1e6:.2f}M; batch {args.batch_size}, {args.size}x{args.size} images")
        samples = one["samples"] * args.epochs
        # Where the totals cross: per epoch the offline run saves (online - offline step) x steps/epoch; the
        # rest of each total (start-up, loading, encoding, stage one) does not grow with the epochs.
        per_epoch = offline.plan.steps * (on_s - off_s)
        fixed_off = one["wall_s"] + two["wall_s"] - args.epochs * offline.plan.steps * off_s
        fixed_on = on["wall_s"] - args.epochs * offline.plan.steps * on_s
        even = (fixed_off - fixed_on) / per_epoch if per_epoch > 0 else float("inf")
        return [
            result("offline_vs_online_step", off_s, on_s, "s/step", 2.0, ">=", ratio=on_s / off_s,
                   note=f"ratio = online / offline; {sizes}; best of {args.reps} x {k} steps"),
            result("offline_vs_online_total", one["wall_s"] + two["wall_s"], on["wall_s"], "s", 1.0, ">=",
                   ratio=on["wall_s"] / (one["wall_s"] + two["wall_s"]),
                   note=f"ratio = online / offline; {args.epochs} epochs of {one['samples']} samples ({samples} "
                        f"student samples): stage one {one['wall_s']:.1f} s + train-student {two['wall_s']:.1f} s; "
                        "fresh process each, loading included; from the per-step times the totals cross at "
                        f"{even:.1f} epochs"),
            result("stage_two_vs_online_peak_rss", two["peak_rss"] / 2**20, on["peak_rss"] / 2**20, "MiB", 1.0, "<=",
                   note=f"peak RSS (VmHWM) of fresh processes; stage one peaked at {one['peak_rss'] / 2**20:.0f} MiB"),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _asdict(cfg) -> dict:
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(cfg)))


if __name__ == "__main__":
    import sys

    res = main()
    save(res, cli_results_path(sys.argv[1:]))
    print(table(res))
