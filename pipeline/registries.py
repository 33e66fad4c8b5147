"""The names a user can choose, each declared once: placements, objectives, strategies, trackers, feature pools
(docs/architecture.md, "Settings and registries"). Declared here, not beside the implementations, because the CLI
reads them without importing torch or a stage; an entry names its implementation by import path (`Entry.load`)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from .settings import at_least, int_in, int_list, non_empty, one_of, positive, setting

MAX_LORA_RANK = 4096  # a LoRA's rank: a Wan layer is at most 5120 wide (lora.json is refused past it too)


@dataclass(frozen=True)
class Entry:
    name: str
    help: str
    settings: type | None = None  # the entry's settings dataclass; None: it takes none
    listed: bool = True  # shown in lists and choices (the `map` placement is spelled as its .json path)
    stage_one: bool = True  # trackers: teacher-cache can report to it too
    caps: object = None  # what the entry can do (its registry's capabilities dataclass), read instead of its name
    impl: str | type | None = None  # "module:Class" of the implementation, imported by `load`; a plug-in: its class

    def load(self):
        """The implementation `impl` names (imported on first use)."""
        if not isinstance(self.impl, str):
            return self.impl
        module, _, attr = self.impl.partition(":")
        return getattr(importlib.import_module(module), attr)


class Registry:
    """An ordered list of declared names (the order of errors, choices and `--help`)."""

    def __init__(self, what: str, caps: object = None):
        self.what, self._entries, self.caps = what, {}, caps  # `caps`: an entry's capabilities unless it says

    def declare(self, name: str, help: str, settings: type | None = None, **extra) -> Entry:
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is declared twice")
        entry = self._entries[name] = Entry(name, help, settings, **{"caps": self.caps} | extra)
        return entry

    def settings(self, name: str, help: str, **extra):
        """Class decorator: declare `name` with the decorated class as its settings dataclass."""

        def deco(cls):
            cls.NAME = name
            self.declare(name, help, cls, **extra)
            return cls

        return deco

    def forget(self, name: str) -> None:
        """Undo a declaration (a plug-in declared for one `with` block: objective_base.registered)."""
        self._entries.pop(name, None)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def names(self) -> list[str]:
        return [e.name for e in self._entries.values() if e.listed]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def get(self, name: str, flag: str) -> Entry:
        """The entry `name` chosen by `flag`; ValueError naming the choices for one declared nowhere."""
        if name not in self._entries:
            raise ValueError(f"{flag} {name!r} is not one of {', '.join(self.names())}")
        return self._entries[name]

    def where(self, **caps) -> list[Entry]:
        """The entries whose capabilities have these values, in declaration order."""
        return [e for e in self._entries.values() if all(getattr(e.caps, k) == v for k, v in caps.items())]

    def listing(self) -> str:
        """"name (help); name (help)" for a flag's help."""
        return "; ".join(f"{e.name} ({e.help})" for e in self._entries.values() if e.listed)


# -- placements (stages/teacher_cache/placements/, docs/placements.md) ---------------------------------------------


@dataclass(frozen=True)
class PlacementCaps:
    """What a placement can do: stage one, `plan` and the cost code read these, never its name."""

    gpu: str = "no"  # "required": stops without CUDA; "if available": the rank's GPU when one is visible; "no"
    without_gpu: str = "cpu"  # what to suggest when a required GPU is missing
    replica_per_gpu: bool = False  # a whole replica on one GPU: one rank per GPU by default under torchrun
    spreads: bool = False  # one replica over every GPU of a node: one process per node, refused under torchrun
    streams: str | None = None  # "ram" | "disk": the weights are streamed to the computing device from there
    speed: tuple[float, str] | None = None  # a step's speed against `cuda`, and its source; None: not measured
    takes_max_memory: bool = False  # --max-memory is its budget
    offloads_text_encoder: bool = False  # on a GPU, the text encoder too stays in RAM
    picks: bool = False  # chooses another placement for this machine (auto)
    json_map: bool = False  # spelled as the path of its device-map .json
    auto: bool = True  # `auto` may pick it (placement_choice.decide, by its capabilities)


