"""accelerate device maps: `--placement balanced`, `sequential` and a JSON map (`--placement my-map.json`), each
transformer dispatched at model level, `WanTransformerBlock` never split (docs/placements.md).
"""

from __future__ import annotations

import reprlib
import shutil
import warnings
from pathlib import Path

import torch

from pipeline.config_types import read_object
from pipeline.errors import UserError
from pipeline.runtime import dist_env, print0

from ..group_offload import meta_transformer, param_dtypes
from ..placement_choice import Inventory, Needs, expert_pieces, fits_across, gib, parse_size
from .base import ENCODER_FREED, Layout, Placement, PlacementKind, PlanInput


def parse_max_memory(text: str | None) -> dict | None:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> accelerate's max_memory {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'}."""
    if not text:
        return None
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
    """A JSON device map -> (accelerate map, main device); `check_devices=False`: planned for another machine."""
    p = Path(path)
    fix = "pass a JSON file mapping module prefixes to \"cuda:N\", \"cpu\" or \"disk\" (see docs/placements.md)"
    raw = read_object(p, "device map", fix)  # (a FIFO refused, never waited on; the size and the nesting capped)
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"device map {p} must be a non-empty JSON object {{module prefix: device}}")
    out, gpus = {}, []
    for key, value in raw.items():
        v = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
        num = v.removeprefix("cuda:")
        if v in ("cpu", "disk"):
            out[key] = v
        elif num.isascii() and num.isdigit() and len(num) <= 4 and (v.startswith("cuda:") or isinstance(value, int)):
            idx, key_text = int(num), reprlib.repr(key)
            if check_devices and not torch.cuda.is_available():
                raise UserError(f"device map {p} puts {key_text} on {value!r} but no CUDA GPU is visible; use cpu "
                                "or disk entries only")
            if check_devices and idx >= torch.cuda.device_count():
                raise UserError(f"device map {p} puts {key_text} on cuda:{idx}; {torch.cuda.device_count()} GPU(s) "
                                "visible")
            out[key] = idx
            gpus.append(idx)
        else:
            raise UserError(f"device map {p}: {reprlib.repr(key)} -> {reprlib.repr(value)} is not a device; use "
                            "\"cuda:N\", \"cpu\" or \"disk\"")
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
    missing = sorted({".".join(n.split(".")[:2 if n.startswith("blocks.") else 1]) for n in params if not covered(n)})
    if missing:
        raise UserError(f"device map {source}: no device for module(s) {', '.join(missing[:8])}"
                        f"{' ...' if len(missing) > 8 else ''}; every module needs an entry ({hint})")


def device_map_for(model: torch.nn.Module, evens: bool, max_memory: dict, dtype: torch.dtype) -> dict:
    """accelerate's map of one transformer over `max_memory`, blocks never split, evened over the GPUs or not."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or ["WanTransformerBlock"])
    special = {n: d for n, d in param_dtypes(model, dtype).items() if d != dtype}
    if evens:
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         dtype=dtype, special_dtypes=special)
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
                                 special_dtypes=special)


def map_bytes(model: torch.nn.Module, device_map: dict, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each device of `device_map` holds (keys 'cuda:N', 'cpu', 'disk')."""
    dtypes = param_dtypes(model, dtype)
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        dev = device_map[key]
        dev = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
        out[dev] = out.get(dev, 0) + p.numel() * dtypes[name].itemsize
    return out


class _DeviceMapPlacement(PlacementKind):
    """Shared by the three: each expert's map (`device_map`; `plan_map` for `plan`), dispatched by diffusers."""

    def load_expert(self, p, spec, comp, log=print, fuse=None):
        from diffusers import WanTransformer3DModel

        dmap = self.device_map(p, meta_transformer(spec.path, comp, real_buffers=False))
        if fuse is not None and (off := sorted({str(v) for v in dmap.values() if v in ("cpu", "disk")})):
            raise UserError(f"--teacher-lora with --placement {p.name}: the map keeps part of {comp} on "
                            f"{' and '.join(off)}, where accelerate holds weights a fused LoRA cannot change; give "
                            "the GPUs room for the experts (--max-memory), or use --placement offload")
        folder = None
        if "disk" in dmap.values():
            # accelerate names its files after the parameters alone: one folder per expert (and per rank).
            folder = p.offload_dir / f"{comp}-devicemap-rank{dist_env().rank}"
            shutil.rmtree(folder, ignore_errors=True)  # rewritten at every load: never stale
        with warnings.catch_warnings():  # keys naming loose parameters (scale_shift_table) are fine, not modules
            warnings.filterwarnings("ignore", message="The following device_map keys do not match")
            m = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp, torch_dtype=p.torch_dtype,
                                                      device_map=dmap, use_safetensors=True,
                                                      offload_folder=None if folder is None else str(folder))
        return (fuse or (lambda x: x))(m).eval().requires_grad_(False)

    def layout(self, x: PlanInput) -> Layout:
        dtype = getattr(torch, x.sizes.dtype)
        model = meta_transformer(Path(x.sizes.path), x.sizes.experts[0], real_buffers=False)
        dmap = self.plan_map(model, x, dtype)
        per_dev = map_bytes(model, dmap, dtype)
        copies = len(x.sizes.experts) if x.order == "step" else 1
        resident = {d: b * copies for d, b in per_dev.items() if d != "disk"}
        main = min((d for d in per_dev if d.startswith("cuda")), default="cpu")
        resident[main] = resident.get(main, 0) + x.needs.activations
        spill = per_dev.get("cpu", 0) + per_dev.get("disk", 0) if main != "cpu" else per_dev.get("disk", 0)
        summary = ", ".join(f"{d} {gib(b)}" for d, b in per_dev.items())
        where = {"text_encoder": f"{main}, {ENCODER_FREED}"} | {e: summary + x.one_at_a_time for e in x.sizes.experts}
        notes = [f"{gib(spill)} of each expert sits on cpu/disk and is moved to the GPU at every forward"] if spill else []
        return Layout(where, resident, spill, notes)


