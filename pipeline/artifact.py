"""The run artifact: what `train-student` leaves in its OUT folder (the layout: docs/architecture.md, "The run
artifact"), and `distill.json`'s record. `train-student` writes it, `sample`, `eval` and `export` read it; nobody
else spells these names. The record is a dataclass: a key is written and read under one name only.

`RunLayout.foreign` tells a folder of ours from anyone else's: `train-student` writes into an --out that is empty
or holds only these names, each of its kind (a folder or a file; a JSON file that reads as ours), and their
temporary siblings (`<name>.<pid>.tmp`), never into a project folder that happens to hold a `config.json`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from cache import format as F
from cache import safe_open
from cache.records import MAX_PROMPTS, MAX_STEPS, CacheHeader, Record, TeacherLora, _int, _list, _short, optional

from .config import MAX_SEQUENCE_LENGTH
from .lock import RUN_LOCK, read_head
from .prompts import MAX_PROMPT_CHARS
from .registries import MAX_LORA_RANK

STUDENT = "student"
STUDENT_EMA = "student_ema"
STUDENT_INIT = "student_init"
CHECKPOINTS = "checkpoints"
DISTILL = "distill.json"
RESOLVED_CONFIG = "config.json"
METRICS = "metrics.jsonl"
LOSS_PNG = "loss.png"
TENSORBOARD = "tensorboard"
WANDB = "wandb"  # the folder wandb.init(dir=OUT) writes
WANDB_RUN = "wandb-run.json"
# A LoRA student's folder: one diffusers LoRA file per expert (what `WanPipeline.load_lora_weights` takes; the
# low-noise expert's with load_into_transformer_2=True, named as Wan2.2-Lightning names them) and its description.
LORA_JSON = "lora.json"
LORA_FILE = "pytorch_lora_weights.safetensors"  # a one-expert teacher's (diffusers' default name)
LORA_EXPERT_FILES = {"transformer": "high_noise_model.safetensors", "transformer_2": "low_noise_model.safetensors"}


def lora_file(component: str, teacher_experts: int) -> str:
    """The LoRA file of expert `component` of a teacher with `teacher_experts` transformers."""
    return LORA_FILE if teacher_experts == 1 else LORA_EXPERT_FILES[component]


@dataclass(frozen=True)
class RunLayout:
    """Paths of one training run's output folder."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    student = property(lambda self: self.root / STUDENT)
    student_ema = property(lambda self: self.root / STUDENT_EMA)
    student_init = property(lambda self: self.root / STUDENT_INIT)
    checkpoints = property(lambda self: self.root / CHECKPOINTS)
    distill = property(lambda self: self.root / DISTILL)
    resolved_config = property(lambda self: self.root / RESOLVED_CONFIG)
    metrics = property(lambda self: self.root / METRICS)
    loss_png = property(lambda self: self.root / LOSS_PNG)
    tensorboard = property(lambda self: self.root / TENSORBOARD)
    wandb = property(lambda self: self.root / WANDB)
    wandb_run = property(lambda self: self.root / WANDB_RUN)

    def holds_run(self) -> list[str]:
        """Names of the run outputs already present (a finished or checkpointed run)."""
        return [p.name for p in (self.student, self.student_ema, self.checkpoints) if p.exists()]

    def foreign(self, limit: int = 3) -> list[str]:
        """What in this folder is not a train-student run's, in words (at most `limit`, then how many more); [] for
        an empty or missing folder or one holding only what a run writes (`_RUN_ENTRIES`). Links count as foreign:
        a run never makes one, and writing through it would write elsewhere."""
        if not self.root.is_dir():
            return []
        found = [f"{e.name}{why}" for e in sorted(self.root.iterdir()) if (why := _not_ours(e)) is not None]
        return found[:limit] + ([f"{len(found) - limit} more"] if len(found) > limit else [])


RECORD_FIX = "rerun train-student to rewrite it"  # what a refused record of a run tells the user
EVAL_REPORT = "eval.json"  # what `eval` writes into the run folder by default (stages/sample/evaluate.py REPORT_NAME)
# ... and its plots beside it (the report's name with .png; with --attributes, -attributes.png): a run folder holds
# them, so that `eval` on a run never blocks its later `train-student --resume`
EVAL_PLOTS = (Path(EVAL_REPORT).with_suffix(".png").name, f"{Path(EVAL_REPORT).stem}-attributes.png")
_PNGS = (LOSS_PNG, *EVAL_PLOTS)
# Every name a run folder holds, and whether it is a folder.
_RUN_ENTRIES = {STUDENT: True, STUDENT_EMA: True, STUDENT_INIT: True, CHECKPOINTS: True, TENSORBOARD: True,
                WANDB: True, DISTILL: False, RESOLVED_CONFIG: False, METRICS: False, WANDB_RUN: False,
                RUN_LOCK: False, EVAL_REPORT: False, **dict.fromkeys(_PNGS, False)}
