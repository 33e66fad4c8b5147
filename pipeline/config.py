"""Configs of every command, side by side: one frozen dataclass each, loaded from TOML with CLI flags on top
(config_types.load_config; docs/architecture.md, "Settings and registries"). Imports nothing heavy: the CLI builds
its options from it at load."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

from .flops import DEFAULT_GPU, GPUS, gpu_name
from .prompts import MAX_PROMPT_CHARS
from .registries import (
    FEATURE_POOLS, GRID_FORMS, OBJECTIVES, PLACEMENTS, STRATEGIES, STUDENTS, TRACKERS, LoraSettings,
    PlacementSettings, StudentSchedule, TeacherSpeedSettings, placement_entry, student_grids,
)
from .settings import (
    at_least, byte_size, check_settings, gpu_sizes, in_range, int_in, int_list, merged, must, non_empty, one_of,
    positive, refuse_foreign, setting, settings_of, str_tuple,
)

DTYPES = one_of(("float32", "bfloat16", "float16"))
GPU_NAMES = tuple(g.name for g in GPUS)  # --gpu's choices (pipeline/flops.py)
DTYPE_DEFAULT = "bfloat16 on CUDA, float32 on CPU"

# WanPipeline's own defaults: stage one's for a new cache, the inference commands' when distill.json records none.
DEFAULT_HEIGHT = 480
DEFAULT_WIDTH = 832
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # text tokens (padding length)
# At most 8x Wan's 512 text tokens: room to try longer captions (an A14B embedding of 4096 is 32 MiB), and the
# tokenizer is never asked to pad to 10^8 tokens, which aborts the process in its Rust code (exit 134).
MAX_SEQUENCE_LENGTH = 4096
_SEQUENCE_LENGTH = int_in(1, MAX_SEQUENCE_LENGTH, f" (Wan's text encoder reads {DEFAULT_MAX_SEQUENCE_LENGTH} tokens)")
DEFAULT_STEPS = 40
DEFAULT_GUIDANCE = 4.0
DEFAULT_FPS = 8  # sample's videos: a 9-frame clip plays in about a second


def _prompt_text(name, v) -> None:
    """A prompt given as a setting is bounded as a prompt file's line is (a megabyte pasted by mistake is refused
    before the tokenizer sees it); the value is not echoed."""
    if isinstance(v, str) and len(v) > MAX_PROMPT_CHARS:
        raise ValueError(f"--{name} is {len(v):,} characters long, more than the {MAX_PROMPT_CHARS:,} a prompt may "
                         "hold; shorten it")


def save_resolved(cfg, path: str | os.PathLike) -> None:
    """Write the resolved config next to an output (atomically), so every result says how it was made."""
    from cache.atomic import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(dataclasses.asdict(cfg), indent=2, default=str) + "\n").encode())


def _asks_cpu(cfg) -> bool:
    """`cpu_only` of a config with --device: the CLI hides the GPUs before anything asks CUDA (runtime.hide_gpus)."""
    return cfg.device == "cpu"


def _revision(of: str = "--teacher", default_text: str | None = None):
    """The Hub revision of a teacher setting, declared alike by every command that names a teacher."""
    return setting(None, help=f"Hub revision (branch, tag or commit) of {of} when it is a Hub id.", check=non_empty,
                   default_text=default_text)


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """What the teacher computes for each trajectory and how many run together (stage one, `plan`, the costs)."""

    dtype: str | None = setting(None, help="Teacher dtype.", check=DTYPES, default_text=DTYPE_DEFAULT)
    steps: int = setting(DEFAULT_STEPS, help="Denoising steps of the teacher's sampler; one sample per step.",
                         check=at_least(1))
    guidance: float = setting(DEFAULT_GUIDANCE, help="CFG scale (of the high-noise expert for Wan 2.2); <= 1 "
                                                     "disables CFG.", check=positive(allow_zero=True))
    guidance_2: float | None = setting(None, help="CFG scale of the low-noise expert (Wan 2.2).",
                                       check=positive(allow_zero=True), default_text="--guidance")
    height: int = setting(DEFAULT_HEIGHT, help="Image height in pixels.", check=at_least(1))
    width: int = setting(DEFAULT_WIDTH, help="Image width in pixels.", check=at_least(1))
    frames: int = setting(1, help="Frames (1 = images; video teachers take 4k+1).", check=at_least(1))
    seeds_per_prompt: int = setting(1, help="Trajectories per prompt, each from its own seeded noise.",
                                    check=at_least(1))
    max_sequence_length: int = setting(DEFAULT_MAX_SEQUENCE_LENGTH, help="Text tokens (padding length), as "
                                                                         "WanPipeline's.", check=_SEQUENCE_LENGTH)
    batch_size: int = setting(4, help="Trajectories run together (CFG doubles the forward batch).", check=at_least(1))


@dataclass(frozen=True, kw_only=True)
class RecordSettings:
    """What each sample records besides x_t and the target (cache/schema.py's optional fields)."""

    save_cond_uncond: bool = setting(False, help="Also store the conditional and unconditional predictions.")
    record_features: tuple[int, ...] | None = setting(
        None, parse=int_list, help="Teacher blocks (each expert's) whose projected outputs every sample stores, e.g. "
                                   "0,20: for `train-student --objective velocity+feature`.")
    feature_dim: int = setting(256, help="Width the recorded features are projected to.", check=at_least(1))
    feature_pool: str = setting("none", help=f"Feature rows: {FEATURE_POOLS.listing()}.",
                                check=one_of(FEATURE_POOLS.names))
    feature_seed: int = setting(0, help="Seed of the fixed feature projection.")
    record_steps: int | None = setting(
        None, check=at_least(1), default_text="every step",
        help="Record only N of the --steps per trajectory (every step still runs; the final latent is always kept): "
             "step 0, --keep-steps, the rest drawn by --record-seed, the same for every trajectory; `plan "
             "--record-steps` and `cache info` show the bytes.")
    record_seed: int | None = setting(None, help="Seed of the steps --record-steps draws.", default_text="--seed")
    keep_steps: tuple[int, ...] | None = setting(
        None, parse=int_list, help="Steps --record-steps always records besides 0, e.g. the boundaries a "
                                   "`--objective segment --student-steps K` student needs (0,20 for K=2 of 40 steps).")
    for_students: tuple[str, ...] | None = setting(
        None, parse=student_grids, default_text="none: --keep-steps alone",
        help=f"Student grids the cache is made for, each {GRID_FORMS}: it records the union of their boundaries (the "
             "teacher steps nearest their sigmas; the dry run prints each grid's steps, experts and distance), plus "
             "--record-steps' drawn extras; without --record-steps those boundaries alone.")


@dataclass(frozen=True, kw_only=True)
class TeacherRun(PlacementSettings, TeacherSpeedSettings, RunShape, RecordSettings):
    """The teacher's run as `plan` sizes it and `teacher-cache` runs it."""

    teacher: str = setting(check=non_empty, help="Wan pipeline: local diffusers folder or Hub id (e.g. "
                           "Wan-AI/Wan2.2-T2V-A14B-Diffusers; HF_HUB_OFFLINE=1 uses the local Hub cache).")
    revision: str | None = _revision()
    placement: str = setting("auto", help=f"Where the teacher's weights live: {' | '.join(PLACEMENTS.names())} | a "
                                          "device-map .json (docs/placements.md; `wandistiller plan` explains auto).",
                             check=one_of(PLACEMENTS.names, cli_choice=False, otherwise=lambda v: v.endswith(".json"),
                                          otherwise_text=" or a device-map .json file"))


@dataclass(frozen=True, kw_only=True)
class TeacherCacheConfig(TeacherRun):
    """Stage one: run the teacher over a prompt set and timestep schedule, write the cache."""

    TOML_SECTION = "teacher_cache"

    prompts: str | None = setting(None, path=True, default_text="none: --images gives them",
                                  help="Prompt file: .txt (one a line, # comments) or .jsonl ({\"prompt\": ...} a "
                                       "line).")
    images: str | None = setting(None, path=True, help="Image-to-video: a file of <image path><TAB><prompt> lines "
                                 "(paths relative to it), the first frame of each prompt's trajectories, instead of "
                                 "--prompts; for a WanImageToVideoPipeline teacher or TI2V's image mode.")
    images_from: str | None = setting(None, path=True, help="Image-to-video without an image set: a finished "
                                      "text-to-video CACHE's prompts, each with the first frame of its seed-0 "
                                      "trajectory decoded (its teacher's VAE), instead of --prompts/--images.")
    out: str = setting(help="CACHE_DIR to write (or resume).", check=non_empty, path=True)
    teacher_lora: tuple[str, ...] | None = setting(
        None, parse=str_tuple, multiple=True, default_text="none",
        help="A LoRA (.safetensors, diffusers' or Wan's key names) fused into the teacher before it runs, as "
             "[EXPERT=]FILE[:SCALE] (EXPERT 1|high or 2|low, default every expert; SCALE default 1); repeatable. "
             "Its sha256 and scale enter the fingerprint; sample and eval fuse it into the teacher they draw.")
    seed: int = setting(0, help="Base seed of the initial noise of (prompt, seed index).")
    negative_prompt: str = setting("", help="Negative prompt for CFG.", default_text="empty", check=_prompt_text)
    samples_per_shard: int = setting(1024, help="Samples per tar shard (a shard closes at the first block boundary "
                                                "past this many).", check=at_least(1))
    part: int | None = setting(None, help="This process's part (with --num-parts), e.g. one per node.",
                               default_text="RANK under torchrun, else 0")
    num_parts: int | None = setting(None, help="Number of parts the prompt set is split into.",
                                    default_text="WORLD_SIZE under torchrun, else 1")
    overwrite: bool = setting(False, help="Replace a cache made with other settings.")
    report_to: str = setting("none", check=one_of(lambda: [e.name for e in TRACKERS.entries() if e.stage_one]),
                             help="Progress scalars (prompts/s, samples/s, bytes, projected size, ETA) for TensorBoard "
                                  "under CACHE_DIR/parts/part-P/tensorboard, or none.")
    dry_run: bool = setting(False, help="Check the settings, prompts, teacher configs and --out, print what the run "
                                        "would do and exit: no weight loaded, nothing written.")

    cpu_only = property(lambda self: placement_entry(self.placement).caps.gpu == "no")  # (as _asks_cpu)

    def __post_init__(self):
        check_settings(self)
        if sum(v is not None for v in (self.prompts, self.images, self.images_from)) != 1:
            raise ValueError("give one of --prompts FILE (text-to-video), --images FILE or --images-from CACHE "
                             "(image-to-video)")
        _check_record_steps(self)
        if self.teacher_lora:
            from .teacher_lora import parse  # (here: the CLI loads this module, and that one reads files through cache/)

            for text in self.teacher_lora:
                parse(text)
        if self.record_features is not None and len(set(self.record_features)) != len(self.record_features):
            raise ValueError(f"record-features must list distinct teacher blocks, got {self.record_features!r}")
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
                raise ValueError(f"part must be in [0, num-parts): got --part {self.part} with --num-parts "
                                 f"{self.num_parts}; parts are numbered 0 to {self.num_parts - 1}")


def _check_record_steps(cfg: TeacherCacheConfig) -> None:
    """--record-steps N out of --steps, with its seed and the steps it must keep."""
    n, steps = cfg.record_steps, cfg.steps
    if n is None:
        if cfg.record_seed is not None or cfg.keep_steps is not None:
            raise ValueError("record-seed and keep-steps choose the steps --record-steps N records: give "
                             "--record-steps too")
        return
    if n > steps:
        raise ValueError(f"record-steps {n} exceeds --steps {steps}; choose 1 to {steps} (or leave it out to record "
                         "every step)")
    keep = sorted({0, *(cfg.keep_steps or ())})
    if keep[-1] >= steps:
        raise ValueError(f"keep-steps must list steps from 0 to {steps - 1} (--steps {steps}), got "
                         f"{','.join(map(str, cfg.keep_steps))}")
    if len(keep) > n:
        raise ValueError(f"keep-steps {','.join(map(str, keep))} (step 0 always included) are {len(keep)} steps, more "
                         f"than --record-steps {n}; record at least {len(keep)}")


def _workers(name, v) -> None:
    """At most one DataLoader worker per core this process may run on (its affinity: taskset, cgroups, SLURM's
    --cpus-per-task): a worker's work is CPU work (read, crc32c, decode, collate), and more workers than cores only
    wait for each other (500 of them on 2 cores fork 500 processes)."""
    at_least(0)(name, v)
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    if v > cores:
        raise ValueError(f"{name} {v} is more than the {cores} CPU core(s) this machine gives the process; use at most "
                         f"{cores} (or leave it out: cores per rank - 2, at most 4)")


def _default_workers() -> int:
    """The rank's share of CPU cores minus two (the trainer and its torch threads), at most 4: 0 on 2 cores."""
    world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
    return max(0, min(4, (os.cpu_count() or 1) // world - 2))


_ObjectiveSettings = merged("_ObjectiveSettings", OBJECTIVES)  # every objective's settings, as flat fields


@dataclass(frozen=True, kw_only=True)
class TrainStudentConfig(LoraSettings, _ObjectiveSettings):
    """Stage two: train a student (compact, or LoRA adapters on the teacher) from one or more finished caches."""

    TOML_SECTION = "train_student"

    cache: tuple[str, ...] = setting(help="CACHE_DIR of stage one; repeat for several caches with the same "
                                          "fingerprint.", parse=str_tuple, path=True, multiple=True)
    student_config: str | None = setting(None, help="Student WanTransformer3DModel JSON (configs/student-*.json).",
                                         check=non_empty, path=True, default_text="none: --lora-of instead")
    out: str = setting(help="Output folder: student/, student_ema/, checkpoints/, metrics.jsonl, loss.png, "
                            "distill.json.", check=non_empty, path=True)
    epochs: int | None = setting(None, help="Passes over the cache.", check=at_least(1),
                                 default_text="1, or what --max-steps needs")
    max_steps: int | None = setting(None, help="Stop after this many optimizer steps (the first of --epochs and "
                                               "--max-steps wins).", check=at_least(1))
    batch_size: int = setting(8, help="Samples per rank per micro-step; global batch = batch size x world x "
                                      "grad accum.", check=at_least(1))
    grad_accum: int = setting(1, help="Micro-steps per optimizer step.", check=at_least(1))
    lr: float = setting(1e-4, help="Peak AdamW learning rate, reached after --warmup-steps.", check=positive())
    min_lr_ratio: float = setting(0.0, help="Cosine floor as a fraction of --lr, reached at the last step.",
                                  check=in_range(0, 1))
    warmup_steps: int = setting(100, help="Linear warmup from 0, in optimizer steps.", check=at_least(0))
    weight_decay: float = setting(0.01, help="AdamW decay of matrices (biases, norms and tables are not decayed).",
                                  check=positive(allow_zero=True))
    max_grad_norm: float = setting(1.0, help="Clip the global gradient norm; 0 disables clipping.",
                                   check=positive(allow_zero=True))
    ema_decay: float = setting(0.0, help="EMA decay of the weights (e.g. 0.999), saved as OUT/student_ema; 0 = no "
                                         "EMA.", check=in_range(0, 1, high_open=True, note=" (0 = off)"))
    mixed_precision: str | None = setting(None, help="Autocast dtype.", check=one_of(("no", "bf16", "fp16")),
                                          default_text="bf16 on CUDA, no on CPU")
    gradient_checkpointing: bool = setting(False, help="Recompute block activations in the backward pass (less "
                                                       "memory, ~30% slower).")
    num_workers: int | None = setting(None, help="DataLoader worker processes per rank reading shards.",
                                      check=_workers, default_text="CPU cores per rank - 2, at most 4")
    seed: int = setting(0, help="Student init and epoch order seed (the order is a function of seed and epoch).",
                        check=at_least(0))
    checkpoint_every: int = setting(500, help="Optimizer steps between checkpoints (and one at the last step); "
                                    "0 = none.", check=at_least(0))
    keep_checkpoints: int = setting(2, help="Newest complete checkpoints kept.", check=at_least(1))
    resume: bool = setting(False, help="Continue from the newest complete checkpoint in --out.")
    train_steps: tuple[int, ...] | None = setting(None, parse=int_list, default_text="all",
                                                  help="Train only on these cached step indices, e.g. 0,4,8.")
    init_from_teacher: str | None = setting(None, path=True, help="Teacher pipeline/transformer folder, .safetensors "
                                                                  "file or Hub id to copy matching weights from.")
    revision: str | None = _revision("--init-from-teacher or --lora-of")
    teacher_blocks: tuple[int, ...] | None = setting(None, parse=int_list, default_text="spread",
                                                     help="Teacher block for each student block, e.g. 0,4,8.")
    holdout_prompts: int = setting(0, help="Prompts kept out of training; their cached samples give the held-out "
                                           "loss.", check=at_least(0))
    train_trajectories: int = setting(0, check=at_least(0),
                                      help="Train only on the first N trajectories (cache, prompt, seed) that are not "
                                           "held out: what a stage one over fewer prompts would give (a data curve); "
                                           "0 = all.")
    eval_every: int = setting(100, help="Optimizer steps between held-out evaluations (also at start and end); 0 = "
                                        "ends only.", check=at_least(0))
    log_every: int = setting(10, help="Optimizer steps between metrics.jsonl lines.", check=at_least(1))
    device: str = setting("auto", help="Training device (auto: CUDA if present).",
                          check=one_of(("auto", "cuda", "cpu")))
    verify: str = setting("checksum", check=one_of(("checksum", "size")),
                          help="Shard check before training: checksum (every byte of every shard against its recorded "
                               "checksum, and the prompt rows against theirs) or size (sizes and member index).")
    embedding_cache_size: int = setting(1024, help="Prompt embeddings each reader process keeps in memory (LRU).",
                                        check=at_least(1))
    order: str = setting("auto", check=one_of(("auto", "shuffle", "grouped")),
                         help="Epoch order: shuffle (uniform), grouped (prompts a window of --embedding-cache-size / 2 "
                              "at a time, samples shuffled within the window: each embedding read once per epoch) or "
                              "auto (grouped when the prompts outnumber --embedding-cache-size).")
    collective_timeout_s: float = setting(600.0, help="Seconds a rank may wait in a collective before it fails.",
                                          check=positive())
    strategy: str = setting("ddp", help=f"How the student is laid over the ranks: {STRATEGIES.listing()}.",
                            check=one_of(STRATEGIES.names))
    # Plug-ins registered after the CLI loaded pass too: get_objective refuses an unknown one when the stage starts.
    objective: str = setting("velocity", help=f"What the student learns: {OBJECTIVES.listing()}.", check=non_empty)
    report_to: str = setting("tensorboard", check=one_of(TRACKERS.names),
                             help=f"Where the curves go besides metrics.jsonl (rank 0): {TRACKERS.listing()}.")
    val_every: int = setting(0, check=at_least(0),
                             help="Optimizer steps between validations by sampling the held-out prompts (final-latent "
                                  "MSE against the teacher's cached latents; needs --holdout-prompts); 0 = off.")
    val_max_prompts: int = setting(4, help="Held-out prompts (all their seeds) validation samples.", check=at_least(1))
    val_decode: bool = setting(False, help="Also decode the validation latents with the teacher's VAE (rank 0) and "
                                           "log a teacher|student image grid.")
    dry_run: bool = setting(False, help="Time one training step (after a warm-up step) on this machine and report the "
                                        "student's parameters, memory per GPU, samples/s and the run's projected time, "
                                        "then exit: nothing is written to --out, shards are checked by size only.")
    gpu: str | None = setting(None, parse=gpu_name, default_text="this machine's CUDA GPU when it is one of them, "
                              f"else {DEFAULT_GPU}", help="--dry-run: the GPU the run's GPU-hours are priced on by the "
                                                          f"FLOP model (docs/costs.md): {', '.join(GPU_NAMES)}.")

    cpu_only = property(_asks_cpu)

    @property
    def objective_settings(self):
        """The chosen objective's settings dataclass (None for a plug-in declared without one)."""
        return settings_of(self, OBJECTIVES[self.objective]) if self.objective in OBJECTIVES else None

    def __post_init__(self):
        if self.num_workers is None:
            object.__setattr__(self, "num_workers", _default_workers())
        check_settings(self)
        refuse_foreign(self, self.objective, "objective")
        _check_student_kind(self)
        if not self.cache or not all(isinstance(c, str) and c for c in self.cache):
            raise ValueError("cache must name at least one CACHE_DIR (--cache)")
        if self.mixed_precision == "fp16" and not STRATEGIES[self.strategy].caps.fp16:
            raise ValueError(f"mixed-precision fp16 does not go with strategy {self.strategy} (its loss scaler would "
                             "see only this rank's shard of the gradients and ranks could disagree on skipping a "
                             "step); use --mixed-precision bf16")
        if self.revision is not None and all(getattr(self, k.caps.teacher) is None for k in STUDENTS.entries()):
            raise ValueError("revision is the Hub revision of --init-from-teacher or --lora-of: give one of them too")
        if self.teacher_blocks is not None and self.init_from_teacher is None:
            raise ValueError("teacher-blocks needs --init-from-teacher (the teacher to read the blocks from)")
        if self.val_every and not self.holdout_prompts:
            raise ValueError("val-every samples held-out prompts: give --holdout-prompts N too")
        if self.val_decode and not self.val_every:
            raise ValueError("val-decode decodes the validation samples: give --val-every N too")
        if self.val_decode and self.report_to == "none":
            raise ValueError("val-decode logs an image grid to the tracker: use --report-to tensorboard or wandb")


def _check_student_kind(cfg: TrainStudentConfig) -> None:
    """Exactly one student kind (registries.STUDENTS), with its own settings and none of another's."""
    kinds = STUDENTS.entries()
    chosen = [k for k in kinds if getattr(cfg, k.caps.chosen_by) is not None]
    if len(chosen) != 1:
        raise ValueError("give " + " or ".join(f"{k.caps.flag} ({k.help})" for k in kinds) + ", "
                         + ("not both" if chosen else "one of them"))
    kind, caps = chosen[0], chosen[0].caps
    for other in (k for k in kinds if k is not kind and k.settings is not None):
        own = {f.name for f in dataclasses.fields(other.settings)}
        changed = [f.name for f in dataclasses.fields(cfg) if f.name in own and getattr(cfg, f.name) != f.default]
        if changed:
            raise ValueError(f"{changed[0].replace('_', '-')} applies to {other.caps.flag.split()[0]} runs only: give "
                             f"{other.caps.flag} or drop it")
    for name, why in caps.refused:
        if getattr(cfg, name) is not None:
            raise ValueError(f"{name.replace('_', '-')} does not go with {caps.flag.split()[0]}: {why}")
    if cfg.objective in OBJECTIVES and not caps.trains(OBJECTIVES[cfg.objective].caps):
        fit = [e.name for e in OBJECTIVES.entries() if caps.trains(e.caps)]
        raise ValueError(f"--objective {cfg.objective} does not go with {caps.flag.split()[0]}; use {' or '.join(fit)}")
    part = caps.partial
    if part and getattr(cfg, part) != cfg.__dataclass_fields__[part].default and cfg.val_every:
        raise ValueError(f"val-every samples whole trajectories, which need both experts, and "
                         f"--{part.replace('_', '-')} {getattr(cfg, part)} loads one; drop --val-every "
                         "(and sample or eval the run afterwards)")


# -- the commands that run a trained student: sample, export, eval ---------------------------------------
# A setting left None is resolved at run time: distill.json, the manifest or the teacher, then the DEFAULT_* above.
_DEVICE = must(lambda v: re.match(r"^(auto|cpu|cuda(:\d+)?)$", str(v)), "be auto, cpu, cuda or cuda:N")


def _student(help: str = "train-student --out folder (student/, distill.json) or a student model folder."):
    return setting(help=help, check=non_empty, path=True)


def _weights():
    return setting("auto", check=one_of(("auto", "ema", "raw")),
                   help="Student weights: auto = student_ema/ when the run saved it, else student/.")


def _compare(help: str):
    return setting((), help=help, parse=str_tuple, path=True, multiple=True,
                   check=must(lambda v: all(isinstance(c, str) and c for c in v), "list train-student OUT folders"))


@dataclass(frozen=True, kw_only=True)
class _Inference:
    student: str = _student("train-student --out folder (student/, distill.json) or a student model folder; "
                            "RUN1+RUN2: the --lora-experts 1 and 2 runs of one cache, as one LoRA.")
    weights: str = _weights()
    device: str = setting("auto", help="auto (the first GPU if any) | cpu | cuda | cuda:N.", check=_DEVICE)
    dtype: str | None = setting(None, help="Model dtype.", check=DTYPES, default_text=DTYPE_DEFAULT)
    hybrid: tuple[str, ...] = _compare("A few-step segment run (or LoRA pair) drawn as a hybrid: the teacher, guided, "
                                       "over its own steps up to the run's --hybrid-steps'th boundary, then the run "
                                       "(repeatable).")
    hybrid_steps: int | None = setting(None, check=at_least(1), help="--hybrid: how many of the run's steps the "
                                       "teacher draws instead.", default_text="those on the high-noise expert")

    cpu_only = property(_asks_cpu)

    def __post_init__(self):
        check_settings(self)


@dataclass(frozen=True, kw_only=True)
class SampleConfig(_Inference):
    """`wandistiller sample`: teacher and student images from the same noise, side by side in one PNG."""

    TOML_SECTION = "sample"

    teacher: str | None = setting(None, help="Wan pipeline folder or Hub id.", default_text="the teacher named in "
                                                                                          "distill.json")
    revision: str | None = _revision(default_text="distill.json's, for its teacher")
    prompts: str | None = setting(None, path=True, default_text="none: --images gives them", check=non_empty,
                                  help="Prompt file (.txt or .jsonl); one grid row per prompt.")
    images: str | None = setting(None, path=True, check=non_empty, help="Image-to-video students: a file of <image path><TAB><prompt> "
                                 "lines (teacher-cache --images' format), one grid row each, instead of --prompts.")
    out: str = setting(help="PNG grid to write; the settings used go to OUT.json.", check=non_empty, path=True)
    steps: int | None = setting(None, help="Denoising steps for both.", check=at_least(1),
                                default_text=f"distill.json's, else {DEFAULT_STEPS}")
    guidance: float | None = setting(None, help="The teacher's CFG scale.", check=positive(allow_zero=True),
                                     default_text=f"distill.json's, else {DEFAULT_GUIDANCE}")
    guidance_2: float | None = setting(None, help="The teacher's low-noise expert scale (Wan 2.2).",
                                       check=positive(allow_zero=True), default_text="distill.json's")
    student_guidance: float | None = setting(None, help="The student's CFG scale.", check=positive(allow_zero=True),
                                             default_text="1.0 if the student learned guided targets, else --guidance")
    negative_prompt: str | None = setting(None, help="Negative prompt for CFG.", check=_prompt_text,
                                          default_text="distill.json's, else empty")
    seed: int = setting(0, help="Noise seed; prompt i starts from seed + i, for teacher and student alike.",
                        check=at_least(0))
    height: int | None = setting(None, help="Image height.", check=at_least(1),
                                 default_text=f"the training resolution, else {DEFAULT_HEIGHT}")
    width: int | None = setting(None, help="Image width.", check=at_least(1),
                                default_text=f"the training resolution, else {DEFAULT_WIDTH}")
    max_sequence_length: int | None = setting(None, help="Text tokens.", check=_SEQUENCE_LENGTH,
                                              default_text=f"distill.json's, else {DEFAULT_MAX_SEQUENCE_LENGTH}")
    max_prompts: int = setting(8, help="Use the first K prompts of the file (one grid row each).", check=at_least(1))
    student_steps: int | None = setting(None, help="The student's sampling steps.", check=at_least(1),
                                        default_text="distill.json's: a few-step student's K, else --steps")
    compare: tuple[str, ...] = _compare("Another train-student OUT (or a LoRA pair, RUN1+RUN2) drawn beside the "
                                        "student at its own steps (repeatable).")
    fps: int | None = setting(None, help="Frames per second of a video run's animated WebPs and mp4s (video students "
                              "only).", check=at_least(1), default_text=str(DEFAULT_FPS))

    def __post_init__(self):
        super().__post_init__()
        if (self.prompts is None) == (self.images is None):
            raise ValueError("give one of --prompts FILE (a text-to-video student) or --images FILE (image-to-video)")


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """`wandistiller export`: a diffusers pipeline folder with the student as its one transformer."""

    TOML_SECTION = "export"

    student: tuple[str, ...] = setting(help="train-student --out folder (student/, distill.json) or a student model "
                                       "folder; twice (or RUN1+RUN2): the --lora-experts 1 and 2 runs of one cache, "
                                       "exported as one LoRA.", parse=str_tuple, path=True, multiple=True,
                                       check=must(lambda v: 1 <= len(v) <= 2 and all(isinstance(s, str) and s
                                                                                    for s in v),
                                                  "name one student folder, or the two runs of a LoRA pair"))
    weights: str = _weights()
    teacher: str | None = setting(None, help="Wan pipeline folder or Hub id.",
                                  default_text="the teacher named in distill.json")
    revision: str | None = _revision(default_text="distill.json's, for its teacher")
    out: str = setting(help="Pipeline folder to create.", check=non_empty, path=True)
    copy: bool = setting(True, flag="copy/link", help="Copy the teacher's text encoder, tokenizer, VAE and scheduler "
                         "into the folder (self-contained: what the Hub needs), or symlink them (no second copy on "
                         "disk; works on this machine only).")
    overwrite: bool = setting(False, help="Replace an earlier export at --out (never any other folder).")
    base_model: str | None = setting(None, help="The teacher's Hub id, for the model card's base_model.",
                                     default_text="--teacher when it is a Hub id or a Hub cache snapshot")
    push_to_hub: str | None = setting(None, help="Then upload the folder to this Hub model repo (created if missing), "
                                                 "e.g. you/wan-student; needs `hf auth login` or HF_TOKEN.")
    private: bool = setting(False, help="Create the --push-to-hub repo private.")
    fuse: bool = setting(False, help="A LoRA run: a standalone pipeline with the adapters merged into the teacher's "
                                     "transformers, instead of the adapter files for load_lora_weights.")
    guidance_scale: float | None = setting(None, check=positive(), help="A student that takes the guidance scale as "
                                           "an input (train-student --guidance-range): the scale baked into the "
                                           "exported transformer (WanPipeline has no way to pass it).",
                                           default_text="none: such a student is refused without it")
    lora_format: str = setting("diffusers", check=one_of(("diffusers", "wan"), cli_choice=False), help="A LoRA run's "
                               "adapter files: diffusers (peft key names) or wan (the original Wan key names, "
                               "diffusion_model.blocks.N...lora_down/lora_up/alpha: for ComfyUI, and diffusers).")

    cpu_only = True  # export copies weights and writes files: never a GPU

    def __post_init__(self):
        check_settings(self)
        if self.push_to_hub and not self.copy:
            raise ValueError("push-to-hub uploads files, and --link leaves links to the teacher's files in their "
                             "place; drop --link")
        if self.private and not self.push_to_hub:
            raise ValueError("private applies to the repo --push-to-hub creates: give --push-to-hub REPO_ID too")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(_Inference):
    """`wandistiller eval`: the student against the teacher's cached trajectories."""

    TOML_SECTION = "eval"

    cache: str = setting(help="CACHE_DIR whose trajectories to compare with (ideally held out).", check=non_empty,
                         path=True)
    prompts: str | None = setting(None, path=True, help="Held-out prompt file: only the cache's prompts listed there.")
    max_prompts: int | None = setting(None, help="Use the first K selected prompts (all their seeds).",
                                      check=at_least(1), default_text="all")
    report: str | None = setting(None, path=True, help="JSON report; the plot goes next to it.",
                                 default_text="STUDENT/eval.json")
    teacher: str | None = setting(None, help="Teacher (folder or Hub id) for the timing comparison.",
                                  default_text="the cache manifest's teacher")
    revision: str | None = _revision(default_text="the manifest's, for its teacher")
    teacher_timing: bool = setting(True, help="Time the teacher too (loads its transformers, not its text encoder or "
                                              "VAE).")
    timing_runs: int = setting(2, help="Trajectories timed per model, after a warm-up.", check=at_least(1))
    init_seed: int | None = setting(None, help="Seed of the untrained baseline.", check=at_least(0),
                                    default_text="student_init/ if saved, else distill.json's, else 0")
    batch_size: int = setting(8, help="Samples (velocity MSE) or trajectories (sampling) per forward.",
                              check=at_least(1))
    attributes: str | None = setting(None, check=non_empty, path=True, help="Captions that teacher and student "
                                     "draw, scored by the attribute checker: shapes captions (data/shapes-heldout.txt; "
                                     "clip captions, data/clips-heldout.txt, on a video cache: motion too); on an "
                                     "image-to-video cache a file of <image path><TAB><clip caption> lines, as "
                                     "sample --images, each image its clip's first frame (first-frame fidelity too); "
                                     "needs the teacher's text encoder and VAE.")
    checked_captions: str | None = setting(None, check=non_empty, path=True, help="Captions the drawings are scored "
                                           "against instead, caption i for --attributes' caption i (as many, of the "
                                           "same grammar; --attributes then lists no caption twice): e.g. the ones a "
                                           "recolouring LoRA fused into the teacher is meant to draw.",
                                           default_text="--attributes' own")
    attribute_max_prompts: int | None = setting(None, help="Use the first K --attributes captions.",
                                                check=at_least(1), default_text="all")
    attribute_seeds: int = setting(1, check=at_least(1), help="Noise draws per --attributes or --motion caption "
                                   "(more clips, narrower intervals).")
    motion: str | None = setting(None, check=non_empty, path=True, help="Prompts of any wording that teacher and "
                                 "models draw on a video cache, scored by optical flow (dynamic degree, flow ratio, "
                                 "flicker; --attributes' clips get them too); on an image-to-video cache a file of "
                                 "<image path><TAB><prompt> lines.")
    teacher_redraw: tuple[int, ...] | None = setting(
        None, parse=int_list, check=must(lambda v: min(v) >= 1, "list integers >= 1"),
        help="Also draw the teacher at each of these step counts (its scheduler and guidance), as rows beside the "
             "students: e.g. 16,4,2 for its own floor, a 4-step student's steps and its forward passes.")
    attribute_grid: int = setting(8, help="Teacher | student pairs drawn into REPORT-attributes.png (0: none).",
                                  check=at_least(0))
    student_steps: tuple[int, ...] | None = setting(
        None, parse=int_list, check=must(lambda v: min(v) >= 1, "list integers >= 1"),
        help="Sample the student with each of these step counts, e.g. 1,2,4.",
        default_text="its own: distill.json's student_steps, else the teacher's steps")
    compare: tuple[str, ...] = _compare("Another train-student OUT (or a LoRA pair, RUN1+RUN2) sampled at its own "
                                        "steps from the same noise (repeatable); the report's table lines them up "
                                        "with the teacher.")

    def __post_init__(self):
        super().__post_init__()
        if self.checked_captions is not None and self.attributes is None:
            raise ValueError("checked-captions scores the drawings of --attributes' captions: give --attributes FILE "
                             "too (or drop --checked-captions)")


# -- plan: the machine stage one would run on, and the run's size ---------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PlanSettings(StudentSchedule):
    """`wandistiller plan`'s own settings: the machine (by default this one), the run's size, and the schedule of the
    segment student it is for (its boundaries become --keep-steps of the printed command under --record-steps)."""

    TOML_SECTION = "plan"

    nodes: int = setting(1, check=at_least(1), help="Nodes stage one would run on, each with --gpus-per-node GPUs.")
    gpus_per_node: int | None = setting(None, check=at_least(0), help="GPUs per node (0: none).",
                                        default_text="this machine's count (1 if it has none)")
    gpu_memory: str | None = setting(None, check=byte_size, help="Memory of each GPU, e.g. 80GiB (GiB = 2^30 bytes, GB "
                                                                 "= 10^9).", default_text="this machine's free memory")
    assume_gpus: str | None = setting(None, check=gpu_sizes, help="A node's GPUs when they differ: 4x24GiB, "
                                      "80GiB,40GiB or none (instead of --gpus-per-node and --gpu-memory).")
    assume_ram: str | None = setting(None, check=byte_size, help="Available RAM of a node (e.g. 256GiB).",
                                     default_text="this machine's")
    assume_disk: str | None = setting(None, check=byte_size, help="Free disk under --offload-dir (e.g. 2TiB); "
                                      "without --offload-dir the offload folder is inside CACHE_DIR, so the cache's "
                                      "disk too (unless --out is given: measured there).",
                                      default_text="this machine's")
    out: str | None = setting(None, path=True, help="CACHE_DIR of the printed command: the free space of its "
                              "filesystem (measured there, or at its nearest existing folder) is set beside the "
                              "cache's bytes, and a cache that does not fit is refused.",
                              default_text="the placeholder CACHE_DIR: the disk is --assume-disk's, else unchecked")
    ranks_per_node: int | None = setting(None, check=at_least(1), help="torchrun processes per node.",
                                         default_text="one per GPU when a replica fits one GPU, else 1")
    prompts: int | None = setting(None, check=at_least(1), help="Prompt count: the cache's bytes, and stage one's "
                                                                "GPU-hours and wall time.")
    step_time: float | None = setting(None, check=positive(), help="Seconds of one teacher step of one trajectory (CFG "
                                      "included) with the chosen placement, for the time projection.",
                                      default_text="--measure's, else the measured table of docs/costs.md")
    measure: bool = setting(False, help="Load the teacher's weights and time one real step with the chosen placement "
                                        "on this machine (plan on the machine that will run it).")
    gpu: str | None = setting(None, parse=gpu_name, default_text=DEFAULT_GPU,
                              help=f"The GPU both stages' times are priced on by the FLOP model, its dense bf16 peak "
                                   f"at the efficiency measured on H100 (docs/costs.md): {', '.join(GPU_NAMES)}.")
    gpu_tflops: float | None = setting(None, check=positive(), help="Dense bf16 TFLOPS (no sparsity) of a GPU "
                                                                    "--gpu does not name, instead of it.")
    student_config: str | None = setting(None, check=non_empty, path=True, default_text="a LoRA of the teacher's "
                                         "experts", help="Stage two's student, for its GPU-hours: a compact "
                                                         "student's JSON (configs/student-*.json).")
    train_epochs: int = setting(1, check=at_least(1), help="Stage two's passes over the cache, for its GPU-hours "
                                                           "(docs/lora.md's recipe trains 2).")
    image_to_video: bool = setting(False, help="TI2V-5B's image mode (teacher-cache --images): count each prompt's "
                                   "first-frame condition and print --images. An image-to-video pipeline (I2V-A14B) "
                                   "is planned so without it.")
    gradient_checkpointing: bool = setting(True, help="Stage two recomputes each block's forward in the backward "
                                                      "(train-student --gradient-checkpointing, the recipe's): one "
                                                      "more forward a sample.")

    def __post_init__(self):
        check_settings(self)
        if self.assume_gpus is not None and (self.gpus_per_node is not None or self.gpu_memory is not None):
            raise ValueError("assume-gpus describes a node's GPUs on its own: give it, or --gpus-per-node and "
                             "--gpu-memory, not both")
        if self.measure and self.step_time is not None:
            raise ValueError("step-time and measure both give the step time: drop one")
        if self.gpu is not None and self.gpu_tflops is not None:
            raise ValueError("gpu and gpu-tflops both name the GPU: drop one")
        if self.measure and (self.gpu is not None or self.gpu_tflops is not None):
            raise ValueError(f"measure times a step on this machine's own GPU, and --gpu"
                             f"{'-tflops' if self.gpu is None else ''} prices another: drop one")
