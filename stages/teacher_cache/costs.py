"""What the two stages cost before they run. Stage one: prompts x seeds x steps teacher steps, times one step's
seconds: from `plan --measure` (one real step here, the first expert standing for both), `--step-time` or
`STEP_TABLE`'s figure carried to the run's tokens by the FLOP model and to `--gpu`'s peak (pipeline/flops.py). Stage
two: the samples of its epochs times one training sample's FLOPs at `--gpu`'s speed; docs/costs.md shows the table and
the model's figures too (tests/test_costs.py keeps them equal)."""

from __future__ import annotations

import inspect
import math
import tempfile
import time
from dataclasses import dataclass, replace

import torch

from cache.records import TEACHER_SHAPE
from pipeline import flops
from pipeline.config import DEFAULT_GUIDANCE, TeacherCacheConfig
from pipeline.config_types import read_object
from pipeline.errors import UserError
from pipeline.flops import STEP_TABLE, StepFigure, flop, step_flops  # noqa: F401 (StepFigure: importable from here)
from pipeline.registries import LoraSettings, placement_entry
from pipeline.model_call import InputRule, Inputs, predict

from . import placements
from .placements import ExpertSet
from .speed import TeacherSpeed, spelled
from .teacher import load_scheduler, resolve_teacher
from .trajectory import Schedule, TrajectoryRunner


@dataclass(frozen=True)
class StepTime:
    """Seconds of one teacher step of one trajectory with the chosen placement, and where the figure comes from."""

    seconds: float
    source: str


