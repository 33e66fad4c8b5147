"""The placement planner: what the teacher needs (from configs alone, models on the meta device), what the machine
has, and which placement `auto` picks (`decide`, pure; its rules are docs/placements.md's, by capabilities).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pipeline.config import RunShape
from pipeline.errors import UserError
from pipeline.registries import PLACEMENTS
from pipeline.settings import parse_bytes, parse_gpus

from .teacher import configs_spec, read_json

GiB = 2**30
# Kept free on every GPU: CUDA context, allocator fragmentation, cuBLAS workspaces.
GPU_RESERVE = int(1.5 * GiB)
GPU_MARGIN = 0.08  # fraction of a GPU's memory kept free on top of the reserve
RAM_MARGIN = 0.15  # fraction of available RAM kept for the rest of the process (records, zarr, Python)
ACTIVATION_SAFETY = 1.25  # the activation estimate below is a count of the large tensors only
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _user_errors(parse):
    """`parse` with its ValueError turned into the UserError of the same line."""
    def parsed(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise UserError(f"{e}") from None
    return parsed


parse_size = _user_errors(parse_bytes)  # '24GiB', '80GB' (GB = 10^9, GiB = 2^30, as accelerate) -> bytes
_parse_gpus = _user_errors(parse_gpus)  # '4x24GiB', '80GiB,40GiB' or 'none' -> free bytes per GPU


@dataclass(frozen=True)
class Inventory:
    """Free memory of each visible GPU, available host RAM and free disk where the offload folder goes."""

    gpus: tuple[int, ...] = ()  # free bytes per visible GPU
    gpu_total: tuple[int, ...] = ()  # total bytes per GPU (for the margin); empty: same as free
    ram: int = 0  # available host RAM, bytes
    disk: int = 0  # free bytes under the offload directory
    ranks_per_node: int = 1  # torchrun processes on this node (they share its RAM and disk)
    source: str = "measured"
    assumed: tuple[str, ...] = ()  # of "gpus", "ram", "disk": the figures given (--assume-*), not measured here
    disk_at: str = ""  # the folder whose filesystem `disk` was measured on

    @classmethod
    def measure(cls, offload_dir: str | os.PathLike | None = None, ranks_per_node: int = 1,
                gpus: bool = True) -> Inventory:
        """This machine. `gpus=False` leaves the GPUs out: asking CUDA for free memory initialises it, which a
        run that computes on the CPU must never do (in a process forked after CUDA started it raises)."""
        info = [torch.cuda.mem_get_info(d) for d in range(torch.cuda.device_count())] \
            if gpus and torch.cuda.is_available() else []
        free, where = free_space(offload_dir or ".")
        return cls(tuple(int(f) for f, _ in info), tuple(int(t) for _, t in info), _available_ram(), free,
                   ranks_per_node, disk_at=str(where))

    @classmethod
    def assume(cls, gpus: str | None, ram: str | None, disk: str | None, ranks_per_node: int = 1,
               measured: Inventory | None = None) -> Inventory:
        """A made-up machine for `plan`: gpus '4x24GiB' or '80GiB,40GiB' or 'none'; unset parts are measured."""
        base = measured or cls.measure(gpus=gpus is None)
        g, t = (_parse_gpus(gpus),) * 2 if gpus is not None else (base.gpus, base.gpu_total)
        assumed = tuple(name for name, v in (("gpus", gpus), ("ram", ram), ("disk", disk)) if v)
        return cls(g, t, parse_size(ram) if ram else base.ram, parse_size(disk) if disk else base.disk,
                   ranks_per_node, "assumed" if assumed else base.source, assumed, "" if disk else base.disk_at)

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
        """Each figure with where it came from: an --assume-* figure is "assumed", the rest measured here."""
        def how(name: str) -> str:
            return "assumed" if name in self.assumed or self.source == "assumed" and not self.assumed else "measured"

        gpus = ", ".join(gib(f) for f in self.gpus) if self.gpus else "none"
        ranks = f"; {self.ranks_per_node} ranks per node" if self.ranks_per_node > 1 else ""
        disk = f"measured at {self.disk_at}" if how("disk") == "measured" and self.disk_at else how("disk")
        return (f"GPUs free: {gpus} ({how('gpus')}); RAM available {gib(self.ram)} ({how('ram')}); disk free "
                f"{gib(self.disk)} for the offload folder ({disk}){ranks}")


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def free_space(path: str | os.PathLike) -> tuple[int, Path]:
    """Free bytes of the filesystem `path` is (or will be) on, and the folder measured: `path`, or its nearest
    existing parent (a folder not made yet lands on its parent's filesystem)."""
    p = Path(path).expanduser().absolute()
    while not p.is_dir() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free, p


@dataclass(frozen=True)
class Component:
    """One component of the teacher, measured on the meta device."""

    name: str
    cls: str
    params: int
    bytes: int  # at the run dtype (parts diffusers keeps in float32 counted in float32)
    blocks: int = 0  # transformer blocks (WanTransformerBlock), 0 for other components
    block_bytes: int = 0  # the largest block
    layer_bytes: int = 0  # the largest group of leaf-level offloading (a Linear, mostly), 0 for other components
    checkpoint_bytes: int | None = None  # tensor bytes in the safetensors files, None without weights
    checkpoint_dtype: str | None = None


@dataclass(frozen=True)
class TeacherSizes:
    path: str
    dtype: str
    components: dict[str, Component]
    experts: tuple[str, ...]
    transformer_config: dict
    vae_spatial: int
    vae_temporal: int


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

    from .group_offload import largest_layer_bytes, meta_transformer, weight_bytes

    spec = configs_spec(Path(path), str(path))
    root, mi, experts = spec.path, spec.model_index, spec.experts
    tdtype = getattr(torch, dtype)
    comps: dict[str, Component] = {}

    def other(name: str, model: torch.nn.Module, width: int) -> Component:  # the text encoder or the VAE
        n = sum(p.numel() for p in model.parameters())
        ck, ckd = _checkpoint(root / name)
        return Component(name, type(model).__name__, n, n * width, checkpoint_bytes=ck, checkpoint_dtype=ckd)

    for comp in experts:
        model = meta_transformer(root, comp, real_buffers=False)
        blocks = list(getattr(model, "blocks", []))
        block_bytes = max((weight_bytes(b, tdtype) for b in blocks), default=0)
        comps[comp] = Component(comp, type(model).__name__, sum(p.numel() for p in model.parameters()),
                                weight_bytes(model, tdtype), len(blocks), block_bytes,
                                largest_layer_bytes(model, tdtype), *_checkpoint(root / comp))
    if isinstance(mi.get("text_encoder"), list) and mi["text_encoder"][0]:
        import transformers

        cls = getattr(transformers, mi["text_encoder"][1])
        config = cls.config_class.from_dict(read_json(root, "text_encoder/config.json"))  # (cls: checked)
        with init_empty_weights(include_buffers=True):  # nothing allocated on the CPU
            enc = cls(config)
        enc.tie_weights()  # init_empty_weights unties shared embeddings; the loaded model shares them
        width = DTYPE_BYTES["bfloat16" if dtype == "float16" else dtype]  # T5 runs bf16 for fp16
        comps["text_encoder"] = other("text_encoder", enc, width)
    if isinstance(mi.get("vae"), list) and mi["vae"][0] and spec.configs["vae"]:
        import diffusers

        with init_empty_weights(include_buffers=True):  # nothing allocated on the CPU
            vae = getattr(diffusers, mi["vae"][1]).from_config(spec.configs["vae"])
        comps["vae"] = other("vae", vae, DTYPE_BYTES[dtype])
    return TeacherSizes(str(root), dtype, comps, experts, spec.transformer_config, spec.vae_spatial, spec.vae_temporal)


def tokens_per_sample(sizes: TeacherSizes, height: int, width: int, frames: int) -> int:
    pt, ph, pw = sizes.transformer_config.get("patch_size", (1, 2, 2))
    f = (frames - 1) // sizes.vae_temporal + 1
    return (f // pt) * (height // sizes.vae_spatial // ph) * (width // sizes.vae_spatial // pw)


def activation_bytes(sizes: TeacherSizes, shape: RunShape) -> int:
    """Peak activation memory of one transformer forward for a block of `shape.batch_size` trajectories: the large
    tensors alive inside one block (hidden states, f32 copy, q/k/v, attention out: ~8 x dim per token; the FFN's:
    2 x ffn per token; the text context: 3 x dim per text token). SDPA's memory-efficient kernels: no tokens^2."""
    c = sizes.transformer_config
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    b = DTYPE_BYTES[sizes.dtype]
    seqs = shape.batch_size * (2 if shape.guidance > 1.0 else 1)  # CFG: both branches in one forward
    s = tokens_per_sample(sizes, shape.height, shape.width, shape.frames)
    per_token = (8 * dim + 2 * c["ffn_dim"]) * b
    return int(ACTIVATION_SAFETY * (seqs * s * per_token + seqs * shape.max_sequence_length * 3 * dim * b))


@dataclass(frozen=True)
class Needs:
    """What the trajectory loop needs, in bytes: the input of `decide`."""

    experts: tuple[int, ...]  # each expert's weights at the run dtype
    blocks: int  # transformer blocks per expert
    block: int  # the largest block
    other: int  # an expert's weights outside its blocks (embeddings, time projection, output head)
    layer: int  # the largest layer leaf-level offloading moves at once
    activations: int  # one forward of the batch
    text_encoder: int = 0
    batch: int = 1  # the trajectories of that forward (--batch-size)

    @classmethod
    def of(cls, sizes: TeacherSizes, activations: int, batch: int = 1) -> Needs:
        ex = [sizes.components[e] for e in sizes.experts]
        enc = sizes.components.get("text_encoder")
        return cls(tuple(e.bytes for e in ex), max(e.blocks for e in ex), max(e.block_bytes for e in ex),
                   max(e.bytes - e.blocks * e.block_bytes for e in ex), max(e.layer_bytes for e in ex), activations,
                   enc.bytes if enc else 0, batch)

    def at_batch(self, batch: int) -> Needs:
        """The same teacher for `batch` trajectories a forward (`activation_bytes` is linear in the batch)."""
        return replace(self, activations=-(-self.activations * batch // self.batch), batch=batch)

    @property
    def layer_streaming_gpu(self) -> int:
        """GPU bytes of `offload`: the layer computing, the next one prefetched and the activations."""
        return 2 * self.layer + self.activations

    @property
    def block_streaming_gpu(self) -> int:
        """GPU bytes of `disk` on a GPU: the block computing, the next one, the rest of the expert, activations."""
        return 2 * self.block + self.other + self.activations


class FitsNowhere(UserError):
    """`decide` found no placement: the one line, with what it was asked to place where (for `plan`'s report)."""

    def __init__(self, line: str, needs: Needs, inv: Inventory, reasons: list[str] | None = None):
        super().__init__(f"{line}; `wandistiller plan` shows the sizes and the machines that would fit")
        self.line, self.needs, self.inv, self.reasons = line, needs, inv, reasons or []


def machines_that_fit(needs: Needs, ranks_per_node: int = 1) -> list[str]:
    """The least of each resource `decide` would accept for `needs`, margins included, one line per placement."""
    gpu = lambda b: gib((b + GPU_RESERVE) / (1 - GPU_MARGIN))  # noqa: E731
    ram = lambda b: gib(b * ranks_per_node / (1 - RAM_MARGIN))  # noqa: E731
    both, one, act, two = sum(needs.experts), max(needs.experts), needs.activations, len(needs.experts) > 1
    major = lambda text: f" ({text} expert-major, one expert resident)" if two else ""  # noqa: E731
    return [f"cuda: one GPU of {gpu(both + act)}" + major(gpu(one + act)),
            f"offload: a GPU of {gpu(needs.layer_streaming_gpu)} with {ram(both)} of RAM available" + major(ram(one)),
            f"cpu (no GPU): {ram(both + act)} of RAM available" + major(ram(one + act)),
            f"disk: {gib(both * ranks_per_node / 0.95)} free under --offload-dir (weights streamed block by block)"]


def pick(**caps) -> str:
    """The first placement `auto` may pick that has these capabilities."""
    return PLACEMENTS.where(auto=True, **caps)[0].name


@dataclass(frozen=True)
class Decision:
    placement: str  # a placement's name
    expert_order: str  # step | expert
    reasons: list[str] = field(default_factory=list)
    batch_size: int | None = None  # a smaller batch than the one asked for, that this placement fits (plan's)


def fits_across(weights: list[int], capacities: list[int]) -> bool:
    """Sequential fill of unsplittable pieces over devices in order (how accelerate fills a device map)."""
    caps, i = list(capacities), 0
    for w in weights:
        while i < len(caps) and caps[i] < w:
            i += 1
        if i == len(caps):
            return False
        caps[i] -= w
    return True


def expert_pieces(needs: Needs, n_experts: int) -> list[int]:
    return ([needs.other] + [needs.block] * needs.blocks) * n_experts


def decide(needs: Needs, inv: Inventory, smaller_batches: bool = False) -> Decision:
    """Pick a placement and an expert order for `needs` on the machine `inv` (pure: no device is touched).

    On a GPU a smaller batch that fits it whole (`cuda`: nothing streamed) beats streaming the weights at this
    batch, and any batch that fits beats none: with `smaller_batches` (`plan`, which prints the command) the
    decision takes the largest such batch (`Decision.batch_size`); without (a run, whose --batch-size is the
    user's) it keeps the batch, or refuses it, and names the one that fits."""
    first = _attempt(needs, inv)
    if inv.gpus and needs.batch > 1 and (isinstance(first, FitsNowhere) or not _whole(first)):
        found = [(b, d) for b in range(needs.batch - 1, 0, -1)
                 if isinstance(d := _attempt(needs.at_batch(b), inv), Decision)]
        best = next(((b, d) for b, d in found if _whole(d)), None)
        if best is None and isinstance(first, FitsNowhere) and found:
            best = found[0]
        if best is not None:
            b, d = best
            gpu = gib(min(inv.usable_gpu(i) for i in range(len(inv.gpus))))
            said = f"batch {needs.batch} " + (f"fits no placement on this GPU ({gpu} usable)"
                                              if isinstance(first, FitsNowhere)
                                              else f"fits only with the weights streamed ({first.placement})")
            if smaller_batches:
                return Decision(d.placement, d.expert_order, [*first.reasons, f"{said}: batch {b} does on "
                                f"{d.placement}, {d.reasons[-1]}; the command uses --batch-size {b}"], b)
            hint = f"--batch-size {b} fits on placement {d.placement}"
            if isinstance(first, FitsNowhere):
                raise FitsNowhere(f"{first.line}; {hint}", needs, inv, first.reasons)
            return replace(first, reasons=[*first.reasons, f"{hint} (nothing streamed)"])
    if isinstance(first, FitsNowhere):
        raise first
    return first


def _whole(d: Decision) -> bool:
    """Whether the decision keeps a replica whole on each GPU (nothing streamed, every GPU computing)."""
    return PLACEMENTS[d.placement].caps.replica_per_gpu


def _attempt(needs: Needs, inv: Inventory) -> Decision | FitsNowhere:
    try:
        return _rules(needs, inv)
    except FitsNowhere as e:
        return e


def _rules(needs: Needs, inv: Inventory) -> Decision:
    """docs/placements.md's rules, in order, for this batch; the first that fits wins."""
    both, one, two = sum(needs.experts), max(needs.experts), len(needs.experts) > 1
    act, ram, why = needs.activations, inv.usable_ram, []
    if inv.gpus:
        gpu = min(inv.usable_gpu(i) for i in range(len(inv.gpus)))
        what = "a replica (both experts)" if two else "the transformer"
        if both + act <= gpu:
            why.append(f"{what} {gib(both)} + activations {gib(act)} fit one GPU ({gib(gpu)} usable)")
            if inv.ranks_per_node > 1:
                why.append("under torchrun each rank holds one replica on its own GPU; the parts split the prompts")
            return Decision(pick(replica_per_gpu=True), "step", why)
        if two and one + act <= gpu:
            why.append(f"one expert {gib(one)} + activations {gib(act)} fits one GPU ({gib(gpu)} usable), both "
                       f"{gib(both)} do not: expert-major order keeps one expert resident at a time")
            return Decision(pick(replica_per_gpu=True), "expert", why)
        why.append(f"{what} {gib(both)} + activations {gib(act)} does not fit one GPU ({gib(gpu)} usable)")
        if len(inv.gpus) > 1 and inv.ranks_per_node == 1:
            caps = [inv.usable_gpu(i) - act for i in range(len(inv.gpus))]
            room = gib(sum(max(c, 0) for c in caps))
            # both experts (or the one), else (two) one expert at a time
            for n, who, order, tail in ((len(needs.experts), what, "step", "no block split"),
                                        (1, "one expert", "expert", "both do not: expert-major order")):
                if fits_across(expert_pieces(needs, n), caps):
                    why.append(f"{who} fits across the {len(inv.gpus)} GPUs ({room} usable after activations), {tail}")
                    return Decision(pick(spreads=True), order, why)
            why.append(f"the experts do not fit across the {len(inv.gpus)} GPUs either")
        elif len(inv.gpus) > 1:
            why.append("balanced is not used under torchrun (every rank would spread over every GPU)")
        stream_gpu = needs.layer_streaming_gpu
        if stream_gpu <= gpu:
            if both <= ram or one <= ram:
                why.append(f"{'both experts' if both <= ram else 'one expert'} fit in RAM ({gib(ram)} usable per "
                           f"rank); the GPU holds two layers + activations ({gib(stream_gpu)})")
                return Decision(pick(streams="ram"), "step" if both <= ram else "expert", why)
            why.append(f"no expert fits in RAM ({gib(ram)} usable per rank)")
        else:
            why.append(f"even two streamed layers + activations ({gib(stream_gpu)}) do not fit the GPU; lower "
                       "--batch-size or the resolution")
    else:
        if both + act <= ram:
            why.append(f"no GPU; {'both experts' if two else 'the transformer'} {gib(both)} + activations "
                       f"{gib(act)} fit in RAM ({gib(ram)} usable)")
            return Decision(pick(gpu="no"), "step", why)
        if two and one + act <= ram:
            why.append(f"no GPU; one expert {gib(one)} + activations {gib(act)} fits in RAM ({gib(ram)} usable), "
                       f"both {gib(both)} do not: expert-major order")
            return Decision(pick(gpu="no"), "expert", why)
        why.append(f"no GPU, and the weights ({gib(both)}) + activations do not fit in RAM ({gib(ram)} usable)")
    # disk on a GPU computes there: two blocks, the rest of the expert and the activations
    disk_gpu = needs.block_streaming_gpu if inv.gpus else 0
    if both <= inv.usable_disk and (not inv.gpus or disk_gpu <= gpu):
        why.append(f"weights streamed from the offload folder ({gib(both)} of {gib(inv.usable_disk)} free disk); "
                   "RAM holds one block at a time")
        return Decision(pick(streams="disk"), "step", why)
    tail = (f"streaming from the offload folder would need {gib(disk_gpu)} of the GPU" if inv.gpus and disk_gpu > gpu
            else f"the offload folder would need {gib(both)} of disk ({gib(inv.usable_disk)} free)")
    raise FitsNowhere("the teacher fits nowhere on this machine: " + "; ".join(why) + f"; {tail}", needs, inv, why)
