"""Stage configs: one frozen dataclass per stage, loaded from TOML with CLI flags on top.

Every field is documented where it is declared; `__post_init__` rejects values that cannot work with a
ValueError naming the field, which the CLI turns into one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

PLACEMENTS = ("auto", "cpu", "cuda", "balanced", "sequential", "offload", "disk")
EXPERT_ORDERS = ("auto", "step", "expert")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def load_config(cls, toml_path: str | os.PathLike | None, overrides: dict[str, Any]):
    """Build `cls` from a TOML file (optional) with `overrides` (CLI flags that were given) on top.

    TOML keys may use dashes or underscores, at the top level or under a table named after the stage.
    Unknown keys and bad values end in a UserError naming the key and the file.
    """
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if toml_path is not None:
        p = Path(toml_path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist; pass an existing TOML file to --config")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"config file {p} is not valid TOML: {e}") from e
        section = getattr(cls, "TOML_SECTION", None)
        if section and isinstance(data.get(section), dict):
            data = {**{k: v for k, v in data.items() if not isinstance(v, dict)}, **data[section]}
        for k, v in data.items():
            key = k.replace("-", "_")
            if key not in names:
                raise UserError(f"config file {p}: unknown key {k!r}; valid keys: {', '.join(sorted(names))}")
            values[key] = v
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:  # missing required field
        raise UserError(f"incomplete configuration: {e}") from e
    except ValueError as e:
        where = f" (config file {toml_path})" if toml_path else ""
        raise UserError(f"{e}{where}") from e


def save_resolved(cfg, path: str | os.PathLike) -> None:
    """Write the resolved config next to an output, so every result says how it was made."""
    Path(path).write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str) + "\n")


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TeacherCacheConfig:
    """Stage one: run the teacher over a prompt set and timestep schedule, write the cache."""

    TOML_SECTION = "teacher_cache"

    teacher: str  # local diffusers folder or hub id of a Wan 2.x pipeline
    prompts: str  # .txt (one prompt a line, '#' comments) or .jsonl ({"prompt": ...} a line)
    out: str  # CACHE_DIR
    revision: str | None = None  # hub revision (branch, tag or commit) when `teacher` is a hub id
    placement: str = "auto"  # where the teacher's weights live, see docs/placements.md
    device: int = 0  # CUDA device index for placement `cuda` (and the execution device of offload)
    dtype: str | None = None  # float32 | bfloat16 | float16; default bfloat16 on CUDA, float32 on CPU
    steps: int = 40  # denoising steps of the teacher's sampler; one sample per step
    guidance: float = 4.0  # CFG scale (of the high-noise expert for Wan 2.2); <= 1 disables CFG
    guidance_2: float | None = None  # CFG scale of the low-noise expert (Wan 2.2); default = guidance
    height: int = 480
    width: int = 832
    frames: int = 1  # 1 = images; video teachers take 4k+1
    seeds_per_prompt: int = 1  # trajectories per prompt, each from its own seeded noise
    seed: int = 0  # base seed; noise of (prompt, seed_idx) is seeded from (seed, prompt_idx, seed_idx)
    negative_prompt: str = ""
    max_sequence_length: int = 512  # text tokens (padding length), as WanPipeline's argument
    batch_size: int = 4  # trajectories run together (CFG doubles the forward batch)
    samples_per_shard: int = 1024  # a shard closes at the first block boundary past this many samples
    part: int | None = None  # this process's part; default RANK under torchrun, else 0
    num_parts: int | None = None  # default WORLD_SIZE under torchrun, else 1
    overwrite: bool = False  # replace an existing cache made with other settings
    offload_dir: str | None = None  # placement `disk`: folder for streamed weights (default CACHE_DIR/offload)
    max_memory: str | None = None  # placements balanced/sequential: "0=70GiB,1=70GiB,cpu=200GiB"
    # Two-expert teachers: "step" runs every step of a block before the next block; "expert" runs a window of
    # blocks with expert 1, then with expert 2, so one expert is resident at a time; "auto" picks "expert"
    # when both experts do not fit where the placement keeps them. The cache is the same either way.
    expert_order: str = "auto"
    save_cond_uncond: bool = False  # also store the conditional and unconditional predictions

    def __post_init__(self):
        for name in ("teacher", "prompts", "out"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if self.placement not in PLACEMENTS and not self.placement.endswith(".json"):
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)} or a device-map .json file, "
                             f"got {self.placement!r}")
        if self.expert_order not in EXPERT_ORDERS:
            raise ValueError(f"expert-order must be one of {', '.join(EXPERT_ORDERS)}, got {self.expert_order!r}")
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        for name in ("steps", "height", "width", "frames", "seeds_per_prompt", "max_sequence_length",
                     "batch_size", "samples_per_shard"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        _positive("guidance", self.guidance, allow_zero=True)
        if self.guidance_2 is not None:
            _positive("guidance-2", self.guidance_2, allow_zero=True)
        if self.seeds_per_prompt > 99:
            raise ValueError("seeds-per-prompt must be at most 99 (sample keys hold two digits)")
        if self.steps > 999:
            raise ValueError("steps must be at most 999 (sample keys hold three digits)")
        if (self.part is None) != (self.num_parts is None):
            raise ValueError("give --part and --num-parts together")
        if self.num_parts is not None:
            if self.num_parts < 1:
                raise ValueError(f"num-parts must be >= 1, got {self.num_parts}")
            if not 0 <= self.part < self.num_parts:
                raise ValueError(f"part must be in [0, num-parts); got part {self.part} with num-parts "
                                 f"{self.num_parts}")
        if self.device < 0:
            raise ValueError(f"device must be a CUDA device index >= 0, got {self.device}")


MIXED_PRECISION = ("no", "bf16", "fp16")
SHARD_CHECKS = ("sha256", "size")


def _int_list(name: str, value) -> tuple[int, ...] | None:
    """'0,4,8' or [0, 4, 8] -> (0, 4, 8); ValueError naming the field otherwise."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    try:
        out = tuple(int(str(v).strip()) for v in items if str(v).strip() != "")
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be comma-separated integers like 0,4,8, got {value!r}") from None
    if not out or any(v < 0 for v in out):
        raise ValueError(f"{name} must list integers >= 0, got {value!r}")
    return out


