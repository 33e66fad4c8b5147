"""The student kind (docs/architecture.md, "The student kind"): what a kind of student is to stage two (a
`StudentKind` built from the train-student config) and to the inference commands (the class itself: `Student.kind`).
The kinds, compact.py and lora.py, are declared with their settings and capabilities in pipeline/registries.py
(`STUDENTS`); nothing outside this package asks which kind a student is."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from cache.cache_error import UnsafeFileError
from pipeline import guidance_input
from pipeline.artifact import DistillRecord, LoraRecord
from pipeline.config_types import read_object
from pipeline.errors import UserError, first_line
from pipeline.hub import teacher_folder
from pipeline.model_call import InputRule
from pipeline.registries import STUDENTS
from pipeline.teacher_files import PIPELINES

TRANSFORMER_CLASS = "WanTransformer3DModel"
FIX = "rerun train-student, or pass another --student"  # what a refused file of a student folder tells the user
PAIR = "+"  # RUN1+RUN2: two one-expert LoRA runs taken as one student (lora.py `LoraStudent.pair`)


def model_class():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


@dataclass(frozen=True)
class Student:
    """A trained student: which weights, and what distill.json says about how it was trained."""

    root: Path  # train-student OUT (or the folder given, for a bare student folder)
    path: Path  # the transformer folder whose weights are used
    weights: str  # "ema", "raw" or "folder" (a bare folder was given)
    config: dict  # the transformer's config.json
    kind: type[StudentKind]  # what it is (the module docstring)
    distill: DistillRecord | None = None  # distill.json; None for a bare student folder
    lora: LoraRecord | None = None  # a LoRA run's lora.json; None for a compact student
    teacher_path: Path | None = None  # a LoRA run's teacher folder (the base its adapters load into)
    members: tuple[Student, ...] = ()  # a LoRA pair (RUN1+RUN2, lora.py): its two runs, in expert order

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


class StudentKind:
    """One kind of student. An instance is the student a train-student run trains (the methods below); the class,
    in each kind's classmethods, what the inference commands know of a trained one: `find(p, run, chosen, which)`
    (run `p`'s `Student` in its folder `chosen`, its weights checked against its records), `load`, `untrained`
    (eval's baseline; `init_exact`: whether it is the start exactly) and `pair` (RUN1+RUN2, or a refusal)."""

    config: dict  # its WanTransformer3DModel config, checked against the cache (set by `prepare` at the latest)
    bf16_policy = True  # --strategy fsdp may gather its float32 master weights in bf16 (a MixedPrecisionPolicy)
    marker: str  # the file that makes a run's student folder this kind's
    adapters = False  # its weights are adapters on the teacher: `export --fuse` and `--lora-format` apply

    def __init__(self, cfg):
        self.cfg = cfg

    def prepare(self, manifest: dict, cache: str, requested: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Refuse (one line) a cache this student cannot learn from; returns the cached steps to train on."""
        raise NotImplementedError

    def build(self, seed: int, dtype: torch.dtype) -> torch.nn.Module:
        """The untrained student, the same on every rank for `seed` (`dtype`: the autocast dtype, float32 without)."""
        raise NotImplementedError

    def describe(self, model: torch.nn.Module) -> str:
        """What the run's first line adds about the student."""
        return ""

    def record(self) -> LoraRecord | None:
        """distill.json's `lora` entry."""
        return None

    def identity(self) -> dict | None:
        """The run identity's entry of what this kind adds to its config (a resume must find it again)."""
        return None

    def teacher_flag(self) -> tuple[str, str | None]:
        """(flag, teacher) of the teacher this run names, if any."""
        return "--init-from-teacher", self.cfg.init_from_teacher

    def checkpoint_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the student (a DDP checkpoint's model.safetensors), in host memory."""
        return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}

    def load_checkpoint_state(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Put a checkpoint's `checkpoint_state` back, strictly."""
        model.load_state_dict(tensors, strict=True)

    def shard(self, model: torch.nn.Module, **kw) -> None:
        """FSDP2 units below the root one (`kw`: fully_shard's mesh and policy): one per transformer block."""
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, **kw)

    def gathered(self, model: torch.nn.Module, is_main: bool):
        """What rank 0 saves of an FSDP-sharded student (every rank calls this; None off rank 0): the full weights
        in host memory, in the unsharded class."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_main:
            return None
        with torch.device("meta"):  # no memory behind its weights: the gathered tensors become them
            plain = meta_model(model.config, "the student")
        plain.load_state_dict(full, assign=True)
        return plain


def kinds() -> list[type[StudentKind]]:
    """The student kinds, in declaration order (compact first: a student folder with no other kind's marker)."""
    return [e.load() for e in STUDENTS.entries()]


def student_kind(cfg) -> StudentKind:
    """The student `cfg` asks for, chosen once by the setting that chooses its kind (config.py checked it is one)."""
    return next(e for e in STUDENTS.entries() if getattr(cfg, e.caps.chosen_by) is not None).load()(cfg)


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The student's parameters that training changes, by name: all of a compact student's, a LoRA student's adapters
    (its base is frozen). What the optimizer, the EMA and the checkpoints hold."""
    return [(k, p) for k, p in model.named_parameters() if p.requires_grad]


def check_compatible(cfg: dict, manifest: dict, path: str) -> None:
    """Refuse a student that cannot consume the cache's latents and prompt embeddings."""
    defaults = {k: v.default for k, v in inspect.signature(model_class().__init__).parameters.items()}
    get = lambda k: cfg.get(k, defaults.get(k))  # noqa: E731
    c, f, h, w = manifest.latent_shape
    problems = []
    if get("in_channels") != manifest.in_channels:  # the teacher's: the latents', and an I2V condition's channels
        problems.append(f"in_channels {get('in_channels')} but the cache's teacher takes {manifest.in_channels}")
    if (get("out_channels") or get("in_channels")) != c:
        problems.append(f"out_channels {get('out_channels')} but the targets have {c} channels")
    text_dim = manifest.text_dim
    if text_dim is not None and get("text_dim") != text_dim:
        problems.append(f"text_dim {get('text_dim')} but the cache's prompt embeddings have {text_dim}")
    pt, ph, pw = tuple(get("patch_size"))
    if f % pt or h % ph or w % pw:
        problems.append(f"patch_size {[pt, ph, pw]} does not divide the latent grid {[f, h, w]}")
    else:  # Wan's rotary table (WanRotaryPosEmbed) holds rope_max_seq_len positions per axis, in patches
        rope = int(get("rope_max_seq_len"))
        axes = (("frames", f // pt), ("height", h // ph), ("width", w // pw))
        if over := [f"{name} {n}" for name, n in axes if n > rope]:
            problems.append(f"rope_max_seq_len {rope} is fewer positions than the cache's latents have patches "
                            f"along an axis ({', '.join(over)}); set rope_max_seq_len to at least "
                            f"{max(f // pt, h // ph, w // pw)}")
    rule = InputRule.of(manifest)
    if rule.per_token and (pt, ph, pw) != rule.patch:
        problems.append(f"patch_size {[pt, ph, pw]} differs from the teacher's {list(rule.patch)}, and this cache "
                        "uses per-token timesteps laid out on the teacher's patch grid")
    if problems:
        raise UserError(f"student config {path} does not fit the cache: " + "; ".join(problems)
                        + f" (cache: latent {[c, f, h, w]}, text_dim {text_dim}, patch {list(rule.patch)})")


def read_distill(path: Path) -> DistillRecord:
    try:
        return DistillRecord.read(path)
    except UnsafeFileError:  # (its line says what to do)
        raise
    except (ValueError, TypeError) as e:
        raise UserError(f"distill file {e}; rerun train-student to rewrite it, or remove it") from e


def meta_model(config: dict, where: Path):
    """The WanTransformer3DModel `config` builds, on the meta device (no memory, no weights): its tensors' shapes; with
    the guidance embedding its config names (pipeline/guidance_input.py)."""
    try:
        with torch.device("meta"):
            return with_guidance(model_class().from_config(config), config)
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError, OverflowError) as e:
        raise UserError(f"{where} does not describe a {TRANSFORMER_CLASS} ({first_line(e)}); {FIX}") from e


def with_guidance(model: torch.nn.Module, config) -> torch.nn.Module:
    """`model` with the guidance embedding `config` names (a student of --guidance-range), untrained; else as it is."""
    r = guidance_input.trained_range(config)
    return model if r is None else guidance_input.attach(model, *r)


def teacher_dir(name: str, revision: str | None = None, recorded_in: str | None = None) -> Path:
    """Local folder of a Wan teacher pipeline (pipeline.hub: one that `recorded_in` named is never fetched)."""
    p = teacher_folder(name, revision, recorded_in=recorded_in)
    mi = p / "model_index.json"
    if not mi.is_file():
        raise UserError(f"teacher {name!r} is not a diffusers pipeline folder (no model_index.json in {p})")
    cls = read_object(mi, "teacher index").get("_class_name")
    if cls not in PIPELINES:
        raise UserError(f"teacher {name!r} is a {cls!r}, not a {' or '.join(PIPELINES)}")
    return p


def teacher_transformer_config(path: Path) -> dict:
    """Config of the teacher's (first) transformer, read without loading weights."""
    for comp in ("transformer", "transformer_2"):
        cf = path / comp / "config.json"
        if cf.is_file():
            return read_object(cf, "teacher config")
    raise UserError(f"teacher {path} has no transformer/config.json")
