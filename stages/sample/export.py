"""`wandistiller export`: a diffusers pipeline folder that runs the student with no other argument (a LoRA run's:
export_lora.py). The folder's layout, its copies and how it is published: docs/architecture.md, "The export"."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cache import safe_write
from pipeline import guidance_input
from pipeline.artifact import DISTILL
from pipeline.config import ExportConfig
from pipeline.errors import UserError
from pipeline.model_call import NONE, InputRule
from pipeline.progress_bar import progress_bar
from pipeline.sampling import chosen_points, own_sampler, student_scheduler
from pipeline.teacher_files import check_config, copy_tree, read_component, read_index, snapshot_blobs
from stages.students.student_kind import FIX, teacher_transformer_config

from . import export_lora, hub_card
from .hub_card import MARK, building, draw, sigmas_sentence
from .models import BORROWED, Student, check_compatible, find_pair, find_student, student_teacher


def _sampling_hints(student: Student, tpath: Path, condition: str) -> dict:
    """What a user of the export should pass: the student's steps, its guidance, the training size (from the latent
    shape and the teacher's VAE when distill.json has none), text length and, drawing from an image, its condition."""
    try:
        vae_spatial = read_component(tpath, "vae").get("scale_factor_spatial") or 8
    except FileNotFoundError:
        vae_spatial = 8
    teacher_guidance = student.setting("guidance")
    hints = {"guidance_scale": 1.0 if student.guided else teacher_guidance, "guided_targets": student.guided,
             "teacher_guidance_scale": teacher_guidance}
    for hint, key in (("num_inference_steps", "sampling_steps"), ("teacher_steps", "steps"),
                      *((k, k) for k in ("max_sequence_length", "negative_prompt", "height", "width", "latent_shape",
                                         "objective"))):
        if student.setting(key) is not None:
            hints[hint] = student.setting(key)
    if student.distill is not None and (points := chosen_points(student.distill)) is not None:
        hints["sigmas"] = [float(v) for v in points]  # its scheduler's `sigmas=`: the boundaries it chose
    if student.setting("frames", 1) > 1:  # a video student: its clip length (an image one's hints as before)
        hints["num_frames"] = student.setting("frames")
    if condition != NONE:  # an image-to-video student: called as WanImageToVideoPipeline (hub_card.draw)
        hints["condition"] = condition
    shape = hints.get("latent_shape")
    if "height" not in hints and isinstance(shape, list) and len(shape) == 4:
        hints["height"], hints["width"] = shape[2] * vae_spatial, shape[3] * vae_spatial
    return hints


