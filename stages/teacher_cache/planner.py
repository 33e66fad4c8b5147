"""The placement planner: what the teacher needs, what the machine has, and where the weights should live.

Everything here works from configs alone: models are instantiated on the meta device (accelerate
`init_empty_weights`), so a folder holding only the JSON configs of Wan2.2-T2V-A14B can be planned on a
laptop. Checkpoint sizes come from safetensors headers when weight files are present.

The decision (`decide`) is a pure function of the sizes and a device `Inventory`, so tests feed it made-up
machines. Its rules, in order (the first that fits wins):

1. a replica (every expert) fits one GPU with margin        -> cuda (under torchrun: one replica per GPU)
   one expert fits one GPU, two do not                      -> cuda, expert-major order
2. the experts fit across the visible GPUs, blocks unsplit  -> balanced (expert-major if only one expert fits)
3. the experts fit in host RAM and a block fits the GPU     -> offload (expert-major if only one fits)
4. otherwise the weights are streamed from disk             -> disk
Without a GPU: the experts fit in RAM -> cpu (expert-major if only one fits), else disk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline.errors import UserError

GiB = 2**30
# Kept free on every GPU: CUDA context, allocator fragmentation, cuBLAS workspaces.
GPU_RESERVE = int(1.5 * GiB)
GPU_MARGIN = 0.08  # fraction of a GPU's memory kept free on top of the reserve
RAM_MARGIN = 0.15  # fraction of available RAM kept for the rest of the process (records, zarr, Python)
ACTIVATION_SAFETY = 1.25  # the activation estimate below is a count of the large tensors only
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'24GiB', '80GB', '512MiB', '2TiB' or a byte count -> bytes (GB = 10^9, GiB = 2^30, as accelerate)."""
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise UserError(f"cannot read the size {text!r}; write it like 24GiB, 80GB, 512MiB or 2TiB")
    return int(value * _UNITS[unit])


# --- the machine ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inventory:
    """Free memory of each visible GPU, available host RAM and free disk where the offload folder goes."""

    gpus: tuple[int, ...] = ()  # free bytes per visible GPU
    gpu_total: tuple[int, ...] = ()  # total bytes per GPU (for the margin); empty: same as free
    ram: int = 0  # available host RAM, bytes
    disk: int = 0  # free bytes under the offload directory
    ranks_per_node: int = 1  # torchrun processes on this node (they share its RAM and disk)
    source: str = "measured"

    @classmethod
    def measure(cls, offload_dir: str | os.PathLike | None = None, ranks_per_node: int = 1) -> Inventory:
        gpus, totals = [], []
        if torch.cuda.is_available():
            for d in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(d)
                gpus.append(int(free))
                totals.append(int(total))
        return cls(tuple(gpus), tuple(totals), _available_ram(), _free_disk(offload_dir), ranks_per_node)

    @classmethod
    def assume(cls, gpus: str | None, ram: str | None, disk: str | None, ranks_per_node: int = 1,
               measured: Inventory | None = None) -> Inventory:
        """A made-up machine for `plan`: gpus '4x24GiB' or '80GiB,40GiB' or 'none'; unset parts are measured."""
        base = measured or cls.measure()
        g, t = base.gpus, base.gpu_total
        if gpus is not None:
            g = _parse_gpus(gpus)
            t = g
        return cls(g, t, parse_size(ram) if ram else base.ram, parse_size(disk) if disk else base.disk,
                   ranks_per_node, "assumed" if (gpus or ram or disk) else base.source)

    def usable_gpu(self, i: int) -> int:
        total = self.gpu_total[i] if i < len(self.gpu_total) else self.gpus[i]
        return max(self.gpus[i] - GPU_RESERVE - int(GPU_MARGIN * total), 0)

    @property
    def usable_ram(self) -> int:
        """RAM one rank may fill with weights."""
        return int(self.ram * (1 - RAM_MARGIN)) // max(self.ranks_per_node, 1)

    @property
    def usable_disk(self) -> int:
        return int(self.disk * 0.95) // max(self.ranks_per_node, 1)

    def describe(self) -> str:
        gpus = ", ".join(gib(f) for f in self.gpus) if self.gpus else "none"
        ranks = f"; {self.ranks_per_node} ranks per node" if self.ranks_per_node > 1 else ""
        return f"GPUs free: {gpus}; RAM available {gib(self.ram)}; disk free {gib(self.disk)}{ranks} ({self.source})"


