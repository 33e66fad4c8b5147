"""Where the teacher's weights live while stage one runs: one class per `--placement`, declared in
pipeline/registries.py (its name, help, capabilities and this class's import path).

    module          --placement                     weights live
    cpu.py          cpu                             RAM, computed on the CPU
    cuda.py         cuda                            one GPU (one replica per rank under torchrun)
    device_map.py   balanced, sequential, X.json    spread over GPUs (and cpu/disk) by an accelerate map
    offload.py      offload                         RAM, streamed to the GPU layer by layer
    disk.py         disk                            an offload folder, streamed block by block
    auto.py         auto                            the planner's pick (placement_choice.decide)

To add a placement: docs/architecture.md's recipe (a module here with a `PlacementKind` subclass, its declaration
in pipeline/registries.py, a row in docs/placements.md). Stage one, `plan`, the launch and the cost code read its
capabilities; the cache does not change (placements are left out of the fingerprint).
"""

from __future__ import annotations

from .base import Layout, Placement, PlacementKind, PlanInput, check_ranks_fit_gpus, default_dtype, get


def choose_placement(cfg, spec) -> Placement:
    """The placement this process runs with: the user's, checked, or (auto) the planner's pick."""
    entry = get(cfg.placement)
    entry.validate(cfg)
    entry.check(cfg, spec)
    return entry.resolve(cfg, spec)


__all__ = ["Layout", "Placement", "PlacementKind", "PlanInput", "check_ranks_fit_gpus", "choose_placement",
           "default_dtype", "get"]
