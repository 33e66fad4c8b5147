"""A LoRA export's ComfyUI side: the student's schedule as ComfyUI's samplers spell it (steps, the expert switch
step, ModelSamplingSD3's shift, sampler and scheduler, CFG) and a workflow in ComfyUI's API format that applies the
export's adapter files to the teacher's expert models (docs/lora.md, "ComfyUI")."""

from __future__ import annotations

from dataclasses import dataclass

from cache.records import TeacherLora
from pipeline.artifact import DistillRecord
from pipeline.lora_experts import COMPONENTS
from pipeline.model_call import CONCAT, InputRule
from pipeline.sampling import FLOW_EULER, own_sampler, student_scheduler

WORKFLOW = "comfyui-workflow.json"
HYBRID_WORKFLOW = "comfyui-hybrid-workflow.json"  # the teacher, then the run (hybrid_passes)
# ComfyUI's files of the teachers it ships templates for (Comfy-Org's repackaged weights, the names its Wan
# templates load): {Hub id: (a diffusion model per expert, text encoder, VAE)}
KNOWN = {
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (("wan2.2_t2v_high_noise_14B_fp16.safetensors",
                                          "wan2.2_t2v_low_noise_14B_fp16.safetensors"),
                                         "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors"),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": (("wan2.2_i2v_high_noise_14B_fp16.safetensors",
                                          "wan2.2_i2v_low_noise_14B_fp16.safetensors"),
                                         "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors"),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": (("wan2.2_ti2v_5B_fp16.safetensors",), "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                        "wan2.2_vae.safetensors"),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": (("wan2.1_t2v_14B_fp16.safetensors",), "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                        "wan_2.1_vae.safetensors"),
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": (("wan2.1_t2v_1.3B_fp16.safetensors",),
                                         "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors"),
}
ROLES = dict(zip(COMPONENTS, ("high-noise", "low-noise")))
FIRST_FRAME_FILE = "first_frame.png"  # an image-to-video workflow's LoadImage (ComfyUI's input folder)
# Below this, ComfyUI's schedule and the student's visit the same points (float32 rounding, and ComfyUI's table of
# 1000 sigmas against UniPC's endpoint 1 - 1/1000)
SAME = 2e-3


@dataclass(frozen=True)
class Schedule:
    """The student's K steps as ComfyUI runs them: KSamplerAdvanced `steps`, the step where the low-noise expert
    takes over (`switch`), ModelSamplingSD3's `shift`, and the sigmas of both."""

    steps: int
    switch: int  # how many of the K steps the high-noise expert takes (K: a one-expert teacher's)
    shift: float
    chosen: bool  # the shift is the run's own (--student-shift); else the teacher's flow_shift
    sampler: str
    trained: list[float]  # the sigmas the student was trained to start its steps at
    comfy: list[float]  # those ComfyUI's simple scheduler visits at `shift`

    @property
    def difference(self) -> float:
        return max(abs(a - b) for a, b in zip(self.trained, self.comfy))

    @property
    def exact(self) -> bool:
        return self.chosen and self.difference <= SAME


def comfy_sigmas(shift: float, steps: int) -> list[float]:
    """ComfyUI's `simple` scheduler on a Wan model patched by ModelSamplingSD3(shift): its table of 1000 flow sigmas
    (comfy/model_sampling.py ModelSamplingDiscreteFlow: shift t / (1 + (shift - 1) t), t = 1/1000 .. 1) read at
    every 1000/K-th entry from the top (comfy/samplers.py simple_scheduler), without the final 0."""
    table = [shift * t / (1 + (shift - 1) * t) for t in ((i + 1) / 1000 for i in range(1000))]
    return [table[-(1 + int(x * len(table) / steps))] for x in range(steps)]


def schedule(record: DistillRecord, experts: list[str], boundary_timestep: float | None) -> Schedule:
    """The schedule of the student `record` describes (on a teacher of `experts`, the first running at t >=
    `boundary_timestep`: boundary_ratio x num_train_timesteps), from what it recorded: its boundaries (the teacher's
    steps where its K steps start), else its scheduler's K steps; the run's --student-shift, else the teacher's
    flow_shift."""
    sched = student_scheduler(record)
    bounds = record.objective_settings.get("boundaries")
    steps = len(bounds) if bounds else record.sampling_steps
    sched.set_timesteps(steps)
    if bounds:
        timesteps, trained = [record.timesteps[b] for b in bounds], [record.sigmas[b] for b in bounds]
    else:
        timesteps, trained = sched.timesteps.tolist()[:steps], sched.sigmas.tolist()[:steps]
    switch = steps if len(experts) == 1 else sum(float(t) >= boundary_timestep for t in timesteps)
    teacher_shift, sampler = teacher_sampling(record.scheduler)
    chosen = (shift := record.objective_settings.get("student_shift")) is not None
    shift, sampler = (shift if chosen else teacher_shift), (sampler if own_sampler(record) is None else "euler")
    return Schedule(steps, switch, float(shift), chosen, sampler, [round(float(s), 4) for s in trained],
                    [round(s, 4) for s in comfy_sigmas(float(shift), steps)])


