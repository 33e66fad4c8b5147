"""Find and load what the inference commands run: the trained student (the run artifact, or a bare transformer
folder), its untrained twin and the teacher pipeline. The student's `kind` (`CompactRun` here, export_lora.py's
`LoraRun`) finds, loads, rebuilds untrained and exports it: docs/architecture.md, "The run artifact"."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cache import safe_open
from cache.cache_error import UnsafeFileError
from pipeline.artifact import (
    DISTILL, STUDENT, STUDENT_EMA, STUDENT_INIT, DistillRecord, LoraRecord, RunLayout, tensor_mismatch,
)
from pipeline.config_types import read_object
from pipeline.errors import UserError, first_line
from pipeline.hub import teacher_folder
from pipeline.teacher_files import PICKLED

if TYPE_CHECKING:
    from .export_lora import LoraRun

log = logging.getLogger(__name__)

TRANSFORMER_CLASS = "WanTransformer3DModel"
PIPELINE_CLASS = "WanPipeline"
# Teacher components a student pipeline borrows (everything but the transformers).
BORROWED = ("tokenizer", "text_encoder", "vae", "scheduler")
FIX = "rerun train-student, or pass another --student"  # what a refused file of a student folder tells the user
PAIR = "+"  # RUN1+RUN2: two one-expert LoRA runs taken as one student (export_lora.py `LoraRun.pair`)


@dataclass(frozen=True)
class Student:
    """A trained student: which weights, and what distill.json says about how it was trained."""

    root: Path  # train-student OUT (or the folder given, for a bare student folder)
    path: Path  # the transformer folder whose weights are used
    weights: str  # "ema", "raw" or "folder" (a bare folder was given)
    config: dict  # the transformer's config.json
    kind: CompactRun | LoraRun  # what it is (the module docstring)
    distill: DistillRecord | None = None  # distill.json; None for a bare student folder
    lora: LoraRecord | None = None  # a LoRA run's lora.json; None for a compact student
    teacher_path: Path | None = None  # a LoRA run's teacher folder (the base its adapters load into)
    members: tuple[Student, ...] = ()  # a LoRA pair (RUN1+RUN2, export_lora.py): its two runs, in expert order

    @property
    def name(self) -> str:
        """What it is called in summaries: its run folder's name, a pair's two joined by PAIR."""
        return PAIR.join(m.root.name for m in self.members) if self.members else self.root.name

    def adapter_folder(self, comp: str) -> Path:
        """The folder holding expert `comp`'s LoRA file: its own, or that of the pair's run that trained `comp`."""
        return next((m.path for m in self.members if comp in m.lora.trained), self.path)

    @property
    def guided(self) -> bool:
        """Whether the student learned CFG-guided targets (then it samples at guidance 1)."""
        return self.distill.guided if self.distill is not None else True

    @property
    def fingerprints(self) -> list[str]:
        """Fingerprints of the cache(s) the student was trained on."""
        return list(self.distill.fingerprints) if self.distill is not None else []

    def setting(self, key: str, default=None):
        """distill.json's `key` (a DistillRecord field), or `default` when it is unset or there is no record."""
        v = getattr(self.distill, key) if self.distill is not None else None
        return default if v is None else v

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.config.get("patch_size", (1, 2, 2)))

    def describe(self) -> dict:
        path = PAIR.join(str(m.path) for m in self.members) if self.members else str(self.path)
        return {"path": path, "weights": self.weights, "distill_json": self.distill is not None,
                "guided_targets": self.guided, "objective": self.setting("objective"),
                "student_steps": self.setting("sampling_steps")}


def _transformer_config(folder: Path, run: Path | None = None) -> dict | None:
    """config.json of a WanTransformer3DModel folder, its weights checked against it (`check_weights`); None if
    `folder` holds no model config. `run`: the run folder `folder` lies in (then `folder` must not be a link)."""
    try:
        cfg = safe_open.read_json(*((run, f"{folder.name}/config.json") if run else (folder, "config.json")),
                                  "config", fix=FIX)
    except FileNotFoundError:
        return None
    if not isinstance(cfg, dict) or cfg.get("_class_name") != TRANSFORMER_CLASS:
        name = cfg.get("_class_name") if isinstance(cfg, dict) else cfg
        raise UserError(f"{folder} holds a {name!r}, not a {TRANSFORMER_CLASS} student")
    check_weights(folder, cfg)
    return cfg


def meta_model(config: dict, where: Path):
    """The WanTransformer3DModel `config` builds, on the meta device (no memory, no weights): its tensors' shapes."""
    from diffusers import WanTransformer3DModel

    try:
        with torch.device("meta"):
            return WanTransformer3DModel.from_config(config)
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError, OverflowError) as e:
        raise UserError(f"{where} does not describe a {TRANSFORMER_CLASS} ({first_line(e)}); {FIX}") from e


