"""`--placement auto` (the default): the planner's pick for this machine (placement_choice.decide)."""

from __future__ import annotations

from pipeline.errors import UserError
from pipeline.runtime import dist_env

from .. import placement_choice
from .base import Layout, PlacementKind, PlanInput, check_ranks_fit_gpus, default_dtype, get, measure


class Auto(PlacementKind):

    def validate(self, cfg) -> None:
        if dist_env().world_size > 1 and self.uses_rank_gpu():
            check_ranks_fit_gpus("placement auto (on a machine with GPUs)")

    def check(self, cfg, spec) -> None:
        if cfg.max_memory is not None:
            raise UserError("--max-memory needs --placement balanced or sequential (auto picks its own budget)")

    def resolve(self, cfg, spec):
        device = self.execution_device(cfg)
        dtype = cfg.dtype or default_dtype(device)
        needs, inv = measure(cfg, spec, dtype, gpus=device.type == "cuda")
        d = placement_choice.decide(needs, inv)
        entry = get(d.placement)
        if dist_env().world_size > 1 and entry.caps.spreads:  # one rank per node: still one teacher per rank
            entry = get(placement_choice.pick(streams="ram"))
        device = entry.execution_device(cfg)
        dtype = cfg.dtype or default_dtype(device)
        return entry.placement(cfg, spec, device, dtype, d.expert_order, needs.activations,
                               reason="; ".join(d.reasons))

    def layout(self, x: PlanInput) -> Layout:
        raise RuntimeError("auto has no layout of its own: plan the placement placement_choice.decide picks")