def teacher_sampling(conf: dict) -> tuple[float, str]:
    """(ModelSamplingSD3's shift, the KSampler's sampler name) of the teacher's scheduler config `conf`."""
    flow = conf["_class_name"] == FLOW_EULER
    sampler = "euler" if flow else "uni_pc_bh2" if conf.get("solver_type") == "bh2" else "uni_pc"
    return float(conf.get("shift" if flow else "flow_shift", 1.0)), sampler


def model_files(base_model: str | None, experts: int, teacher: str) -> tuple[tuple[str, ...], str, str, bool]:
    """(each of the `experts` diffusion models, the text encoder, the VAE, known): ComfyUI's own file names of the
    teacher, else names that say they are the user's to fill in."""
    if base_model in KNOWN and len(KNOWN[base_model][0]) == experts:
        return (*KNOWN[base_model], True)
    models = tuple(f"{teacher}-{ROLES[c] if experts > 1 else 'model'}.safetensors" for c in COMPONENTS[:experts])
    return models, f"{teacher}-umt5.safetensors", f"{teacher}-vae.safetensors", False


@dataclass(frozen=True)
class Pass:
    """One KSamplerAdvanced of a workflow: expert `comp`'s model (through its adapter when `adapted`) patched to `shift`,
    steps `start`-`end` of a `steps`-step `sampler` schedule, at `cfg`."""

    comp: str
    adapted: bool
    shift: float
    sampler: str
    cfg: float
    steps: int
    start: int
    end: int
    who: str = ""  # the title's owner: "teacher" in a hybrid's teacher part


def own_passes(sched: Schedule, experts: list[str], adapters: dict[str, str], cfg: float) -> list[Pass]:
    """The run's own: the K steps split at the switch step, each expert's through its adapter (an expert of no step
    left out)."""
    spans = dict(zip(experts, [(0, sched.switch), (sched.switch, sched.steps)]))  # (one expert: all K steps)
    return [Pass(c, c in adapters, sched.shift, sched.sampler, cfg, sched.steps, *spans[c]) for c in experts
            if spans[c][0] < spans[c][1]]


def hybrid_passes(record: DistillRecord, sched: Schedule, experts: list[str], boundary_timestep: float) -> list[Pass]:
    """eval's and sample's --hybrid as ComfyUI runs it: the teacher's own models (no adapter) at the cache's guidance,
    sampler and shift over its steps up to the run's first low-noise boundary (its high-noise steps, then any low-noise
    ones before that boundary), then the run's low-noise adapter from its step `switch` on, at CFG 1. Empty for a
    run without boundaries or a one-expert teacher."""
    bounds = record.objective_settings.get("boundaries")
    if not bounds or len(experts) < 2 or not 0 < sched.switch < sched.steps:
        return []
    n, stop = record.steps, int(bounds[sched.switch])
    switch = sum(float(t) >= boundary_timestep for t in record.timesteps)
    shift, sampler = teacher_sampling(record.scheduler)
    guidance = [record.guidance, record.guidance if record.guidance_2 is None else record.guidance_2]
    teacher = [Pass(c, False, shift, sampler, g, n, a, b, "teacher") for c, g, (a, b) in
               zip(experts, guidance, [(0, switch), (switch, stop)]) if a < b]
    return teacher + [Pass(experts[1], True, sched.shift, sched.sampler, 1.0, sched.steps, sched.switch, sched.steps)]


