"""Configs of every command, side by side: one frozen dataclass each (teacher-cache, train-student, sample,
export, eval), loaded from TOML with CLI flags on top.

Every field is documented where it is declared; `__post_init__` rejects values that cannot work with a
ValueError naming the field, which the CLI turns into one line and exit code 2. The defaults of the
teacher's sampling settings are defined once below (DEFAULT_*).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache.atomic import atomic_write_bytes

from .config_types import type_problem
from .errors import UserError

PLACEMENTS = ("auto", "cpu", "cuda", "balanced", "sequential", "offload", "disk")
EXPERT_ORDERS = ("auto", "step", "expert")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")

# The teacher's sampling settings when nothing says otherwise: WanPipeline's own defaults. Stage one uses them
# for a new cache; the inference commands fall back to them when distill.json does not record a value.
DEFAULT_HEIGHT = 480
DEFAULT_WIDTH = 832
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # text tokens (padding length)
DEFAULT_STEPS = 40
DEFAULT_GUIDANCE = 4.0


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
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    where = f" (config file {toml_path})" if toml_path else ""
    problem = type_problem(cls, values)
    if problem is not None:
        problem = problem[1] + ("" if problem[0] in given else where)
    try:
        cfg = cls(**values)
    except ValueError as e:  # a range check names the range too: its message wins
        raise UserError(f"{e}{where}") from e
    except TypeError as e:  # missing required field, or a value of the wrong type
        raise UserError(problem or f"incomplete configuration: {e}") from e
    except Exception as e:  # a wrong type that __post_init__ tripped over
        if problem is None:
            raise
        raise UserError(problem) from e
    if problem is not None:
        raise UserError(problem)
    return cfg


def save_resolved(cfg, path: str | os.PathLike) -> None:
    """Write the resolved config next to an output, so every result says how it was made (tmp + fsync + rename:
    a kill leaves the old one or the new one)."""
    atomic_write_bytes(path, (json.dumps(dataclasses.asdict(cfg), indent=2, default=str) + "\n").encode())


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


class _DeviceChoice:
    """A command with a `device` setting runs on the CPU when it says so."""

    @property
    def cpu_only(self) -> bool:
        """The run asked for the CPU: the CLI hides the GPUs before anything asks CUDA (runtime.hide_gpus)."""
        return self.device == "cpu"


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
    steps: int = DEFAULT_STEPS  # denoising steps of the teacher's sampler; one sample per step
    guidance: float = DEFAULT_GUIDANCE  # CFG scale (of the high-noise expert for Wan 2.2); <= 1 disables CFG
    guidance_2: float | None = None  # CFG scale of the low-noise expert (Wan 2.2); default = guidance
    height: int = DEFAULT_HEIGHT
    width: int = DEFAULT_WIDTH
    frames: int = 1  # 1 = images; video teachers take 4k+1
    seeds_per_prompt: int = 1  # trajectories per prompt, each from its own seeded noise
    seed: int = 0  # base seed; noise of (prompt, seed_idx) is seeded from (seed, prompt_idx, seed_idx)
    negative_prompt: str = ""
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH  # text tokens (padding length), as WanPipeline's
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
    # Feature distillation: teacher block indices ("0,20", the same in each expert) whose outputs on the
    # conditional branch every sample stores, times a fixed seeded projection to feature_dim, pooled over
    # tokens when feature_pool is "mean" (cache/features.py). None: no features.
    record_features: tuple[int, ...] | None = None
    feature_dim: int = 256
    feature_pool: str = "none"
    feature_seed: int = 0
    report_to: str = "none"  # tensorboard: progress scalars under CACHE_DIR/parts/part-P/tensorboard
    # Bounded cache size: record only record_steps of the teacher's steps per trajectory (every step still runs;
    # the final latent is always stored). The same steps for every trajectory: step 0, keep_steps, and the rest
    # drawn from record_seed (default: seed). None: every step.
    record_steps: int | None = None
    record_seed: int | None = None
    keep_steps: tuple[int, ...] | None = None  # steps always recorded, e.g. a few-step student's boundaries

    @property
    def cpu_only(self) -> bool:
        """The run asked for the CPU: the CLI hides the GPUs before anything asks CUDA (runtime.hide_gpus)."""
        return self.placement == "cpu"

    def __post_init__(self):
        object.__setattr__(self, "record_features", _int_list("record-features", self.record_features))
        object.__setattr__(self, "keep_steps", _int_list("keep-steps", self.keep_steps))
        _check_record_steps(self)
        if self.record_features is not None and (not self.record_features
                                                 or len(set(self.record_features)) != len(self.record_features)):
            raise ValueError(f"record-features must list distinct teacher blocks, got {self.record_features!r}")
        if not isinstance(self.feature_dim, int) or isinstance(self.feature_dim, bool) or self.feature_dim < 1:
            raise ValueError(f"feature-dim must be an integer >= 1, got {self.feature_dim!r}")
        if self.report_to not in ("tensorboard", "none"):
            raise ValueError(f"report-to must be tensorboard or none for teacher-cache, got {self.report_to!r}")
        if self.feature_pool not in FEATURE_POOLS:
            raise ValueError(f"feature-pool must be one of {', '.join(FEATURE_POOLS)}, got {self.feature_pool!r}")
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


def _check_record_steps(cfg: TeacherCacheConfig) -> None:
    """--record-steps N out of --steps, with its seed and the steps it must keep."""
    n, steps = cfg.record_steps, cfg.steps
    if n is None:
        if cfg.record_seed is not None or cfg.keep_steps is not None:
            raise ValueError("record-seed and keep-steps choose the steps --record-steps N records: give "
                             "--record-steps too")
        return
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"record-steps must be an integer >= 1, got {n!r}")
    if isinstance(steps, int) and n > steps:
        raise ValueError(f"record-steps {n} exceeds --steps {steps}; choose 1 to {steps} (or leave it out to record "
                         "every step)")
    if cfg.record_seed is not None and (not isinstance(cfg.record_seed, int) or isinstance(cfg.record_seed, bool)):
        raise ValueError(f"record-seed must be an integer, got {cfg.record_seed!r}")
    keep = sorted({0, *(cfg.keep_steps or ())})
    if isinstance(steps, int) and keep[-1] >= steps:
        raise ValueError(f"keep-steps must list steps from 0 to {steps - 1} (--steps {steps}), got "
                         f"{','.join(map(str, cfg.keep_steps))}")
    if len(keep) > n:
        raise ValueError(f"keep-steps {','.join(map(str, keep))} (step 0 always included) are {len(keep)} steps, more "
                         f"than --record-steps {n}; record at least {len(keep)}")


FEATURE_POOLS = ("none", "mean")  # cache/features.py
MIXED_PRECISION = ("no", "bf16", "fp16")
REPORT_TO = ("tensorboard", "wandb", "none")  # stages/train_student/tracking.py
SHARD_CHECKS = ("checksum", "size")
SHARD_CHECK_ALIASES = {"sha256": "checksum"}  # its name before shards were checksummed with crc32c
STRATEGIES = ("ddp", "fsdp")  # stages/train_student/strategy.py
ORDERS = ("auto", "shuffle", "grouped")  # stages/train_student/data.py (order_window)


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
class TrainStudentConfig(_DeviceChoice):
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
    verify: str = "checksum"  # shard check before training: checksum (size + checksum + member index) | size
    embedding_cache_size: int = 1024  # prompt embeddings kept per reader process (LRU)
    # The epoch's order: shuffle = a uniform permutation of the samples; grouped = prompts in a random order, a window
    # of embedding_cache_size / 2 prompts at a time, each window's samples shuffled (each embedding read once per
    # epoch and rank, not once per sample); auto = grouped when the training prompts outnumber embedding_cache_size
    order: str = "auto"
    collective_timeout_s: float = 600.0  # a rank waiting longer than this in a collective fails
    # How the student is laid over the ranks: ddp = a full replica per rank (weights, gradients, AdamW moments,
    # EMA); fsdp = PyTorch FSDP2, each rank holds 1/world of all of them (for students whose training state does
    # not fit one GPU; docs/multi-gpu.md). Checkpoints of fsdp are sharded (torch.distributed.checkpoint);
    # the run artifact is the same.
    strategy: str = "ddp"
    # What the student learns: a registered objective (stages/train_student/objectives.py; `train-student
    # --help` lists them). velocity = the teacher's prediction at each cached step.
    objective: str = "velocity"
    # velocity+feature: student block S learns cached teacher block T ("S:T,..."), weighted by feature_weight
    feature_pairs: str | None = None
    feature_weight: float = 1.0
    # segment: a few-step student sampled with student_steps Euler steps (1 .. the cache's steps; a divisor of them
    # reproduces the teacher's schedule exactly); segment_velocity_weight > 0 adds that weight x the per-step
    # velocity loss at the same states; segment_start_weight weighs the segment loss at the states the K-step sampler
    # starts its steps from (the segments' first states) against 1 at the states inside a segment
    student_steps: int | None = None
    segment_velocity_weight: float = 0.0
    segment_start_weight: float = 1.0
    # Where the curves go besides metrics.jsonl: tensorboard (event files in OUT/tensorboard), wandb (the optional
    # extra `wandistiller[wandb]`; WANDB_MODE, WANDB_PROJECT, ... as W&B reads them) or none. Rank 0 alone writes.
    report_to: str = "tensorboard"
    # Validation by sampling: every val_every optimizer steps (and at the end) rank 0 samples the student from the
    # cached initial noise of the first val_max_prompts held-out prompts (all their seeds) and logs the final-latent
    # MSE against the teacher's cached final latents; 0 = off. Needs holdout_prompts.
    val_every: int = 0
    val_max_prompts: int = 4
    val_decode: bool = False  # also decode those latents with the teacher's VAE (rank 0) and log a teacher|student grid

    def __post_init__(self):
        if not isinstance(self.objective, str) or not self.objective:
            raise ValueError(f"objective must be a registered objective's name, got {self.objective!r}")
        if self.feature_pairs is not None and not isinstance(self.feature_pairs, str):
            raise ValueError(f"feature-pairs must be a string like \"0:10,1:30\", got {self.feature_pairs!r}")
        _positive("feature-weight", self.feature_weight, allow_zero=True)
        _positive("segment-velocity-weight", self.segment_velocity_weight, allow_zero=True)
        _positive("segment-start-weight", self.segment_start_weight)
        if self.student_steps is not None:
            if not isinstance(self.student_steps, int) or isinstance(self.student_steps, bool) or self.student_steps < 1:
                raise ValueError(f"student-steps must be an integer >= 1, got {self.student_steps!r}")
            if self.objective == "velocity":
                raise ValueError("student-steps applies to a few-step objective (--objective segment); a velocity "
                                 "student samples with any step count (sample/eval --student-steps)")
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
        object.__setattr__(self, "verify", SHARD_CHECK_ALIASES.get(self.verify, self.verify))
        if self.verify not in SHARD_CHECKS:
            raise ValueError(f"verify must be one of {', '.join(SHARD_CHECKS)}, got {self.verify!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.strategy == "fsdp" and self.mixed_precision == "fp16":
            raise ValueError("mixed-precision fp16 does not go with strategy fsdp (its loss scaler would see only "
                             "this rank's shard of the gradients and ranks could disagree on skipping a "
                             "step); use --mixed-precision bf16")
        object.__setattr__(self, "train_steps", _int_list("train-steps", self.train_steps))
        object.__setattr__(self, "teacher_blocks", _int_list("teacher-blocks", self.teacher_blocks))
        if self.teacher_blocks is not None and self.init_from_teacher is None:
            raise ValueError("teacher-blocks needs --init-from-teacher (the teacher to read the blocks from)")
        if self.report_to not in REPORT_TO:
            raise ValueError(f"report-to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        for name, low in (("val_every", 0), ("val_max_prompts", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        if self.val_every and not self.holdout_prompts:
            raise ValueError("val-every samples held-out prompts: give --holdout-prompts N too")
        if self.val_decode and not self.val_every:
            raise ValueError("val-decode decodes the validation samples: give --val-every N too")
        if self.val_decode and self.report_to == "none":
            raise ValueError("val-decode logs an image grid to the tracker: use --report-to tensorboard or wandb")


# -- the commands that run a trained student: sample, export, eval ---------------------------------------
# Settings left as None are resolved at run time from the student's distill.json, then the cache manifest or
# the teacher, then the DEFAULT_* above; the resolved values are written next to every output.

WEIGHTS = ("auto", "ema", "raw")  # auto = the EMA weights when the run saved them, else the raw ones
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _check_common(cfg) -> None:
    for name in ("student", "out"):
        v = getattr(cfg, name, "-")
        if not isinstance(v, str) or not v:
            raise ValueError(f"{name} must be a non-empty path")
    if cfg.weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {cfg.weights!r}")


def _check_runtime(cfg) -> None:
    if not _DEVICE_RE.match(str(cfg.device)):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    if cfg.dtype is not None and cfg.dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {cfg.dtype!r}")


def _check_ints(cfg, names: tuple[str, ...], minimum: int = 1) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < minimum):
            raise ValueError(f"{name.replace('_', '-')} must be an integer >= {minimum}, got {v!r}")


def _check_scales(cfg, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{name.replace('_', '-')} must be a number >= 0, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class SampleConfig(_DeviceChoice):
    """`wandistiller sample`: teacher and student images from the same noise, side by side in one PNG."""

    TOML_SECTION = "sample"

    student: str  # train-student OUT (holding student/ and distill.json) or a student transformer folder
    prompts: str  # .txt or .jsonl prompt file
    out: str  # the PNG grid to write; its settings go to the same name + .json
    teacher: str | None = None  # Wan pipeline folder or hub id; default: the teacher named in distill.json
    weights: str = "auto"  # auto | ema | raw
    steps: int | None = None  # default: distill.json's steps, else DEFAULT_STEPS
    guidance: float | None = None  # the teacher's CFG scale; default: distill.json's, else DEFAULT_GUIDANCE
    guidance_2: float | None = None  # the teacher's low-noise expert scale (Wan 2.2); default: distill.json's
    student_guidance: float | None = None  # default 1.0 when the student learned guided targets, else --guidance
    negative_prompt: str | None = None  # default: distill.json's, else empty
    seed: int = 0  # prompt i starts from noise seeded with seed + i, for teacher and student alike
    height: int | None = None  # default: distill.json's latent_shape x the VAE factor, else DEFAULT_HEIGHT
    width: int | None = None  # default: as height, else DEFAULT_WIDTH
    max_sequence_length: int | None = None  # default: distill.json's, else DEFAULT_MAX_SEQUENCE_LENGTH
    max_prompts: int = 8  # the first K prompts of the file (one grid row each)
    student_steps: int | None = None  # the student's sampling steps; default: distill.json's (a few-step student's K)
    compare: tuple[str, ...] = ()  # more train-student OUTs drawn beside the student, each at its own steps
    device: str = "auto"  # auto (cuda if visible) | cpu | cuda | cuda:N
    dtype: str | None = None  # default bfloat16 on CUDA, float32 on CPU

    def __post_init__(self):
        _check_common(self)
        _check_runtime(self)
        if not isinstance(self.prompts, str) or not self.prompts:
            raise ValueError("prompts must be a non-empty path")
        _check_ints(self, ("steps", "height", "width", "max_sequence_length", "max_prompts", "student_steps"))
        object.__setattr__(self, "compare", (self.compare,) if isinstance(self.compare, str) else tuple(self.compare or ()))
        _check_ints(self, ("seed",), minimum=0)
        _check_scales(self, ("guidance", "guidance_2", "student_guidance"))


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """`wandistiller export`: a diffusers pipeline folder with the student as its one transformer."""

    TOML_SECTION = "export"

    student: str  # train-student OUT or a student transformer folder
    out: str  # the pipeline folder to create
    teacher: str | None = None  # default: the teacher named in distill.json
    weights: str = "auto"  # auto | ema | raw
    copy: bool = False  # copy the teacher's text encoder, tokenizer, VAE, scheduler instead of symlinking them
    overwrite: bool = False  # replace an earlier export at --out (never any other folder)

    cpu_only = True  # export copies weights and writes files: never a GPU

    def __post_init__(self):
        _check_common(self)


@dataclass(frozen=True, kw_only=True)
class EvalConfig(_DeviceChoice):
    """`wandistiller eval`: the student against the teacher's cached trajectories."""

    TOML_SECTION = "eval"

    student: str  # train-student OUT or a student transformer folder
    cache: str  # CACHE_DIR of stage one (ideally of held-out prompts)
    prompts: str | None = None  # held-out prompt file: evaluate only the cache's prompts listed there
    max_prompts: int | None = None  # the first K selected prompts (all seeds of each); default all
    report: str | None = None  # JSON report; default OUT/eval.json; the plot goes next to it (.png)
    teacher: str | None = None  # for the timing comparison; default: the manifest's teacher
    teacher_timing: bool = True  # time the teacher too (loads its transformers, not its text encoder or VAE)
    timing_runs: int = 2  # trajectories timed for each model (after one warm-up run)
    init_seed: int | None = None  # seed of the untrained student; default: distill.json's init_seed/seed, else 0
    weights: str = "auto"  # auto | ema | raw
    batch_size: int = 8  # samples (velocity MSE) or trajectories (sampling) per forward
    # Shapes captions (pipeline/shapes.py grammar, e.g. data/shapes-heldout.txt) that teacher and student draw
    # from the same noise, read by the attribute checker (stages/sample/attributes.py); loads the teacher's
    # text encoder and VAE. Default: none.
    attributes: str | None = None
    attribute_max_prompts: int | None = None  # the first K captions of --attributes; default all
    attribute_grid: int = 8  # teacher | student pairs of the first K captions drawn into REPORT-attributes.png
    # The student's sampling steps, one entry each ("1,2,4"); default: its own (distill.json's student_steps, else
    # the teacher's steps).
    student_steps: tuple[int, ...] | None = None
    compare: tuple[str, ...] = ()  # more train-student OUTs, each sampled at its own steps from the same noise
    device: str = "auto"
    dtype: str | None = None

    def __post_init__(self):
        _check_common(self)
        _check_runtime(self)
        if not isinstance(self.cache, str) or not self.cache:
            raise ValueError("cache must be a non-empty path")
        if self.attributes is not None and (not isinstance(self.attributes, str) or not self.attributes):
            raise ValueError("attributes must be a non-empty path")
        _check_ints(self, ("max_prompts", "timing_runs", "batch_size", "attribute_max_prompts"))
        _check_ints(self, ("attribute_grid",), minimum=0)
        _check_ints(self, ("init_seed",), minimum=0)
        steps = _int_list("student-steps", self.student_steps)
        if steps is not None and min(steps) < 1:
            raise ValueError(f"student-steps must list integers >= 1, got {self.student_steps!r}")
        object.__setattr__(self, "student_steps", steps)
        compare = (self.compare,) if isinstance(self.compare, str) else tuple(self.compare or ())
        if not all(isinstance(c, str) and c for c in compare):
            raise ValueError(f"compare must list train-student OUT folders, got {self.compare!r}")
        object.__setattr__(self, "compare", compare)