PLACEMENTS = Registry("placement")
_P = "stages.teacher_cache.placements."
PLACEMENTS.declare("auto", "the planner's pick for this machine (`wandistiller plan` explains it)",
                   caps=PlacementCaps(gpu="if available", picks=True, auto=False), impl=_P + "kinds:Auto")
PLACEMENTS.declare("cpu", "RAM, computed on the CPU", caps=PlacementCaps(), impl=_P + "kinds:Cpu")
PLACEMENTS.declare("cuda", "one GPU (one replica per rank under torchrun)",
                   caps=PlacementCaps(gpu="required", replica_per_gpu=True, speed=(1.0, "")), impl=_P + "kinds:Cuda")
_SPREAD = dict(gpu="required", without_gpu="offload or disk (or cpu)", spreads=True, takes_max_memory=True,
               speed=(1.0, "one GPU computes at a time, as one replica would (not measured)"))
PLACEMENTS.declare("balanced", "spread evenly over the GPUs (and RAM) by accelerate", caps=PlacementCaps(**_SPREAD),
                   impl=_P + "device_map:Balanced")
PLACEMENTS.declare("sequential", "filling GPU 0 first, then the next (and RAM)",
                   caps=PlacementCaps(**_SPREAD, auto=False), impl=_P + "device_map:Sequential")
PLACEMENTS.declare("offload", "RAM, streamed to the GPU layer by layer",
                   caps=PlacementCaps(gpu="if available", streams="ram", offloads_text_encoder=True, speed=(
                       0.71, "offload runs at 0.71x of cuda (an A14B expert on an H100, docs/placements.md)")),
                   impl=_P + "kinds:Offload")
PLACEMENTS.declare("disk", "an offload folder, streamed block by block",
                   caps=PlacementCaps(gpu="if available", streams="disk", offloads_text_encoder=True),
                   impl=_P + "kinds:Disk")
PLACEMENTS.declare("map", "a device-map .json file", listed=False,
                   caps=PlacementCaps(gpu="if available", json_map=True, auto=False), impl=_P + "device_map:DeviceMap")


def placement_entry(value: str) -> Entry:
    """The entry of a `--placement` value (a path ending in .json is the device-map entry); ValueError otherwise."""
    if value.endswith(".json"):
        return PLACEMENTS.where(json_map=True)[0]
    if value not in PLACEMENTS.names():
        raise ValueError(f"unknown placement {value!r}; use one of {', '.join(PLACEMENTS.names())} or a device-map "
                         ".json file")
    return PLACEMENTS[value]

@dataclass(frozen=True, kw_only=True)
class PlacementSettings:
    """What a placement is told besides its name; every placement reads the ones that concern it (base.py)."""

    device: int = setting(0, help="CUDA device index of --placement cuda (and the execution GPU of offload).",
                          check=at_least(0))
    max_memory: str | None = setting(
        None, help="--placement balanced/sequential: memory per device, e.g. \"0=70GiB,1=70GiB,cpu=200GiB\".")
    offload_dir: str | None = setting(None, path=True, default_text="CACHE_DIR/offload",
                                      help="--placement disk: folder the weights stream from.")
    # "step": every step of a block before the next; "expert": a window of blocks with expert 1, then expert 2.
    expert_order: str = setting("auto", check=one_of(("auto", "step", "expert")),
                                help="Two experts: expert = one expert resident at a time, step = both (same "
                                     "cache); auto picks expert when both do not fit.")


# -- the teacher's speed options (stages/teacher_cache/speed.py, docs/costs.md "A faster teacher step") -----------


@dataclass(frozen=True)
class QuantCaps:
    """A `--teacher-quant` choice: torchao's config class that quantizes the blocks' linear layers, and the CUDA
    compute capability its kernels need (None: any device, the CPU included)."""

    torchao: str | None = None
    capability: tuple[int, int] | None = None


QUANTS = Registry("teacher quantization", caps=QuantCaps())
QUANTS.declare("none", "the teacher's own weights")
QUANTS.declare("int8", "int8 weights and activations, CPU or CUDA",
               caps=QuantCaps("Int8DynamicActivationInt8WeightConfig"))
QUANTS.declare("fp8", "float8 weights and activations, CUDA of compute capability 8.9+ (Ada, Hopper)",
               caps=QuantCaps("Float8DynamicActivationFloat8WeightConfig", (8, 9)))