def _parse_gpus(text: str) -> tuple[int, ...]:
    text = text.strip().lower()
    if text in ("", "none", "0"):
        return ()
    if "x" in text and "," not in text:
        n, size = text.split("x", 1)
        if not n.strip().isdigit():
            raise UserError(f"cannot read --assume-gpus {text!r}; write e.g. 4x24GiB or 80GiB,40GiB")
        return (parse_size(size),) * int(n)
    return tuple(parse_size(s) for s in text.split(","))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _free_disk(path: str | os.PathLike | None) -> int:
    p = Path(path or ".").resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


# --- the teacher ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Component:
    """One component of the teacher, measured on the meta device."""

    name: str
    cls: str
    params: int
    bytes: int  # at the run dtype (parts diffusers keeps in float32 counted in float32)
    blocks: int = 0  # transformer blocks (WanTransformerBlock), 0 for other components
    block_bytes: int = 0  # the largest block
    checkpoint_bytes: int | None = None  # tensor bytes in the safetensors files, None without weights
    checkpoint_dtype: str | None = None

    @property
    def other_bytes(self) -> int:
        """Weights outside the blocks (embeddings, time projection, output head)."""
        return self.bytes - self.blocks * self.block_bytes


@dataclass(frozen=True)
class TeacherSizes:
    path: str
    dtype: str
    components: dict[str, Component]
    experts: tuple[str, ...]
    transformer_config: dict
    vae_spatial: int
    vae_temporal: int


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except FileNotFoundError as e:
        raise UserError(f"{p} is missing; the planner needs the teacher's model_index.json and component "
                        "configs (weights are optional)") from e
    except json.JSONDecodeError as e:
        raise UserError(f"{p} is not valid JSON ({e})") from e


