"""What stage one costs before it runs: prompts x seeds x steps teacher steps, times one step's seconds: from
`plan --measure` (one real step here, the first expert standing for both), `--step-time` or `STEP_TABLE`'s figure
carried to the run's tokens by the FLOP model (`step_flops`); docs/costs.md shows the table and the model's figures
too (tests/test_costs.py keeps them equal)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace

import torch

from pipeline.config import DEFAULT_GUIDANCE, TeacherCacheConfig
from pipeline.errors import UserError
from pipeline.registries import placement_entry
from pipeline.sampling import model_timestep

from . import placements
from .speed import TeacherSpeed, spelled
from .teacher import ExpertSet, load_scheduler, resolve_teacher
from .trajectory import Schedule, TrajectoryRunner


@dataclass(frozen=True)
class StepFigure:
    """A measured teacher step: one denoising step of one trajectory, CFG on (two sequences in one forward), bf16."""

    shape: tuple[int, int, int]  # (dim, num_layers, ffn_dim) of the transformer that ran it
    teacher: str
    height: int
    width: int
    frames: int
    seconds: float
    gpu: str
    source: str
    image_tokens: int = 0  # an image-to-video teacher's image tokens, which its cross-attention attends to too

    @property
    def tokens(self) -> int:
        """Latent tokens per sequence (Wan's VAE: 4x in time, 16x in space with patch 2)."""
        return ((self.frames - 1) // 4 + 1) * (self.height // 16) * (self.width // 16)


STEP_TABLE = (
    StepFigure((5120, 40, 13824), "Wan2.2-T2V-A14B (one expert; Wan2.1-T2V-14B has the same shape)", 480, 832, 1,
               0.20, "H100", "issue 35's figure, not measured by this repo; a FLOP count agrees"),
)
PEAK_TFLOPS = {"H100": 989, "H200": 989}  # dense bf16, without sparsity


@dataclass(frozen=True)
class StepTime:
    """Seconds of one teacher step of one trajectory with the chosen placement, and where the figure comes from."""

    seconds: float
    source: str


def step_flops(transformer_config: dict, tokens: int, text_tokens: int = 512, cfg: bool = True,
               image_tokens: int = 0) -> dict:
    """FLOPs of one teacher step of one trajectory (2 per multiply-add) over num_layers Wan blocks: `linear` (self-
    attention's q, k, v, o and cross-attention's q, o on the latent tokens, its k, v on the text and image tokens, the
    FFN), `self_attention` (QK^T and AV: 2 L^2 dim multiply-adds a block) and `cross_attention` (the same over the
    text and image tokens); CFG runs two sequences. Not counted: norms, RoPE, modulation, the patch embedding, the
    head and the embedders (under 0.2% at A14B's width)."""
    c = transformer_config
    dim, ctx = c["num_attention_heads"] * c["attention_head_dim"], text_tokens + image_tokens
    per_block = {"linear": tokens * (6 * dim * dim + 2 * dim * c["ffn_dim"]) + ctx * 2 * dim * dim,
                 "self_attention": 2 * tokens * tokens * dim, "cross_attention": 2 * tokens * ctx * dim}
    out = {k: 2 * v * c["num_layers"] * (2 if cfg else 1) for k, v in per_block.items()}
    return out | {"total": sum(out.values())}


def table_step_time(transformer_config: dict, tokens: int, placement: str, text_tokens: int = 512) -> StepTime | None:
    """The table's figure for this teacher shape and placement, carried to `tokens` by the FLOP model, or None."""
    c = transformer_config
    shape = (c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["ffn_dim"])
    fig = next((f for f in STEP_TABLE if f.shape == shape), None)
    speed = placement_entry(placement).caps.speed  # None: not measured at A14B sizes (docs/placements.md)
    if fig is None or speed is None:
        return None
    run, base = step_flops(c, tokens, text_tokens), step_flops(c, fig.tokens)["total"]
    peak = base / fig.seconds / PEAK_TFLOPS[fig.gpu] / 1e12
    where = (f"the table of docs/costs.md ({fig.teacher.split(' (')[0]}, {fig.height}x{fig.width}x{fig.frames}, "
             f"{fig.seconds:.2f} s on one {fig.gpu}: {flop(base)} FLOP a step, {peak:.0%} of its bf16 peak; "
             f"{fig.source})")
    if run["total"] != base:
        attention = (run["self_attention"] + run["cross_attention"]) / run["total"]
        where = (f"FLOP model: {flop(run['total'])} FLOP a step, {run['total'] / base:.1f}x the table's (linear "
                 f"{1 - attention:.0%}, attention {attention:.0%}); calibrated by {where}")
    if speed[1]:
        where += f"; {speed[1]}"
    return StepTime(fig.seconds * run["total"] / base / speed[0], where)


def cache_compute(header, prompts: int) -> dict:
    """`cache info --prompts`'s compute figures for `prompts` prompts of a cache like `header`'s (a CacheHeader):
    its teacher steps (every step runs, recorded or not) and, for a teacher of the table's shape, the FLOP model's
    seconds a step and GPU-hours on the table's GPU (placement cuda)."""
    out = {"projected_teacher_steps": (steps := prompts * header.seeds_per_prompt * header.steps)}
    if header.teacher_shape is None:
        return out | {"projected_teacher_time": "not recorded by the stage one that made this cache (the teacher's "
                                                "shape): `wandistiller plan --prompts N` gives it"}
    (_, f, h, w), (pt, ph, pw) = header.latent_shape, header.patch_size
    step = table_step_time(header.teacher_shape, (f // pt) * (h // ph) * (w // pw), "cuda", header.max_sequence_length)
    if step is None:
        return out | {"projected_teacher_time": "no table figure for this teacher's shape: `wandistiller plan --measure "
                                                "--prompts N` on the GPU box times a step"}
    return out | {"teacher_step_s": round(step.seconds, 3), "projected_teacher_gpu_hours": round(
        steps * step.seconds / 3600, 1), "teacher_step_source": step.source}


def flop(x: float) -> str:
    return f"{x:.2e}".replace("e+", "e")


def project(prompts: int, seeds: int, steps: int, step: StepTime, parts: int, gpus_per_part: int) -> dict:
    """Stage one's teacher compute for `prompts`: `parts` processes at once, each holding `gpus_per_part` GPUs."""
    step_count = prompts * seeds * steps
    busy_s = step_count * step.seconds  # one process's seconds for the whole run
    return {"teacher_steps": step_count, "step_s": step.seconds, "step_source": step.source, "parts": parts,
            "gpus": parts * gpus_per_part, "wall_h": busy_s / parts / 3600,
            "gpu_hours": busy_s * gpus_per_part / 3600}


def render(c: dict, prompts: int, seeds: int, steps: int) -> list[str]:
    gpus = f"{c['gpus']} GPU{'s' if c['gpus'] != 1 else ''}" if c["gpus"] else "the CPU"
    step_s = f"{c['step_s']:.2f}" if c["step_s"] >= 0.1 else f"{c['step_s']:.3g}"
    return [f"time        {prompts:,} prompts x {seeds} seed(s) x {steps} steps = {c['teacher_steps']:,} teacher steps x "
            f"{step_s} s = {c['gpu_hours']:,.1f} GPU-hours; {_duration(c['wall_h'])} wall on {gpus}",
            f"            step time: {c['step_source']}",
            "            (the teacher's compute alone: loading the weights and encoding the prompts add minutes per "
            "process)"]


def _duration(hours: float) -> str:
    if hours >= 48:
        return f"{hours / 24:.1f} days"
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def measure_step(run: TeacherCacheConfig, placement: str, log=print) -> StepTime:
    """Seconds of one teacher step of one trajectory with the concrete `placement` and the run's shape."""
    spec = resolve_teacher(run.teacher, run.revision)
    spec.check_sizes(run.height, run.width, run.frames)
    with tempfile.TemporaryDirectory(prefix="wandistiller-measure-") as tmp:
        cfg = replace(run, prompts="(plan --measure)", out=tmp, placement=placement)
        try:
            p = placements.choose_placement(cfg, spec)
        except UserError as e:
            raise UserError(f"--measure runs the step on this machine: {e}") from e
        speed = TeacherSpeed.of(cfg)
        speed.check(p)
        t0 = time.perf_counter()
        experts = ExpertSet(spec, p, log, speed.prepare)
        experts.activate((1,))
        load_s = time.perf_counter() - t0
        scheduler = load_scheduler(spec)
        schedule = Schedule.build(scheduler, 2, None, DEFAULT_GUIDANCE, None)  # one expert, CFG on
        runner = TrajectoryRunner([experts[0]], scheduler, schedule, 2, p.torch_dtype, p.device,
                                  spec.expand_timesteps, patch=spec.patch_size)
        seconds = _time_step(runner, experts[0], spec, cfg, p.device, p.torch_dtype)
        experts.close()
    b, options = cfg.batch_size, speed.numerics(p.device)
    with_options = f", {spelled(options)}" if options else ""
    log(f"measured: one step of {b} trajectories in {seconds:.3f} s with placement {p.name} on {p.device} "
        f"({p.dtype}{with_options}; the expert loaded in {load_s:.1f} s)")
    return StepTime(seconds / b, f"measured here by --measure: {seconds:.3g} s for a batch of {b}, placement "
                                 f"{p.name} on {p.device}, {p.dtype}{with_options}")


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
    for _ in range(2):  # the first warms up
        t0 = time.perf_counter()
        runner.predict(model, latents, timestep, context, DEFAULT_GUIDANCE)
        sync(device)
    return time.perf_counter() - t0