# The settings every resolved train-student config.json holds (pipeline/config.py `save_resolved`).
_CONFIG_KEYS = {"cache", "out", "resume", "checkpoint_every", "strategy"}


def _base_name(name: str) -> str | None:
    """The run entry a name is, or is a temporary sibling of (`student.123.tmp`, `config.json.123.tmp`,
    `loss.png.tmp.png`, `student.123.old.tmp`); None for a name a run never writes."""
    if name in _RUN_ENTRIES:
        return name
    temporary = name.endswith(".tmp") or name == f"{LOSS_PNG}.tmp.png"
    return next((base for base in _RUN_ENTRIES if temporary and name.startswith(base + ".")), None)


# What `_not_ours` reads of a file at most: a run's records are kilobytes (an eval.json of 128 captions ~50 KB, of
# thousands a few MB), and a file someone else left there is not read whole whatever its size.
_HEAD_BYTES = 64 << 20


def _not_ours(entry: Path) -> str | None:
    """Why `entry` (in a would-be run folder) is not what train-student writes there, as a suffix to its name
    (`" (not a train-student config)"`, `""` for a name a run never writes); None when it is a run's."""
    base = _base_name(entry.name)
    if base is None:
        return ""
    if entry.is_symlink():
        return " (a link)"
    if not (entry.is_dir() or entry.is_file()):  # a FIFO would hang the read below, a device feed it for ever
        return " (neither a file nor a folder)"
    if _RUN_ENTRIES[base] != entry.is_dir():
        return " (a folder)" if entry.is_dir() else " (a file)"
    if entry.name != base or entry.is_dir():
        return None  # a temporary sibling, or one of the run's folders
    head = read_head(entry, _HEAD_BYTES)  # (never through a link, never waiting on a FIFO)
    if base in _PNGS:
        return None if head[:8] in (b"\x89PNG\r\n\x1a\n", b"") else " (not a PNG)"
    if base in (RESOLVED_CONFIG, DISTILL, WANDB_RUN, EVAL_REPORT):
        try:
            obj = safe_open.parse_json(head, entry)
        except ValueError:  # (one past _HEAD_BYTES is cut, so no JSON: not a record of ours)
            return " (not readable JSON)"
        if base == RESOLVED_CONFIG and not (isinstance(obj, dict) and _CONFIG_KEYS <= obj.keys()):
            return " (not a train-student config)"
        if base == DISTILL and DistillRecord.problem(obj) is not None:
            return " (not a train-student record)"
        return None
    if base == METRICS:  # one JSON record per line, each with its `type`: the first one tells
        first = head.split(b"\n", 1)[0]
        try:
            return None if not first.strip() or "type" in safe_open.parse_json(first, entry) else \
                " (not train-student metrics)"
        except (ValueError, TypeError):
            return " (not train-student metrics)"
    return None


# What a Wan teacher draws at most: its rotary table holds 1024 positions per axis (WanRotaryPosEmbed's default, every
# released Wan config's; stages/teacher_cache/teacher.py ROPE_MAX_SEQ_LEN), each a patch of 2 x 16 pixels (TI2V's VAE;
# 8 for the others) or of 1 latent frame (4 frames). A record beyond them is no run of a Wan teacher.
MAX_SIDE, MAX_FRAMES = 1024 * 2 * 16, (1024 - 1) * 4 + 1
MAX_LORA_TARGETS = 64  # (a block has 10 linear modules)
_FINITE = (lambda v: type(v) in (int, float) and math.isfinite(v)), "a finite number"
_SCALE = (lambda v: _FINITE[0](v) and v >= 0), "a finite number >= 0"
_RATIO = (lambda v: _FINITE[0](v) and 0 <= v <= 1), "a number in 0..1"
_NAME = (lambda v: isinstance(v, str) and 0 < len(v) <= 4096), "a non-empty string"


