"""`train-student --dry-run`: what a run costs, from two optimizer steps measured on this machine through the
Trainer's own `step` (the first warms up, the second is timed); nothing is written to --out. docs/usage.md."""

from __future__ import annotations

import inspect
import tempfile
import time
from pathlib import Path

import torch

from cache.size import human
from pipeline import flops
from pipeline.cache_status import frames_words
from pipeline.flops import flop
from pipeline.runtime import print0
from stages.students.student_kind import trained_parameters

from .data import make_loader
from .epoch import RankBatches
from .loop import Parts, TrainState, Trainer, make_ema, peak_memory_gib
from .train_plan import TrainPlan, lr_at

TRAINING_BYTES, EMA_BYTES = 16, 4  # per parameter: fp32 weights, gradients, AdamW's two moments; an EMA copy


def measure(p: TrainPlan, parts: Parts) -> dict:
    """Time one optimizer step after a warm-up one, print the report on rank 0 and return it."""
    cfg, epochs, device = p.cfg, p.epochs, p.device
    parts.ema = make_ema(parts.model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    with tempfile.TemporaryDirectory(prefix="wandistiller-dry-run-") as tmp:
        trainer = Trainer(p, parts, TrainState(), Path(tmp))
        sampler = RankBatches(epochs, p.data.train_rows, cfg.seed, 0, p.env.rank, 0)
        it = iter(make_loader(trainer.dataset, sampler, cfg.num_workers, device.type == "cuda"))
        timed = min(2, epochs.steps)  # a warm-up step, then the one timed (an epoch of one step: that one)
        for step in range(timed):
            for g in parts.optimizer.param_groups:
                g["lr"] = lr_at(step, p.total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
            t0 = time.perf_counter()
            trainer.data_wait_s = 0.0
            _, _, count, _ = trainer.step(it, step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            took = time.perf_counter() - t0
        wait = trainer.data_wait_s
        del it
        trainer.close_logs()
    model = parts.model
    params = (sum(p.numel() for p in model.parameters()), sum(p.numel() for _, p in trained_parameters(model)),
              sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad))
    report = _report(p, params, count, took, wait, timed)
    if (grid := getattr(p.objective, "grid", None)) is not None:  # a segment student: its steps on the cache's
        report["student_grid"] = {"spec": grid.spec, "steps": grid.bounds, "timesteps": grid.timesteps,
                                  "experts": grid.experts, "off_sigma": round(grid.off, 6), "line": grid.describe()}
    print0("\n".join(_lines(report) + ([f"schedule    {g['spec'] or 'the chosen timesteps'} {g['line']}"]
                                       if (g := report.get("student_grid")) else [])))
    return report


def _report(p: TrainPlan, params: tuple[int, int, int], count: int, took: float, wait: float, timed: int) -> dict:
    """`params`: (all, trained, bytes of the frozen ones): a LoRA student trains its adapters alone, and its frozen
    base costs its own bytes on every GPU, no gradient and no AdamW state."""
    cfg, env = p.cfg, p.env
    shards = env.world_size if p.strategy.caps.shards else 1  # the training state (and a frozen base) split
    total, trained, frozen_bytes = params
    state = (trained * (TRAINING_BYTES + (EMA_BYTES if cfg.ema_decay > 0 else 0)) + frozen_bytes) / shards
    rate = count / took
    return {"dry_run": True, "params": total, "trained_params": trained, "frozen_bytes": frozen_bytes,
            "strategy": cfg.strategy, "ema": cfg.ema_decay > 0, "world_size": env.world_size,
            "device": p.device.type, "training_state_bytes_per_gpu": int(state),
            "peak_memory_gib": round(peak_memory_gib(p.device), 3),
            "peak_memory_kind": "CUDA allocated" if p.device.type == "cuda" else "peak RSS of the process",
            "global_batch": p.epochs.global_batch * cfg.grad_accum, "step_s": round(took, 4), "warmed_up": timed > 1,
            "samples_per_s": round(rate, 3), "samples_per_s_per_rank": round(rate / env.world_size, 3),
            "data_wait_frac": round(wait / took, 3), "train_samples": len(p.data.train_rows), **p.manifest.clip(),
            "steps_per_epoch": p.epochs.steps, "total_steps": p.total, "projected_h": round(p.total * took / 3600, 3),
            **_flop_model(p, frozen_bytes > 0, p.total * p.epochs.global_batch * cfg.grad_accum)}


def _flop_model(p: TrainPlan, frozen_base: bool, samples: int) -> dict:
    """The FLOP model's figures for the run (pipeline/flops.py): a training sample's FLOPs, and the run's `samples`
    (every step's global batch, an epoch's padding included) in GPU-hours on --gpu (default: this CUDA device when
    the table has it, else H100) and in wall time on this run's ranks. A frozen base trains adapters of --lora-rank."""
    from diffusers import WanTransformer3DModel

    signature = inspect.signature(WanTransformer3DModel.__init__).parameters.items()
    cfg, m = p.cfg, p.manifest
    c = {k: v.default for k, v in signature} | p.student.config  # a key the config leaves out: the class's default
    (_, f, h, w), (pt, ph, pw) = m.latent_shape, tuple(c.get("patch_size") or (1, 2, 2))
    rank = cfg.lora_rank if frozen_base else 0
    per = flops.train_flops(c, (f // pt) * (h // ph) * (w // pw), int(m.max_sequence_length), adapter_rank=rank,
                            adapter_targets=tuple(t.strip() for t in cfg.lora_targets.split(",")),
                            checkpointing=cfg.gradient_checkpointing,
                            discriminator=getattr(p.objective, "adversarial", None) is not None)
    here = flops.detected_gpu(torch.cuda.get_device_name(p.device)) if p.device.type == "cuda" else None
    on = flops.gpu(cfg.gpu or here)
    sample_s = flops.seconds(per["total"], on)
    return {"flops_per_sample": per, "flop_gpu": on.name, "flop_sample_s": sample_s,
            "flop_gpu_hours": round(samples * sample_s / 3600, 3),
            "flop_wall_h": round(samples * sample_s / 3600 / p.env.world_size, 3),
            "flop_source": flops.speed_words(on) + flops.width_note(c)}


def _lines(r: dict) -> list[str]:
    ema, hours, fl = " + an EMA copy" if r["ema"] else "", _hours(r["projected_h"]), r["flops_per_sample"]
    per = f" ({r['samples_per_s_per_rank']:.1f} per rank of {r['world_size']})" if r["world_size"] > 1 else ""
    frozen = (f" ({r['trained_params']:,} trained; the frozen base {human(r['frozen_bytes'])})"
              if r["frozen_bytes"] else "")
    return [
        "train-student --dry-run: nothing trained, nothing written to --out",
        f"student     {r['params']:,} parameters{frozen}; training state {human(r['training_state_bytes_per_gpu'])} "
        f"per GPU ({r['strategy']}: float32 trained weights, gradients and AdamW moments{ema}"
        f"{', and the frozen base' if frozen else ''}), activations on top",
        f"measured    a step of {r['global_batch']} samples in {r['step_s']:.3g} s"
        + (" after a warm-up step" if r["warmed_up"] else " (no warm-up: the epoch has one step)")
        + f" on {r['device']}: {r['samples_per_s']:.1f} samples/s{per}; peak memory {r['peak_memory_gib']:.2f} GiB "
        f"({r['peak_memory_kind']}); {100 * r['data_wait_frac']:.0f}% of the step waiting for data",
        f"run         {r['train_samples']:,} training samples{frames_words(r)}, {r['steps_per_epoch']:,} steps an "
        f"epoch, {r['total_steps']:,} steps: {hours} at this rate",
        f"FLOP model  {flop(fl['total'])} FLOP a sample (forward {flop(fl['forward'])}, backward "
        f"{flop(fl['backward'])}" + "".join(f", {k} {flop(fl[k])}" for k in ("recompute", "discriminator")
                                            if fl.get(k)) + f"): {r['flop_sample_s']:.3g} s a sample on "
        f"{r['flop_gpu']}, the run's {r['total_steps'] * r['global_batch']:,} samples {r['flop_gpu_hours']:,.1f} "
        f"GPU-hours, {_hours(r['flop_wall_h'])} wall on {r['world_size']} GPU{'s' if r['world_size'] > 1 else ''}",
        f"            at {r['flop_source']}",
    ]


def _hours(h: float) -> str:
    return f"{h:.1f} h" if h >= 1 else f"{h * 60:.1f} min"