def check_weights(folder: Path, config: dict) -> None:
    """Refuse a transformer folder whose weights are not what its config.json builds, before any is read: a pickled
    weight file (`PICKLED`), no *.safetensors, or tensors (their headers, bounded) of other names or shapes."""
    files = list(safe_open.walk(folder, FIX))  # (a link or a FIFO anywhere in it: refused)
    if pickled := [f for f in files if f.endswith(PICKLED)]:
        raise UserError(f"student folder {folder} holds {pickled[0]}, a pickled weight file, which WanDistiller never "
                        f"loads (unpickling runs code); a student's weights are *.safetensors: remove it, or {FIX}")
    found = {}
    for f in (f for f in files if "/" not in f and f.endswith(".safetensors")):
        found |= {k: shape for k, (_, shape) in safe_open.safetensors_header(folder, f, FIX).items()}
    if not found:
        raise UserError(f"student folder {folder} has a config but no *.safetensors weights; "
                        "rerun train-student or point --student at a finished run")
    layers = config.get("num_layers", 0)
    if not (type(layers) is int and 0 < layers <= len(found)):  # (each block holds tensors: none left unbuilt)
        raise UserError(f"{folder / 'config.json'}: num_layers {layers!r} is not what its {len(found)} weight "
                        f"tensors hold; {FIX}")
    model = meta_model(config, folder / "config.json")
    if problem := tensor_mismatch(found, {k: tuple(v.shape) for k, v in model.state_dict().items()}):
        raise UserError(f"student folder {folder}: its weights are not what its config.json builds ({problem}); "
                        f"{FIX}")


def read_distill(path: Path) -> DistillRecord:
    try:
        return DistillRecord.read(path)
    except UnsafeFileError:  # (its line says what to do)
        raise
    except (ValueError, TypeError) as e:
        raise UserError(f"distill file {e}; rerun train-student to rewrite it, or remove it") from e


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
    # A train-student OUT holds student/ (and its own config.json, the run's settings); anything else must be
    # a transformer folder itself.
    if not (run.student.is_dir() or run.student_ema.is_dir() or os.path.lexists(run.distill)):
        bare = _transformer_config(p)
        if bare is None:
            raise UserError(f"{p} holds no student: neither {STUDENT}/ nor a model config.json; pass the --out "
                            "folder of a finished `wandistiller train-student` run")
        # OUT/student given directly: its distill.json is one level up.
        parent = RunLayout(p.parent)
        distill = (read_distill(parent.distill) if p.name in (STUDENT, STUDENT_EMA) and os.path.lexists(parent.distill)
                   else None)
        return Student(root=p.parent if distill else p, path=p, weights="folder", config=bare, kind=COMPACT,
                       distill=distill)
    if not run.student.is_dir():  # train-student renames student/ into place last: without it the run did not finish
        raise UserError(f"{p} holds no finished student: {STUDENT}/ is missing (train-student was stopped "
                        "before it saved); rerun the same train-student command with --resume to finish it")
    # (a marker that is a link or a FIFO is there, to be refused as its kind reads it: never taken for no marker)
    kind = next((k for k in map(_load, OTHER_KINDS) if os.path.lexists(run.student / k.marker)), COMPACT)
    has_ema = (run.student_ema / kind.marker).is_file()
    if weights == "ema" and not has_ema:
        raise UserError(f"--weights ema: {p} has no {STUDENT_EMA}/ (EMA was off in train-student); "
                        "use --weights raw or auto")
    chosen, which = (run.student_ema, "ema") if weights == "ema" or (weights == "auto" and has_ema) \
        else (run.student, "raw")
    return kind.find(p, run, chosen, which)  # (each kind checks its weights against its records as it finds them)


