"""A LoRA run's `wandistiller export` (the LoRA student kind: stages/students/lora.py): the adapters, their card and
ComfyUI's workflow (comfyui.py), or with `--fuse` the merged pipeline (docs/lora.md, "Using it")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from cache import safe_open, safe_write
from cache.atomic import honour_umask
from cache.format import DTYPES
from pipeline import lora_experts
from pipeline.artifact import DISTILL, LORA_JSON
from pipeline.config import ExportConfig
from pipeline.errors import UserError
from pipeline.hub import is_hub_id
from pipeline.model_call import InputRule
from pipeline.sampling import own_sampler, student_scheduler
from pipeline.teacher_files import I2V_PIPELINE, read_index
from stages.students.student_kind import FIX, Student

from . import comfyui, hub_card
from .hub_card import MARK, building, draw, sigmas_sentence


def readme(student: Student, hints: dict, name: str, base: str, fused: bool, comfy: str = "") -> str:
    """The model card: base, steps, guidance 1, text length, a call, then `comfy` (ComfyUI's section); `name`,
    `base`: public."""
    steps, msl = hints.get("num_inference_steps"), hints.get("max_sequence_length")
    lora = replace(student.lora, teacher=base)
    call = ", ".join(f"{k}={hints[k]!r}" for k in ("num_inference_steps", "height", "width", "max_sequence_length")
                     if k in hints)
    experts = ", ".join(f"`{f}` ({c})" for c, f in lora.files.items())
    video, draw_call = draw(hints, f"guidance_scale=1.0, {call}")
    pipeline = hub_card.pipeline_class(hints, "WanPipeline")  # (an image-to-video teacher's: called from an image)
    frames = hints.get("num_frames")
    rows = f"\n| num_frames | {frames} (the clip length it was trained on) |" if frames else ""
    if "sigmas" in hints:  # a chosen schedule, said as the full export's card says it
        rows += "\n\n" + sigmas_sentence(hints, "model_index.json" if fused else LORA_JSON, "The LoRA's")
    if fused:
        load = (f'pipe = {pipeline}.from_pretrained("{name}", torch_dtype=torch.bfloat16).to("cuda")  '
                "# adapters merged, scheduler included")
    else:
        where = "" if is_hub_id(base) else "  # the base: where your copy of the teacher lies"
        load = (f'pipe = {pipeline}.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda"){where}\n'
                f'pipe.scheduler = UniPCMultistepScheduler.from_pretrained("{name}", subfolder="scheduler")\n'
                + "\n".join(f'pipe.load_lora_weights("{name}", weight_name="{f}", adapter_name="{comp}"'
                            + (", load_into_transformer_2=True)" if comp == "transformer_2" else ")")
                            for comp, f in student.lora.files.items()))
    if student.members:  # a pair: each expert trained in a run of its own
        trained = " and ".join(f"{m.setting('optimizer_steps')} steps ({m.lora.trained[0]})" for m in student.members)
        trained = f"one run per expert, trained {trained},"
    else:
        trained = f"trained\n{student.setting('optimizer_steps')} steps"
    half, carried = "", hub_card.carried_teacher_loras(student.distill, "This LoRA on the plain base")
    if len(lora.experts) > len(lora.files):  # one expert of two: the other runs with the teacher's weights
        half = ("\nThis export holds one expert's adapter: the other expert runs with the teacher's own weights. "
                "`wandistiller export --student RUN1 --student RUN2` exports the two one-expert runs as one.\n")
    return f"""# WanDistiller LoRA: {steps}-step, guidance 1, on {lora.teacher}

Base: `{lora.teacher}`{f" (revision {lora.revision})" if lora.revision else ''}. Rank {lora.rank},
alpha {lora.alpha:g}, on {', '.join(lora.targets)} of every block. Adapters: {experts}; {trained} from the \
teacher's cached guided trajectories (objective
`{student.setting('objective')}`){', merged into the base (`--fuse`)' if fused else ''}.{carried}
{half}
| setting | use |
|---|---|
| num_inference_steps | {steps} (the schedule in `scheduler/`: other counts run, off the trained schedule) |
| guidance_scale | 1.0 (the teacher's CFG at {hints.get('teacher_guidance_scale')} is inside the adapters) |
| max_sequence_length | {msl} (the text length it was trained on) |
| height x width | {hints.get('height')} x {hints.get('width')} |{rows}

```python
import torch
from diffusers import UniPCMultistepScheduler, {pipeline}
{video}
{load}
{draw_call}
```
""" + comfy


def _fused(student: Student, tmp: Path, dtype) -> None:
    """The teacher pipeline (its own class: an I2V teacher's WanImageToVideoPipeline) with the adapters merged into its
    transformers, saved whole into `tmp`."""
    import diffusers

    cls = diffusers.WanImageToVideoPipeline if read_index(student.teacher_path).get("_class_name") == I2V_PIPELINE \
        else diffusers.WanPipeline
    pipe = cls.from_pretrained(student.teacher_path, torch_dtype=dtype, use_safetensors=True)
    for comp, name in student.lora.files.items():  # each expert's adapter, named after it, merged into it
        _adapter(student, comp)  # (checked: a regular file of the run, which diffusers' loader then opens)
        pipe.load_lora_weights(str(student.adapter_folder(comp)), weight_name=name, adapter_name=comp,
                               load_into_transformer_2=comp == "transformer_2")
        pipe.fuse_lora(components=[comp], adapter_names=[comp])
    pipe.unload_lora_weights()  # the merged weights stay; the LoRA layers go
    pipe.scheduler = student_scheduler(student.distill)
    pipe.save_pretrained(tmp)
    honour_umask(tmp)  # (safetensors writes 0600 whatever the umask)
    hub_card.drop_local_names(tmp)  # (each config's _name_or_path: the teacher's folder)


def _adapter(student: Student, comp: str) -> Path:
    """Expert `comp`'s adapter file: a regular file inside its run's student folder, no link (safe_open)."""
    return safe_open.resolve_inside(student.adapter_folder(comp), student.lora.files[comp], FIX)


def run(cfg: ExportConfig, student: Student, hints: dict, out: Path) -> dict:
    """Write the adapters (or, with --fuse, the merged pipeline) to `out`; returns the summary."""
    if cfg.fuse and cfg.lora_format == "wan":
        raise UserError("--lora-format wan names the adapter files' keys, and --fuse writes a merged pipeline without "
                        "adapter files; drop one of them")
    base_model, base = hub_card.public_teacher(student.lora.teacher, student.teacher_path, cfg.base_model)
    comfy, workflow, hybrid = "", None, None
    if not cfg.fuse:  # ComfyUI's workflow for the adapter files, on the run's own schedule
        lora = student.lora
        sched = comfyui.schedule(student.distill, lora.experts, lora.boundary_timestep)
        files = comfyui.model_files(base_model, len(lora.experts), base)
        workflow = comfyui.workflow(sched, lora.experts, lora.files, hints, files, InputRule.of(student.distill))
        comfy = comfyui.card(sched, lora.experts, lora.files, lora.boundary_timestep, hints, files, base,
                             cfg.lora_format == "wan")
        if hybrid := comfyui.hybrid_passes(student.distill, sched, lora.experts, lora.boundary_timestep):
            carried = student.setting("teacher_loras")
            comfy += comfyui.hybrid_card(hybrid, carried)
            hybrid = comfyui.workflow(sched, lora.experts, lora.files, hints, files, InputRule.of(student.distill),
                                      passes=hybrid, teacher_loras=carried)
    card = (hub_card.front_matter(hub_card.teacher_license(student.teacher_path, base_model), base_model,
                             own_sampler(student.distill) is not None, tags=() if cfg.fuse else ("lora",),
                             video="num_frames" in hints, image="condition" in hints)
            + readme(student, hints, cfg.push_to_hub or out.name, base, cfg.fuse, comfy))
    lora = replace(student.lora, teacher=base).to_json()
    mark = {**hints, "student_run": student.name, "weights": student.weights, "lora": lora,
            "fused": cfg.fuse, "cache_fingerprints": student.fingerprints}
    if student.members:  # a pair: which run trained which expert
        mark["runs"] = {m.lora.trained[0]: {"student_run": m.root.name, "weights": m.weights,
                                            "optimizer_steps": m.setting("optimizer_steps"),
                                            "train_steps": m.setting("train_steps")} for m in student.members}
    with building(out) as tmp:
        if cfg.fuse:
            _fused(student, tmp, DTYPES.get(student.setting("dtype"), torch.float32))
            index = safe_open.read_json(tmp, "model_index.json", "config")  # (diffusers' own, just written)
            safe_write.write_json(tmp / "model_index.json", index | {MARK: mark})
        else:
            for comp, name in student.lora.files.items():  # the bytes, not the run's file modes
                if cfg.lora_format == "wan":  # (no LoraConfig metadata: diffusers would scale by alpha / rank twice)
                    state = lora_experts.wan_state(load_file(_adapter(student, comp)), student.lora.alpha)
                    safe_write.write_file(tmp / name, save(state))
                else:
                    safe_write.copy_file(_adapter(student, comp), tmp / name)
            safe_write.write_json(tmp / LORA_JSON, lora | {MARK: mark}, indent=1)
            student_scheduler(student.distill).save_pretrained(tmp / "scheduler")
            safe_write.write_json(tmp / comfyui.WORKFLOW, workflow)
            if hybrid:
                safe_write.write_json(tmp / comfyui.HYBRID_WORKFLOW, hybrid)
        public = replace(student.distill.lora, teacher=base).to_json()
        record = hub_card.public_record(student.distill, base) | {"lora": public}
        safe_write.write_json(tmp / DISTILL, record)
        safe_write.write_file(tmp / "README.md", card.encode())
    what = "merged pipeline" if cfg.fuse else "LoRA adapters"
    tqdm.write(f"{what} written to {out} (base {student.lora.teacher}"
               + (f"; {' and '.join(f'{m.lora.trained[0]} from {m.root}' for m in student.members)}"
                  if student.members else "") + "); sample at guidance_scale=1.0, "
               f"num_inference_steps={hints.get('num_inference_steps')}, "
               f"max_sequence_length={hints.get('max_sequence_length')}"
               + (f", num_frames={hints['num_frames']}" if "num_frames" in hints else "")
               + (f"; ComfyUI: {comfyui.WORKFLOW} ({sched.sampler}/simple, {sched.steps} steps, shift "
                  f"{sched.shift:g}" + (f", switch at step {sched.switch}" if len(lora_experts.COMPONENTS) ==
                                        len(student.lora.experts) else "") + ")" if workflow else ""))
    return {"out": str(out), **mark}