def _readme(name: str, hints: dict, student: Student, teacher: str, own_scheduler: bool) -> str:
    """The model card's body: how to call the pipeline `name` (its Hub id or folder name, never a path)."""
    g = hints["guidance_scale"]
    g_text = (f"guidance_scale={g}" if g is not None else
              "guidance_scale=<the teacher's scale> (distill.json did not record it)")
    baked = hints.get("baked_guidance_scale")
    why = (f"The student learned the teacher over a range of guidance scales, the scale an input; this export has "
           f"{baked:g} baked in (`wandistiller export --guidance-scale` bakes another), with guidance inside it: "
           "sample at guidance_scale=1.0." if baked is not None else
           "The student learned the teacher's CFG-guided predictions, so guidance is already inside it: "
           "sample at guidance_scale=1.0 (one forward per step; larger values apply CFG twice)."
           if student.guided else
           "The student learned the teacher's conditional predictions: sample with classifier-free guidance "
           "at the teacher's scale.")
    steps, pipeline = hints.get("num_inference_steps"), hub_card.pipeline_class(hints, "DiffusionPipeline")
    if own_scheduler:
        sched = (f"It is a **{steps}-step** student (objective `{hints.get('objective')}`): `scheduler/` holds its own "
                 f"schedule, the teacher's flow-matching sigmas walked with {steps} first-order (Euler) steps, which "
                 f"lands on the points it was trained to jump between when called with num_inference_steps={steps}. "
                 "Other step counts run, but off the trained schedule.")
        if "sigmas" in hints:
            sched += " " + sigmas_sentence(hints, "model_index.json")
    else:
        sched = (f"It samples with the teacher's scheduler and step count ({steps} steps); fewer steps run, at a loss "
                 "of fidelity (`wandistiller eval --student-steps` measures it).") if steps else ""
    msl = hints.get("max_sequence_length")
    text = (f"Pass max_sequence_length={msl}: the student was trained on text embeddings padded to {msl} tokens, "
            "and WanPipeline's default (512) pads them further with zeros the student never saw, which can ruin "
            "its images (the tiny shapes teacher draws 8 of 24 shape colours right at 512 instead of 23 of 24)."
            if msl else "")
    clip = f" on clips of {hints['num_frames']} frames" if "num_frames" in hints else ""
    size = (f"It was trained at {hints['height']}x{hints['width']}{clip}; other sizes are untested."
            if "height" in hints else "")
    call = ", ".join(f"{k}={hints[k]!r}" for k in ("num_inference_steps", "height", "width", "max_sequence_length")
                     if k in hints)
    table = "\n".join(f"| {k} | {v} |" for k, v in (
        ("num_inference_steps", steps), ("guidance_scale", g), ("height x width",
                                                                 f"{hints.get('height')} x {hints.get('width')}"),
        ("max_sequence_length", msl), ("num_frames", hints.get("num_frames", 1))))
    video, call = draw(hints, f"{g_text}, {call}", wrap=True)
    passed = f"num_inference_steps, guidance_scale{', num_frames' * bool(video)} and max_sequence_length"
    carried = hub_card.carried_teacher_loras(student.distill, "The student")
    return f"""# WanDistiller student pipeline

A {student.config.get("num_layers", "?")}-block student ({student.weights} weights) distilled with WanDistiller from teacher
`{teacher}`, in its pipeline: the student is the only transformer (`transformer_2` and `boundary_ratio` are null).{carried}

| setting | use |
|---|---|
{table}

{why}

{sched}

{text} {size}

```python
import torch
from diffusers import {pipeline}
{video}
pipe = {pipeline}.from_pretrained("{name}", torch_dtype=torch.bfloat16).to("cuda")
{call}
```

diffusers takes {passed} from the call, not from the folder,
so pass them as above. The same settings are in `model_index.json` under `{MARK}`.
"""


def _teacher(cfg: ExportConfig, student: Student) -> tuple[str, Path, dict, InputRule]:
    """The teacher's name, folder, model_index and input rule (drawing from an image when the student learned to),
    checked to hold what the pipeline borrows and to fit the student."""
    teacher_name, tpath = student_teacher(cfg, student)
    index = read_index(tpath)  # (tpath's files checked by pipeline/hub.py: no link out of it, no FIFO, no pickle)
    missing = [c for c in BORROWED if not (isinstance(index.get(c), list) and index[c][0] and (tpath / c).is_dir())]
    if missing:
        raise UserError(f"teacher {teacher_name!r} lacks {', '.join(missing)} in {tpath}; export needs them")
    tcfg = check_config("transformer", teacher_transformer_config(tpath), f"the transformer config of {tpath}")
    rule = InputRule.of_teacher(index, tcfg, student.setting("condition", NONE) != NONE)
    check_compatible(student, in_channels=int(tcfg["in_channels"]), text_dim=int(tcfg["text_dim"]),
                     out_channels=tcfg.get("out_channels"), latent_hw=None, rule=rule,
                     against=f"teacher {teacher_name}")
    return teacher_name, tpath, index, rule


def _fill(tmp: Path, cfg: ExportConfig, student: Student, tpath: Path, index: dict, hints: dict,
          own_scheduler: bool, teacher: str, card: str) -> None:
    """Write the pipeline folder's content into `tmp`."""
    if "baked_guidance_scale" in hints:  # the scale folded into the time embedding: a plain WanTransformer3DModel
        model = student.kind.load(student, torch.float32, torch.device("cpu"))
        guidance_input.bake(model, hints["baked_guidance_scale"]).save_pretrained(tmp / "transformer")
    else:
        copy_tree(student.path, tmp / "transformer", FIX)
    for comp in progress_bar(BORROWED, desc="export", unit="component", dynamic_ncols=True):
        if comp == "scheduler" and own_scheduler:  # the student's schedule: num_inference_steps=K reproduces it
            student_scheduler(student.distill).save_pretrained(tmp / comp)
        elif cfg.copy:
            copy_tree(tpath / comp, tmp / comp, blobs=snapshot_blobs(tpath))
        else:
            os.symlink((tpath / comp).resolve(), tmp / comp, target_is_directory=True)
    index.update({
        "transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None],
        "boundary_ratio": None, "expand_timesteps": bool(index.get("expand_timesteps", False)),
        MARK: {**hints, "student_run": student.name, "weights": student.weights,
               "teacher": teacher, "cache_fingerprints": student.fingerprints,
               "components": "copied" if cfg.copy else "symlinked",
               "scheduler": "the student's own (Euler on the teacher's sigmas)" if own_scheduler else "the teacher's"},
    })
    safe_write.write_json(tmp / "model_index.json", index)
    hub_card.drop_local_names(tmp)  # (a re-saved teacher's configs name the folder it was loaded from)
    if student.distill is not None:
        safe_write.write_json(tmp / DISTILL, hub_card.public_record(student.distill, teacher))
    safe_write.write_file(tmp / "README.md", card.encode())


