"""The cache's JSON records as frozen dataclasses: stage one's header, the manifest, a shard record.

Each record's fields are its JSON keys, in the order written (`to_json`); `from_json` refuses an unknown key, a
missing one or one of another type or range in one line (docs/architecture.md, "The cache")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import ClassVar

import numpy as np

from . import format as F
from .cache_error import FormatVersionError
from .feature_projection import matrix_sha256, projection_matrix

MAX_PARTS, MAX_PROMPTS, MAX_SEEDS, MAX_STEPS = 10**5, 10**8, 100, 1000
# The format's own upper bounds: the names hold 5 digits of part, 6 of shard, 8 of prompt, 2 of seed and 3 of step
# (`format.sample_key`, `format.shard_relpath`), so no cache can have more.
SHARD_RE = re.compile(r"^shards/part-(\d{5})-\d{6}\.tar$")
TEACHER_SHAPE = ("num_attention_heads", "attention_head_dim", "num_layers", "ffn_dim")  # the header's teacher_shape


def _int(lo: int = 0, hi: int | None = None) -> tuple[Callable, str]:
    return ((lambda v: type(v) is int and v >= lo and (hi is None or v <= hi)),
            f"a whole number >= {lo}" if hi is None else f"a whole number in {lo}..{hi}")


def _list(item: tuple[Callable, str], what: str) -> tuple[Callable, str]:
    return (lambda v: type(v) is list and all(item[0](x) for x in v)), f"a list of {what}"


def _maybe(check: tuple[Callable, str]) -> tuple[Callable, str]:
    return (lambda v: v is None or check[0](v)), f"{check[1]} or null"


_STR = (lambda v: isinstance(v, str)), "a string"
_BOOL = (lambda v: type(v) is bool), "true or false"
_NUMBER = (lambda v: type(v) in (int, float)), "a number"
_OBJECT = (lambda v: type(v) is dict), "an object"
# The check of each annotation a record field has; RANGES narrows the ones readers compute with.
_CHECKS = {"int": _int(), "str": _STR, "bool": _BOOL, "float": _NUMBER, "dict": _OBJECT,
           "list[int]": _list(_int(), "whole numbers"), "list[float]": _list(_NUMBER, "numbers"),
           "list[str]": _list(_STR, "strings"), "list[dict]": _list(_OBJECT, "objects")}
RANGES = {
    "prompts": _int(1, MAX_PROMPTS), "seeds_per_prompt": _int(1, MAX_SEEDS), "steps": _int(1, MAX_STEPS),
    "recorded_steps": _list(_int(0, MAX_STEPS - 1), "step numbers"), "latent_shape": _list(_int(1), "sizes"),
    "dtype": ((lambda v: v in F.DTYPES), f"one of {', '.join(F.DTYPES)}"), "max_sequence_length": _int(1),
    "text_dim": _int(1), "num_parts": _int(1, MAX_PARTS), "condition_shape": _list(_int(1), "sizes"),
    "condition": ((lambda v: v in F.CONDITIONS), f"one of {', '.join(F.CONDITIONS)}"),
    "part": _int(0, MAX_PARTS - 1), "crc32c": _int(0, 2**32 - 1), "batch_size": _int(1), "samples_per_shard": _int(1),
    "patch_size": _list(_int(1), "sizes"), "teacher_shape": ((lambda v: type(v) is dict and sorted(v) == sorted(
        TEACHER_SHAPE) and all(_int(1)[0](x) for x in v.values())), f"{', '.join(TEACHER_SHAPE)}, whole numbers >= 1"),
}


def optional(default=None):
    """A field written only when it is not `default` (settings whose absence keeps older fingerprints)."""
    return field(default=default, metadata={"optional": True})


def _check(f: dataclasses.Field, own: dict) -> tuple[Callable, str]:
    kind = str(f.type).replace(" | None", "")
    # (a nested record, or a list of them: its own `problem` checks its fields)
    check = own.get(f.name) or RANGES.get(f.name) or _CHECKS.get(kind) or (
        _list(_OBJECT, "records") if kind.startswith("list[") else _OBJECT)
    return _maybe(check) if str(f.type).endswith("| None") else check


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_version(path: Path, record: dict) -> None:
    """CacheError unless `record` (a manifest or a part's progress record, read from `path`) was written in this
    FORMAT_VERSION: a cache of another version is refused whole, never read in part."""
    version = record.get("format_version")
    if version == F.FORMAT_VERSION:
        return
    if isinstance(version, int) and version < F.FORMAT_VERSION:
        raise FormatVersionError(f"{path}: written by an older wandistiller (format {version}); rebuild it with "
                                 "teacher-cache")
    raise FormatVersionError(f"{path}: format {version!r}, this wandistiller reads format {F.FORMAT_VERSION}; "
                             "rebuild it with teacher-cache, or use the wandistiller that wrote it")


class Record:
    """JSON in the field order, back with every field checked (`problem`)."""

    FIRST: ClassVar[tuple[str, ...]] = ()  # fields written before the rest (the manifest's own)
    # Fields holding records (or lists of them): field -> (its record type, how its problem names it).
    NESTED: ClassVar[dict[str, tuple[type, str]]] = {}
    # A record's own ranges, before RANGES (a record outside the cache bounds its fields by what reads them).
    RANGES: ClassVar[dict[str, tuple[Callable, str]]] = {}

    def to_json(self) -> dict:
        return self._json([*self.FIRST, *(f.name for f in fields(self) if f.name not in self.FIRST)])

    def _json(self, names) -> dict:
        out = {}
        for name in names:
            v = getattr(self, name)
            if (f := self.__dataclass_fields__[name]).metadata.get("optional") and v == f.default:
                continue
            out[name] = v.to_json() if isinstance(v, Record) else [x.to_json() for x in v] \
                if isinstance(v, list) and v and isinstance(v[0], Record) else v
        return out

    @classmethod
    def problem(cls, obj, where: str = "") -> str | None:
        """Why `obj` is not this record: not an object, an unknown key, a required one missing, one of another
        type or range; None when it is."""
        if not isinstance(obj, dict):
            return f"{where or 'it'} is not a JSON object"
        known = {f.name: f for f in fields(cls)}
        if unknown := sorted(set(obj) - set(known)):
            return f"{where}it has an unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown[:5]))}"
        for name, f in known.items():
            if name not in obj:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    return f"{where}lacks the field {name!r}"
            elif not (check := _check(f, cls.RANGES))[0](obj[name]):
                return f"{where}its field {name!r} is {_short(obj[name])}, expected {check[1]}"
        for name, (kind, label) in cls.NESTED.items():
            found = obj.get(name)  # (an optional one may be null or absent)
            for rec in found if isinstance(found, list) else [] if found is None else [found]:
                if (problem := kind.problem(rec, label)) is not None:
                    return problem
        return None

    @classmethod
    def from_json(cls, obj, where: str = ""):
        """The record `obj` holds; ValueError with `problem` in one line otherwise."""
        if (problem := cls.problem(obj, where)) is not None:
            raise ValueError(problem)
        return cls._build(obj)

    @classmethod
    def _build(cls, obj: dict):
        return cls(**obj | {name: [kind._build(r) for r in obj[name]] if isinstance(obj[name], list)
                            else kind._build(obj[name]) for name, (kind, _) in cls.NESTED.items()
                            if obj.get(name) is not None})


@dataclass(frozen=True, kw_only=True)
class ShardRecord(Record):
    """One shard a part wrote (in its progress record and in the manifest)."""

    path: str  # shards/part-PPPPP-SSSSSS.tar (format.shard_relpath)
    part: int
    samples: int
    bytes: int
    crc32c: int  # of the shard's bytes (cache/checksum.py)
    blocks: list[int]  # the part's trajectory blocks it holds


@dataclass(frozen=True, kw_only=True)
class PartEntry(Record):
    """A part, as the manifest lists it."""

    part: int
    prompts: int
    blocks: int


@dataclass(frozen=True, kw_only=True)
class TeacherLora(Record):
    """A LoRA fused into the teacher before stage one ran (`teacher-cache --teacher-lora`): by content, not place."""

    file: str  # the file's name, for people (its folder is in the header's teacher_lora_paths)
    sha256: str  # of the file's bytes: what the fingerprint holds and what sample/eval check before fusing it again
    scale: float
    experts: list[int]  # the experts it was fused into (1 = high-noise `transformer`, 2 = `transformer_2`)

    RANGES = {"sha256": ((lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None),
                         "64 hex digits"),
              "experts": _list(_int(1, 2), "expert numbers (1 or 2)")}

    @staticmethod
    def describe(loras: list[TeacherLora] | None) -> str:
        """One line naming `loras` (cards, `cache info`): "style.safetensors x0.8 (experts 1, 2, sha256 0123abcd...)"."""
        return "; ".join(f"{r.file} x{r.scale:g} (expert{'s' * (len(r.experts) > 1)} "
                         f"{', '.join(map(str, r.experts))}, sha256 {r.sha256[:12]})" for r in loras or ())


@dataclass(frozen=True, kw_only=True)
class CacheHeader(Record):
    """Stage one's settings and the teacher's facts: identical in every part's progress record, the manifest's
    settings, hashed (less NOT_FINGERPRINTED) into the cache's fingerprint. Built by `planned` alone."""

    teacher: str  # as given (hub id or folder)
    revision: str | None
    teacher_path: str  # absolute local folder of the teacher when stage one ran
    dtype: str
    steps: int
    timesteps: list[float]
    sigmas: list[float]
    experts: list[int]  # expert used at each step (1 = high-noise `transformer`, 2 = `transformer_2`)
    guidance: float
    guidance_2: float | None
    boundary_ratio: float | None
    expand_timesteps: bool
    height: int
    width: int
    frames: int
    latent_shape: list[int]
    max_sequence_length: int
    negative_prompt: str
    seeds_per_prompt: int
    seed: int
    prompts: int
    prompt_set_sha256: str
    text_dim: int
    in_channels: int
    patch_size: list[int]
    scheduler: dict
    cfg: bool  # whether targets are CFG-guided predictions (guidance > 1)
    save_cond_uncond: bool
    # --record-features: teacher block indices recorded, the fixed projection (D, pooling, seed, sha256), rows per block
    record_features: list[int] | None = optional()
    feature_dim: int | None = optional()
    feature_pool: str | None = optional()  # "none" (one row per latent token) or "mean"
    feature_seed: int | None = optional()
    feature_tokens: int | None = optional()
    feature_projection_sha256: str | None = optional()
    # --record-steps N: the steps every trajectory records (sorted) and the settings that chose them
    recorded_steps: list[int] | None = optional()
    record_steps: int | None = optional()
    record_seed: int | None = optional()
    keep_steps: list[int] | None = optional()
    for_students: list[str] | None = optional()  # --for-students: the grids whose boundaries keep_steps holds
    # the teacher's speed options that can change a target (attention backend, compile, tf32 on CUDA, quantization)
    numerics: dict | None = optional()
    # the transformer's shape (heads, head dim, blocks, ffn) for `cache info --prompts`'s compute figure; its config's
    # hash is in `teacher_identity`, so it stays out of the fingerprint (caches made before it keep theirs)
    teacher_shape: dict | None = optional()
    # image-to-video: how each trajectory's condition latent (the prompt store's `condition`, [*condition_shape])
    # enters the transformer, "none" (text-to-video), "concat" or "first_frame" (pipeline/model_call.py InputRule)
    condition: str = optional(F.NO_CONDITION)
    condition_shape: list[int] | None = optional()
    # --teacher-lora: the LoRAs fused into the teacher, in the order fused (fingerprinted: another LoRA or scale is
    # another teacher), and where each file was (not fingerprinted: moving a file does not change what it is)
    teacher_loras: list[TeacherLora] | None = optional()
    teacher_lora_paths: list[str] | None = optional()
    teacher_identity: dict  # hashes of the teacher's configs and weight files (fingerprinted)

    # Fields that say where the teacher was found, not what it is: left out of the fingerprint (its content enters
    # as `teacher_identity`), so moving the teacher folder does not invalidate a cache.
    NOT_FINGERPRINTED: ClassVar[tuple[str, ...]] = ("teacher", "revision", "teacher_path", "teacher_shape",
                                                    "teacher_lora_paths")
    NESTED = {"teacher_loras": (TeacherLora, "its teacher LoRA: ")}

    @classmethod
    def problem(cls, obj, where: str = "") -> str | None:
        problem = super().problem(obj, where)
        plain = obj.get("condition", F.NO_CONDITION) == F.NO_CONDITION if problem is None else None
        if problem is None and plain != (obj.get("condition_shape") is None):
            return f"{where}its fields 'condition' and 'condition_shape' disagree (a condition has a shape, none none)"
        if problem is None and len(obj.get("teacher_loras") or ()) != len(obj.get("teacher_lora_paths") or ()):
            return f"{where}its fields 'teacher_loras' and 'teacher_lora_paths' disagree (one path for each LoRA)"
        return problem

    def clip(self) -> dict:
        """A video cache's clip length, decoded and in latent frames (`cache info`, `train-student --dry-run`); {} for
        an image cache, whose reports stay as they were."""
        return {"frames": self.frames, "latent_frames": self.latent_shape[1]} if self.frames > 1 else {}

    def settings(self) -> dict:
        """The header's JSON (a manifest's settings): what the fingerprint is taken over."""
        return self._json(f.name for f in fields(CacheHeader))

    def settings_fingerprint(self) -> str:
        """sha256 of the settings less NOT_FINGERPRINTED (a manifest's equals its `fingerprint` unless edited)."""
        return fingerprint({k: v for k, v in self.settings().items() if k not in self.NOT_FINGERPRINTED})

    @classmethod
    def planned(cls, cfg, teacher, scheduler, schedule, *, dtype: str, prompts: int, prompt_set_sha256: str,
                identity: dict, numerics: dict | None = None, teacher_loras=()) -> CacheHeader:
        """The header of the cache `cfg` (teacher-cache's settings) writes with `teacher` (a TeacherSpec), its
        scheduler and `schedule`, at `dtype`, for `prompts` prompts (stage one records it, `plan` projects from it),
        with the speed options that can change a target (`numerics`) and the LoRAs fused into the teacher (`teacher_loras`:
        (TeacherLora, absolute path) pairs)."""
        tcfg, latent = teacher.transformer_config, list(teacher.latent_shape(cfg.height, cfg.width, cfg.frames))
        guidance_2 = cfg.guidance_2 if cfg.guidance_2 is not None else (cfg.guidance if teacher.boundary_ratio
                                                                         else None)
        return cls(
            teacher=cfg.teacher, revision=cfg.revision, teacher_path=str(teacher.path.resolve()), dtype=dtype,
            steps=cfg.steps, timesteps=schedule.timesteps, sigmas=schedule.sigmas, experts=schedule.experts,
            guidance=cfg.guidance, guidance_2=guidance_2, boundary_ratio=teacher.boundary_ratio,
            expand_timesteps=teacher.expand_timesteps, height=cfg.height, width=cfg.width, frames=cfg.frames,
            latent_shape=latent, max_sequence_length=cfg.max_sequence_length, negative_prompt=cfg.negative_prompt,
            seeds_per_prompt=cfg.seeds_per_prompt, seed=cfg.seed, prompts=prompts,
            prompt_set_sha256=prompt_set_sha256, text_dim=tcfg["text_dim"], in_channels=tcfg["in_channels"],
            patch_size=list(teacher.patch_size),
            scheduler={k: v for k, v in scheduler.config.items() if not k.startswith("_")}
            | {"_class_name": type(scheduler).__name__},
            cfg=schedule.cfg, save_cond_uncond=cfg.save_cond_uncond, **_features(cfg, teacher, latent),
            **_condition(cfg, teacher),
            **_recorded(cfg), numerics=numerics, teacher_shape={k: tcfg[k] for k in TEACHER_SHAPE},
            **({"teacher_loras": [r for r, _ in teacher_loras], "teacher_lora_paths": [p for _, p in teacher_loras]}
               if teacher_loras else {}),
            teacher_identity=identity)


def _condition(cfg, teacher) -> dict:
    """Image-to-video (--images): how the teacher takes each trajectory's condition latent, and its shape."""
    images = getattr(cfg, "images", None) or getattr(cfg, "images_from", None)
    if not (images or teacher.image_to_video):  # (`plan` of an I2V teacher: always one)
        return {}
    return dict(condition=teacher.condition_for(True), condition_shape=teacher.condition_shape(cfg.height, cfg.width,
                                                                                           cfg.frames))


def _features(cfg, teacher, latent_shape) -> dict:
    """The settings of --record-features; the projection's sha256 ties the cached features to the matrix
    written beside them."""
    if cfg.record_features is None:
        return {}
    tcfg = teacher.transformer_config
    dim = int(tcfg["num_attention_heads"]) * int(tcfg["attention_head_dim"])
    _, f, h, w = latent_shape
    pt, ph, pw = teacher.patch_size
    tokens = 1 if cfg.feature_pool == "mean" else (f // pt) * (h // ph) * (w // pw)
    return dict(record_features=list(cfg.record_features), feature_dim=cfg.feature_dim, feature_pool=cfg.feature_pool,
                feature_seed=cfg.feature_seed, feature_tokens=tokens,
                feature_projection_sha256=matrix_sha256(projection_matrix(dim, cfg.feature_dim, cfg.feature_seed)))


def _recorded(cfg) -> dict:
    """The steps --record-steps keeps and the settings that chose them (none when every step is recorded)."""
    seed = cfg.seed if cfg.record_seed is None else cfg.record_seed
    steps = choose_recorded_steps(cfg.steps, cfg.record_steps, seed, cfg.keep_steps or ())
    if len(steps) == cfg.steps:
        return {}
    grids = {"for_students": list(cfg.for_students)} if getattr(cfg, "for_students", None) else {}
    return dict(recorded_steps=steps, record_steps=cfg.record_steps, record_seed=seed,
                keep_steps=sorted(cfg.keep_steps or ()), **grids)


def choose_recorded_steps(steps: int, record_steps: int | None, seed: int, keep=()) -> list[int]:
    """The steps every trajectory records under --record-steps N, ascending (docs/architecture.md, "The cache",
    Recorded steps): step 0, `keep`, the rest drawn by a generator seeded with `seed` alone; None or N >= steps: all."""
    if record_steps is None or record_steps >= steps:
        return list(range(steps))
    fixed = sorted({0, *keep})
    rest = [k for k in range(steps) if k not in fixed]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), 0x524543])))  # "REC"
    drawn = rng.choice(rest, size=record_steps - len(fixed), replace=False) if record_steps > len(fixed) else []
    return sorted(fixed + [int(k) for k in drawn])


