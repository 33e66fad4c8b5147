"""Where the teacher's weights live while stage one runs: one registered entry per `--placement`.

    module          --placement                     weights live
    cpu.py          cpu                             RAM, computed on the CPU
    cuda.py         cuda                            one GPU (one replica per rank under torchrun)
    device_map.py   balanced, sequential, X.json    spread over GPUs (and cpu/disk) by an accelerate map
    offload.py      offload                         RAM, streamed to the GPU layer by layer
    disk.py         disk                            an offload folder, streamed block by block
    auto.py         auto                            the planner's pick (planner.decide)

To add a placement: write a module here with a `PlacementKind` subclass (base.py says what each method is
for), decorate it with `@register`, import the module below, and give it a row in docs/placements.md. If
`auto` should pick it, add its rule to `planner.decide`. Stage one, `wandistiller plan` and `--help` find it
through the registry; the cache does not change (placements are left out of the fingerprint).
"""

from __future__ import annotations

# Each module registers its entries on import; this order is the order errors and `plan` list them in.
from . import auto, cpu, cuda, device_map, offload, disk  # noqa: F401, I001
from .base import (
    REGISTRY, Layout, Placement, PlacementKind, PlanInput, check_ranks_fit_gpus, default_dtype, get, names, register,
)


def validate(cfg) -> None:
    """Refuse a placement that cannot run here before any weight loads or any device is touched (stage one
    calls it before torchrun's process group is set up)."""
    get(cfg.placement).validate(cfg)


def choose_placement(cfg, spec) -> Placement:
    """The placement this process runs with: the user's, checked, or (auto) the planner's pick."""
    entry = get(cfg.placement)
    entry.validate(cfg)
    return entry.resolve(cfg, spec)


__all__ = ["REGISTRY", "Layout", "Placement", "PlacementKind", "PlanInput", "check_ranks_fit_gpus",
           "choose_placement", "default_dtype", "get", "names", "register", "validate"]
