"""`--placement cpu`: a whole replica in RAM, computed on the CPU (float32 by default); it never touches CUDA."""

from __future__ import annotations

from ..placement_choice import Inventory, Needs
from .base import ENCODER_FREED, Layout, PlacementKind, PlanInput


class Cpu(PlacementKind):
    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        both = sum(needs.experts)
        return "expert" if len(needs.experts) > 1 and both + needs.activations > inv.usable_ram else "step"

    def layout(self, x: PlanInput) -> Layout:
        where = {"text_encoder": f"cpu, {ENCODER_FREED}"} | {e: "cpu" + x.one_at_a_time for e in x.sizes.experts}
        return Layout(where, {"cpu": x.resident_experts + x.needs.activations})