def _checkpoint(folder: Path) -> tuple[int | None, str | None]:
    """Tensor bytes and dtype(s) from the safetensors headers of `folder` (data is not read)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None, None
    width = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}
    total, dtypes = 0, set()
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                dtypes.add(sl.get_dtype())
                total += math.prod(sl.get_shape()) * width.get(sl.get_dtype(), 4)
    return total, "+".join(sorted(dtypes))


def teacher_sizes(path: str | os.PathLike, dtype: str) -> TeacherSizes:
    """Parameters and bytes of every component of the Wan pipeline at `path`, from configs alone."""
    from accelerate import init_empty_weights

    from .offload import meta_transformer, weight_bytes

    root = Path(path)
    mi = _read_json(root / "model_index.json")
    if mi.get("_class_name") != "WanPipeline":
        raise UserError(f"{root} is a {mi.get('_class_name')!r}, not a WanPipeline")
    tdtype = getattr(torch, dtype)
    comps: dict[str, Component] = {}
    experts = tuple(c for c in ("transformer", "transformer_2") if isinstance(mi.get(c), list) and mi[c][0])
    if not experts:
        raise UserError(f"{root}/model_index.json names no transformer")
    for comp in experts:
        _read_json(root / comp / "config.json")
        model = meta_transformer(root, comp, real_buffers=False)
        blocks = list(getattr(model, "blocks", []))
        block_bytes = max((weight_bytes(b, tdtype) for b in blocks), default=0)
        ck, ckd = _checkpoint(root / comp)
        comps[comp] = Component(comp, type(model).__name__, sum(p.numel() for p in model.parameters()),
                                weight_bytes(model, tdtype), len(blocks), block_bytes, ck, ckd)
    if isinstance(mi.get("text_encoder"), list) and mi["text_encoder"][0]:
        import transformers

        cls = getattr(transformers, mi["text_encoder"][1])
        config = cls.config_class.from_dict(_read_json(root / "text_encoder" / "config.json"))
        with init_empty_weights(include_buffers=True):  # nothing allocated on the CPU
            enc = cls(config)
        enc.tie_weights()  # init_empty_weights unties shared embeddings; the loaded model shares them
        n = sum(p.numel() for p in enc.parameters())
        enc_bytes = DTYPE_BYTES["bfloat16" if dtype == "float16" else dtype]  # T5 runs bf16 for fp16
        ck, ckd = _checkpoint(root / "text_encoder")
        comps["text_encoder"] = Component("text_encoder", cls.__name__, n, n * enc_bytes, checkpoint_bytes=ck,
                                          checkpoint_dtype=ckd)
    vae_cfg = {}
    if isinstance(mi.get("vae"), list) and mi["vae"][0] and (root / "vae" / "config.json").is_file():
        import diffusers

        cls = getattr(diffusers, mi["vae"][1])
        vae_cfg = _read_json(root / "vae" / "config.json")
        with init_empty_weights(include_buffers=True):  # nothing allocated on the CPU
            vae = cls.from_config(vae_cfg)
        n = sum(p.numel() for p in vae.parameters())
        ck, ckd = _checkpoint(root / "vae")
        comps["vae"] = Component("vae", cls.__name__, n, n * DTYPE_BYTES[dtype], checkpoint_bytes=ck,
                                 checkpoint_dtype=ckd)
    return TeacherSizes(str(root), dtype, comps, experts, _read_json(root / experts[0] / "config.json"),
                        int(vae_cfg.get("scale_factor_spatial") or 8), int(vae_cfg.get("scale_factor_temporal") or 4))


def tokens_per_sample(sizes: TeacherSizes, height: int, width: int, frames: int) -> int:
    pt, ph, pw = sizes.transformer_config.get("patch_size", (1, 2, 2))
    f = (frames - 1) // sizes.vae_temporal + 1
    return (f // pt) * (height // sizes.vae_spatial // ph) * (width // sizes.vae_spatial // pw)


def activation_bytes(sizes: TeacherSizes, batch: int, height: int, width: int, frames: int, cfg: bool = True,
                     text_len: int = 512) -> int:
    """Peak activation memory of one transformer forward for a block of `batch` trajectories (estimate).

    Counts the large tensors alive inside one WanTransformerBlock: the hidden states and their float32 copy,
    q/k/v and the attention output (~8 x dim per token), the FFN's intermediate and its activation (2 x ffn
    per token), and the projected text context for cross-attention (3 x dim per text token). Attention runs
    through SDPA's memory-efficient kernels, so no tokens^2 term.
    """
    c = sizes.transformer_config
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    b = DTYPE_BYTES[sizes.dtype]
    seqs = batch * (2 if cfg else 1)
    s = tokens_per_sample(sizes, height, width, frames)
    per_token = (8 * dim + 2 * c["ffn_dim"]) * b
    return int(ACTIVATION_SAFETY * (seqs * s * per_token + seqs * text_len * 3 * dim * b))


# --- the decision --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Needs:
    """What the trajectory loop needs, in bytes: the input of `decide`."""

    experts: tuple[int, ...]  # each expert's weights at the run dtype
    blocks: int  # transformer blocks per expert
    block: int  # the largest block
    other: int  # an expert's weights outside its blocks
    activations: int  # one forward of the batch
    text_encoder: int = 0

    @classmethod
    def of(cls, sizes: TeacherSizes, activations: int) -> Needs:
        ex = [sizes.components[e] for e in sizes.experts]
        enc = sizes.components.get("text_encoder")
        return cls(tuple(e.bytes for e in ex), max(e.blocks for e in ex), max(e.block_bytes for e in ex),
                   max(e.other_bytes for e in ex), activations, enc.bytes if enc else 0)


@dataclass(frozen=True)
class Decision:
    placement: str  # cpu | cuda | balanced | offload | disk
    expert_order: str  # step | expert
    reasons: list[str] = field(default_factory=list)


def _fits_across(weights: list[int], capacities: list[int]) -> bool:
    """Sequential fill of unsplittable pieces over devices in order (how accelerate fills a device map)."""
    caps, i = list(capacities), 0
    for w in weights:
        while i < len(caps) and caps[i] < w:
            i += 1
        if i == len(caps):
            return False
        caps[i] -= w
    return True


def _pieces(needs: Needs, n_experts: int) -> list[int]:
    return ([needs.other] + [needs.block] * needs.blocks) * n_experts


def decide(needs: Needs, inv: Inventory) -> Decision:
    """Pick a placement and an expert order for `needs` on the machine `inv` (pure: no device is touched)."""
    both, one, two = sum(needs.experts), max(needs.experts), len(needs.experts) > 1
    act = needs.activations
    ram = inv.usable_ram
    why: list[str] = []
    if inv.gpus:
        gpu = min(inv.usable_gpu(i) for i in range(len(inv.gpus)))
        what = "a replica (both experts)" if two else "the transformer"
        if both + act <= gpu:
            why.append(f"{what} {gib(both)} + activations {gib(act)} fit one GPU ({gib(gpu)} usable)")
            if inv.ranks_per_node > 1:
                why.append("under torchrun each rank holds one replica on its own GPU; the parts split the prompts")
            return Decision("cuda", "step", why)
        if two and one + act <= gpu:
            why.append(f"one expert {gib(one)} + activations {gib(act)} fits one GPU ({gib(gpu)} usable), both "
                       f"{gib(both)} do not: expert-major order keeps one expert resident at a time")
            return Decision("cuda", "expert", why)
        why.append(f"{what} {gib(both)} + activations {gib(act)} does not fit one GPU ({gib(gpu)} usable)")
        if len(inv.gpus) > 1 and inv.ranks_per_node == 1:
            caps = [inv.usable_gpu(i) - act for i in range(len(inv.gpus))]
            room = gib(sum(max(c, 0) for c in caps))
            if _fits_across(_pieces(needs, len(needs.experts)), caps):
                why.append(f"{what} fits across the {len(inv.gpus)} GPUs ({room} usable after activations), "
                           "no block split")
                return Decision("balanced", "step", why)
            if two and _fits_across(_pieces(needs, 1), caps):
                why.append(f"one expert fits across the {len(inv.gpus)} GPUs ({room} usable after activations), "
                           "both do not: expert-major order")
                return Decision("balanced", "expert", why)
            why.append(f"the experts do not fit across the {len(inv.gpus)} GPUs either")
        elif len(inv.gpus) > 1:
            why.append("balanced is not used under torchrun (every rank would spread over every GPU)")
        stream_gpu = 2 * needs.block + needs.other + act  # current block + the prefetched one
        if stream_gpu <= gpu:
            if both <= ram or one <= ram:
                why.append(f"{'both experts' if both <= ram else 'one expert'} fit in RAM ({gib(ram)} usable per "
                           f"rank); the GPU holds two blocks + activations ({gib(stream_gpu)})")
                return Decision("offload", "step" if both <= ram else "expert", why)
            why.append(f"no expert fits in RAM ({gib(ram)} usable per rank)")
        else:
            why.append(f"even one streamed block + activations ({gib(stream_gpu)}) does not fit the GPU; lower "
                       "--batch-size or the resolution")
    else:
        if both + act <= ram:
            why.append(f"no GPU; {'both experts' if two else 'the transformer'} {gib(both)} + activations "
                       f"{gib(act)} fit in RAM ({gib(ram)} usable)")
            return Decision("cpu", "step", why)
        if two and one + act <= ram:
            why.append(f"no GPU; one expert {gib(one)} + activations {gib(act)} fits in RAM ({gib(ram)} usable), "
                       f"both {gib(both)} do not: expert-major order")
            return Decision("cpu", "expert", why)
        why.append(f"no GPU, and the weights ({gib(both)}) + activations do not fit in RAM ({gib(ram)} usable)")
    if both <= inv.usable_disk:
        why.append(f"weights streamed from the offload folder ({gib(both)} of {gib(inv.usable_disk)} free disk); "
                   "RAM holds one block at a time")
        return Decision("disk", "step", why)
    raise UserError("the teacher fits nowhere on this machine: " + "; ".join(why) +
                    f"; the offload folder would need {gib(both)} of disk ({gib(inv.usable_disk)} free)")


def expert_order_for(placement: str, needs: Needs, inv: Inventory) -> str:
    """For an explicit placement: expert-major when its memory tier cannot hold both experts at once."""
    if len(needs.experts) < 2:
        return "step"
    both, act = sum(needs.experts), needs.activations
    if placement == "cuda" and inv.gpus:
        return "step" if both + act <= max(inv.usable_gpu(i) for i in range(len(inv.gpus))) else "expert"
    if placement in ("balanced", "sequential") and inv.gpus:
        caps = [inv.usable_gpu(i) - act for i in range(len(inv.gpus))]
        return "step" if _fits_across(_pieces(needs, 2), caps) else "expert"
    if placement == "cpu":
        return "step" if both + act <= inv.usable_ram else "expert"
    if placement == "offload":
        return "step" if both <= inv.usable_ram else "expert"
    return "step"  # disk and custom maps: nothing (or the user's choice) is resident


# --- device maps (accelerate) ---------------------------------------------------------------------------------

def device_map_for(model: torch.nn.Module, kind: str, max_memory: dict, dtype: torch.dtype) -> dict:
    """accelerate's device map of one transformer over `max_memory` (device -> bytes or '70GiB'), its blocks
    never split. `balanced` evens the load over the GPUs; `sequential` fills GPU 0 first."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    from .offload import param_dtypes

    no_split = list(getattr(model, "_no_split_modules", None) or ["WanTransformerBlock"])
    special = {n: d for n, d in param_dtypes(model, dtype).items() if d != dtype}
    if kind == "balanced":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         dtype=dtype, special_dtypes=special)
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
                                 special_dtypes=special)