def hybrid_card(passes: list[Pass], teacher_loras: list[TeacherLora] | None = None) -> str:
    """The card's paragraph on the hybrid workflow: its samplers and how far apart ComfyUI's two schedules hand over."""
    *_, last, run = passes  # (the teacher's last sampler, then the run's)
    left, starts = _sigma_at(last), _sigma_at(run, run.start)
    files = ", ".join(r.file for r in teacher_loras or ())
    models = (f"the teacher's own models with the LoRAs its cache was drawn with ({files}: put them in ComfyUI's "
              "loras folder)" if files else "the teacher's own models, no adapter")
    return (f"\n`{HYBRID_WORKFLOW}` is the hybrid users run to keep the teacher's motion, as `wandistiller eval "
            f"--hybrid` measures it: {models}, at CFG {last.cfg:g} over steps 0-{last.end} "
            f"of its {last.steps}-step {last.sampler} schedule (shift {last.shift:g}), then the low-noise adapter over "
            f"steps {run.start}-{run.end} of its own {run.steps} at CFG 1. ComfyUI's teacher schedule hands over at "
            f"sigma {left:.4f}, where the adapter's starts at {starts:.4f}.\n")


def _sigma_at(p: Pass, step: int | None = None) -> float:
    """The sigma ComfyUI's simple schedule of pass `p` reaches at `step` (its end by default; 0 past the last)."""
    at = p.end if step is None else step
    return comfy_sigmas(p.shift, p.steps)[at] if at < p.steps else 0.0


def workflow(sched: Schedule, experts: list[str], adapters: dict[str, str], hints: dict, files: tuple,
             rule: InputRule, prompt: str = "a lighthouse at night", passes: list[Pass] | None = None,
             teacher_loras: list[TeacherLora] | None = None) -> dict:
    """The API-format workflow (node id -> class_type, inputs, links as [node id, output]): each expert's model
    through its LoraLoaderModelOnly (strength 1) and ModelSamplingSD3, a KSamplerAdvanced per expert (the
    high-noise one's leftover noise handed to the low-noise one at the switch step), decoded and saved; an
    image-to-video student's (hints' `condition`) from a loaded first frame, as ComfyUI's Wan templates take it.
    `passes`: other samplers than the run's own (`hybrid_passes`), whose teacher passes load `teacher_loras` (the
    LoRAs fused into the teacher the run's cache was drawn with) at their scales."""
    passes = passes or own_passes(sched, experts, adapters, hints.get("guidance_scale", 1.0))
    models, clip, vae, _ = files
    nodes: dict[str, dict] = {}

    def add(kind: str, title: str, **inputs) -> list:
        nodes[str(len(nodes) + 1)] = {"class_type": kind, "inputs": inputs, "_meta": {"title": title}}
        return [str(len(nodes)), 0]

    text = add("CLIPLoader", "Load CLIP (umt5)", clip_name=clip, type="wan", device="default")
    vae_node = add("VAELoader", "Load VAE", vae_name=vae)
    positive = add("CLIPTextEncode", "Prompt", text=prompt, clip=text)
    guided = any(p.cfg != 1.0 for p in passes)
    negative = add("CLIPTextEncode", "Negative prompt" + ("" if guided else " (unused at CFG 1)"),
                   text=hints.get("negative_prompt", "") if guided else "", clip=text)
    size = dict(width=hints.get("width"), height=hints.get("height"), length=hints.get("num_frames", 1), batch_size=1)
    condition = hints.get("condition")
    image = {"start_image": add("LoadImage", "First frame", image=FIRST_FRAME_FILE)} if condition else {}
    if condition == CONCAT:  # Wan2.2-I2V: the image latent and mask on the conditioning, the latent empty
        i2v = add("WanImageToVideo", "Image to video", positive=positive, negative=negative, vae=vae_node, **size,
                  **image)
        positive, negative, latent = i2v, [i2v[0], 1], [i2v[0], 2]
    else:  # (TI2V: the image in latent frame 0)
        latent = (add("Wan22ImageToVideoLatent", "Empty latent video", vae=vae_node, **size, **image)
                  if rule.per_token else add("EmptyHunyuanLatentVideo", "Empty latent video", **size))
    loaded = {}
    for i, p in enumerate(passes):
        role = ROLES[p.comp] if len(experts) > 1 else "the"
        if p.comp not in loaded:
            loaded[p.comp] = add("UNETLoader", f"Load {role} model", unet_name=models[experts.index(p.comp)],
                                 weight_dtype="default")
        model = loaded[p.comp]
        if p.adapted and p.comp in adapters:
            model = add("LoraLoaderModelOnly", f"LoRA ({role})", model=model, lora_name=adapters[p.comp],
                        strength_model=1.0)
        for r in (teacher_loras or ()) if p.who == "teacher" else ():
            if experts.index(p.comp) + 1 in r.experts:
                model = add("LoraLoaderModelOnly", f"Teacher LoRA {r.file} ({role})", model=model, lora_name=r.file,
                            strength_model=r.scale)
        who = f"{p.who}, {role}" if p.who else role
        model = add("ModelSamplingSD3", f"Shift ({who})", model=model, shift=p.shift)
        latent = add("KSamplerAdvanced", f"Sampler ({who}: steps {p.start}-{p.end}" +
                     (f" of {p.steps})" if p.who else ")"), model=model,
                     add_noise="enable" if i == 0 else "disable", noise_seed=0, steps=p.steps, cfg=p.cfg,
                     sampler_name=p.sampler, scheduler="simple", positive=positive, negative=negative,
                     latent_image=latent, start_at_step=p.start, end_at_step=p.end,
                     return_with_leftover_noise="enable" if i < len(passes) - 1 else "disable")
    images = add("VAEDecode", "Decode", samples=latent, vae=vae_node)
    add("SaveAnimatedWEBP", "Save", images=images, filename_prefix="wandistiller", fps=16, lossless=False,
        quality=90, method="default")
    return nodes