class CompactRun:
    """A compact run's student: a WanTransformer3DModel folder (student/, or student_ema/)."""

    marker = "config.json"  # the file that makes a student folder this kind's
    adapters = False  # `export --fuse` and `--lora-format` apply to a student with adapters

    def find(self, p: Path, run: RunLayout, chosen: Path, which: str) -> Student:
        cfg = _transformer_config(chosen, run.root)
        if cfg is None:
            raise UserError(f"{p} holds no student: {chosen.name}/config.json is missing; pass the --out folder of "
                            "a finished `wandistiller train-student` run")
        distill = read_distill(run.distill) if os.path.lexists(run.distill) else None
        if distill is None:
            log.warning("%s has no %s: assuming the student learned guided targets", p, DISTILL)
        return Student(root=p, path=chosen, weights=which, config=cfg, kind=self, distill=distill)

    def load(self, student: Student, dtype: torch.dtype, device: torch.device):
        from diffusers import WanTransformer3DModel

        try:
            model = WanTransformer3DModel.from_pretrained(student.path, torch_dtype=dtype, use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise UserError(f"cannot load the student from {student.path} ({str(e).splitlines()[0]}); "
                            "rerun train-student or pass another --student") from e
        return model.to(device).eval().requires_grad_(False)

    def init_exact(self, student: Student, seed: int | None) -> bool:
        """Whether `untrained` reproduces the starting weights: saved, or the recorded seed and no teacher blocks."""
        return seed is None and (_has_init_dir(student) or student.setting("init_seed") is not None
                                 and not student.setting("init_from_teacher"))

    def untrained(self, student: Student, seed: int | None, dtype: torch.dtype, device: torch.device):
        """The student before training and how it was obtained: OUT/student_init/ when saved, else config.json after
        `torch.manual_seed` (--init-seed, else distill.json's `init_seed`, else 0), as train-student builds it."""
        from diffusers import WanTransformer3DModel

        exact = self.init_exact(student, seed)
        if seed is None and _has_init_dir(student):
            model = WanTransformer3DModel.from_pretrained(RunLayout(student.root).student_init, torch_dtype=dtype,
                                                          use_safetensors=True)
            how = {"source": f"{STUDENT_INIT}/", "exact": exact}
        else:
            if seed is None:
                seed = int(student.setting("init_seed", 0))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = WanTransformer3DModel.from_config(student.config)
            how = {"source": "config.json + torch.manual_seed", "seed": seed, "exact": exact}
        return model.to(device, dtype).eval().requires_grad_(False), how

    def export(self, cfg, student: Student, hints: dict, out: Path, teacher: tuple) -> dict:
        return _load("stages.sample.export:write_pipeline")(cfg, student, hints, out, *teacher)

    def pair(self, members: list[Student], names: list[str]) -> Student:
        raise UserError(f"{PAIR.join(names)}: {names[0]} is a compact student, and a pair joins two LoRA runs of one "
                        "teacher, one per expert (train-student --lora-of TEACHER --lora-experts 1, and 2)")


COMPACT = CompactRun()
# The other kinds, declared by import path as the registries declare implementations (each builds on this module).
OTHER_KINDS = ("stages.sample.export_lora:LORA_RUN",)


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


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


def _has_init_dir(student: Student) -> bool:
    return _transformer_config(RunLayout(student.root).student_init, student.root) is not None


def check_compatible(student: Student, *, in_channels: int, text_dim: int, latent_hw: tuple[int, int] | None,
                     expand_timesteps: bool | None, against: str) -> None:
    """Refuse a student that cannot run on these latents and text embeddings, with one line saying why."""
    problems = []
    cin = int(student.config["in_channels"])
    cout = int(student.config.get("out_channels") or cin)
    if cin != in_channels or cout != in_channels:
        problems.append(f"latent channels {cin}->{cout}, {against} has {in_channels}")
    if int(student.config.get("text_dim", -1)) != text_dim:
        problems.append(f"text_dim {student.config.get('text_dim')}, {against} has {text_dim}")
    if latent_hw is not None:
        _, ph, pw = student.patch_size
        if latent_hw[0] % ph or latent_hw[1] % pw:
            problems.append(f"patch size {list(student.patch_size)} does not tile the {latent_hw[0]}x{latent_hw[1]} "
                            "latent grid")
    learned = student.setting("expand_timesteps")
    if expand_timesteps is not None and learned is not None and bool(learned) != bool(expand_timesteps):
        problems.append(f"trained with expand_timesteps={bool(learned)}, {against} uses {bool(expand_timesteps)}")
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


def teacher_dir(name: str, revision: str | None = None, recorded_in: str | None = None) -> Path:
    """Local folder of a Wan teacher pipeline (pipeline.hub: one that `recorded_in` named is never fetched)."""
    p = teacher_folder(name, revision, recorded_in=recorded_in)
    mi = p / "model_index.json"
    if not mi.is_file():
        raise UserError(f"teacher {name!r} is not a diffusers pipeline folder (no model_index.json in {p})")
    cls = read_object(mi, "teacher index").get("_class_name")
    if cls != PIPELINE_CLASS:
        raise UserError(f"teacher {name!r} is a {cls!r}, not a {PIPELINE_CLASS}")
    return p


def teacher_transformer_config(path: Path) -> dict:
    """Config of the teacher's (first) transformer, read without loading weights."""
    for comp in ("transformer", "transformer_2"):
        cf = path / comp / "config.json"
        if cf.is_file():
            return read_object(cf, "teacher config")
    raise UserError(f"teacher {path} has no transformer/config.json")


def load_teacher(path: Path, dtype: torch.dtype, device: torch.device, *, text: bool = True, vae: bool = True):
    """The teacher as diffusers' WanPipeline; without its text encoder and/or VAE when they are not needed."""
    from diffusers import WanPipeline

    skip = {} if text else {"text_encoder": None, "tokenizer": None}
    if not vae:
        skip["vae"] = None
    try:
        pipe = WanPipeline.from_pretrained(path, torch_dtype=dtype, use_safetensors=True, **skip)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the teacher from {path} ({str(e).splitlines()[0]})") from e
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