# Cache-skipping accelerators: each reuses an earlier step's residuals or outputs instead of running the teacher (or
# some of its blocks), so a target at a skipped step is not the teacher's. Stage one refuses every one (caps: the
# diffusers hook names that give one away on a loaded transformer; TeaCache has no diffusers hook).
STEP_CACHES = Registry("step cache", caps=())
STEP_CACHES.declare("none", "every step runs the whole teacher")
STEP_CACHES.declare("first-block", "diffusers' First-Block Cache", caps=("fbc_leader_block_hook", "fbc_block_hook"))
STEP_CACHES.declare("mag-cache", "diffusers' MagCache", caps=("mag_cache_leader_block_hook", "mag_cache_block_hook"))
STEP_CACHES.declare("teacache", "TeaCache")
STEP_CACHES.declare("taylorseer", "diffusers' TaylorSeer cache", caps=("taylorseer_cache",))
STEP_CACHES.declare("faster-cache", "diffusers' FasterCache", caps=("faster_cache_denoiser", "faster_cache_block"))
STEP_CACHES.declare("pyramid-attention-broadcast", "diffusers' Pyramid Attention Broadcast",
                    caps=("pyramid_attention_broadcast",))
STEP_CACHES.declare("sea-cache", "diffusers' SeaCache", caps=("sea_cache_root", "sea_cache_leader_block",
                                                              "sea_cache_block", "sea_cache_post_norm"))
STEP_CACHE_WHY = ("a cache-skipping hook reuses earlier steps' residuals instead of running the teacher, so the "
                  "targets stage one would write at the skipped steps are not the teacher's")


def _step_cache(name, v) -> None:
    one_of(STEP_CACHES.names)(name, v)
    if v != "none":
        raise ValueError(f"{name} {v} is refused for stage one: {STEP_CACHE_WHY}; leave it out (a few-step student is "
                         "the fast sampler this project makes)")


def _attention_backend(name, v) -> None:
    """One of diffusers' attention backends (read from diffusers only when the value is not the default)."""
    if v != "native":
        from diffusers.models.attention_dispatch import AttentionBackendName
        one_of([b.value for b in AttentionBackendName])(name, v)


@dataclass(frozen=True, kw_only=True)
class TeacherSpeedSettings:
    """How fast the teacher's step runs on the same weights: what stage one and `plan --measure` apply to every
    expert. Recorded in the cache header (`numerics`, fingerprinted) where it can change a target."""

    attention_backend: str = setting(
        "native", check=_attention_backend,
        help="The teacher's attention kernel through diffusers' dispatcher: native (torch SDPA), flash, _flash_3_hub, "
             "sage, ... (diffusers' AttentionBackendName); refused when its package or a GPU it needs is missing.")
    compile: bool = setting(False, help="Regional torch.compile of the teacher's repeated blocks (diffusers' "
                                        "compile_repeated_blocks); the warm-up that compiles is not counted as a step.")
    tf32: bool = setting(False, help="TF32 for float32 matmuls on CUDA (Wan's float32 parts: time embedding, "
                                     "modulation); nothing on the CPU. docs/costs.md gives its drift.")
    teacher_quant: str = setting("none", check=one_of(QUANTS.names),
                                 help=f"Quantize the teacher's block linears through torchao (pip install "
                                      f"'wandistiller[quant]'); opt-in, the targets drift: {QUANTS.listing()}.")
    step_cache: str = setting("none", check=_step_cache,
                              help=f"Refused for stage one, every value but none: {STEP_CACHE_WHY}.")


# -- student kinds (stages/students/; the LoRA student: docs/lora.md) ------------------------------------------------

@dataclass(frozen=True)
class StudentCaps:
    """A student kind as the settings know it: config.py's checks read these, never its name."""

    chosen_by: str  # the setting that chooses it
    flag: str  # how a refusal names it
    teacher: str  # the setting that names a teacher (whose Hub revision is --revision)
    refused: tuple[tuple[str, str], ...] = ()  # settings that do not go with it, and why
    trains: Callable[[ObjectiveCaps], bool] = lambda caps: True  # whether an objective (its caps) can train it
    partial: str | None = None  # a setting that, away from its default, loads part of it (--val-every needs it whole)