def _bounded(item: tuple, what: str, lo: int, hi: int) -> tuple:
    check = _list(item, what)
    return (lambda v: check[0](v) and lo <= len(v) <= hi), f"{check[1]} ({lo if lo == hi else f'{lo}..{hi}'})"


def _experts_list(v) -> bool:
    """A LoRA record's experts: transformer names, each once, in expert order."""
    return type(v) is list and bool(v) and v == [c for c in LORA_EXPERT_FILES if c in v]


_EXPERTS = _experts_list, f"a list of {' and/or '.join(LORA_EXPERT_FILES)}, in that order"
_STEP_LIST = _bounded(_FINITE, "finite numbers", 1, MAX_STEPS + 1)  # (a schedule: its end may be listed too)


@dataclass(frozen=True, kw_only=True)
class LoraRecord(Record):
    """A LoRA run's lora.json (and distill.json's `lora`): the teacher it adapts and its adapters, what `sample`,
    `eval` and `export` rebuild the student from (stages/students/lora.py writes it)."""

    teacher: str  # as given to --lora-of (an export's copy: its public name)
    revision: str | None
    experts: list[str]  # the teacher's transformers
    trained: list[str]  # those with adapters
    files: dict  # trained expert -> its LoRA file (`lora_file`)
    boundary_ratio: float | None
    boundary_timestep: float | None
    rank: int
    alpha: float
    targets: list[str]

    RANGES = {"teacher": _NAME, "experts": _EXPERTS, "trained": _EXPERTS, "boundary_ratio": _RATIO,
              "boundary_timestep": _SCALE, "rank": _int(1, MAX_LORA_RANK),
              "alpha": ((lambda v: _FINITE[0](v) and v > 0), "a finite number > 0"),
              "targets": _bounded(_NAME, "module names", 1, MAX_LORA_TARGETS)}

    @classmethod
    def problem(cls, obj, where: str = "") -> str | None:
        """Record.problem, then: the trained experts are some of its experts, and each one's file is the one name
        train-student gives it (`lora_file`), never a path."""
        if (problem := super().problem(obj, where)) is not None:
            return problem
        if not set(obj["trained"]) <= set(obj["experts"]):
            return f"{where}its trained experts {obj['trained']} are not among its experts {obj['experts']}"
        want = {c: lora_file(c, len(obj["experts"])) for c in obj["trained"]}
        if obj["files"] != want:
            return f"{where}its field 'files' is {_short(obj['files'])}, expected {want}"
        return None

    @classmethod
    def read(cls, folder: str | os.PathLike) -> LoraRecord:
        """FOLDER/lora.json (`safe_open.read_json`: no link followed, size and nesting bounded); ValueError naming
        what is wrong otherwise."""
        return cls.from_json(safe_open.read_json(folder, LORA_JSON, "record", fix=RECORD_FIX))


def tensor_mismatch(found: dict, want: dict) -> str | None:
    """How the tensors `found` ({name: shape}: a weight file's) differ from those `want`, in words; None where they
    are the same."""
    if extra := sorted(found.keys() - want.keys()):
        return f"it holds {extra[0]!r}, which is not one of the {len(want)} tensors expected"
    if missing := sorted(want.keys() - found.keys()):
        return f"it lacks {missing[0]!r} ({len(missing)} of the {len(want)} tensors expected are missing)"
    bad = next((k for k in sorted(want) if tuple(found[k]) != tuple(want[k])), None)
    return None if bad is None else f"{bad!r} is {list(found[bad])}, expected {list(want[bad])}"


