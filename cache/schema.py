"""The declared schema: every tensor and metadata field a cached sample may carry, and the prompt stores' arrays of
one row per trajectory (docs/architecture.md, "The cache"; adding one: "Extension points"). Every setting that turns
one on is in stage one's header, so in the fingerprint: caches with a field and without are never mixed in training."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from . import format as F
from .records import CacheHeader, Manifest


def _latent(m: CacheHeader) -> tuple[int, ...]:
    return tuple(m.latent_shape)


def _features(m: CacheHeader) -> tuple[int, ...]:
    return len(m.record_features), m.feature_tokens, m.feature_dim


@dataclass(frozen=True)
class SampleField:
    """One tensor of a sample's `<key>.safetensors`."""

    name: str
    doc: str
    shape: Callable[[CacheHeader], tuple[int, ...]]  # from the header
    when: str | None = None  # header setting that makes every sample carry it; None: every sample does
    dtype: str | None = None  # a `format.DTYPES` name; None: the cache's dtype (manifest `dtype`)
    recorded_by: str | None = None  # the stage-one flag that records an optional field (for error messages)

    def present(self, header: CacheHeader) -> bool:
        return self.when is None or bool(getattr(header, self.when))

    def dtype_name(self, header: CacheHeader) -> str:
        return self.dtype or header.dtype


@dataclass(frozen=True)
class MetaField:
    """One entry of a sample's `<key>.json`."""

    name: str
    doc: str
    type: type


SAMPLE_FIELDS: dict[str, SampleField] = {f.name: f for f in (
    SampleField(F.T_X_T, "the noisy latent the teacher saw at this step", _latent),
    SampleField(F.T_TARGET, "the prediction the teacher's sampler used (CFG-guided when the cache's cfg is true)",
                _latent),
    SampleField(F.T_TARGET_COND, "the teacher's conditional prediction", _latent, when="save_cond_uncond",
                recorded_by="teacher-cache --save-cond-uncond"),
    SampleField(F.T_TARGET_UNCOND, "the teacher's unconditional prediction", _latent, when="save_cond_uncond",
                recorded_by="teacher-cache --save-cond-uncond"),
    SampleField(F.T_FEATURES, "the conditional branch's hidden states after each recorded teacher block (of the "
                "expert that ran the step), times the cache's fixed projection: [blocks, tokens or 1, feature_dim]",
                _features, when="record_features", recorded_by="teacher-cache --record-features BLOCKS"),
)}


@dataclass(frozen=True)
class TrajectoryField:
    """One per-trajectory array of a part's prompt store, [rows, seeds, *shape]: what the store creates, its checks
    compare, the size arithmetic counts and the readers read (`prompt_store.PartRows.latents`)."""

    name: str  # its zarr array
    doc: str
    shape: Callable[[CacheHeader], tuple[int, ...]]  # one trajectory's, from the header
    when: Callable[[CacheHeader], bool] | None = None  # whether the header's settings make a store hold it; None: all
    dtype: str = "float32"

    def present(self, header: CacheHeader) -> bool:
        return self.when is None or self.when(header)


TRAJECTORY_FIELDS: dict[str, TrajectoryField] = {f.name: f for f in (
    TrajectoryField(F.Z_INIT_NOISE, "the noise the trajectory starts from", _latent),
    TrajectoryField(F.Z_FINAL_LATENTS, "the latent the teacher's sampler ended in", _latent),
    TrajectoryField(F.Z_CONDITION, "the image-to-video condition latent the trajectory was sampled with",
                    lambda m: tuple(m.condition_shape), when=lambda m: m.condition != F.NO_CONDITION),
)}


def trajectory_fields(header: CacheHeader) -> list[TrajectoryField]:
    """The per-trajectory arrays the prompt stores of a cache of these settings hold."""
    return [f for f in TRAJECTORY_FIELDS.values() if f.present(header)]


META_FIELDS: dict[str, MetaField] = {f.name: f for f in (
    MetaField(F.M_PROMPT_IDX, "global prompt index (order of first appearance in the prompt file)", int),
    MetaField(F.M_SEED_IDX, "which of the prompt's seeds", int),
    MetaField(F.M_STEP, "index of the teacher's sampling step (one of the cache's `recorded_steps`)", int),
    MetaField(F.M_TIMESTEP, "the scheduler's timestep at that step", float),
    MetaField(F.M_SIGMA, "the scheduler's sigma at that step", float),
    MetaField(F.M_EXPERT, "expert that ran the step (1 = transformer, 2 = transformer_2)", int),
    MetaField(F.M_GUIDANCE, "CFG scale used at that step", float),
)}