@dataclass(frozen=True, kw_only=True)
class TrainStudentConfig:
    """Stage two: train a student `WanTransformer3DModel` from one or more finished caches."""

    TOML_SECTION = "train_student"

    cache: tuple[str, ...]  # CACHE_DIR(s) of stage one; several must share one fingerprint
    student_config: str  # JSON config of the student WanTransformer3DModel (configs/student-*.json)
    out: str  # OUT: student/, student_ema/, checkpoints/, metrics.jsonl, loss.png, distill.json
    epochs: int | None = None  # passes over the cache; default 1, or as many as --max-steps needs
    max_steps: int | None = None  # stop after this many optimizer steps (first of epochs/max_steps wins)
    batch_size: int = 8  # samples per rank per micro-step; global batch = batch_size x world x grad_accum
    grad_accum: int = 1  # micro-steps per optimizer step
    lr: float = 1e-4  # peak AdamW learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.0  # the cosine decays to lr x min_lr_ratio at the last step
    warmup_steps: int = 100  # linear warmup from 0 (in optimizer steps)
    weight_decay: float = 0.01  # AdamW decay of matrices (biases, norms and tables are not decayed)
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0 disables clipping
    ema_decay: float = 0.0  # EMA of the weights (e.g. 0.999); 0 = off. Saved as OUT/student_ema
    mixed_precision: str | None = None  # no | bf16 | fp16 autocast; default bf16 on CUDA, no on CPU
    gradient_checkpointing: bool = False  # recompute block activations in backward (less memory, ~30% slower)
    # DataLoader worker processes per rank reading shards; default: the rank's share of CPU cores minus two
    # (the training process and its torch threads), at most 4 -- 0 on a 2-core machine, where workers
    # would only compete with training.
    num_workers: int | None = None
    seed: int = 0  # student init and the epoch order, which is a function of (seed, epoch)
    checkpoint_every: int = 500  # optimizer steps between checkpoints; 0 = none
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    resume: bool = False  # continue from the newest complete checkpoint in OUT/checkpoints
    train_steps: tuple[int, ...] | None = None  # train only on these cached step indices ("0,4,8"); default all
    init_from_teacher: str | None = None  # teacher pipeline/transformer folder or .safetensors to copy weights from
    teacher_blocks: tuple[int, ...] | None = None  # teacher block of each student block ("0,4,8"); default spread
    holdout_prompts: int = 0  # prompts kept out of training; their cached samples give the held-out loss
    eval_every: int = 100  # optimizer steps between held-out evaluations (also at start and end); 0 = ends only
    log_every: int = 10  # optimizer steps between metrics.jsonl lines
    device: str = "auto"  # auto (CUDA if present) | cuda | cpu
    verify: str = "sha256"  # shard check before training: sha256 (size + hash + member index) | size
    embedding_cache_size: int = 1024  # prompt embeddings kept per reader process (LRU)
    collective_timeout_s: float = 600.0  # a rank waiting longer than this in a collective fails

    def __post_init__(self):
        caches = (self.cache,) if isinstance(self.cache, str) else tuple(self.cache or ())
        object.__setattr__(self, "cache", caches)
        if not caches or not all(isinstance(c, str) and c for c in caches):
            raise ValueError("cache must name at least one CACHE_DIR (--cache)")
        for name in ("student_config", "out"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name.replace('_', '-')} must be a non-empty string")
        if self.num_workers is None:
            world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
            object.__setattr__(self, "num_workers", max(0, min(4, (os.cpu_count() or 1) // world - 2)))
        for name in ("batch_size", "grad_accum", "num_workers", "checkpoint_every", "keep_checkpoints",
                     "warmup_steps", "holdout_prompts", "eval_every", "log_every", "embedding_cache_size", "seed"):
            v = getattr(self, name)
            low = 1 if name in ("batch_size", "grad_accum", "keep_checkpoints", "log_every",
                                "embedding_cache_size") else 0
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        for name in ("epochs", "max_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        _positive("lr", self.lr)
        _positive("weight-decay", self.weight_decay, allow_zero=True)
        _positive("max-grad-norm", self.max_grad_norm, allow_zero=True)
        _positive("collective-timeout-s", self.collective_timeout_s)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min-lr-ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema-decay must be in [0, 1) (0 = off), got {self.ema_decay!r}")
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed-precision must be one of {', '.join(MIXED_PRECISION)}, "
                             f"got {self.mixed_precision!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.verify not in SHARD_CHECKS:
            raise ValueError(f"verify must be one of {', '.join(SHARD_CHECKS)}, got {self.verify!r}")
        object.__setattr__(self, "train_steps", _int_list("train-steps", self.train_steps))
        object.__setattr__(self, "teacher_blocks", _int_list("teacher-blocks", self.teacher_blocks))
        if self.teacher_blocks is not None and self.init_from_teacher is None:
            raise ValueError("teacher-blocks needs --init-from-teacher (the teacher to read the blocks from)")