@dataclass(frozen=True, kw_only=True)
class DistillRecord(Record):
    """distill.json: what the student learned (the cache's settings, copied from its manifest) and how it is meant
    to be sampled. Every field is written; `from_json` refuses an unknown, missing or mistyped one."""

    student: str = STUDENT
    student_ema: str | None = None  # STUDENT_EMA when EMA weights were saved
    caches: list[dict]  # [{path, fingerprint}] of the caches trained on
    fingerprints: list[str]
    # The manifest's (cache/records.py CacheHeader) teacher and sampling settings: the targets are the teacher's
    # *guided* predictions when cfg is true, and the student then samples without CFG.
    teacher: str
    teacher_path: str | None  # None in an export's copy (stages/sample/hub_card.py public_record)
    revision: str | None
    cfg: bool
    guidance: float
    guidance_2: float | None
    boundary_ratio: float | None
    negative_prompt: str
    max_sequence_length: int  # the text length of the cache's embeddings: sample with it
    expand_timesteps: bool
    condition: str = optional(F.NO_CONDITION)  # image-to-video: how the cache's condition latent enters (model_call)
    # the LoRAs fused into the cache's teacher (teacher-cache --teacher-lora): sample and eval fuse them into the
    # teacher they draw beside the student; their paths are local (None in an export's copy)
    teacher_loras: list[TeacherLora] | None = optional()
    teacher_lora_paths: list[str] | None = optional()
    latent_shape: list[int]
    height: int
    width: int
    frames: int
    dtype: str
    steps: int  # the teacher's sampling steps in the cache
    timesteps: list[float]
    sigmas: list[float]
    scheduler: dict
    train_steps: list[int]  # cached step indices trained on
    train_timesteps: list[float]
    heldout_prompts: list[int]
    train_trajectories: int | None = optional()  # --train-trajectories N: the first N trajectories only; None: all
    init_seed: int
    init_from_teacher: str | None = None
    student_config: str | None = None
    optimizer_steps: int = 0
    samples_seen: int = 0
    epochs_completed: int = 0
    # The objective trained (stages/train_student/objective_velocity.py) and its settings.
    objective: str
    objective_settings: dict
    # Sampling steps the student is meant to use; None: the teacher's `steps`.
    student_steps: int | None = None
    # A LoRA student (--lora-of): the teacher it adapts and its adapters (what student/lora.json says); None for
    # a compact student.
    lora: LoraRecord | None = None

    NESTED = {"lora": (LoraRecord, "its lora: "), "teacher_loras": (TeacherLora, "its teacher LoRA: ")}
    # Every number sample, eval and export compute with, bounded by what a Wan teacher takes (a billion steps or
    # frames would run out of memory or abort, not refuse).
    RANGES = {"teacher": _NAME, "student_steps": _int(1, MAX_STEPS), "frames": _int(1, MAX_FRAMES),
              "height": _int(1, MAX_SIDE), "width": _int(1, MAX_SIDE),
              "max_sequence_length": _int(1, MAX_SEQUENCE_LENGTH),
              "negative_prompt": ((lambda v: isinstance(v, str) and len(v) <= MAX_PROMPT_CHARS),
                                  f"a string of at most {MAX_PROMPT_CHARS:,} characters"),
              "latent_shape": _bounded(_int(1, MAX_SIDE), "sizes", 4, 4), "guidance": _SCALE, "guidance_2": _SCALE,
              "boundary_ratio": _RATIO, "timesteps": _STEP_LIST, "sigmas": _STEP_LIST,
              "train_steps": _bounded(_int(0, MAX_STEPS - 1), "step numbers", 1, MAX_STEPS),
              "train_timesteps": _STEP_LIST, "heldout_prompts": _list(_int(0, MAX_PROMPTS - 1), "prompt numbers"),
              "train_trajectories": _int(1), "init_seed": _int(-2**63, 2**64 - 1)}

    @classmethod
    def of_cache(cls, manifest: CacheHeader, **learned) -> DistillRecord:
        """The record of a student trained on the cache `manifest` describes: the fields the two records share
        copied from it as they are (unless `learned` changes them: a student of another guidance), `learned` (the
        run's own fields) for the rest."""
        shared = {f.name for f in fields(CacheHeader)} & {f.name for f in fields(cls)}
        return cls(**{k: getattr(manifest, k) for k in shared} | learned)

    guided = property(lambda self: self.cfg)  # the student learned CFG-guided targets: it samples at guidance 1
    sampling_steps = property(lambda self: self.steps if self.student_steps is None else self.student_steps)

    @classmethod
    def from_json(cls, obj, source: str | os.PathLike = DISTILL) -> DistillRecord:
        """The record of a distill.json; ValueError naming what is wrong (a file of another tool) otherwise."""
        problem = cls.problem(obj)
        if problem is not None:
            raise ValueError(f"{source}: {problem}; it was not written by this WanDistiller's train-student")
        return cls._build(obj)

    @classmethod
    def read(cls, path: str | os.PathLike) -> DistillRecord:
        """Read distill.json (`safe_open.read_json`: no link followed, size and nesting bounded); ValueError with the
        reason if it is not a record."""
        path = Path(path)
        return cls.from_json(safe_open.read_json(path.parent, path.name, "record", fix=RECORD_FIX), path)