def table_step_time(transformer_config: dict, tokens: int, placement: str, text_tokens: int = 512,
                    on: flops.Gpu | None = None) -> StepTime | None:
    """The table's figure for this teacher shape and placement, carried to `tokens` by the FLOP model and to the peak
    of `on` (the table's own GPU when None), or None."""
    c = transformer_config
    shape = (c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"], c["ffn_dim"])
    fig = next((f for f in STEP_TABLE if f.shape == shape), None)
    speed = placement_entry(placement).caps.speed  # None: not measured at A14B sizes (docs/placements.md)
    if fig is None or speed is None:
        return None
    run, base = step_flops(c, tokens, text_tokens), step_flops(c, fig.tokens)["total"]
    where = (f"the table of docs/costs.md ({fig.teacher.split(' (')[0]}, {fig.height}x{fig.width}x{fig.frames}, "
             f"{fig.seconds:.2f} s on one {fig.gpu}: {flop(base)} FLOP a step, {flops.EFFICIENCY:.0%} of its bf16 "
             f"peak; {fig.source})")
    if run["total"] != base:
        attention = (run["self_attention"] + run["cross_attention"]) / run["total"]
        where = (f"FLOP model: {flop(run['total'])} FLOP a step, {run['total'] / base:.1f}x the table's (linear "
                 f"{1 - attention:.0%}, attention {attention:.0%}); calibrated by {where}")
    slower = 1.0
    if on is not None and on.name != fig.gpu:  # the same efficiency at another peak
        slower = flops.gpu(fig.gpu).tflops / on.tflops
        where += f"; on {flops.speed_words(on)}"
    if speed[1]:
        where += f"; {speed[1]}"
    return StepTime(fig.seconds * run["total"] / base / speed[0] * slower, where)


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


def train_projection(student: dict, what: str, tokens: int, text_tokens: int, samples: int, epochs: int, gpus: int,
                     on: flops.Gpu, checkpointing: bool, adapter_rank: int = 0,
                     adapter_targets: tuple[str, ...] = ()) -> dict:
    """Stage two's compute, `plan --prompts`' figure: `epochs` passes over the cache's `samples`, each one training
    sample of the transformer `student` (its config; `what` names it) by the FLOP model at the speed of `on`, over
    `gpus` GPUs training data-parallel (assumed to scale linearly; none: one)."""
    f = flops.train_flops(student, tokens, text_tokens, adapter_rank=adapter_rank, adapter_targets=adapter_targets,
                          checkpointing=checkpointing)
    sample_s = flops.seconds(f["total"], on)
    busy_h = samples * epochs * sample_s / 3600
    return {"student": what, "gradient_checkpointing": checkpointing, "samples_per_epoch": samples, "epochs": epochs,
            "flops_per_sample": f, "sample_s": sample_s, "gpu": on.name, "gpu_tflops": on.tflops,
            "efficiency": round(flops.EFFICIENCY, 4), "gpu_hours": busy_h, "gpus": max(gpus, 1),
            "wall_h": busy_h / max(gpus, 1), "source": flops.speed_words(on) + flops.width_note(student)}


def stage_two(settings, teacher: dict, plan, gpus: int, on: flops.Gpu | None) -> dict:
    """`train_projection` for `plan` (its cache's samples and tokens) and the student its `settings` (PlanSettings)
    describe: --student-config's compact student, else a LoRA of the teacher's experts with train-student's default
    rank and targets; `teacher`: the teacher's transformer config."""
    samples = plan.cache["prompts"] * plan.cache["seeds_per_prompt"] * plan.cache["recorded_steps"]
    tokens, text, on = plan.tokens_per_sample, plan.cache["max_sequence_length"], on or flops.gpu()
    common = (text, samples, settings.train_epochs, gpus, on, settings.gradient_checkpointing)
    if settings.student_config is None:
        adapter, experts = LoraSettings(), sum(c["name"].startswith("transformer") for c in plan.components)
        targets = tuple(t.strip() for t in adapter.lora_targets.split(","))
        whose = f"{experts} experts (each sample through its own expert)" if experts > 1 else "transformer"
        what = f"a rank-{adapter.lora_rank} LoRA of the teacher's {whose}"
        return train_projection(teacher, what, tokens, *common, adapter.lora_rank, targets)
    from diffusers import WanTransformer3DModel

    defaults = {k: v.default for k, v in inspect.signature(WanTransformer3DModel.__init__).parameters.items()}
    student = defaults | read_object(settings.student_config, "student config", "pass a JSON file of "
                                     "WanTransformer3DModel arguments like configs/student-1.3b.json")
    if bad := [k for k in TEACHER_SHAPE if not (type(student.get(k)) is int and student[k] >= 1)]:
        raise UserError(f"student config {settings.student_config}: {', '.join(bad)} must each be a whole number >= 1 "
                        "(the FLOP model reads them); give them as configs/student-1.3b.json does")
    patch = lambda c: math.prod(c.get("patch_size") or (1, 2, 2))  # noqa: E731 (WanTransformer3DModel's default)
    what = f"the compact student {settings.student_config}"
    return train_projection(student, what, tokens * patch(teacher) // patch(student), *common)


def render_train(t: dict) -> list[str]:
    """`plan`'s stage-two lines (`train_projection`'s figures)."""
    f, gpus = t["flops_per_sample"], f"{t['gpus']} GPU{'s' if t['gpus'] != 1 else ''}"
    passes = "forward + backward" + (" + the recompute of gradient checkpointing"
                                     if t["gradient_checkpointing"] else "")
    return [f"stage two   {t['student']}: {t['samples_per_epoch']:,} samples x {t['epochs']} epoch(s) x "
            f"{flop(f['total'])} FLOP ({passes}) = {t['sample_s']:.3g} s a sample = {t['gpu_hours']:,.1f} GPU-hours; "
            f"{_duration(t['wall_h'])} wall on {gpus}",
            f"            sample time: FLOP model (forward {flop(f['forward'])}, backward {flop(f['backward'])}"
            + (f", recompute {flop(f['recompute'])}" if f["recompute"] else "") + f" FLOP, one sequence: no CFG) at "
            f"{t['source']}"] + [line for c in t.get("commands", ()) for line in
                                 [f"  {c['when']}:", *("    " + w for w in c["command"].splitlines())]]


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
        runner = TrajectoryRunner([experts[0]], scheduler, schedule, 2, p.torch_dtype, p.device, InputRule.of(spec))
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
    text = torch.zeros(b, cfg.max_sequence_length, spec.transformer_config["text_dim"], device=device, dtype=dtype)
    inputs = Inputs(latents, torch.full((b,), 999.0, device=device), text, text[:1])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    for _ in range(2):  # the first warms up
        t0 = time.perf_counter()
        predict(model, inputs, DEFAULT_GUIDANCE, runner.rule, batched=True)
        sync(device)
    return time.perf_counter() - t0
