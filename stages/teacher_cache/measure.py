"""`plan --measure`: the time of one real teacher step (`TrajectoryRunner.predict`) with the chosen placement on
this machine, on noise and zero text embeddings, the first expert standing for both (docs/costs.md).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace

import torch

from pipeline.config import DEFAULT_GUIDANCE, TeacherCacheConfig
from pipeline.errors import UserError
from pipeline.wan_inputs import model_timestep

from . import placements
from .costs import StepTime
from .teacher import ExpertSet, load_scheduler, resolve_teacher
from .trajectory import Schedule, TrajectoryRunner


def measure_step(run: TeacherCacheConfig, placement: str, log=print) -> StepTime:
    """Seconds of one teacher step of one trajectory (a batch of `run.batch_size` timed, divided by it), run with the
    concrete `placement` and the run's shape."""
    spec = resolve_teacher(run.teacher, run.revision)
    spec.check_sizes(run.height, run.width, run.frames)
    with tempfile.TemporaryDirectory(prefix="wandistiller-measure-") as tmp:
        cfg = replace(run, prompts="(plan --measure)", out=tmp, placement=placement)
        try:
            p = placements.choose_placement(cfg, spec)
        except UserError as e:
            raise UserError(f"--measure runs the step on this machine: {e}") from e
        t0 = time.perf_counter()
        experts = ExpertSet(spec, p, log)
        experts.activate((1,))
        load_s = time.perf_counter() - t0
        scheduler = load_scheduler(spec)
        schedule = Schedule.build(scheduler, 2, None, DEFAULT_GUIDANCE, None)  # one expert, CFG on
        runner = TrajectoryRunner([experts[0]], scheduler, schedule, 2, p.torch_dtype, p.device,
                                  spec.expand_timesteps, patch=spec.patch_size)
        seconds = _time_step(runner, experts[0], spec, cfg, p.device, p.torch_dtype)
        experts.close()
    b = cfg.batch_size
    log(f"measured: one step of {b} trajectories in {seconds:.3f} s with placement {p.name} on {p.device} "
        f"({p.dtype}; the expert loaded in {load_s:.1f} s)")
    return StepTime(seconds / b, f"measured here by --measure: {seconds:.3g} s for a batch of {b}, placement "
                                 f"{p.name} on {p.device}, {p.dtype}")


@torch.inference_mode()
def _time_step(runner: TrajectoryRunner, model, spec, cfg: TeacherCacheConfig, device: torch.device,
               dtype: torch.dtype) -> float:
    """The second of two steps, in seconds (the first warms up)."""
    b = cfg.batch_size
    latents = torch.randn(b, *spec.latent_shape(cfg.height, cfg.width, cfg.frames), device=device).to(dtype)
    context = torch.zeros(2 * b, cfg.max_sequence_length, spec.transformer_config["text_dim"], device=device,
                          dtype=dtype)
    t = torch.full((b,), 999.0, device=device)
    timestep = model_timestep(t, latents.shape[2:], spec.expand_timesteps, spec.patch_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    runner.predict(model, latents, timestep, context, DEFAULT_GUIDANCE)  # warms up
    sync(device)
    t0 = time.perf_counter()
    runner.predict(model, latents, timestep, context, DEFAULT_GUIDANCE)
    sync(device)
    return time.perf_counter() - t0