def card(sched: Schedule, experts: list[str], adapters: dict[str, str], boundary_timestep: float | None,
         hints: dict, files: tuple, teacher: str, wan: bool) -> str:
    """The model card's ComfyUI section: the workflow, its numbers, and how far its schedule is from the student's."""
    models, clip, vae, known = files
    both, cfg = len(experts) > 1, hints.get("guidance_scale", 1.0)
    negative = "negative prompt empty: CFG 1 never runs it" if cfg == 1.0 else "the cache's negative prompt"
    applied = ", ".join(f"`{f}` on the {ROLES[c] if both else 'teacher'} model" for c, f in adapters.items())
    if len(experts) > len(adapters):
        other = next(c for c in experts if c not in adapters)
        applied += f"; the {ROLES[other]} model has none: the teacher's own weights"
    switch = (f"| switch step | {sched.switch} (the high-noise expert runs steps 0-{sched.switch}, then the "
              f"low-noise one steps {sched.switch}-{sched.steps}: the teacher's boundary at t >= "
              f"{boundary_timestep:g}) |\n" if both else "")
    grid = f"ComfyUI's simple schedule at shift {sched.shift:g} visits sigmas {sched.comfy}"
    if sched.exact:
        fit = f"{grid}, the points the student was trained at (max difference {sched.difference:.2g})."
    else:
        why = ("its own --student-shift" if sched.chosen else
               f"the teacher's {hints.get('teacher_steps')}-step schedule cut into {sched.steps} segments")
        fit = (f"That is an approximation: the student was trained at sigmas {sched.trained} ({why}), and {grid} "
               f"(max difference {sched.difference:.2g}), the nearest a KSampler's schedule comes; diffusers, with "
               "the scheduler above, samples the trained points.")
    names = ("The model, text encoder and VAE files are ComfyUI's own (Comfy-Org's repackaged weights: "
             f"{', '.join(f'`{m}`' for m in models)}, `{clip}`, `{vae}`)." if known else
             f"`{teacher}` has no ComfyUI files that this export knows of: the loaders name "
             f"{', '.join(f'`{m}`' for m in (*models, clip, vae))}, which stand for your own conversions of its "
             "experts, text encoder and VAE; point them at your files.")
    if hints.get("condition"):
        node = "WanImageToVideo" if hints["condition"] == CONCAT else "Wan22ImageToVideoLatent"
        keys = (f"The clip starts from `{FIRST_FRAME_FILE}` (a LoadImage: put your image in ComfyUI's `input` folder), "
                f"passed to {node} as its start_image. ")
    else:
        keys = ""
    keys += ("The adapter files hold the original Wan key names, which ComfyUI's LoRA loader reads: copy them to "
            "`models/loras`." if wan else "These adapter files hold diffusers' key names; ComfyUI reads the "
            "original Wan key names, which `wandistiller export --lora-format wan` writes (the same workflow "
            "loads them): copy those to `models/loras`.")
    return f"""
## ComfyUI

`{WORKFLOW}` is the workflow in ComfyUI's API format (open it in ComfyUI, or queue it with `POST /prompt`): each
expert's model through a LoraLoaderModelOnly at strength 1.0 ({applied}) and a ModelSamplingSD3, then a
KSamplerAdvanced per expert, the first handing its leftover noise to the second. {keys}

| setting | value |
|---|---|
| sampler / scheduler | {sched.sampler} / simple |
| steps | {sched.steps} |
{switch}| CFG | {cfg} ({negative}) |
| shift | {sched.shift:g} (ModelSamplingSD3{' on each expert' if both else ''}) |
| size | {hints.get('width')} x {hints.get('height')} (width x height), length {hints.get('num_frames', 1)} (frames) |

{fit} {names}
"""