def run(cfg: ExportConfig) -> dict:
    """Write the pipeline folder (and upload it with --push-to-hub); returns the summary."""
    if cfg.push_to_hub:
        hub_card.check_online(cfg.push_to_hub)
    # one folder, or RUN1+RUN2 (--student twice): the two one-expert LoRA runs of a pair, as one student
    student = find_student(*cfg.student, cfg.weights) if len(cfg.student) == 1 else find_pair(list(cfg.student),
                                                                                             cfg.weights)
    asked = [flag for flag, on in (("--fuse", cfg.fuse), ("--lora-format", cfg.lora_format != "diffusers")) if on]
    if asked and not student.kind.adapters:
        raise UserError(f"{asked[0]} applies to a LoRA run's adapter files, and {cfg.student[0]} is a compact student "
                        f"(its export is already a standalone pipeline); drop {asked[0]}")
    learned = guidance_input.trained_range(student.config)
    if (learned is None) != (cfg.guidance_scale is None):
        raise UserError(f"{cfg.student[0]} takes the guidance scale as an input, which WanPipeline cannot pass: give "
                        f"--guidance-scale W to bake one in (it learned {learned[0]:g}..{learned[1]:g})" if learned
                        else f"--guidance-scale bakes a scale into a student that takes it as an input "
                             f"(train-student --guidance-range), and {cfg.student[0]} does not; drop it")
    teacher = _teacher(cfg, student)
    out = Path(cfg.out)
    safe_write.claim_folder(out, "export", replace=cfg.overwrite, hint=" or add --overwrite to replace this earlier "
                            "export")
    hints = _sampling_hints(student, teacher[1], teacher[3].condition)
    if learned:
        hints["baked_guidance_scale"] = cfg.guidance_scale
    # a pipeline folder here; a student's adapters in diffusers' LoRA format, or with --fuse a merged pipeline
    summary = (export_lora.run(cfg, student, hints, out) if student.kind.adapters
               else write_pipeline(cfg, student, hints, out, *teacher[:3]))
    if cfg.push_to_hub:
        summary["hub"] = hub_card.push(out, cfg.push_to_hub, cfg.private)
        tqdm.write(f"pushed to the Hub: {summary['hub']}")
    return summary


def write_pipeline(cfg: ExportConfig, student: Student, hints: dict, out: Path, teacher_name: str, tpath: Path,
                   index: dict) -> dict:
    """A compact student's export: the pipeline folder at `out`; returns the summary."""
    own_scheduler = student.distill is not None and own_sampler(student.distill) is not None
    base_model, teacher = hub_card.public_teacher(teacher_name, tpath, cfg.base_model)  # a Hub id, else a name
    card = (hub_card.front_matter(hub_card.teacher_license(tpath, base_model), base_model, own_scheduler,
                                  video="num_frames" in hints, image="condition" in hints)
            + _readme(cfg.push_to_hub or out.name, hints, student, teacher, own_scheduler))
    with building(out) as tmp:
        _fill(tmp, cfg, student, tpath, index, hints, own_scheduler, teacher, card)
    tqdm.write(f"pipeline written to {out} (student {student.weights} weights, teacher components "
               f"{'copied' if cfg.copy else 'symlinked'}); sample it at guidance_scale={hints['guidance_scale']}"
               + "".join(f", {k}={hints[k]}" for k in ("num_inference_steps", "max_sequence_length", "num_frames")
                         if k in hints))
    return {"out": str(out), **index[MARK]}
