"""Find and load what the inference commands run: the trained student (the run artifact, or a bare transformer
folder) as its kind finds it (stages/students/: `Student.kind` loads, rebuilds untrained and pairs it), and the
teacher pipeline: docs/architecture.md, "The run artifact"."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipeline import teacher_lora
from pipeline.artifact import STUDENT, STUDENT_EMA, RunLayout
from pipeline.errors import UserError
from pipeline.model_call import InputRule
from stages.students.compact import CompactStudent
from stages.students.student_kind import PAIR, TRANSFORMER_CLASS, Student, kinds, teacher_dir

# Teacher components a student pipeline borrows (everything but the transformers).
BORROWED = ("tokenizer", "text_encoder", "vae", "scheduler")


def split_pair(path: str) -> list[str]:
    """The runs `path` names: itself, or where nothing of that name exists, the RUN1+RUN2 it spells (PAIR)."""
    return [path] if PAIR not in path or os.path.lexists(Path(path).expanduser()) else path.split(PAIR)


def model_name(path: str) -> str:
    """A --student or --compare folder's name in a table: a run's (OUT/student given: OUT's), a pair's joined."""
    names = [p.parent.name if p.name in (STUDENT, STUDENT_EMA) else p.name for p in map(Path, split_pair(path))]
    return PAIR.join(names)


def find_pair(paths: list[str], weights: str = "auto") -> Student:
    """Two one-expert LoRA runs of one teacher and cache as one student (their kind's `pair`), refused in one line
    else."""
    if len(paths) != 2 or not all(paths):
        raise UserError(f"{PAIR.join(paths)} names {len(paths)} runs; a pair is two, RUN1{PAIR}RUN2 (the train-student "
                        "--lora-experts 1 and --lora-experts 2 runs of one cache), and a folder of that name does not "
                        "exist")
    members = [find_student(p, weights) for p in paths]
    return members[0].kind.pair(members, paths)


def find_student(path: str, weights: str = "auto") -> Student:
    """Locate the student: OUT of train-student (the run artifact of pipeline/artifact.py) or a bare folder; RUN1+RUN2:
    a LoRA pair (`find_pair`)."""
    if len(parts := split_pair(path)) > 1:
        return find_pair(parts, weights)
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"student {p} does not exist; pass the --out folder of `wandistiller train-student` "
                        f"(holding {STUDENT}/) or a {TRANSFORMER_CLASS} folder")
    if not p.is_dir():
        raise UserError(f"student {p} is a file; pass the train-student output folder")
    run = RunLayout(p)
    # A train-student OUT holds student/ (and its config.json, the run's settings); anything else is a model folder.
    if not (run.student.is_dir() or run.student_ema.is_dir() or os.path.lexists(run.distill)):
        return CompactStudent.find_folder(p)
    if not run.student.is_dir():  # train-student renames student/ into place last: without it the run did not finish
        raise UserError(f"{p} holds no finished student: {STUDENT}/ is missing (train-student was stopped "
                        "before it saved); rerun the same train-student command with --resume to finish it")
    # (a marker that is a link or a FIFO is there, to be refused as its kind reads it: never taken for no marker)
    kind = next((k for k in kinds()[1:] if os.path.lexists(run.student / k.marker)), CompactStudent)
    has_ema = (run.student_ema / kind.marker).is_file()
    if weights == "ema" and not has_ema:
        raise UserError(f"--weights ema: {p} has no {STUDENT_EMA}/ (EMA was off in train-student); "
                        "use --weights raw or auto")
    chosen, which = (run.student_ema, "ema") if weights == "ema" or (weights == "auto" and has_ema) \
        else (run.student, "raw")
    return kind.find(p, run, chosen, which)  # (each kind checks its weights against its records as it finds them)


def pick_device(device: str, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """The device (auto = first CUDA GPU if any) and dtype (bfloat16 on CUDA, float32 on CPU by default)."""
    from cache.format import DTYPES

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device} needs a CUDA GPU and none is visible; use --device cpu")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise UserError(f"--device {device} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    return dev, DTYPES[name]


def check_compatible(student: Student, *, in_channels: int, text_dim: int, latent_hw: tuple[int, int] | None,
                     rule: InputRule | None, against: str, out_channels: int | None = None) -> None:
    """Refuse a student that cannot run on these latents and text embeddings, with one line saying why
    (`out_channels`: the latents', where an I2V teacher takes more channels than it predicts; `rule`: how `against`
    lays out its inputs, compared with what the student's record says it learned)."""
    problems = []
    cin = int(student.config["in_channels"])
    cout = int(student.config.get("out_channels") or cin)
    if cin != in_channels or cout != (out_channels or in_channels):
        problems.append(f"latent channels {cin}->{cout}, {against} has {in_channels}->{out_channels or in_channels}")
    if int(student.config.get("text_dim", -1)) != text_dim:
        problems.append(f"text_dim {student.config.get('text_dim')}, {against} has {text_dim}")
    if latent_hw is not None:
        _, ph, pw = student.patch_size
        if latent_hw[0] % ph or latent_hw[1] % pw:
            problems.append(f"patch size {list(student.patch_size)} does not tile the {latent_hw[0]}x{latent_hw[1]} "
                            "latent grid")
    learned = InputRule.of(student.distill) if student.distill is not None else None
    if rule is not None and learned is not None:
        if learned.per_token != rule.per_token:
            problems.append(f"trained with expand_timesteps={learned.per_token}, {against} uses {rule.per_token}")
        if learned.condition != rule.condition:
            problems.append(f"trained on image condition {learned.condition}, {against} takes {rule.condition}")
    if problems:
        raise UserError(f"student {student.path} does not fit {against}: {'; '.join(problems)}")


def named_teacher(cfg, recorded: str | None, recorded_revision: str | None, record: str) -> Path:
    """--teacher (with --revision), else the teacher `record` names, at its recorded revision unless --revision says."""
    if cfg.teacher:
        return teacher_dir(cfg.teacher, cfg.revision)
    return teacher_dir(recorded, cfg.revision or recorded_revision, record)


def student_teacher(cfg, student: Student) -> tuple[str, Path]:
    """The name and folder of the teacher `sample` and `export` run: --teacher, else the one distill.json names."""
    name = cfg.teacher or student.setting("teacher")
    if name is None:
        raise UserError(f"no teacher: {student.root} has no distill.json naming one; pass --teacher")
    return name, named_teacher(cfg, name, student.setting("revision"), f"{student.root}'s distill.json")


def load_teacher(path: Path, dtype: torch.dtype, device: torch.device, *, text: bool = True, vae: bool = True,
                 image: bool = False, teacher_loras: list[teacher_lora.Loaded] = ()):
    """The teacher as diffusers' WanPipeline (`image`: WanImageToVideoPipeline, which TI2V's folder loads as too);
    without its text encoder and/or VAE when they are not needed; `teacher_loras` (what its cache's teacher carried,
    teacher_lora.recorded) fused into its experts before it moves to `device`."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    skip = {} if text else {"text_encoder": None, "tokenizer": None}
    if not vae:
        skip["vae"] = None
    try:
        pipe = (WanImageToVideoPipeline if image else WanPipeline).from_pretrained(path, torch_dtype=dtype, use_safetensors=True, **skip)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the teacher from {path} ({str(e).splitlines()[0]})") from e
    teacher_lora.fuse_pipeline(pipe, list(teacher_loras))
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
