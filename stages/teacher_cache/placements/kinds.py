"""The placements that keep each expert whole, on one device or streamed to it (cpu, cuda, offload, disk), and
`auto` (the default), the planner's pick for this machine (placement_choice.decide)."""

from __future__ import annotations

from pipeline.errors import UserError
from pipeline.runtime import dist_env

from .. import placement_choice
from ..group_offload import load_disk_expert, load_ram_expert
from ..placement_choice import Inventory, Needs, gib
from .base import ENCODER_FREED, Layout, PlacementKind, PlanInput, check_ranks_fit_gpus, default_dtype, get, measure


class Cpu(PlacementKind):
    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        both = sum(needs.experts)
        return "expert" if len(needs.experts) > 1 and both + needs.activations > inv.usable_ram else "step"

    def layout(self, x: PlanInput) -> Layout:
        where = {"text_encoder": f"cpu, {ENCODER_FREED}"} | {e: "cpu" + x.one_at_a_time for e in x.sizes.experts}
        return Layout(where, {"cpu": x.resident_experts + x.needs.activations})


class Cuda(PlacementKind):
    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        if len(needs.experts) < 2 or not inv.gpus:
            return "step"
        best = max(inv.usable_gpu(i) for i in range(len(inv.gpus)))
        return "step" if sum(needs.experts) + needs.activations <= best else "expert"

    def layout(self, x: PlanInput) -> Layout:
        where = {"text_encoder": f"cuda:0, {ENCODER_FREED}"} | {e: "cuda:0" + x.one_at_a_time for e in x.sizes.experts}
        return Layout(where, {"cuda:0": x.resident_experts + x.needs.activations})


class Offload(PlacementKind):
    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        return "expert" if len(needs.experts) > 1 and sum(needs.experts) > inv.usable_ram else "step"

    def load_expert(self, p, spec, comp, log=print, fuse=None):
        return load_ram_expert(spec, comp, p.torch_dtype, p.device, fuse)

    def layout(self, x: PlanInput) -> Layout:
        if not x.inv.gpus:
            where = {"text_encoder": f"cpu, {ENCODER_FREED}"}
            where |= {e: "cpu RAM (on a CPU, offload computes where the weights are)" for e in x.sizes.experts}
            return Layout(where, {"cpu": x.resident_experts + x.needs.activations})
        where = {"text_encoder": f"cpu, moved to cuda:0 as a whole to encode (model offload), {ENCODER_FREED}"}
        where |= {e: f"cpu RAM (pinned), one layer at a time on cuda:0 (+ the next, prefetched on a CUDA stream; "
                     f"largest {gib(x.needs.layer)})" for e in x.sizes.experts}
        return Layout(where, {"cpu": x.resident_experts, "cuda:0": x.needs.layer_streaming_gpu},
                      streamed=max(x.needs.experts))


class Disk(PlacementKind):
    def load_expert(self, p, spec, comp, log=print, fuse=None):
        return load_disk_expert(spec, comp, p.torch_dtype, p.device, p.offload_dir, log)

    def cannot_fuse(self, p) -> str | None:
        return "its experts stream from an offload folder written from the checkpoint as it is"

    def layout(self, x: PlanInput) -> Layout:
        both, block_ram = sum(x.needs.experts), x.needs.block + x.needs.other
        if not x.inv.gpus:
            where = {"text_encoder": f"cpu, {ENCODER_FREED}"}
            where |= {e: "offload folder (disk), one block at a time in RAM" for e in x.sizes.experts}
            return Layout(where, dict(disk=both, cpu=block_ram + x.needs.activations), max(x.needs.experts))
        where = {"text_encoder": f"cpu, moved to cuda:0 as a whole to encode (model offload), {ENCODER_FREED}"}
        where |= {e: "offload folder (disk), one block at a time in RAM and on cuda:0" for e in x.sizes.experts}
        # the GPU: the block computing, the next one prefetched, the rest of the expert and the activations
        gpu = 2 * x.needs.block + x.needs.other + x.needs.activations
        return Layout(where, dict(disk=both, cpu=block_ram) | {"cuda:0": gpu}, max(x.needs.experts))


class Auto(PlacementKind):
    def validate(self, cfg) -> None:
        if dist_env().world_size > 1 and self.uses_rank_gpu():
            check_ranks_fit_gpus("placement auto (on a machine with GPUs)")

    def check(self, cfg, spec) -> None:
        if cfg.max_memory is not None:
            raise UserError("--max-memory needs --placement balanced or sequential (auto picks its own budget)")

    def resolve(self, cfg, spec):
        device = self.execution_device(cfg)
        needs, inv = measure(cfg, spec, cfg.dtype or default_dtype(device), gpus=device.type == "cuda")
        d = placement_choice.decide(needs, inv)
        entry = get(d.placement)
        if dist_env().world_size > 1 and entry.caps.spreads:  # one rank per node: still one teacher per rank
            entry = get(placement_choice.pick(streams="ram"))
        device = entry.execution_device(cfg)
        return entry.placement(cfg, spec, device, cfg.dtype or default_dtype(device), d.expert_order,
                               needs.activations, reason="; ".join(d.reasons))
