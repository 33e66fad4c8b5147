"""Teacher features for feature distillation (`teacher-cache --record-features BLOCKS`), read on the way.

The outputs of the chosen blocks of whichever expert runs a step are read by forward hooks that only look
(they return nothing, so the block's output and every later computation are untouched: the cached targets
are bit-identical to a cache made without features), during the same forward that makes the targets (no
second teacher pass). With CFG the batch is [conditional; unconditional]: the first half is kept. Each is
projected through the cache's fixed matrix on the device that holds the block (cache/feature_projection.py), pooled
over tokens on request, and handed back on the CPU in the cache's dtype, per trajectory of the batch.
"""

from __future__ import annotations

import contextlib

import torch

from cache.feature_projection import project
from pipeline.errors import UserError


class FeatureRecorder:
    """Captures [B, len(blocks), tokens or 1, D] per forward of an expert."""

    def __init__(self, blocks: tuple[int, ...], matrix: torch.Tensor, pool: str, dtype: torch.dtype):
        self.blocks, self.matrix, self.pool, self.dtype = tuple(blocks), matrix, pool, dtype
        self._out: dict[int, torch.Tensor] = {}

    @staticmethod
    def check_blocks(blocks: tuple[int, ...], num_layers: int, expert: str) -> None:
        bad = [b for b in blocks if not 0 <= b < num_layers]
        if bad:
            raise UserError(f"--record-features {','.join(map(str, blocks))}: {expert} has blocks 0..{num_layers - 1}, "
                            f"not {bad}; choose blocks inside every expert")

    @contextlib.contextmanager
    def capture(self, model: torch.nn.Module, batch: int):
        """Record the chosen blocks' outputs of `model` during the forward inside the `with` (the first
        `batch` rows: the conditional branch)."""
        self._out = {}
        handles = [model.blocks[b].register_forward_hook(self._hook(b, batch)) for b in self.blocks]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, block: int, batch: int):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                self._out[block] = project(hidden[:batch], self.matrix, self.pool).to("cpu", self.dtype)
        return hook

    def result(self) -> torch.Tensor:
        """The last captured forward: [B, len(blocks), tokens or 1, D] on the CPU."""
        missing = [b for b in self.blocks if b not in self._out]
        if missing:
            raise RuntimeError(f"teacher blocks {missing} did not run in the last forward")
        return torch.stack([self._out[b] for b in self.blocks], dim=1)
