"""Configs of the `sample`, `export` and `eval` commands: one frozen dataclass each, built like the stage
configs (`pipeline.config.load_config`: TOML file, CLI flags on top, ValueError → one line, exit 2).

Settings left as None are resolved at run time from the student's `distill.json`, then the cache manifest or
the teacher, then WanPipeline's defaults; the resolved values are written next to every output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
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
class SampleConfig:
    """`wandistiller sample`: teacher and student images from the same noise, side by side in one PNG."""

    TOML_SECTION = "sample"

    student: str  # train-student OUT (holding student/ and distill.json) or a student transformer folder
    prompts: str  # .txt or .jsonl prompt file
    out: str  # the PNG grid to write; its settings go to the same name + .json
    teacher: str | None = None  # Wan pipeline folder or hub id; default: the teacher named in distill.json
    weights: str = "auto"  # auto | ema | raw
    steps: int | None = None  # default: distill.json's steps, else 40 (stage one's default)
    guidance: float | None = None  # the teacher's CFG scale; default: distill.json's, else 4.0
    guidance_2: float | None = None  # the teacher's low-noise expert scale (Wan 2.2); default: distill.json's
    student_guidance: float | None = None  # default 1.0 when the student learned guided targets, else --guidance
    negative_prompt: str | None = None  # default: distill.json's, else empty
    seed: int = 0  # prompt i starts from noise seeded with seed + i, for teacher and student alike
    height: int | None = None  # default: distill.json's latent_shape x the VAE factor, else 480
    width: int | None = None  # default: as height, else 832
    max_sequence_length: int | None = None  # default: distill.json's, else 512
    max_prompts: int = 8  # the first K prompts of the file (one grid row each)
    device: str = "auto"  # auto (cuda if visible) | cpu | cuda | cuda:N
    dtype: str | None = None  # default bfloat16 on CUDA, float32 on CPU

    def __post_init__(self):
        _check_common(self)
        _check_runtime(self)
        if not isinstance(self.prompts, str) or not self.prompts:
            raise ValueError("prompts must be a non-empty path")
        _check_ints(self, ("steps", "height", "width", "max_sequence_length", "max_prompts"))
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

    def __post_init__(self):
        _check_common(self)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
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