def fingerprint(fields_: dict) -> str:
    """sha256 over the canonical JSON of everything that changes the cached targets."""
    return hashlib.sha256(json.dumps(fields_, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Manifest(CacheHeader):
    """manifest.json: the header of every part, its fingerprint, and the shards of all parts."""

    format_version: int
    fingerprint: str
    sample_fields: list[str]  # tensors every sample carries (schema.py)
    num_parts: int
    samples: int
    bytes: int
    parts: list[PartEntry]
    shards: list[ShardRecord]
    created: str
    negative_sha256: str | None = optional()  # of negative.safetensors

    FIRST: ClassVar[tuple[str, ...]] = ("format_version", "fingerprint")
    NESTED = CacheHeader.NESTED | {"parts": (PartEntry, "a part record: "),
                                   "shards": (ShardRecord, "a shard record: ")}

    def header(self) -> CacheHeader:
        return CacheHeader(**{f.name: getattr(self, f.name) for f in fields(CacheHeader)})

    @classmethod
    def problem(cls, obj, where: str = "") -> str | None:
        return super().problem(obj, where) or parts_problem(obj["num_parts"], obj["prompts"])


def parts_problem(num_parts: int, prompts: int) -> str | None:
    """A record of more parts than prompts (each part holds a prompt at least)."""
    if num_parts > prompts:
        return f"its field 'num_parts' is {num_parts}, more parts than its {prompts} prompts"
    return None


def shard_problem(shards: list[ShardRecord], cache_dir, num_parts: int, part: int | None = None) -> str | None:
    """Why a shard record of a manifest (or of part `part`'s progress record) is not one: its path not
    `shards/part-PPPPP-SSSSSS.tar` inside the cache folder, of one of its parts (of its own part); or None."""
    for rec in shards:
        rel = rec.path
        if not isinstance(rel, str) or not rel:
            return f"shard path {rel!r} is not a path"
        p = PurePosixPath(rel)
        if p.is_absolute() or PureWindowsPath(rel).drive or ".." in p.parts or "\\" in rel:
            return f"shard path {rel!r} is outside the cache folder {cache_dir}"
        if not (m := SHARD_RE.match(rel)):
            return f"shard path {rel!r} is not of the form {F.SHARDS_DIR}/part-PPPPP-SSSSSS.tar"
        if (own := int(m.group(1))) >= num_parts or rec.part != own or part not in (None, own):
            return f"shard path {rel!r} is not one of {'its parts' if part is None else 'its part'}"
    return None
