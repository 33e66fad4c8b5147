"""`wandistiller export` of a LoRA run (`train-student --lora-of`): the adapters in the form Wan users load them.

    LORA_DIR/
      high_noise_model.safetensors   expert 1's adapter (transformer), diffusers' LoRA format; a one-expert
      low_noise_model.safetensors    teacher's is pytorch_lora_weights.safetensors. Each holds its LoraConfig as
                                     metadata, so `load_lora_weights` restores alpha as well as the weights
      lora.json                      which file is which expert, the base, rank, alpha, targets
      scheduler/                     the schedule to sample with (a K-step student's Euler steps on the teacher's
                                     sigmas; else the teacher's)
      distill.json, README.md        the run's record, and the model card: the Hub's YAML metadata (as the
                                     compact export's, tagged `lora`), base, steps, guidance 1, text length

No local path is written anywhere (`--push-to-hub` uploads these files): the base is named by its Hub id, else its
folder's name, and the folder itself by --push-to-hub's repo id, else its own name (`hub_card.public_teacher`,
`hub_card.public_record`, as the compact export). Files are copies of contents, not modes, created under the umask.

loaded as `WanPipeline.from_pretrained(BASE)` + `pipe.load_lora_weights(LORA_DIR, weight_name=...)` (transformer_2's
with `load_into_transformer_2=True`). `--fuse` writes a standalone pipeline instead: the teacher with the adapters
merged into its transformers (diffusers' `fuse_lora`, then `unload_lora_weights`) and the student's scheduler.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tqdm.auto import tqdm

from cache.atomic import honour_umask, publish_dir
from pipeline.artifact import DISTILL, LORA_JSON
from pipeline.config import ExportConfig
from pipeline.faults import fault_point
from pipeline.hub import is_hub_id
from pipeline.sampling import own_sampler, student_scheduler

from . import hub_card
from .models import Student

MARK = "_wandistiller"  # (export.MARK): the key that lets --overwrite replace an earlier export


def _load_calls(student: Student, where: str) -> str:
    lines = []
    for comp, name in student.lora["files"].items():
        into = ", load_into_transformer_2=True" if comp == "transformer_2" else ""
        lines.append(f'pipe.load_lora_weights("{where}", weight_name="{name}", adapter_name="{comp}"{into})')
    return "\n".join(lines)


def readme(student: Student, hints: dict, name: str, base: str, fused: bool) -> str:
    """The model card: the base, the steps, guidance 1, the text length, and a copy-paste call. `name`: what the
    export is loaded as (its Hub id, or the folder's name), `base`: the teacher's public name; never a local path."""
    steps, msl = hints.get("num_inference_steps"), hints.get("max_sequence_length")
    lora = student.lora | {"teacher": base}
    call = ", ".join(f"{k}={hints[k]!r}" for k in ("num_inference_steps", "height", "width", "max_sequence_length")
                     if k in hints)
    experts = ", ".join(f"`{f}` ({c})" for c, f in lora["files"].items())
    if fused:
        load = (f'pipe = WanPipeline.from_pretrained("{name}", torch_dtype=torch.bfloat16).to("cuda")  '
                "# adapters merged, scheduler included")
    else:
        where = "" if is_hub_id(base) else "  # the base: where your copy of the teacher lies"
        load = (f'pipe = WanPipeline.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda"){where}\n'
                f'pipe.scheduler = UniPCMultistepScheduler.from_pretrained("{name}", subfolder="scheduler")\n'
                + _load_calls(student, name))
    return f"""# WanDistiller LoRA: {steps}-step, guidance 1, on {lora['teacher']}

Base: `{lora['teacher']}`{f" (revision {lora['revision']})" if lora.get('revision') else ''}. Rank {lora['rank']},
alpha {lora['alpha']:g}, on {', '.join(lora['targets'])} of every block. Adapters: {experts}; trained
{student.setting('optimizer_steps')} steps from the teacher's cached guided trajectories (objective
`{student.setting('objective')}`){', merged into the base (`--fuse`)' if fused else ''}.

| setting | use |
|---|---|
| num_inference_steps | {steps} (the schedule in `scheduler/`: other counts run, off the trained schedule) |
| guidance_scale | 1.0 (the teacher's CFG at {hints.get('teacher_guidance_scale')} is inside the adapters) |
| max_sequence_length | {msl} (the text length it was trained on) |
| height x width | {hints.get('height')} x {hints.get('width')} |

```python
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline

{load}
image = pipe("a lighthouse at night", num_frames=1, guidance_scale=1.0, {call}, output_type="pil").frames[0][0]
```
"""


def _fused(student: Student, tmp: Path, dtype) -> None:
    """The teacher pipeline with the adapters merged into its transformers, saved whole into `tmp`."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(student.teacher_path, torch_dtype=dtype)
    for comp, name in student.lora["files"].items():  # each expert's adapter, named after it, merged into it
        pipe.load_lora_weights(str(student.path), weight_name=name, adapter_name=comp,
                               load_into_transformer_2=comp == "transformer_2")
        pipe.fuse_lora(components=[comp], adapter_names=[comp])
    pipe.unload_lora_weights()  # the merged weights stay; the LoRA layers go
    pipe.scheduler = student_scheduler(student.distill)
    pipe.save_pretrained(tmp)
    honour_umask(tmp)  # (safetensors writes 0600 whatever the umask)
    hub_card.drop_local_names(tmp)  # (each config's _name_or_path: the teacher's folder)


def run(cfg: ExportConfig, student: Student, hints: dict, out: Path) -> dict:
    """Write the adapters (or, with --fuse, the merged pipeline) to `out`; returns the summary."""
    import torch

    from cache.format import DTYPES

    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    base_model, base = hub_card.public_teacher(student.lora["teacher"], student.teacher_path, cfg.base_model)
    card = (hub_card.front_matter(hub_card.teacher_license(student.teacher_path, base_model), base_model,
                             own_sampler(student.distill) is not None, lora=not cfg.fuse)
            + readme(student, hints, cfg.push_to_hub or out.name, base, cfg.fuse))
    lora = student.lora | {"teacher": base}
    mark = {**hints, "student_run": student.root.name, "weights": student.weights, "lora": lora,
            "fused": cfg.fuse, "cache_fingerprints": student.fingerprints}
    try:
        if cfg.fuse:
            _fused(student, tmp, DTYPES.get(student.setting("dtype"), torch.float32))
            index = json.loads((tmp / "model_index.json").read_text())
            (tmp / "model_index.json").write_text(json.dumps(index | {MARK: mark}, indent=2) + "\n")
        else:
            tmp.mkdir(parents=True)
            for name in student.lora["files"].values():  # the bytes, not the run's file modes
                shutil.copyfile(student.path / name, tmp / name)
            (tmp / LORA_JSON).write_text(json.dumps(lora | {MARK: mark}, indent=1) + "\n")
            student_scheduler(student.distill).save_pretrained(tmp / "scheduler")
        (tmp / DISTILL).write_text(json.dumps(hub_card.public_record(student.distill, base), indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        publish_dir(tmp, out, before_replace=lambda: fault_point("before_dir_rename"),
                    after_replace=lambda: fault_point("after_dir_rename"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    what = "merged pipeline" if cfg.fuse else "LoRA adapters"
    tqdm.write(f"{what} written to {out} (base {student.lora['teacher']}); sample at guidance_scale=1.0, "
               f"num_inference_steps={hints.get('num_inference_steps')}, "
               f"max_sequence_length={hints.get('max_sequence_length')}")
    return {"out": str(out), **mark}
