"""What every placement provides (`PlacementKind`), resolves to (`Placement`) and loads (`ExpertSet`, the teacher's
experts as the placement keeps them): docs/placements.md."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline import teacher_lora
from pipeline.errors import UserError
from pipeline.registries import PLACEMENTS, Entry, placement_entry
from pipeline.runtime import dist_env

from .. import placement_choice
from ..placement_choice import Inventory, Needs, TeacherSizes

if TYPE_CHECKING:
    from ..teacher import TeacherSpec

_LOADED: dict[str, PlacementKind] = {}


def of_entry(entry: Entry) -> PlacementKind:
    """The implementation of a declared placement (pipeline/registries.py names its class), made once."""
    if entry.name not in _LOADED:
        _LOADED[entry.name] = entry.load()(entry)
    return _LOADED[entry.name]


def get(name: str) -> PlacementKind:
    """The entry of a `--placement` value (a device-map .json path is the entry whose caps say `json_map`)."""
    try:
        return of_entry(placement_entry(name))
    except ValueError as e:
        raise UserError(str(e)) from None


def default_dtype(device: torch.device) -> str:
    """bfloat16 where the teacher runs on a GPU, float32 on CPU (bf16 matmuls are slow on most CPUs)."""
    return "float32" if device.type == "cpu" else "bfloat16"


def ranks_per_node() -> int:
    """torchrun processes on this node (they share its GPUs, RAM and disk); 1 without torchrun."""
    env = dist_env()
    return 1 if env.world_size == 1 else int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))


def check_ranks_fit_gpus(what: str) -> None:
    """Refuse, before any rank touches a device, more torchrun ranks on this node than visible GPUs."""
    ranks, gpus = ranks_per_node(), torch.cuda.device_count()
    if ranks > gpus:
        err = UserError(f"{ranks} torchrun ranks on this node but {gpus} GPU(s) visible: {what} runs each rank on "
                        f"its own GPU; use --nproc-per-node {gpus} or fewer (or --placement cpu)")
        err.all_ranks = True  # every rank raises it alike
        raise err


@dataclass(frozen=True)
class Placement:
    """A placement resolved for this process: what runs where, and in which order the experts run."""

    kind: str  # the registry name
    device: torch.device  # execution device: the latents live here and the model's output comes back here
    dtype: str
    expert_major: bool = False
    device_map: dict | None = None  # a device-map .json: the validated user map (values int GPU index | cpu | disk)
    map_path: str | None = None
    max_memory: dict | None = None  # balanced/sequential: accelerate max_memory
    offload_dir: Path | None = None  # disk, and maps with disk entries
    activation_bytes: int = 0  # planner's estimate for one forward of the batch: headroom left on each GPU
    reason: str = ""  # why (auto: the planner's decision)

    @property
    def name(self) -> str:
        return self.map_path or self.kind

    @property
    def entry(self) -> PlacementKind:
        return of_entry(PLACEMENTS[self.kind])

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def load_expert(self, spec: TeacherSpec, comp: str, log=print, fuse=None) -> torch.nn.Module:
        """Expert `comp` of the teacher, its weights where this placement keeps them, ready to run; `fuse` (the
        --teacher-lora LoRAs) changes the whole weights first, before any are streamed or dispatched."""
        if fuse is not None:
            self.check_fuse()
        return self.entry.load_expert(self, spec, comp, log, fuse)

    def check_fuse(self) -> None:
        """Refuse --teacher-lora in one line where this placement cannot run a teacher with LoRAs fused into it."""
        if why := self.entry.cannot_fuse(self):
            raise UserError(f"--teacher-lora with --placement {self.name}: {why}; use --placement cpu, cuda, offload "
                            "or balanced with the GPUs to hold the experts")


@dataclass(frozen=True)
class PlanInput:
    """What a placement's `layout` works from: sizes, the machine, the expert order and the user's budget."""

    sizes: TeacherSizes
    needs: Needs
    inv: Inventory
    order: str  # step | expert
    max_memory: dict | None = None
    device_map: dict | None = None

    @property
    def resident_experts(self) -> int:
        """Expert bytes resident at once: both in step-major order, one in expert-major order."""
        return sum(self.needs.experts) if self.order == "step" else max(self.needs.experts)

    @property
    def one_at_a_time(self) -> str:
        return " (one expert at a time)" if self.order == "expert" else ""


ENCODER_FREED = "freed before the transformers load"


@dataclass
class Layout:
    """Where a placement keeps each component during the trajectory loop (what `wandistiller plan` prints)."""

    where: dict[str, str]  # text_encoder and each expert -> a phrase
    resident: dict[str, int]  # device ('cpu', 'cuda:0', 'disk') -> bytes held during the loop
    streamed: int = 0  # weight bytes moved to the execution device per denoising step
    notes: list[str] = field(default_factory=list)


class PlacementKind:
    """One `--placement`, declared with its capabilities (`caps`) in pipeline/registries.py; subclasses override what
    differs (docs/placements.md, "How to add a placement")."""

    def __init__(self, entry: Entry):
        self.name, self.caps = entry.name, entry.caps

    def uses_rank_gpu(self) -> bool:
        """Whether each process computes on its own GPU (`cuda:LOCAL_RANK` under torchrun)."""
        return self.caps.gpu == "required" or self.caps.gpu == "if available" and torch.cuda.is_available()

    def validate(self, cfg) -> None:
        """Refuse what cannot run on this machine's GPUs, from the visible device count alone (CUDA not initialised)."""
        if self.caps.gpu == "required" and not torch.cuda.is_available():
            raise UserError(f"placement {self.name!r} needs a CUDA GPU and none is visible; use --placement "
                            f"{self.caps.without_gpu} (or check CUDA_VISIBLE_DEVICES and the driver)")
        if self.caps.spreads and dist_env().world_size > 1:
            raise UserError(f"placement {self.name!r} spreads one teacher over all GPUs and cannot run under "
                            "torchrun (every rank would do the same); run one process, or use --placement cuda / "
                            "offload")
        if dist_env().world_size > 1 and self.uses_rank_gpu():
            check_ranks_fit_gpus(f"placement {self.name}")

    def check(self, cfg, spec: TeacherSpec) -> None:
        """Refuse settings the placement cannot take, from the configs alone (`--dry-run` makes these checks)."""
        if cfg.max_memory is not None and not self.caps.takes_max_memory:
            raise UserError("--max-memory applies to --placement balanced or sequential only")

    def describe(self, cfg) -> str:
        """The placement as `--dry-run` prints it."""
        return f"{cfg.placement} (checked against the GPUs where it runs)"

    def execution_device(self, cfg) -> torch.device:
        """Where the transformer computes: the rank's GPU (`--device`, or LOCAL_RANK under torchrun), or the CPU."""
        if not self.uses_rank_gpu():
            return torch.device("cpu")
        env = dist_env()
        index = env.local_rank if env.world_size > 1 else cfg.device
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {index} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)

    def resolve(self, cfg, spec: TeacherSpec) -> Placement:
        """The `Placement` of this run: device, dtype and expert order, measured against this machine."""
        extra = self.fields(cfg, spec)
        device = extra.pop("device", None) or self.execution_device(cfg)
        dtype = cfg.dtype or default_dtype(device)
        needs, inv = measure(cfg, spec, dtype, gpus=device.type == "cuda")
        return self.placement(cfg, spec, device, dtype, self.expert_order(needs, inv), needs.activations, **extra)

    def fields(self, cfg, spec: TeacherSpec) -> dict:
        """Extra `Placement` fields (and `device`, to override `execution_device`) from the config."""
        return {}

    def placement(self, cfg, spec: TeacherSpec, device: torch.device, dtype: str, order: str, activations: int,
                  **extra) -> Placement:
        """The record, with the user's `--expert-order` over the placement's own choice."""
        if cfg.expert_order != "auto":
            order = cfg.expert_order
        return Placement(self.name, device, dtype, expert_major=len(spec.experts) > 1 and order == "expert",
                         offload_dir=offload_dir(cfg), activation_bytes=activations, **extra)

    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        """`step`, or `expert` when the placement's memory tier cannot hold both experts at once."""
        return "step"

    def load_expert(self, p: Placement, spec: TeacherSpec, comp: str, log=print, fuse=None) -> torch.nn.Module:
        """Expert `comp`, its weights where the placement keeps them (by default all on the execution device), `fuse`
        applied to the whole weights first (ExpertSet: the --teacher-lora LoRAs)."""
        from diffusers import WanTransformer3DModel

        m = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp, torch_dtype=p.torch_dtype,
                                                     use_safetensors=True)
        return (fuse or (lambda x: x))(m).to(p.device).eval().requires_grad_(False)

    def cannot_fuse(self, p: Placement) -> str | None:
        """Why this placement cannot run a teacher with LoRAs fused into it (None: it can)."""
        return None

    def layout(self, x: PlanInput) -> Layout:
        raise NotImplementedError


