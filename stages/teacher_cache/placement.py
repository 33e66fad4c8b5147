"""Where the teacher's weights live while stage one runs, and loading them there.

This module owns the `--placement` choices (docs/placements.md says when to use which):

- `cpu`: a whole replica in RAM, run on the CPU. `cuda`: a whole replica on one GPU (under torchrun one
  replica per GPU; the parts split the prompts).
- `balanced` / `sequential`: each transformer spread over the visible GPUs by an accelerate device map,
  `WanTransformerBlock` never split, within `--max-memory`; diffusers dispatches the model.
- `path/to/map.json`: your own device map (module prefix -> `cuda:N` | `cpu` | `disk`), checked against the
  model's module names.
- `offload`: weights in CPU RAM, streamed block by block to the GPU (diffusers group offloading, next block
  prefetched on a CUDA stream); the text encoder is offloaded at model level.
- `disk`: weights streamed from `--offload-dir`, one folder per expert tied to the weights (offload.py).
- `auto`: the planner's pick for the measured machine (planner.py).

Numerics do not depend on the placement (the fingerprint leaves it out): every placement runs the same
modules on the same dtype; only where the weights sit between forwards changes.
"""

from __future__ import annotations

import gc
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.runtime import dist_env

from .teacher import TeacherSpec

AVAILABLE = ("auto", "cpu", "cuda", "balanced", "sequential", "offload", "disk")
GPU_ONLY = ("cuda", "balanced", "sequential")
EXPERT_ORDERS = ("auto", "step", "expert")
# Expert-major order holds a window of blocks' records in RAM until the low-noise expert has run them;
# the window is as many blocks as fit in this budget (at least one).
EXPERT_MAJOR_RECORD_BUDGET = 2 * 2**30


@dataclass(frozen=True)
class Placement:
    """A concrete placement for this process: what runs where, and in which order the experts run."""

    kind: str  # cpu | cuda | balanced | sequential | map | offload | disk
    device: torch.device  # execution device: the latents live here and the model's output comes back here
    dtype: str
    expert_major: bool = False
    device_map: dict | None = None  # kind "map": the validated user map (values int GPU index | cpu | disk)
    map_path: str | None = None
    max_memory: dict | None = None  # balanced/sequential: accelerate max_memory
    offload_dir: Path | None = None  # disk, and maps with disk entries
    activation_bytes: int = 0  # planner's estimate for one forward of the batch: headroom left on each GPU
    reason: str = ""  # why (auto: the planner's decision)

    @property
    def name(self) -> str:
        return self.map_path if self.kind == "map" else self.kind


def resolve_placement(placement: str) -> str:
    """The concrete placement name for this machine; clear errors for what cannot run here.

    `auto` resolves in `choose_placement` (it needs the teacher's sizes); here it stays `auto`.
    """
    if placement.endswith(".json"):
        return placement
    if placement not in AVAILABLE:
        raise UserError(f"unknown placement {placement!r}; use one of {', '.join(AVAILABLE)} or a device-map "
                        ".json file")
    if placement in GPU_ONLY and not torch.cuda.is_available():
        alt = "cpu" if placement == "cuda" else "offload or disk (or cpu)"
        raise UserError(f"placement {placement!r} needs a CUDA GPU and none is visible; use --placement {alt} "
                        "(or check CUDA_VISIBLE_DEVICES and the driver)")
    if placement in ("balanced", "sequential") and dist_env().world_size > 1:
        raise UserError(f"placement {placement!r} spreads one teacher over all GPUs and cannot run under torchrun "
                        "(every rank would do the same); run one process, or use --placement cuda / offload")
    return placement


def execution_device(placement: str, device_index: int) -> torch.device:
    """Where the transformer computes: the CPU for `cpu` (and for offload/disk without CUDA), else a GPU
    (under torchrun, the rank's own GPU)."""
    if placement == "cpu" or not torch.cuda.is_available() and placement in ("offload", "disk", "auto"):
        return torch.device("cpu")
    env = dist_env()
    if env.world_size > 1:
        device_index = env.local_rank
    if device_index >= torch.cuda.device_count():
        raise UserError(f"--device {device_index} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", device_index)


