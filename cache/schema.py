"""The declared sample schema: every tensor and metadata field a cached sample may carry.

One entry per field says its dtype, its shape (a rule over the manifest), and whether every sample of a
cache carries it (always, or when a manifest setting turned it on). The writer refuses undeclared
fields, the reader and `cache verify` check each sample against these entries, and stage two's
objectives name the fields they need from here. Adding a field: one `SampleField` below (plus the
manifest setting that turns it on, in `format.py`), then the code that produces it in stage one and
consumes it in stage two.

Every setting that turns a field on is part of stage one's header, and the whole header is hashed into
the fingerprint, so a cache with a field and one without can never be mixed in training.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath

import torch

from . import format as F


def _latent(m: Mapping) -> tuple[int, ...]:
    return tuple(int(v) for v in m[F.F_LATENT_SHAPE])


def _features(m: Mapping) -> tuple[int, ...]:
    return (len(m[F.F_RECORD_FEATURES]), int(m[F.F_FEATURE_TOKENS]), int(m[F.F_FEATURE_DIM]))


@dataclass(frozen=True)
class SampleField:
    """One tensor of a sample's `<key>.safetensors`."""

    name: str
    doc: str
    shape: Callable[[Mapping], tuple[int, ...]]  # from the manifest
    when: str | None = None  # manifest setting that makes every sample carry it; None: every sample does
    dtype: str | None = None  # a `format.DTYPES` name; None: the cache's dtype (manifest `dtype`)
    recorded_by: str | None = None  # the stage-one flag that records an optional field (for error messages)

    def present(self, manifest: Mapping) -> bool:
        return self.when is None or bool(manifest.get(self.when))

    def dtype_name(self, manifest: Mapping) -> str:
        return self.dtype or str(manifest[F.F_DTYPE])


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
    SampleField(F.T_TARGET_COND, "the teacher's conditional prediction", _latent, when=F.F_SAVE_COND_UNCOND,
                recorded_by="teacher-cache --save-cond-uncond"),
    SampleField(F.T_TARGET_UNCOND, "the teacher's unconditional prediction", _latent, when=F.F_SAVE_COND_UNCOND,
                recorded_by="teacher-cache --save-cond-uncond"),
    SampleField(F.T_FEATURES, "the conditional branch's hidden states after each recorded teacher block (of the "
                "expert that ran the step), times the cache's fixed projection: [blocks, tokens or 1, feature_dim]",
                _features, when=F.F_RECORD_FEATURES, recorded_by="teacher-cache --record-features BLOCKS"),
)}

META_FIELDS: dict[str, MetaField] = {f.name: f for f in (
    MetaField(F.M_PROMPT_IDX, "global prompt index (order of first appearance in the prompt file)", int),
    MetaField(F.M_SEED_IDX, "which of the prompt's seeds", int),
    MetaField(F.M_STEP, "index of the teacher's sampling step (one of the cache's `recorded_steps`)", int),
    MetaField(F.M_TIMESTEP, "the scheduler's timestep at that step", float),
    MetaField(F.M_SIGMA, "the scheduler's sigma at that step", float),
    MetaField(F.M_EXPERT, "expert that ran the step (1 = transformer, 2 = transformer_2)", int),
    MetaField(F.M_GUIDANCE, "CFG scale used at that step", float),
)}


def sample_fields(manifest: Mapping) -> tuple[str, ...]:
    """Names of the tensors every sample of the cache described by `manifest` carries."""
    if isinstance(manifest.get(F.F_SAMPLE_FIELDS), list):
        return tuple(manifest[F.F_SAMPLE_FIELDS])
    return tuple(f.name for f in SAMPLE_FIELDS.values() if f.present(manifest))  # a stage-one header: derived from its settings


def recorded_steps(manifest: Mapping) -> tuple[int, ...]:
    """The teacher steps every trajectory of the cache records, ascending: the manifest's `recorded_steps`
    (teacher-cache --record-steps N), else every step. The same for every (prompt, seed), so a cache holds
    prompts x seeds x len(recorded_steps) samples."""
    steps = manifest.get(F.F_RECORDED_STEPS)
    if isinstance(steps, list):
        return tuple(int(k) for k in steps)
    return tuple(range(int(manifest[F.F_STEPS])))


def declared_fields(header: Mapping) -> list[str]:
    """The `sample_fields` entry stage one writes into the manifest for these settings."""
    return [f.name for f in SAMPLE_FIELDS.values() if f.present(header)]


def sample_bytes(manifest: Mapping, fields=None) -> int:
    """Tensor bytes of one sample (safetensors and tar headers aside) for the cache `manifest` describes:
    `fields` (default: every field its samples carry)."""
    total = 0
    for name in fields if fields is not None else sample_fields(manifest):
        f = SAMPLE_FIELDS[name]
        n = 1
        for d in f.shape(manifest):
            n *= int(d)
        total += n * F.DTYPES[f.dtype_name(manifest)].itemsize
    return total


