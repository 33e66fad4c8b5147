"""A LoRA run (`train-student --lora-of`) as the inference commands take it: `LoraRun`, the student kind of models.py
(found by its lora.json, loaded as the teacher with its adapters, untrained as the teacher itself; two one-expert
runs as one student, RUN1+RUN2: `LoraRun.pair`), and its `wandistiller export`: the adapters, their card and
ComfyUI's workflow (comfyui.py), or with `--fuse` the merged pipeline (docs/lora.md, "Using it")."""

from __future__ import annotations

import os
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
from pipeline.teacher_files import hash_json, read_component, read_index, sample_file

from . import comfyui, hub_card
from .export import MARK, STUDENT_FIX, building, draw, sigmas_sentence
from .models import PAIR, Student, meta_model, read_distill, teacher_dir, teacher_transformer_config


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
        folders = {comp: student.adapter_folder(comp) for comp in student.lora.files}  # (a pair's: two runs')
        return lora_experts.load(student.teacher_path, folders, student.lora, dtype, device)

    def init_exact(self, student: Student, seed: int | None) -> bool:
        return True  # it starts as the teacher: its adapters start at zero

    def untrained(self, student: Student, seed: int | None, dtype, device):
        model = lora_experts.load(student.teacher_path, student.path, replace(student.lora, files={}), dtype, device)
        return model, {"source": f"the teacher {student.lora.teacher} (LoRA adapters start at zero)", "exact": True}

    def export(self, cfg: ExportConfig, student: Student, hints: dict, out: Path, teacher: tuple) -> dict:
        return run(cfg, student, hints, out)

    def pair(self, members: list[Student], names: list[str]) -> Student:
        """The one-expert runs `members` (found from `names`) of a two-expert teacher as one student, each expert
        with its own run's adapter; its records the pair's: both files, the steps either trained, the prompts both
        held out. Refused in one line unless they are halves of one student (`_mismatch`)."""
        spelled = PAIR.join(names)
        for m, name in zip(members, names):
            if m.kind is not self:
                return m.kind.pair([m], [name])  # (its refusal)
            if len(m.lora.experts) != 2 or len(m.lora.trained) != 1:
                what = ("its teacher has one transformer" if len(m.lora.experts) != 2 else
                        "it trained both experts (--lora-experts all) and is one student already")
                raise UserError(f"{spelled}: {name} is not a one-expert run of a two-expert teacher ({what}); pass "
                                f"it alone, or {PAIR_FIX}")
        hi, lo = sorted(members, key=lambda m: lora_experts.COMPONENTS.index(m.lora.trained[0]))
        if hi.lora.trained == lo.lora.trained:
            expert = lora_experts.COMPONENTS.index(hi.lora.trained[0]) + 1
            raise UserError(f"{spelled}: both runs trained expert {expert} ({hi.lora.trained[0]}); a pair is one "
                            "--lora-experts 1 run and one --lora-experts 2 run")
        if problem := _mismatch(hi, lo):
            raise UserError(f"{spelled}: the two runs do not make one student ({problem}); {PAIR_FIX}")
        a, b = hi.distill, lo.distill
        lora = replace(hi.lora, trained=list(hi.lora.experts), files={**hi.lora.files, **lo.lora.files})
        steps = dict(zip(a.train_steps, a.train_timesteps)) | dict(zip(b.train_steps, b.train_timesteps))
        distill = replace(a, lora=lora, train_steps=sorted(steps), train_timesteps=[steps[k] for k in sorted(steps)],
                          heldout_prompts=sorted(set(a.heldout_prompts) & set(b.heldout_prompts)),
                          optimizer_steps=a.optimizer_steps + b.optimizer_steps,
                          samples_seen=a.samples_seen + b.samples_seen,
                          epochs_completed=min(a.epochs_completed, b.epochs_completed),
                          student_ema=a.student_ema if a.student_ema and b.student_ema else None)
        weights = hi.weights if hi.weights == lo.weights else f"{hi.weights}{PAIR}{lo.weights}"
        return replace(hi, weights=weights, distill=distill, lora=lora, members=(hi, lo))


LORA_RUN = LoraRun()
PAIR_FIX = "pair the --lora-experts 1 and --lora-experts 2 runs of one cache and schedule"


def _mismatch(hi: Student, lo: Student) -> str | None:
    """Why two one-expert runs are not one student's halves, in words; None when they are: one cache (so one
    teacher's targets, frames and text length), one schedule, one adapter shape (the pair's lora.json describes
    one), one teacher's experts to load them into."""
    if set(hi.fingerprints) != set(lo.fingerprints):
        return (f"they were trained on different caches, fingerprints {', '.join(f[:12] for f in hi.fingerprints)} "
                f"and {', '.join(f[:12] for f in lo.fingerprints)}")
    if (one := _schedule(hi)) != (two := _schedule(lo)):
        return f"their schedules differ: {one}, and {two}"
    if (one := _shape(hi)) != (two := _shape(lo)):
        return f"their adapters differ: {one}, and {two}"
    if os.path.realpath(hi.teacher_path) != os.path.realpath(lo.teacher_path) and (
            _identity(hi.teacher_path) != _identity(lo.teacher_path)):
        return f"their teachers differ: {hi.lora.teacher} and {lo.lora.teacher} hold other configs or weights"
    return None