def default_dtype(placement: str, device: torch.device | None = None) -> str:
    """bfloat16 where the teacher runs on a GPU, float32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if device is not None:
        return "float32" if device.type == "cpu" else "bfloat16"
    return "float32" if placement == "cpu" or not torch.cuda.is_available() else "bfloat16"


# The seed script's flags, still accepted: (flag, value) -> the settings they stand for.
_LEGACY_STRATEGY = {"cpu": {"placement": "cpu"}, "balanced": {"placement": "balanced"},
                    "gpu0": {"placement": "cuda", "device": 0}, "auto": {"placement": "auto"}}


def legacy_flags(flags: dict) -> list[str]:
    """Fold the seed script's --teacher_on_cpu / --teacher_device_strategy / --teacher_dtype into `flags`
    (in place); returns one deprecation note per flag used. Conflicting new flags are a UserError."""
    notes, implied = [], {}
    if flags.pop("teacher_on_cpu", None):
        notes.append("note: --teacher_on_cpu is deprecated; use --placement cpu")
        implied["placement"] = ("cpu", "--teacher_on_cpu")
    strategy = flags.pop("teacher_device_strategy", None)
    if strategy is not None:
        new = _LEGACY_STRATEGY[strategy]
        extra = " --device 0" if "device" in new else ""
        notes.append(f"note: --teacher_device_strategy is deprecated; use --placement {new['placement']}{extra}")
        for k, v in new.items():
            implied[k] = (v, f"--teacher_device_strategy {strategy}")
    dtype = flags.pop("teacher_dtype", None)
    if dtype is not None:
        notes.append(f"note: --teacher_dtype is deprecated; use --dtype {dtype}")
        implied["dtype"] = (dtype, "--teacher_dtype")
    for key, (value, source) in implied.items():
        if flags.get(key) is not None and flags[key] != value:
            raise UserError(f"{source} (= --{key} {value}) contradicts --{key} {flags[key]}; drop the deprecated flag")
        flags[key] = value
    return notes


def parse_max_memory(text: str | None) -> dict | None:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> accelerate's max_memory {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'}."""
    if not text:
        return None
    from .planner import parse_size

    out: dict = {}
    for item in text.split(","):
        key, sep, size = item.partition("=")
        key = key.strip().lower().removeprefix("cuda:")
        if not sep or not (key.isdigit() or key in ("cpu", "disk")):
            raise UserError(f"cannot read --max-memory item {item!r}; write it like \"0=70GiB,1=70GiB,cpu=200GiB\"")
        parse_size(size)
        out[int(key) if key.isdigit() else key] = size.strip()
    gpus = [k for k in out if isinstance(k, int)]
    if torch.cuda.is_available() and any(k >= torch.cuda.device_count() for k in gpus):
        raise UserError(f"--max-memory names GPU {max(gpus)} but {torch.cuda.device_count()} are visible")
    return out


