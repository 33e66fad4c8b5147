"""`--placement offload`: each expert in CPU RAM, streamed layer by layer to the GPU (../group_offload.py); without
a GPU it computes where the weights are, as `cpu`."""

from __future__ import annotations

from ..group_offload import load_ram_expert
from ..placement_choice import Inventory, Needs, gib
from .base import ENCODER_FREED, Layout, PlacementKind, PlanInput


class Offload(PlacementKind):

    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        return "expert" if len(needs.experts) > 1 and sum(needs.experts) > inv.usable_ram else "step"

    def load_expert(self, p, spec, comp, log=print):
        return load_ram_expert(spec, comp, p.torch_dtype, p.device)

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