# The kinds, each chosen by its own flag; their own settings (the entry's) are refused with another kind.
STUDENTS = Registry("student kind")
STUDENTS.declare("compact", "a compact student", impl="stages.students.compact:CompactStudent",
                 caps=StudentCaps("student_config", "--student-config", "init_from_teacher"))

# Every block's attention (self and cross) and FFN projections (diffusers' names): what Wan's few-step LoRAs train.
LORA_TARGETS = "to_q,to_k,to_v,to_out.0,ffn.net.0.proj,ffn.net.2"


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """A LoRA student: the teacher's own transformer(s), frozen, with peft adapters trained from the cache."""

    lora_of: str | None = setting(
        None, path=True, default_text="none: a --student-config student",
        help="Train LoRA adapters on this teacher's transformer(s) (its folder or Hub id: the teacher the cache was "
             "made with) instead of a --student-config student; the base stays frozen, each Wan 2.2 expert gets its "
             "own adapter and learns only from the samples it produced.")
    lora_rank: int = setting(16, check=int_in(1, MAX_LORA_RANK), help="--lora-of: the adapters' rank.")
    lora_alpha: float | None = setting(None, check=positive(), default_text="--lora-rank",
                                       help="--lora-of: LoRA alpha; the update is scaled by alpha / rank.")
    lora_targets: str = setting(LORA_TARGETS, check=non_empty,
                                help="--lora-of: comma-separated module names adapted in every block (peft "
                                     "target_modules, each matched as a suffix of a module's path).")
    lora_experts: str = setting("all", check=one_of(("all", "1", "2")),
                                help="--lora-of on a two-expert teacher: train both experts' adapters (all), or only "
                                     "expert 1 (transformer, high noise) or 2 (transformer_2, low noise) on its own "
                                     "samples, with only that expert in memory.")


STUDENTS.declare("lora", "LoRA adapters on the teacher's own transformers", LoraSettings,
                 caps=StudentCaps("lora_of", "--lora-of TEACHER", "lora_of",
                                  refused=(("init_from_teacher", "the LoRA student is the teacher itself"),
                                           ("teacher_blocks", "the LoRA student keeps every teacher block"),
                                           ("segment_disc_init", "the adversarial term's discriminator trains beside "
                                                                 "a compact student only")),
                                  trains=lambda caps: caps.lora, partial="lora_experts"),
                 impl="stages.students.lora:LoraStudent")


# -- objectives (stages/train_student/objective_*.py) ------------------------------------------------------------

@dataclass(frozen=True)
class ObjectiveCaps:
    sampler: str | None = None  # how its student samples (pipeline/sampling.py SAMPLERS); None: the teacher's way
    lora: bool = True  # trains a LoRA student too (no heads on student blocks)


OBJECTIVES = Registry("objective", caps=ObjectiveCaps())


def _scale_range(name: str, value) -> tuple[float, float]:
    """'1.5,3' or [1.5, 3] -> (1.5, 3.0): two guidance scales, the first the lower (a `parse`)."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        lo, hi = (float(str(v).strip()) for v in items)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be two guidance scales LO,HI like 1.5,3, got {value!r}") from None
    if not 0 < lo < hi < float("inf"):
        raise ValueError(f"{name} must be LO,HI with 0 < LO < HI, got {value!r}")
    return lo, hi
_OBJ = "stages.train_student.objective_velocity:"


@OBJECTIVES.settings("velocity", "MSE to the teacher's (guided) prediction at each cached step; samples with the "
                                 "teacher's steps", impl=_OBJ + "Velocity")
@dataclass(frozen=True, kw_only=True)
class VelocitySettings:
    """The velocity objective's settings: the guidance scale of the teacher it learns, one or a range taken as the
    student's input (docs/architecture.md, "Guidance as a dial")."""

    target_guidance: float | None = setting(
        None, check=positive(), help="velocity: learn the teacher at this guidance scale instead of the cache's, "
        "u + w (c - u) from its conditional and unconditional predictions (a cache of teacher-cache "
        "--save-cond-uncond; both experts alike).", default_text="the cache's guided prediction")
    guidance_range: tuple[float, float] | None = setting(
        None, parse=_scale_range, help="velocity: LO,HI: learn the teacher at every guidance scale between, the scale "
        "an input of the student embedded beside its timestep (each sample's drawn uniformly; the same cache as "
        "--target-guidance); sample and eval then ask it for theirs, export bakes one in (--guidance-scale). A "
        "compact student.", default_text="one scale")


