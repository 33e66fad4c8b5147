"""diffusers' group-offloading internals that the `disk` and `offload` placements use, in one place, each read in
the diffusers versions CHECKED names: `internal` refuses in one line when one has moved (test_private_adapters.py)."""

from __future__ import annotations

import importlib

CHECKED = ("0.42",)  # diffusers major.minor versions these internals were read in
_HOOKS = "diffusers.hooks.group_offloading"
INTERNALS = ("_GROUP_OFFLOADING", "_GO_LC_SUPPORTED_PYTORCH_LAYERS")  # of diffusers.hooks.group_offloading
GROUP_ATTRIBUTES = ("tensor_to_key", "safetensors_file_path")  # what ModuleGroup.__init__ sets for a disk group


def internal(name: str):
    """The private `name` of diffusers' group offloading (one of INTERNALS); RuntimeError in one line if moved."""
    import diffusers

    assert name in INTERNALS, name  # every private name is listed, so that the test checks it
    try:
        return getattr(importlib.import_module(_HOOKS), name)
    except AttributeError:
        raise RuntimeError(f"diffusers {diffusers.__version__} has no {_HOOKS}.{name}, which WanDistiller uses "
                           f"(checked with diffusers {', '.join(CHECKED)}); install one of those or update "
                           "pipeline/diffusers_private.py") from None


def leaf_layers() -> tuple[type, ...]:
    """The layer types leaf-level group offloading makes a group of each."""
    return tuple(internal("_GO_LC_SUPPORTED_PYTORCH_LAYERS"))


def groups(model) -> list:
    """The distinct diffusers `ModuleGroup`s of a group-offloaded model (from RAM or from disk)."""
    name = internal("_GROUP_OFFLOADING")
    seen = {}
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(name) if registry is not None else None
        if hook is not None:
            seen.setdefault(id(hook.group), hook.group)
    return list(seen.values())


def disk_groups(model) -> list[tuple[object, dict, str]]:
    """(group, {tensor: its key in the group's file}, the file's path) of each group of a model offloaded to disk."""
    found = groups(model)
    if not found or not all(hasattr(g, a) for g in found for a in GROUP_ATTRIBUTES):
        import diffusers

        raise RuntimeError(f"diffusers {diffusers.__version__} lays out disk group offloading differently than "
                           f"WanDistiller expects (ModuleGroup.{' / '.join(GROUP_ATTRIBUTES)}; checked with diffusers "
                           f"{', '.join(CHECKED)})")
    return [(g, g.tensor_to_key, g.safetensors_file_path) for g in found]
