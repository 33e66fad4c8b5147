"""`--placement cuda` (`--device N`, LOCAL_RANK under torchrun): a whole replica on one GPU."""

from __future__ import annotations

from ..placement_choice import Inventory, Needs
from .base import ENCODER_FREED, Layout, PlacementKind, PlanInput


class Cuda(PlacementKind):

    def expert_order(self, needs: Needs, inv: Inventory) -> str:
        if len(needs.experts) < 2 or not inv.gpus:
            return "step"
        best = max(inv.usable_gpu(i) for i in range(len(inv.gpus)))
        return "step" if sum(needs.experts) + needs.activations <= best else "expert"

    def layout(self, x: PlanInput) -> Layout:
        where = {"text_encoder": f"cuda:0, {ENCODER_FREED}"} | {e: "cuda:0" + x.one_at_a_time for e in x.sizes.experts}
        return Layout(where, {"cuda:0": x.resident_experts + x.needs.activations})