@dataclass(frozen=True, kw_only=True)
class StudentSchedule:
    """Where a K-step student's segments start on the teacher's steps (segment; `plan` keeps them: --keep-steps)."""

    student_steps: int | None = setting(
        None, check=at_least(1), help="segment: the student's sampling steps K, 1 .. the cache's steps (a divisor of "
                                      "them reproduces the teacher's schedule exactly).")
    student_timesteps: tuple[int, ...] | None = setting(None, parse=int_list, help="segment: the K boundary "
                                                        "timesteps, steps the cache recorded, e.g. 999,936,837,633.")
    student_shift: float | None = setting(None, check=positive(), help="segment: K boundaries of a flow schedule "
                                          "shifted by S (Wan2.2-Lightning's: 5), at the nearest recorded steps.")
    student_expert_steps: tuple[int, ...] | None = setting(None, parse=int_list, help="segment: H,L: how many of "
                                                           "the K steps fall to the high- and the low-noise expert.")


CHOSEN = ("student_timesteps", "student_shift", "student_expert_steps")  # a schedule other than equal segments
_GRID = re.compile(r"([0-9]+)(?:@shift([0-9]+(?:\.[0-9]+)?))?(?::([0-9]+)\+([0-9]+))?")
GRID_FORMS = "K (equal segments), K@shiftS, K:H+L or K@shiftS:H+L (e.g. 4@shift5:2+2, Wan2.2-Lightning's)"


def grid_choice(spec: str) -> dict:
    """A student grid's spelling (teacher-cache --for-students) as the StudentSchedule settings it stands for: K steps,
    S the shift of their flow schedule, H+L the steps each expert takes (ValueError, one line, otherwise)."""
    m = _GRID.fullmatch(spec.strip())
    if m is None:
        raise ValueError(f"for-students: {spec.strip()!r} is not a student grid; spell each as {GRID_FORMS}")
    k, shift, h, low = m.groups()
    if int(k) < 1 or (h is not None and (int(h) < 1 or int(low) < 1 or int(h) + int(low) != int(k))):
        raise ValueError(f"for-students: {spec.strip()!r}: K is at least 1, and H+L two counts of at least 1 that add "
                         "up to K")
    if shift is not None and float(shift) <= 0:
        raise ValueError(f"for-students: {spec.strip()!r}: the shift must be positive")
    return {"student_steps": int(k), "student_timesteps": None, "student_shift": None if shift is None else
            float(shift), "student_expert_steps": None if h is None else (int(h), int(low))}


def grid_spec(choice) -> str | None:
    """The --for-students spelling of a student's schedule settings (None: explicit --student-timesteps)."""
    k, explicit, shift, split = (choice.get(key) for key in ("student_steps", *CHOSEN))
    if explicit is not None:
        return None
    k = k if k is not None else sum(split)
    return (f"{k}" + (f"@shift{float(shift):g}" if shift is not None else "")
            + (f":{split[0]}+{split[1]}" if split is not None else ""))


def student_grids(name: str, value) -> tuple[str, ...]:
    """'4@shift5:2+2,4@shift12' (or a list) -> their spellings, each checked, in order, once each (a `parse`)."""
    items = value.split(",") if isinstance(value, str) else value
    out = tuple(dict.fromkeys(grid_spec(grid_choice(str(v))) for v in items if str(v).strip()))
    if not out:
        raise ValueError(f"{name} names no student grid; spell each as {GRID_FORMS}")
    return out


@OBJECTIVES.settings("segment", "K-step student (--student-steps K): at each cached state, MSE to the average "
                                "velocity to the end of its segment of the teacher's schedule; samples with K Euler "
                                "steps, no CFG", impl=_OBJ + "Segment", caps=ObjectiveCaps(sampler="euler"))