def map_bytes(model: torch.nn.Module, device_map: dict, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each device of `device_map` holds (keys 'cuda:N', 'cpu', 'disk')."""
    from .offload import param_dtypes

    dtypes = param_dtypes(model, dtype)
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        dev = device_map[key]
        dev = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
        out[dev] = out.get(dev, 0) + p.numel() * dtypes[name].itemsize
    return out


# --- the plan (what `wandistiller plan` prints) --------------------------------------------------------------

@dataclass
class Plan:
    teacher: str
    dtype: str
    batch_size: int
    height: int
    width: int
    frames: int
    tokens_per_sample: int
    inventory: dict
    requested: str
    placement: str
    expert_order: str
    components: list[dict]
    activations_bytes: int
    resident_bytes: dict[str, int]
    streamed_bytes_per_step: int
    decision: list[str]
    notes: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def render(self) -> str:
        lines = [f"teacher     {self.teacher}",
                 f"run         dtype {self.dtype}, batch {self.batch_size} x {self.height}x{self.width}x{self.frames} "
                 f"({self.tokens_per_sample} tokens per sample, CFG doubles the forward batch)",
                 f"machine     {self.inventory['describe']}",
                 f"placement   {self.placement} ({self.expert_order}-major order)"
                 + (f", picked by auto" if self.requested == "auto" else ""),
                 "",
                 f"{'component':<14}{'class':<24}{'params':>16}{'bytes':>13}   where"]
        for c in self.components:
            lines.append(f"{c['name']:<14}{c['class']:<24}{c['params']:>16,}{gib(c['bytes']):>13}   {c['where']}")
            if c.get("checkpoint_bytes") is not None:
                lines.append(f"{'':<14}{'checkpoint on disk':<24}{'':>16}{gib(c['checkpoint_bytes']):>13}   "
                             f"{c['checkpoint_dtype']}")
        lines += ["",
                  f"activations (estimate, batch {self.batch_size}): {gib(self.activations_bytes)}",
                  "resident during the trajectory loop: "
                  + ("; ".join(f"{d} {gib(b)}" for d, b in self.resident_bytes.items()) or "-"),
                  f"streamed per denoising step: {gib(self.streamed_bytes_per_step)}"
                  + (" (the active expert's weights)" if self.streamed_bytes_per_step else " (weights resident)"),
                  "", "decision:"] + [f"  - {r}" for r in self.decision]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def make_plan(teacher: str, placement: str = "auto", dtype: str | None = None, batch_size: int = 4,
              height: int = 480, width: int = 832, frames: int = 1, text_len: int = 512, cfg: bool = True,
              inventory: Inventory | None = None, max_memory: dict | None = None, device_map: dict | None = None,
              expert_order: str = "auto") -> Plan:
    """Sizes, layout and (for auto) the decision for running `teacher` with `placement` on `inventory`."""
    inv = inventory or Inventory.measure()
    gpu_exec = bool(inv.gpus) and placement != "cpu"
    if device_map is not None:
        gpu_exec = any(isinstance(v, int) for v in device_map.values())
    dtype = dtype or ("bfloat16" if gpu_exec else "float32")
    sizes = teacher_sizes(teacher, dtype)
    act = activation_bytes(sizes, batch_size, height, width, frames, cfg, text_len)
    needs = Needs.of(sizes, act)
    notes: list[str] = []
    if placement == "auto":
        d = decide(needs, inv)
        kind, order, why = d.placement, d.expert_order, d.reasons
    else:
        kind = "map" if device_map is not None else placement
        order = expert_order_for(kind, needs, inv)
        why = [f"placement {placement} requested"]
        if kind in ("cuda", "balanced", "sequential") and not inv.gpus:
            notes.append(f"{kind} needs a CUDA GPU and this inventory has none: it would stop with an error")
    if expert_order in ("step", "expert") and len(sizes.experts) > 1:
        order = expert_order
    if len(sizes.experts) < 2:
        order = "step"
    where, resident, streamed = _layout(kind, order, sizes, needs, inv, max_memory, device_map, notes)
    comps = []
    for name in ("text_encoder", *sizes.experts, "vae"):
        c = sizes.components.get(name)
        if c is not None:
            comps.append({"name": name, "class": c.cls, "params": c.params, "bytes": c.bytes, "where": where[name],
                          "blocks": c.blocks, "block_bytes": c.block_bytes, "checkpoint_bytes": c.checkpoint_bytes,
                          "checkpoint_dtype": c.checkpoint_dtype})
    return Plan(teacher, dtype, batch_size, height, width, frames, tokens_per_sample(sizes, height, width, frames),
                asdict(inv) | {"describe": inv.describe()}, placement, placement if kind == "map" else kind, order,
                comps, act, resident, streamed, why, notes)


def _layout(kind, order, sizes, needs, inv, max_memory, device_map, notes):
    """Where each component lives, resident bytes per device during the loop, bytes streamed per step."""
    experts = sizes.experts
    both, one, act = sum(needs.experts), max(needs.experts), needs.activations
    resident_experts = both if order == "step" else one
    where = {"vae": "not loaded in stage one (the cache holds latents)"}
    enc_where = "freed before the transformers load"
    resident: dict[str, int] = {}
    streamed = 0
    if kind == "cpu":
        where["text_encoder"] = f"cpu, {enc_where}"
        for e in experts:
            where[e] = "cpu" + (" (one expert at a time)" if order == "expert" else "")
        resident = {"cpu": resident_experts + act}
    elif kind == "cuda":
        where["text_encoder"] = f"cuda:0, {enc_where}"
        for e in experts:
            where[e] = "cuda:0" + (" (one expert at a time)" if order == "expert" else "")
        resident = {"cuda:0": resident_experts + act}
    elif kind in ("balanced", "sequential", "map"):
        from .offload import meta_transformer

        model = meta_transformer(Path(sizes.path), experts[0], real_buffers=False)
        if kind == "map":
            from .placement import check_device_map

            check_device_map(model, device_map, "given")
            dmap = device_map
        else:
            mm = max_memory or {i: max(inv.usable_gpu(i) - act, 0) for i in range(len(inv.gpus))}
            mm = dict(mm)
            mm.setdefault("cpu", inv.usable_ram)
            dmap = device_map_for(model, kind, mm, getattr(torch, sizes.dtype))
        per_dev = map_bytes(model, dmap, getattr(torch, sizes.dtype))
        copies = len(experts) if order == "step" else 1
        resident = {d: b * copies for d, b in per_dev.items() if d != "disk"}
        gpus = sorted(d for d in per_dev if d.startswith("cuda"))
        main = gpus[0] if gpus else "cpu"
        resident[main] = resident.get(main, 0) + act
        spill = per_dev.get("cpu", 0) + per_dev.get("disk", 0) if gpus else per_dev.get("disk", 0)
        streamed = spill
        summary = ", ".join(f"{d} {gib(b)}" for d, b in per_dev.items())
        for e in experts:
            where[e] = summary + (" (one expert at a time)" if order == "expert" else "")
        where["text_encoder"] = f"{main}, {enc_where}"
        if spill:
            notes.append(f"{gib(spill)} of each expert sits on cpu/disk and is moved to the GPU at every forward")
    elif kind == "offload":
        dev = "cuda:0" if inv.gpus else "cpu"
        where["text_encoder"] = (f"cpu, moved to {dev} as a whole to encode (model offload), {enc_where}"
                                 if inv.gpus else f"cpu, {enc_where}")
        for e in experts:
            where[e] = (f"cpu RAM, one block at a time on {dev} (+ the next, prefetched on a CUDA stream)"
                        if inv.gpus else "cpu RAM (on a CPU, offload computes where the weights are)")
        resident = {"cpu": resident_experts, dev: 2 * needs.block + needs.other + act} if inv.gpus \
            else {"cpu": resident_experts + act}
        streamed = one if inv.gpus else 0
    elif kind == "disk":
        dev = "cuda:0" if inv.gpus else "cpu"
        where["text_encoder"] = (f"cpu, moved to {dev} as a whole to encode (model offload), {enc_where}"
                                 if inv.gpus else f"cpu, {enc_where}")
        for e in experts:
            where[e] = "offload folder (disk), one block at a time in RAM" + (f" and on {dev}" if inv.gpus else "")
        block_ram = needs.block + needs.other
        resident = {"disk": both, "cpu": block_ram} if inv.gpus else {"disk": both, "cpu": block_ram + act}
        if inv.gpus:
            resident[dev] = 2 * needs.block + needs.other + act
        streamed = one
    enc = needs.text_encoder
    if enc and where.get("text_encoder", "").startswith("cuda") and inv.gpus and enc > inv.usable_gpu(0):
        notes.append(f"the text encoder ({gib(enc)}) does not fit cuda:0 ({gib(inv.usable_gpu(0))} usable) for the "
                     "encoding pass; use --placement offload (model offload) or a bigger GPU")
    elif enc and where.get("text_encoder", "").startswith("cpu") and enc > inv.usable_ram:
        notes.append(f"the text encoder ({gib(enc)}) does not fit in RAM ({gib(inv.usable_ram)} usable) for the "
                     "encoding pass; use --dtype bfloat16 or a machine with more RAM")
    return where, resident, streamed
