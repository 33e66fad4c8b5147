"""Where the teacher's weights live while stage one runs: one class per `--placement` (kinds.py, device_map.py),
declared in pipeline/registries.py (docs/placements.md, "How to add a placement")."""

from __future__ import annotations

from .base import (
    ExpertSet, Layout, Placement, PlacementKind, PlanInput, check_ranks_fit_gpus, default_dtype, get, load_experts,
)


def choose_placement(cfg, spec) -> Placement:
    """The placement this process runs with: the user's, checked, or (auto) the planner's pick."""
    entry = get(cfg.placement)
    entry.validate(cfg)
    entry.check(cfg, spec)
    return entry.resolve(cfg, spec)


__all__ = ["ExpertSet", "Layout", "Placement", "PlacementKind", "PlanInput", "check_ranks_fit_gpus",
           "choose_placement", "default_dtype", "get", "load_experts"]