@dataclass(frozen=True, kw_only=True)
class SegmentSettings(StudentSchedule):
    velocity_weight: float = setting(0.0, flag="segment-velocity-weight", check=positive(allow_zero=True),
                                     help="segment: weight of an added per-step velocity loss at the same states.")
    start_weight: float = setting(1.0, flag="segment-start-weight", check=positive(),
                                  help="segment: weight of the loss at each segment's first state (where the K-step "
                                       "sampler queries the student) against 1 inside a segment.")
    loss: str = setting("mse", flag="segment-loss", check=one_of(("mse", "pseudo-huber")),
                        help="segment: the distance per sample: mse, or pseudo-huber, sqrt(mse + c^2) - c (iCT): "
                             "linear in the RMS error above c, so the samples a small student cannot fit pull no "
                             "harder than the rest.")
    huber_c: float = setting(0.01, flag="segment-huber-c", check=positive(),
                             help="segment --segment-loss pseudo-huber: c, in RMS units of the latent velocity.")
    adversarial_weight: float = setting(0.0, flag="segment-adversarial-weight", check=positive(allow_zero=True),
                                        help="segment: weight of an adversarial term on the final segment's outputs "
                                             "(a discriminator beside the student, training-only); 0 = off.")
    disc_init: str | None = setting(None, flag="segment-disc-init", path=True,
                                    help="segment --segment-adversarial-weight: the velocity student (its student_ema "
                                         "folder) the discriminator's trunk starts from.")
    disc_r1: float = setting(1.0, flag="segment-disc-r1", check=positive(allow_zero=True),
                             help="segment --segment-adversarial-weight: weight of the discriminator's approximate R1 "
                                  "penalty.")
    disc_warmup: int = setting(0, flag="segment-disc-warmup", check=at_least(0),
                               help="segment --segment-adversarial-weight: training batches in which only the "
                                    "discriminator learns, before the student's adversarial term starts.")


@OBJECTIVES.settings("velocity+feature", "velocity plus MSE of learned projections of student blocks to the cached "
                                         "teacher features (--feature-pairs S:T,..., --feature-weight; the cache "
                                         "needs --record-features)",
                     impl="stages.train_student.objective_velocity:VelocityFeature", caps=ObjectiveCaps(lora=False))
@dataclass(frozen=True, kw_only=True)
class FeatureSettings:
    feature_pairs: str | None = setting(None, check=non_empty,
                                        help="velocity+feature: student block:teacher block pairs, e.g. 0:1,1:3.")
    feature_weight: float = setting(1.0, check=positive(allow_zero=True),
                                    help="velocity+feature: weight of the feature term.")


# -- strategies (stages/train_student/strategy.py, docs/multi-gpu.md) --------------------------------------------

STRATEGIES = Registry("strategy")
_STRATEGY = "stages.train_student.strategy:"


@dataclass(frozen=True)
class StrategyCaps:
    shards: bool  # the training state (and checkpoints) split over the ranks, not whole on each
    fp16: bool  # takes --mixed-precision fp16 (its loss scaler sees the whole gradient)


STRATEGIES.declare("ddp", "a full student per rank", impl=_STRATEGY + "DDP", caps=StrategyCaps(shards=False, fp16=True))
STRATEGIES.declare("fsdp", "weights, gradients, AdamW state and EMA sharded over the ranks (FSDP2), for students "
                           "that do not fit one GPU (docs/multi-gpu.md)", impl=_STRATEGY + "FSDP",
                   caps=StrategyCaps(shards=True, fp16=False))

# -- trackers (stages/train_student/tracking.py; teacher-cache's progress scalars) -------------------------------

TRACKERS = Registry("tracker")
_TRACKING = "stages.train_student.tracking:"
TRACKERS.declare("tensorboard", "TensorBoard event files", impl=_TRACKING + "TensorBoardTracker")
TRACKERS.declare("wandb", "Weights & Biases: pip install wandb; WANDB_MODE=offline works offline",
                 stage_one=False, impl=_TRACKING + "WandbTracker")
TRACKERS.declare("none", "metrics.jsonl alone", impl=_TRACKING + "Tracker")


# -- feature pools (cache/feature_projection.py POOLS) --------------------------------------------------------------

FEATURE_POOLS = Registry("feature pool")
FEATURE_POOLS.declare("none", "one feature row per latent token")
FEATURE_POOLS.declare("mean", "their mean over tokens")