class _GpuSpread(_DeviceMapPlacement):
    """balanced / sequential: accelerate's map over the visible GPUs, the load evened over them or not."""

    evens: bool

    def check(self, cfg, spec) -> None:
        super().check(cfg, spec)
        parse_max_memory(cfg.max_memory)

    def fields(self, cfg, spec) -> dict:
        return {"max_memory": parse_max_memory(cfg.max_memory)}

    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        if len(needs.experts) < 2 or not inv.gpus:
            return "step"
        caps = [inv.usable_gpu(i) - needs.activations for i in range(len(inv.gpus))]
        return "step" if fits_across(expert_pieces(needs, 2), caps) else "expert"

    @staticmethod
    def max_memory(given: dict | None, inv: Inventory, activations: int) -> dict:
        """--max-memory, by default each GPU's usable memory less the activation headroom, and the usable RAM."""
        mm = dict(given or {i: max(inv.usable_gpu(i) - activations, 0) for i in range(len(inv.gpus))})
        mm.setdefault("cpu", inv.usable_ram)
        return mm

    def device_map(self, p: Placement, meta: torch.nn.Module) -> dict:
        max_memory = p.max_memory or self.max_memory(None, Inventory.measure(p.offload_dir), p.activation_bytes)
        dmap = device_map_for(meta, self.evens, max_memory, p.torch_dtype)
        spill = sorted({str(v) for v in dmap.values() if v in ("cpu", "disk")})
        if spill:
            print0(f"note: {self.name}: part of the transformer does not fit the GPUs within --max-memory and runs "
                   f"from {' and '.join(spill)} (streamed at every forward); see `wandistiller plan`")
        if "disk" in dmap.values() and p.offload_dir is None:
            raise UserError(f"{self.name}: the device map needs disk offload; pass --offload-dir")
        return dmap

    def plan_map(self, model, x, dtype):
        return device_map_for(model, self.evens, self.max_memory(x.max_memory, x.inv, x.needs.activations), dtype)


class Balanced(_GpuSpread):
    evens = True


class Sequential(_GpuSpread):
    evens = False


class DeviceMap(_DeviceMapPlacement):
    """`--placement my-map.json`: the user's map, applied to each expert."""

    def validate(self, cfg) -> None:
        super().validate(cfg)
        read_device_map(cfg.placement)  # its GPUs exist here

    def check(self, cfg, spec) -> None:
        super().check(cfg, spec)
        dmap = read_device_map(cfg.placement, check_devices=False)[0]
        for comp in spec.experts:  # before anything runs: a typo should not cost the encoding pass
            check_device_map(meta_transformer(spec.path, comp, real_buffers=False), dmap, cfg.placement)

    def describe(self, cfg) -> str:
        dmap, main = read_device_map(cfg.placement, check_devices=False)
        return (f"{cfg.placement} (a device map of {len(dmap)} entries, computing on {main}; its devices checked "
                "against the GPUs where it runs)")

    def fields(self, cfg, spec) -> dict:
        dmap, main = read_device_map(cfg.placement)
        return {"device": torch.device(main), "device_map": dmap, "map_path": cfg.placement}

    def device_map(self, p: Placement, meta: torch.nn.Module) -> dict:
        check_device_map(meta, p.device_map, p.map_path)
        return p.device_map

    def plan_map(self, model, x, dtype):
        check_device_map(model, x.device_map, "given")
        return x.device_map