def missing_fields(manifest: Mapping, needed) -> list[str]:
    """Which of `needed` the cache's samples do not carry."""
    have = set(sample_fields(manifest))
    return [n for n in needed if n not in have]


def check_undeclared(names) -> None:
    """ValueError for a tensor no schema entry declares: stage one must not write what no reader knows."""
    unknown = sorted(set(names) - set(SAMPLE_FIELDS))
    if unknown:
        raise ValueError(f"sample tensor(s) {unknown} are not declared in cache/schema.py SAMPLE_FIELDS")


def sample_problems(key: str, tensors: Mapping[str, torch.Tensor], meta: Mapping, manifest: Mapping) -> list[str]:
    """Everything wrong with one decoded sample against the schema and its manifest (empty = sound)."""
    problems = tensor_problems(key, tensors, manifest)
    return problems + meta_problems(key, meta, manifest, identity=not problems)


def tensor_problems(key: str, tensors: Mapping[str, torch.Tensor], manifest: Mapping) -> list[str]:
    """What is wrong with a sample's tensors (names, shapes, dtypes) against the schema and its manifest: a
    function of their layout alone, which a reader may check once per layout (`reader.SampleReader`)."""
    problems = []
    for name in sample_fields(manifest):
        field = SAMPLE_FIELDS.get(name)
        t = tensors.get(name)
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


def meta_problems(key: str, meta: Mapping, manifest: Mapping, identity: bool = True,
                  ids: tuple[int, int, int] | None = None) -> list[str]:
    """What is wrong with a sample's metadata: the types of META_FIELDS, then (with `identity`) whether it names
    the sample `key` (whose (prompt, seed, step) are `ids` where the caller has them: no key to parse) and is of a
    step the cache records."""
    problems = []
    for name, field in META_FIELDS.items():
        v = meta.get(name)
        if field.type is float and isinstance(v, int) and not isinstance(v, bool):
            continue
        if not isinstance(v, field.type) or isinstance(v, bool):
            problems.append(f"sample {key} metadata {name} is {v!r}, expected {field.type.__name__}")
    if not identity:
        return problems
    try:
        if not problems and (F.parse_key(key) if ids is None else ids) != (meta[F.M_PROMPT_IDX], meta[F.M_SEED_IDX],
                                                                           meta[F.M_STEP]):
            problems.append(f"sample {key} metadata names another sample")
    except ValueError as e:
        problems.append(str(e))
    recorded = manifest.get(F.F_RECORDED_STEPS)
    if not problems and isinstance(recorded, list) and meta[F.M_STEP] not in recorded:
        problems.append(f"sample {key} is of step {meta[F.M_STEP]}, which the cache does not record (its "
                        f"{F.F_RECORDED_STEPS}: {','.join(map(str, recorded))})")
    return problems


# -- records: the manifest and each part's progress record -----------------------------------------------------
# Every field a reader relies on, with its type and range, checked once when a record is read (`record_problem`):
# what a hand (or an attacker) wrote there must end in one line, never in a traceback, a hang or a read outside the
# cache. The upper bounds are the format's own: the names hold 5 digits of part, 6 of shard, 8 of prompt, 2 of seed
# and 3 of step (`format.sample_key`, `format.shard_relpath`), so no cache can have more.
MAX_PARTS, MAX_PROMPTS, MAX_SEEDS, MAX_STEPS = 10**5, 10**8, 100, 1000
_SHARD_RE = re.compile(r"^shards/part-(\d{5})-\d{6}\.tar$")


def _int(lo: int = 0, hi: int | None = None) -> tuple[Callable, str]:
    return ((lambda v: type(v) is int and v >= lo and (hi is None or v <= hi)),
            f"a whole number >= {lo}" if hi is None else f"a whole number in {lo}..{hi}")


def _list(item: tuple[Callable, str], what: str) -> tuple[Callable, str]:
    return (lambda v: type(v) is list and all(item[0](x) for x in v)), f"a list of {what}"


_STR = (lambda v: isinstance(v, str)), "a string"
_BOOL = (lambda v: type(v) is bool), "true or false"
_NUMBER = (lambda v: type(v) in (int, float)), "a number"
# The header (stage one's settings, in the manifest and in every progress record): the fields readers compute with.
HEADER_FIELDS = {
    F.F_PROMPTS: _int(1, MAX_PROMPTS), F.F_SEEDS_PER_PROMPT: _int(1, MAX_SEEDS), F.F_STEPS: _int(1, MAX_STEPS),
    F.F_RECORDED_STEPS: _list(_int(0, MAX_STEPS - 1), "step numbers"), F.F_LATENT_SHAPE: _list(_int(1), "sizes"),
    F.F_DTYPE: ((lambda v: v in F.DTYPES), f"one of {', '.join(F.DTYPES)}"), F.F_MAX_SEQUENCE_LENGTH: _int(1),
    F.F_TEXT_DIM: _int(1), F.F_TIMESTEPS: _list(_NUMBER, "numbers"), F.F_SAMPLE_FIELDS: _list(_STR, "names"),
}
SHARD_FIELDS = {F.S_PATH: _STR, F.S_PART: _int(0, MAX_PARTS - 1), F.S_SAMPLES: _int(0), F.S_BYTES: _int(0),
                F.S_CRC32C: _int(0, 2**32 - 1), F.S_BLOCKS: _list(_int(0), "block numbers")}