def sample_fields(manifest: CacheHeader) -> tuple[str, ...]:
    """Names of the tensors every sample of the cache described by `manifest` (or a stage-one header) carries."""
    return tuple(manifest.sample_fields if isinstance(manifest, Manifest) else declared_fields(manifest))


def recorded_steps(manifest: CacheHeader) -> tuple[int, ...]:
    """The teacher steps every trajectory of the cache records, ascending: the manifest's `recorded_steps`
    (teacher-cache --record-steps N), else every step."""
    return tuple(manifest.recorded_steps) if manifest.recorded_steps is not None else tuple(range(manifest.steps))


def declared_fields(header: CacheHeader) -> list[str]:
    """The `sample_fields` entry stage one writes into the manifest for these settings."""
    return [f.name for f in SAMPLE_FIELDS.values() if f.present(header)]


def sample_bytes(manifest: CacheHeader, fields=None) -> int:
    """Tensor bytes of one sample (safetensors and tar headers aside) for the cache `manifest` describes:
    `fields` (default: every field its samples carry)."""
    return sum(math.prod(int(d) for d in SAMPLE_FIELDS[name].shape(manifest))
               * F.DTYPES[SAMPLE_FIELDS[name].dtype_name(manifest)].itemsize
               for name in (fields if fields is not None else sample_fields(manifest)))


def missing_fields(manifest: CacheHeader, needed) -> list[str]:
    """Which of `needed` the cache's samples do not carry."""
    return [n for n in needed if n not in sample_fields(manifest)]


def check_undeclared(names) -> None:
    """ValueError for a tensor no schema entry declares: stage one must not write what no reader knows."""
    if unknown := sorted(set(names) - set(SAMPLE_FIELDS)):
        raise ValueError(f"sample tensor(s) {unknown} are not declared in cache/schema.py SAMPLE_FIELDS")


def sample_problems(key: str, tensors: Mapping[str, torch.Tensor], meta: Mapping, manifest: CacheHeader) -> list[str]:
    """Everything wrong with one decoded sample against the schema and its manifest (empty = sound)."""
    problems = tensor_problems(key, tensors, manifest)
    return problems + meta_problems(key, meta, manifest, identity=not problems)


def tensor_problems(key: str, tensors: Mapping[str, torch.Tensor], manifest: CacheHeader) -> list[str]:
    """What is wrong with a sample's tensors (names, shapes, dtypes) against the schema and its manifest: a
    function of their layout alone, which a reader may check once per layout (`reader.SampleReader`)."""
    problems = []
    for name in sample_fields(manifest):
        field, t = SAMPLE_FIELDS.get(name), tensors.get(name)
        if t is None:
            problems.append(f"sample {key} lacks tensor {name}")
            continue
        if field is None:
            continue  # a field a newer WanDistiller declared: present, not checkable here
        shape, dtype = list(field.shape(manifest)), field.dtype_name(manifest)
        if list(t.shape) != shape or F.DTYPE_NAMES.get(t.dtype) != dtype:
            problems.append(f"sample {key} {name} is {F.DTYPE_NAMES.get(t.dtype, t.dtype)} {list(t.shape)}, "
                            f"expected {dtype} {shape}")
    return problems


def meta_problems(key: str, meta: Mapping, manifest: CacheHeader, identity: bool = True,
                  ids: tuple[int, int, int] | None = None) -> list[str]:
    """What is wrong with a sample's metadata: the types of META_FIELDS, then (with `identity`) whether it names
    the sample `key` (whose (prompt, seed, step) are `ids` where the caller has them: no key to parse) and is of a
    step the cache records."""
    problems = []
    for name, field in META_FIELDS.items():
        v = meta.get(name)
        if not isinstance(v, (int, float) if field.type is float else field.type) or isinstance(v, bool):
            problems.append(f"sample {key} metadata {name} is {v!r}, expected {field.type.__name__}")
    if not identity:
        return problems
    try:
        if not problems and (F.parse_key(key) if ids is None else ids) != (meta[F.M_PROMPT_IDX], meta[F.M_SEED_IDX],
                                                                           meta[F.M_STEP]):
            problems.append(f"sample {key} metadata names another sample")
    except ValueError as e:
        problems.append(str(e))
    recorded = manifest.recorded_steps
    if not problems and recorded is not None and meta[F.M_STEP] not in recorded:
        problems.append(f"sample {key} is of step {meta[F.M_STEP]}, which the cache does not record (its "
                        f"recorded_steps: {','.join(map(str, recorded))})")
    return problems