def read_device_map(path: str, check_devices: bool = True) -> tuple[dict, str]:
    """Load a JSON device map: {module prefix: "cuda:N" | "cpu" | "disk"} -> (accelerate map, its main device).

    `check_devices=False` (planning for another machine) skips the check that the GPUs exist here."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"device map {p} does not exist; pass a JSON file mapping module prefixes to "
                        "\"cuda:N\", \"cpu\" or \"disk\" (see docs/placements.md)")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"device map {p} is not valid JSON ({e})") from e
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"device map {p} must be a non-empty JSON object {{module prefix: device}}")
    out, gpus = {}, []
    for key, value in raw.items():
        v = str(value).strip().lower()
        if v in ("cpu", "disk"):
            out[key] = v
        elif v.removeprefix("cuda:").isdigit() and (v.startswith("cuda:") or isinstance(value, int)):
            idx = int(v.removeprefix("cuda:"))
            if check_devices and not torch.cuda.is_available():
                raise UserError(f"device map {p} puts {key!r} on {value!r} but no CUDA GPU is visible; use cpu "
                                "or disk entries only")
            if check_devices and idx >= torch.cuda.device_count():
                raise UserError(f"device map {p} puts {key!r} on cuda:{idx}; {torch.cuda.device_count()} GPU(s) visible")
            out[key] = idx
            gpus.append(idx)
        else:
            raise UserError(f"device map {p}: {key!r} -> {value!r} is not a device; use \"cuda:N\", \"cpu\" or \"disk\"")
    return out, (f"cuda:{min(gpus)}" if gpus else "cpu")


def check_device_map(model: torch.nn.Module, device_map: dict, source: str) -> None:
    """Every key names a module (or parameter) of `model`, and every parameter is covered exactly once."""
    modules = {n for n, _ in model.named_modules()}
    params = [n for n, _ in model.named_parameters()]
    known = modules | set(params) | {n for n, _ in model.named_buffers()}
    tops = sorted({n.split(".")[0] for n in known if n})
    nblocks = len(getattr(model, "blocks", []))
    hint = f"valid prefixes: {', '.join(tops)}, blocks.0 .. blocks.{nblocks - 1}"
    unknown = [k for k in device_map if k not in known]
    if unknown:
        raise UserError(f"device map {source}: unknown module(s) {', '.join(map(repr, unknown[:5]))} "
                        f"(not in {type(model).__name__}); {hint}")
    on_disk = [k for k, v in device_map.items() if v == "disk" and k not in modules]
    if on_disk:
        raise UserError(f"device map {source}: {', '.join(map(repr, on_disk))} is a parameter, not a module; "
                        "accelerate can put a loose parameter on a GPU or the cpu, not on disk")
    keys = sorted(device_map)
    for a in keys:
        for b in keys:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise UserError(f"device map {source}: {a!r} and {b!r} overlap; give each module one device")
    covered = lambda n: any(k == "" or n == k or n.startswith(k + ".") for k in device_map)  # noqa: E731
    missing = sorted({_prefix(n, nblocks) for n in params if not covered(n)})
    if missing:
        raise UserError(f"device map {source}: no device for module(s) {', '.join(missing[:8])}"
                        f"{' ...' if len(missing) > 8 else ''}; every module needs an entry ({hint})")


def _prefix(param: str, nblocks: int) -> str:
    parts = param.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def choose_placement(cfg, spec: TeacherSpec) -> Placement:
    """The placement this process runs with: the user's, checked, or (auto) the planner's pick."""
    from . import offload, planner

    name = resolve_placement(cfg.placement)
    offload_dir = Path(cfg.offload_dir) if cfg.offload_dir else Path(cfg.out) / "offload"
    max_memory = parse_max_memory(cfg.max_memory)
    if max_memory is not None and name not in ("balanced", "sequential", "auto"):
        raise UserError("--max-memory applies to --placement balanced or sequential only")
    expert_order = getattr(cfg, "expert_order", "auto")
    if expert_order not in EXPERT_ORDERS:
        raise UserError(f"--expert-order must be one of {', '.join(EXPERT_ORDERS)}, got {expert_order!r}")
    if name.endswith(".json"):
        dmap, main = read_device_map(name)
        for comp in spec.experts:  # before anything runs: a typo should not cost the encoding pass
            check_device_map(offload.meta_transformer(spec.path, comp, real_buffers=False), dmap, name)
        device = torch.device(main)
        kind = "map"
    else:
        kind, dmap = name, None
        device = execution_device(name, cfg.device)
    dtype = cfg.dtype or default_dtype(name, device)
    env = dist_env()
    sizes = planner.teacher_sizes(spec.path, dtype)
    act = planner.activation_bytes(sizes, cfg.batch_size, cfg.height, cfg.width, cfg.frames, cfg.guidance > 1.0,
                                   cfg.max_sequence_length)
    needs = planner.Needs.of(sizes, act)
    inv = planner.Inventory.measure(offload_dir, int(_local_world()) if env.world_size > 1 else 1)
    reason = ""
    if kind == "auto":
        if max_memory is not None:
            raise UserError("--max-memory needs --placement balanced or sequential (auto picks its own budget)")
        d = planner.decide(needs, inv)
        kind, order, reason = d.placement, d.expert_order, "; ".join(d.reasons)
        if env.world_size > 1 and kind == "balanced":  # decide() never picks it under torchrun; belt and braces
            kind = "offload"
        device = execution_device(kind, cfg.device)
        if cfg.dtype is None and default_dtype(kind, device) != dtype:
            dtype = default_dtype(kind, device)
    else:
        order = planner.expert_order_for(kind, needs, inv)
    if expert_order != "auto":
        order = expert_order
    two = len(spec.experts) > 1
    return Placement(kind, device, dtype, expert_major=two and order == "expert", device_map=dmap,
                     map_path=name if kind == "map" else None, max_memory=max_memory, offload_dir=offload_dir,
                     activation_bytes=act, reason=reason)


def _local_world() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def expert_window(batch_size: int, steps: int, latent_numel: int, dtype_bytes: int, keep_cond_uncond: bool) -> int:
    """Blocks run together in expert-major order: as many as keep their records within the budget."""
    per_block = batch_size * steps * latent_numel * dtype_bytes * (4 if keep_cond_uncond else 2)
    return max(1, EXPERT_MAJOR_RECORD_BUDGET // max(per_block, 1))


# --- loading ---------------------------------------------------------------------------------------------------

def load_text_encoder(spec: TeacherSpec, dtype: torch.dtype, device: torch.device,
                      placement: Placement | None = None):
    """Tokenizer and UMT5 encoder on `device`. T5 overflows in float16, so float16 runs it in bfloat16.

    With `offload` and `disk` the encoder stays in CPU RAM and accelerate moves it to the GPU as a whole for
    each forward (model-level offload): the GPU is left to the transformer blocks.
    """
    from transformers import AutoTokenizer, UMT5EncoderModel

    enc_dtype = torch.bfloat16 if dtype == torch.float16 else dtype
    tokenizer = AutoTokenizer.from_pretrained(spec.path, subfolder="tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(spec.path, subfolder="text_encoder", dtype=enc_dtype)
    encoder = encoder.eval().requires_grad_(False)
    if placement is not None and placement.kind in ("offload", "disk") and device.type == "cuda":
        from accelerate import cpu_offload_with_hook

        encoder, _ = cpu_offload_with_hook(encoder, device)
        return tokenizer, encoder
    return tokenizer, encoder.to(device)


def load_experts(spec: TeacherSpec, dtype: torch.dtype, device: torch.device,
                 placement: Placement | None = None, log=print) -> ExpertSet:
    """The transformer(s) in expert order (1 = high-noise `transformer`, 2 = low-noise `transformer_2`).

    Step-major placements load every expert now; expert-major ones load each when `activate` asks for it.
    The returned set indexes like a list of models (`experts[0]` is expert 1).
    """
    if placement is None:
        placement = Placement("cpu" if device.type == "cpu" else "cuda", device, str(dtype).removeprefix("torch."))
    experts = ExpertSet(spec, placement, dtype, log)
    if not placement.expert_major:
        experts.activate(None)
    return experts


class ExpertSet:
    """The experts under one placement. `models[i]` is expert i+1 once loaded, else None.

    In expert-major order only the experts asked for are resident: `activate((2,))` frees expert 1 before it
    loads expert 2, so peak memory is one expert.
    """

    def __init__(self, spec: TeacherSpec, placement: Placement, dtype: torch.dtype, log=print):
        self.spec, self.placement, self.dtype, self.log = spec, placement, dtype, log
        self.models: list[torch.nn.Module | None] = [None] * len(spec.experts)

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
        for e in range(1, len(self.models) + 1):
            if e not in want:
                self.release(e)
        for e in sorted(want):
            if self.models[e - 1] is None:
                self.models[e - 1] = self._load(self.spec.experts[e - 1])

    def release(self, expert: int) -> None:
        if self.models[expert - 1] is None:
            return
        self.models[expert - 1] = None
        gc.collect()
        if self.placement.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        for e in range(1, len(self.models) + 1):
            self.release(e)

    def _load(self, comp: str) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        from . import offload

        p, spec, dtype = self.placement, self.spec, self.dtype
        if p.kind in ("cpu", "cuda"):
            m = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp, torch_dtype=dtype)
            return m.to(p.device).eval().requires_grad_(False)
        if p.kind == "offload":
            return offload.load_ram_expert(spec, comp, dtype, p.device)
        if p.kind == "disk":
            return offload.load_disk_expert(spec, comp, dtype, p.device, p.offload_dir, self.log)
        # balanced / sequential / map: accelerate device map at model level; diffusers dispatches.
        meta = offload.meta_transformer(spec.path, comp, real_buffers=False)
        if p.kind == "map":
            check_device_map(meta, p.device_map, p.map_path)
            dmap = p.device_map
        else:
            dmap = _gpu_device_map(meta, p, dtype)
        folder = None
        if "disk" in dmap.values():
            # accelerate names its files after the parameters alone: one folder per expert (and per rank).
            folder = p.offload_dir / f"{comp}-devicemap-rank{dist_env().rank}"
            shutil.rmtree(folder, ignore_errors=True)  # rewritten at every load: never stale
        with warnings.catch_warnings():  # keys naming loose parameters (scale_shift_table) are fine, not modules
            warnings.filterwarnings("ignore", message="The following device_map keys do not match")
            m = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp, torch_dtype=dtype, device_map=dmap,
                                                      offload_folder=None if folder is None else str(folder))
        return m.eval().requires_grad_(False)


def _gpu_device_map(meta: torch.nn.Module, p: Placement, dtype: torch.dtype) -> dict:
    """balanced / sequential: accelerate's map over the visible GPUs within --max-memory (default: measured
    free memory less the activation headroom)."""
    from . import planner

    max_memory = p.max_memory
    if max_memory is None:
        inv = planner.Inventory.measure(p.offload_dir)
        max_memory = {i: max(inv.usable_gpu(i) - p.activation_bytes, 0) for i in range(len(inv.gpus))}
        max_memory["cpu"] = inv.usable_ram
    dmap = planner.device_map_for(meta, p.kind, max_memory, dtype)
    spill = sorted({str(v) for v in dmap.values() if v in ("cpu", "disk")})
    if spill:
        print(f"note: {p.kind}: part of the transformer does not fit the GPUs within --max-memory and runs from "
              f"{' and '.join(spill)} (streamed at every forward); see `wandistiller plan`")
    if "disk" in dmap.values() and p.offload_dir is None:
        raise UserError(f"{p.kind}: the device map needs disk offload; pass --offload-dir")
    return dmap


def load_scheduler(spec: TeacherSpec):
    """The teacher's own scheduler class and config (UniPC flow for the released Wan 2.x pipelines)."""
    import diffusers

    cls_name = spec.configs["scheduler"].get("_class_name")
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise UserError(f"teacher scheduler class {cls_name!r} is unknown to diffusers {diffusers.__version__}")
    return cls.from_pretrained(spec.path, subfolder="scheduler")

