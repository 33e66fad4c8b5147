"""What `wandistiller plan` prints: where the teacher's weights would live, what each device holds, and (auto)
why, from configs alone. The sizes and the decision come from planner.py, the layout from the placement's own
entry (placements/)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from . import placements
from .placements.device_map import parse_max_memory, read_device_map
from .planner import Inventory, Needs, activation_bytes, decide, gib, teacher_sizes, tokens_per_sample

VAE_WHERE = "not loaded in stage one (the cache holds latents)"


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
        entry, order, why = placements.get(d.placement), d.expert_order, d.reasons
    else:
        entry = placements.get(placement)
        order = entry.expert_order(needs, inv)
        why = [f"placement {placement} requested"]
        if entry.gpu == "required" and not inv.gpus:
            notes.append(f"{entry.name} needs a CUDA GPU and this inventory has none: it would stop with an error")
    if expert_order in ("step", "expert") and len(sizes.experts) > 1:
        order = expert_order
    if len(sizes.experts) < 2:
        order = "step"
    layout = entry.layout(placements.PlanInput(sizes, needs, inv, order, max_memory, device_map))
    where = layout.where | {"vae": VAE_WHERE}
    notes += layout.notes + _encoder_notes(needs, inv, where["text_encoder"])
    comps = []
    for name in ("text_encoder", *sizes.experts, "vae"):
        c = sizes.components.get(name)
        if c is not None:
            comps.append({"name": name, "class": c.cls, "params": c.params, "bytes": c.bytes, "where": where[name],
                          "blocks": c.blocks, "block_bytes": c.block_bytes, "checkpoint_bytes": c.checkpoint_bytes,
                          "checkpoint_dtype": c.checkpoint_dtype})
    return Plan(teacher, dtype, batch_size, height, width, frames, tokens_per_sample(sizes, height, width, frames),
                asdict(inv) | {"describe": inv.describe()}, placement, placement if entry.name == "map" else entry.name,
                order, comps, act, layout.resident, layout.streamed, why, notes)


def _encoder_notes(needs: Needs, inv: Inventory, where: str) -> list[str]:
    """The text encoder runs alone before the transformers load: does it fit where the placement puts it?"""
    enc = needs.text_encoder
    if enc and where.startswith("cuda") and inv.gpus and enc > inv.usable_gpu(0):
        return [f"the text encoder ({gib(enc)}) does not fit cuda:0 ({gib(inv.usable_gpu(0))} usable) for the "
                "encoding pass; use --placement offload (model offload) or a bigger GPU"]
    if enc and where.startswith("cpu") and enc > inv.usable_ram:
        return [f"the text encoder ({gib(enc)}) does not fit in RAM ({gib(inv.usable_ram)} usable) for the "
                "encoding pass; use --dtype bfloat16 or a machine with more RAM"]
    return []


def plan_from_flags(teacher: str, placement: str = "auto", dtype: str | None = None, batch_size: int = 4,
                    height: int = 480, width: int = 832, frames: int = 1, max_sequence_length: int = 512,
                    max_memory: str | None = None, expert_order: str = "auto", offload_dir: str | None = None,
                    assume_gpus: str | None = None, assume_ram: str | None = None, assume_disk: str | None = None,
                    ranks_per_node: int = 1) -> Plan:
    """`wandistiller plan`: the plan for this machine, or for the one the `assume_*` strings describe
    ('4x24GiB', '256GiB'; parts not assumed are measured here, this machine's GPUs only if none are assumed)."""
    measured = Inventory.measure(offload_dir, ranks_per_node, gpus=assume_gpus is None)
    inv = Inventory.assume(assume_gpus, assume_ram, assume_disk, ranks_per_node, measured)
    dmap = read_device_map(placement, check_devices=assume_gpus is None)[0] if placement.endswith(".json") else None
    return make_plan(teacher, placement, dtype, batch_size, height, width, frames, max_sequence_length,
                     inventory=inv, max_memory=parse_max_memory(max_memory), device_map=dmap,
                     expert_order=expert_order)