def _schedule(m: Student) -> str:
    bounds = m.distill.objective_settings.get("boundaries")
    return (f"{m.distill.sampling_steps} {own_sampler(m.distill) or 'teacher-scheduler'} steps"
            + (f" from the teacher's steps {bounds}" if bounds else ""))


def _shape(m: Student) -> str:
    return f"rank {m.lora.rank}, alpha {m.lora.alpha:g} on {','.join(m.lora.targets)}"


def _identity(path: Path) -> dict:
    """A teacher's experts as train-student's LoRA identity knows them: their configs, a sample of each weight file,
    and the boundary between them."""
    return {"boundary_ratio": read_index(path).get("boundary_ratio"),
            **{c: hash_json(read_component(path, c)) for c in lora_experts.COMPONENTS},
            **{f"{c}/{f.name}": sample_file(f) for c in lora_experts.COMPONENTS
               for f in sorted((path / c).glob("*.safetensors"))}}


def readme(student: Student, hints: dict, name: str, base: str, fused: bool, comfy: str = "") -> str:
    """The model card: base, steps, guidance 1, text length, a call, then `comfy` (ComfyUI's section); `name`,
    `base`: public."""
    steps, msl = hints.get("num_inference_steps"), hints.get("max_sequence_length")
    lora = replace(student.lora, teacher=base)
    call = ", ".join(f"{k}={hints[k]!r}" for k in ("num_inference_steps", "height", "width", "max_sequence_length")
                     if k in hints)
    experts = ", ".join(f"`{f}` ({c})" for c, f in lora.files.items())
    video, draw_call = draw(hints, f"guidance_scale=1.0, {call}")
    frames = hints.get("num_frames")
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
    if student.members:  # a pair: each expert trained in a run of its own
        trained = " and ".join(f"{m.setting('optimizer_steps')} steps ({m.lora.trained[0]})" for m in student.members)
        trained = f"one run per expert, trained {trained},"
    else:
        trained = f"trained\n{student.setting('optimizer_steps')} steps"
    half = ""
    if len(lora.experts) > len(lora.files):  # one expert of two: the other runs with the teacher's weights
        half = ("\nThis export holds one expert's adapter: the other expert runs with the teacher's own weights. "
                "`wandistiller export --student RUN1 --student RUN2` exports the two one-expert runs as one.\n")
    return f"""# WanDistiller LoRA: {steps}-step, guidance 1, on {lora.teacher}

Base: `{lora.teacher}`{f" (revision {lora.revision})" if lora.revision else ''}. Rank {lora.rank},
alpha {lora.alpha:g}, on {', '.join(lora.targets)} of every block. Adapters: {experts}; {trained} from the \
teacher's cached guided trajectories (objective
`{student.setting('objective')}`){', merged into the base (`--fuse`)' if fused else ''}.
{half}
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
""" + comfy


def _fused(student: Student, tmp: Path, dtype) -> None:
    """The teacher pipeline with the adapters merged into its transformers, saved whole into `tmp`."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(student.teacher_path, torch_dtype=dtype, use_safetensors=True)
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
    return safe_open.resolve_inside(student.adapter_folder(comp), student.lora.files[comp], STUDENT_FIX)


def run(cfg: ExportConfig, student: Student, hints: dict, out: Path) -> dict:
    """Write the adapters (or, with --fuse, the merged pipeline) to `out`; returns the summary."""
    if cfg.fuse and cfg.lora_format == "wan":
        raise UserError("--lora-format wan names the adapter files' keys, and --fuse writes a merged pipeline without "
                        "adapter files; drop one of them")
    base_model, base = hub_card.public_teacher(student.lora.teacher, student.teacher_path, cfg.base_model)
    comfy, workflow = "", None
    if not cfg.fuse:  # ComfyUI's workflow for the adapter files, on the run's own schedule
        lora = student.lora
        sched = comfyui.schedule(student.distill, lora.experts, lora.boundary_timestep)
        files = comfyui.model_files(base_model, len(lora.experts), base)
        workflow = comfyui.workflow(sched, lora.experts, lora.files, hints, files,
                                    bool(student.setting("expand_timesteps")))
        comfy = comfyui.card(sched, lora.experts, lora.files, lora.boundary_timestep, hints, files, base,
                             cfg.lora_format == "wan")
    card = (hub_card.front_matter(hub_card.teacher_license(student.teacher_path, base_model), base_model,
                             own_sampler(student.distill) is not None, tags=() if cfg.fuse else ("lora",),
                             video="num_frames" in hints)
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