MANIFEST_FIELDS = {F.F_FINGERPRINT: _STR, F.F_NUM_PARTS: _int(1, MAX_PARTS), F.F_SAMPLES: _int(0),
                   F.F_BYTES: _int(0), F.F_SHARDS: ((lambda v: type(v) is list), "a list of shard records"),
                   F.F_PARTS: ((lambda v: type(v) is list), "a list"), **HEADER_FIELDS}
PROGRESS_FIELDS = {
    "part": _int(0, MAX_PARTS - 1), F.F_NUM_PARTS: _int(1, MAX_PARTS), F.F_FINGERPRINT: _STR, F.F_PROMPTS: _int(0),
    "blocks": _int(0), "batch_size": _int(1), "samples_per_shard": _int(1), "encoded": _BOOL, "complete": _BOOL,
    "done_blocks": _list(_int(0), "block numbers"), F.F_SHARDS: ((lambda v: type(v) is list), "a list of shard records"),
    "header": ((lambda v: type(v) is dict), "an object"), F.F_NEGATIVE_SHA256: ((lambda v: v is None or
                                                                                 isinstance(v, str)), "a string"),
}
REQUIRED = {"manifest": (F.F_FINGERPRINT, F.F_NUM_PARTS, F.F_SAMPLES, F.F_BYTES, F.F_SHARDS, F.F_PROMPTS, F.F_STEPS),
            "progress": ("part", F.F_NUM_PARTS, F.F_FINGERPRINT, F.F_PROMPTS, "blocks", "batch_size",
                         "samples_per_shard", "done_blocks", F.F_SHARDS, "header")}


def _fields_problem(record, spec: Mapping, required, where: str = "") -> str | None:
    if not isinstance(record, dict):
        return f"{where or 'it'} is not a JSON object"
    for key in required:
        if key not in record:
            return f"{where}lacks the field {key!r}"
    for key, (ok, what) in spec.items():
        if key in record and not ok(record[key]):
            return f"{where}its field {key!r} is {_short(record[key])}, expected {what}"
    return None


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def shard_path_problem(rel, cache_dir) -> str | None:
    """Why a shard path recorded in a manifest or progress record is not `shards/part-PPPPP-SSSSSS.tar` inside the
    cache folder, or None."""
    if not isinstance(rel, str) or not rel:
        return f"shard path {rel!r} is not a path"
    p = PurePosixPath(rel)
    if p.is_absolute() or PureWindowsPath(rel).drive or ".." in p.parts or "\\" in rel:
        return f"shard path {rel!r} is outside the cache folder {cache_dir}"
    if not _SHARD_RE.match(rel):
        return f"shard path {rel!r} is not of the form {F.SHARDS_DIR}/part-PPPPP-SSSSSS.tar"
    return None


def record_problem(record, kind: str, cache_dir) -> str | None:
    """What is wrong with a manifest (`kind` "manifest") or a part's progress record ("progress") as read from
    `cache_dir`: a required field missing, a field of another type or out of its range, a shard record that is not
    one (its path `shards/part-PPPPP-SSSSSS.tar` of its own part), done blocks past the part's; None when sound."""
    progress = kind == "progress"
    problem = _fields_problem(record, PROGRESS_FIELDS if progress else MANIFEST_FIELDS, REQUIRED[kind])
    if problem is None and progress:
        problem = _fields_problem(record["header"], HEADER_FIELDS, (), "its header: ")
    if problem is not None:
        return problem
    num_parts, header = record[F.F_NUM_PARTS], record["header"] if progress else record
    if F.F_PROMPTS in header and num_parts > header[F.F_PROMPTS]:
        return f"its field {F.F_NUM_PARTS!r} is {num_parts}, more parts than its {header[F.F_PROMPTS]} prompts"
    if progress and record["part"] >= num_parts:
        return f"its part {record['part']} is not below its field {F.F_NUM_PARTS!r} {num_parts}"
    if progress and any(b >= record["blocks"] for b in record["done_blocks"]):
        return f"its field 'done_blocks' lists blocks past its {record['blocks']} blocks"
    for rec in record[F.F_SHARDS]:
        problem = (_fields_problem(rec, SHARD_FIELDS, (F.S_PATH, F.S_SAMPLES, F.S_BYTES), "a shard record: ")
                   or shard_path_problem(rec[F.S_PATH], cache_dir))
        if problem is None:
            part = int(_SHARD_RE.match(rec[F.S_PATH]).group(1))
            if part >= num_parts or (progress and part != record["part"]) or rec.get(F.S_PART, part) != part:
                problem = f"shard path {rec[F.S_PATH]!r} is not one of {'its part' if progress else 'its parts'}"
        if problem is not None:
            return problem
    return None
