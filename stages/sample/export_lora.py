"""A LoRA run (`train-student --lora-of`) as the inference commands take it: `LoraRun`, the student kind of models.py
(found by its lora.json, loaded as the teacher with its adapters, untrained as the teacher itself), and its
`wandistiller export`: the adapters and their card, or with `--fuse` the merged pipeline (docs/lora.md, "Using it")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from cache import safe_open, safe_write
from cache.atomic import honour_umask
from cache.cache_error import UnsafeFileError
from cache.format import DTYPES
from pipeline import lora_experts
from pipeline.artifact import DISTILL, LORA_JSON, LoraRecord, RunLayout
from pipeline.config import ExportConfig
from pipeline.errors import UserError
from pipeline.hub import is_hub_id
from pipeline.sampling import own_sampler, student_scheduler

from . import hub_card
from .export import MARK, STUDENT_FIX, building, draw, sigmas_sentence
from .models import Student, meta_model, read_distill, teacher_dir, teacher_transformer_config


class LoraRun:
    """A LoRA run's student: its adapters (student_ema/'s when chosen) on the teacher lora.json names."""

    marker = LORA_JSON  # the file that makes a student folder this kind's
    adapters = True  # `export --fuse` merges them into the teacher, `--lora-format` names their keys

    def find(self, p: Path, run: RunLayout, chosen: Path, which: str) -> Student:
        try:
            record = LoraRecord.read(chosen)  # (bounded, no link followed: a refusal is its own line)
        except UnsafeFileError:
            raise
        except ValueError as e:
            raise UserError(f"LoRA description {chosen / LORA_JSON}: {e}; it was not written by this WanDistiller's "
                            "train-student --lora-of: rerun it") from e
        missing = [f for f in record.files.values() if not (chosen / f).is_file()]
        if missing or not run.distill.is_file():
            raise UserError(f"{p} holds an incomplete LoRA run ({', '.join(missing) or DISTILL} missing); rerun the "
                            "same train-student command with --resume")
        teacher = teacher_dir(record.teacher, record.revision, recorded_in=str(chosen / LORA_JSON))
        config = teacher_transformer_config(teacher)
        lora_experts.check_files(p, chosen.name, record, meta_model(config, teacher))  # (headers only, bounded)
        return Student(root=p, path=chosen, weights=which, config=config, kind=self,
                       distill=read_distill(run.distill), lora=record, teacher_path=teacher)

    def load(self, student: Student, dtype, device):
        return lora_experts.load(student.teacher_path, student.path, student.lora, dtype, device)

    def init_exact(self, student: Student, seed: int | None) -> bool:
        return True  # it starts as the teacher: its adapters start at zero

    def untrained(self, student: Student, seed: int | None, dtype, device):
        model = lora_experts.load(student.teacher_path, student.path, replace(student.lora, files={}), dtype, device)
        return model, {"source": f"the teacher {student.lora.teacher} (LoRA adapters start at zero)", "exact": True}

    def export(self, cfg: ExportConfig, student: Student, hints: dict, out: Path, teacher: tuple) -> dict:
        return run(cfg, student, hints, out)


LORA_RUN = LoraRun()


def readme(student: Student, hints: dict, name: str, base: str, fused: bool, wan: bool = False) -> str:
    """The model card: base, steps, guidance 1, text length, a call (`wan`: ComfyUI's too); `name`, `base`: public."""
    steps, msl = hints.get("num_inference_steps"), hints.get("max_sequence_length")
    lora = replace(student.lora, teacher=base)
    call = ", ".join(f"{k}={hints[k]!r}" for k in ("num_inference_steps", "height", "width", "max_sequence_length")
                     if k in hints)
    experts = ", ".join(f"`{f}` ({c})" for c, f in lora.files.items())
    roles = dict(zip(lora_experts.COMPONENTS, ("high-noise", "low-noise"))) if len(lora.experts) > 1 else {}
    comfy = ", ".join(f"`{f}` on the {roles.get(c, 'teacher')} model" for c, f in lora.files.items())
    video, draw_call = draw(hints, f"guidance_scale=1.0, {call}")
    frames = hints.get("num_frames")
    length = f", length {frames} (frames)" if frames else ""
    rows = f"\n| num_frames | {frames} (the clip length it was trained on) |" if frames else ""
    if "sigmas" in hints:  # a chosen schedule, said as the full export's card says it
        rows += "\n\n" + sigmas_sentence(hints, "model_index.json" if fused else LORA_JSON, "The LoRA's")
    if fused:
        load = (f'pipe = WanPipeline.from_pretrained("{name}", torch_dtype=torch.bfloat16).to("cuda")  '
                "# adapters merged, scheduler included")
    else:
        where = "" if is_hub_id(base) else "  # the base: where your copy of the teacher lies"
        load = (f'pipe = WanPipeline.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda"){where}\n'
                f'pipe.scheduler = UniPCMultistepScheduler.from_pretrained("{name}", subfolder="scheduler")\n'
                + "\n".join(f'pipe.load_lora_weights("{name}", weight_name="{f}", adapter_name="{comp}"'
                            + (", load_into_transformer_2=True)" if comp == "transformer_2" else ")")
                            for comp, f in student.lora.files.items()))
    return f"""# WanDistiller LoRA: {steps}-step, guidance 1, on {lora.teacher}

Base: `{lora.teacher}`{f" (revision {lora.revision})" if lora.revision else ''}. Rank {lora.rank},
alpha {lora.alpha:g}, on {', '.join(lora.targets)} of every block. Adapters: {experts}; trained
{student.setting('optimizer_steps')} steps from the teacher's cached guided trajectories (objective
`{student.setting('objective')}`){', merged into the base (`--fuse`)' if fused else ''}.

| setting | use |
|---|---|
| num_inference_steps | {steps} (the schedule in `scheduler/`: other counts run, off the trained schedule) |
| guidance_scale | 1.0 (the teacher's CFG at {hints.get('teacher_guidance_scale')} is inside the adapters) |
| max_sequence_length | {msl} (the text length it was trained on) |
| height x width | {hints.get('height')} x {hints.get('width')} |{rows}

```python
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline
{video}
{load}
{draw_call}
```
""" + (f"""
The files hold the original Wan key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.lora_up`,
`.alpha`), which `load_lora_weights` above converts on load. ComfyUI: copy them to `models/loras` and apply each with
a LoraLoaderModelOnly node on its expert's model ({comfy}); {steps} steps at CFG 1 (the schedule: `scheduler/`){length}.
""" if wan else "")


def _fused(student: Student, tmp: Path, dtype) -> None:
    """The teacher pipeline with the adapters merged into its transformers, saved whole into `tmp`."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(student.teacher_path, torch_dtype=dtype, use_safetensors=True)
    for comp, name in student.lora.files.items():  # each expert's adapter, named after it, merged into it
        _adapter(student, name)  # (checked: a regular file of the run, which diffusers' loader then opens)
        pipe.load_lora_weights(str(student.path), weight_name=name, adapter_name=comp,
                               load_into_transformer_2=comp == "transformer_2")
        pipe.fuse_lora(components=[comp], adapter_names=[comp])
    pipe.unload_lora_weights()  # the merged weights stay; the LoRA layers go
    pipe.scheduler = student_scheduler(student.distill)
    pipe.save_pretrained(tmp)
    honour_umask(tmp)  # (safetensors writes 0600 whatever the umask)
    hub_card.drop_local_names(tmp)  # (each config's _name_or_path: the teacher's folder)


def _adapter(student: Student, name: str) -> Path:
    """The run's adapter file `name`: a regular file inside its student folder, no link (safe_open)."""
    return safe_open.resolve_inside(student.path, name, STUDENT_FIX)


def run(cfg: ExportConfig, student: Student, hints: dict, out: Path) -> dict:
    """Write the adapters (or, with --fuse, the merged pipeline) to `out`; returns the summary."""
    if cfg.fuse and cfg.lora_format == "wan":
        raise UserError("--lora-format wan names the adapter files' keys, and --fuse writes a merged pipeline without "
                        "adapter files; drop one of them")
    base_model, base = hub_card.public_teacher(student.lora.teacher, student.teacher_path, cfg.base_model)
    card = (hub_card.front_matter(hub_card.teacher_license(student.teacher_path, base_model), base_model,
                             own_sampler(student.distill) is not None, tags=() if cfg.fuse else ("lora",),
                             video="num_frames" in hints)
            + readme(student, hints, cfg.push_to_hub or out.name, base, cfg.fuse, cfg.lora_format == "wan"))
    lora = replace(student.lora, teacher=base).to_json()
    mark = {**hints, "student_run": student.root.name, "weights": student.weights, "lora": lora,
            "fused": cfg.fuse, "cache_fingerprints": student.fingerprints}
    with building(out) as tmp:
        if cfg.fuse:
            _fused(student, tmp, DTYPES.get(student.setting("dtype"), torch.float32))
            index = safe_open.read_json(tmp, "model_index.json", "config")  # (diffusers' own, just written)
            safe_write.write_json(tmp / "model_index.json", index | {MARK: mark})
        else:
            for name in student.lora.files.values():  # the bytes, not the run's file modes
                if cfg.lora_format == "wan":  # (no LoraConfig metadata: diffusers would scale by alpha / rank twice)
                    state = lora_experts.wan_state(load_file(_adapter(student, name)), student.lora.alpha)
                    safe_write.write_file(tmp / name, save(state))
                else:
                    safe_write.copy_file(_adapter(student, name), tmp / name)
            safe_write.write_json(tmp / LORA_JSON, lora | {MARK: mark}, indent=1)
            student_scheduler(student.distill).save_pretrained(tmp / "scheduler")
        public = replace(student.distill.lora, teacher=base).to_json()
        record = hub_card.public_record(student.distill, base) | {"lora": public}
        safe_write.write_json(tmp / DISTILL, record)
        safe_write.write_file(tmp / "README.md", card.encode())
    what = "merged pipeline" if cfg.fuse else "LoRA adapters"
    tqdm.write(f"{what} written to {out} (base {student.lora.teacher}); sample at guidance_scale=1.0, "
               f"num_inference_steps={hints.get('num_inference_steps')}, "
               f"max_sequence_length={hints.get('max_sequence_length')}"
               + (f", num_frames={hints['num_frames']}" if "num_frames" in hints else ""))
    return {"out": str(out), **mark}