def offload_dir(cfg) -> Path:
    return Path(cfg.offload_dir) if cfg.offload_dir else Path(cfg.out) / "offload"


def measure(cfg, spec: TeacherSpec, dtype: str, gpus: bool) -> tuple[Needs, Inventory]:
    """What the teacher needs at `dtype` for this run's batch, and what this machine has (GPUs only if asked)."""
    sizes = placement_choice.teacher_sizes(spec.path, dtype)
    act = placement_choice.activation_bytes(sizes, cfg)
    return Needs.of(sizes, act, cfg.batch_size), Inventory.measure(offload_dir(cfg), ranks_per_node(), gpus=gpus)


def load_experts(spec: TeacherSpec, placement: Placement, log=print, prepare=None, teacher_loras=()) -> ExpertSet:
    """The transformer(s) in expert order: all now in step-major order, each as `activate` asks in expert-major;
    `teacher_loras` (pipeline/teacher_lora.py) fused into each expert as it loads."""
    experts = ExpertSet(spec, placement, log, prepare, teacher_loras)
    if not placement.expert_major:
        experts.activate(None)
    return experts


class ExpertSet:
    """The experts of one placement, indexed like a list; `activate((2,))` frees expert 1 before loading expert 2."""

    def __init__(self, spec: TeacherSpec, placement: Placement, log=print, prepare=None, teacher_loras=()):
        self.spec, self.placement, self.log = spec, placement, log
        self.teacher_loras = list(teacher_loras)
        self.device = placement.device  # where a released expert's memory is handed back
        self.models: list[torch.nn.Module | None] = [None] * len(spec.experts)
        self.prepare = prepare or (lambda model: model)  # the speed options, as each expert loads (speed.py)
        self.on_load = None  # called with each expert once prepared (the compile warm-up of make_cache)

    def __len__(self) -> int:
        return len(self.models)

    def __getitem__(self, i: int) -> torch.nn.Module:
        m = self.models[i]
        if m is None:
            raise RuntimeError(f"expert {i + 1} is not loaded (expert-major order: activate it first)")
        return m

    def activate(self, experts: tuple[int, ...] | None) -> None:
        """Make exactly `experts` (1-based; None = all) resident, releasing the others first."""
        want = set(range(1, len(self.models) + 1)) if experts is None else set(experts)
        released = [e for e in range(len(self.models)) if e + 1 not in want and self.models[e] is not None]
        for e in released:
            self.models[e] = None
        if released:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        for e in sorted(want):
            if self.models[e - 1] is None:
                fuse = ((lambda m, e=e: teacher_lora.fuse(m, self.teacher_loras, e))
                        if self.teacher_loras else None)
                m = self.prepare(self.placement.load_expert(self.spec, self.spec.experts[e - 1], self.log, fuse))
                self.models[e - 1] = m
                if self.on_load is not None:
                    self.on_load(m)

    def close(self) -> None:
        self.activate(())
