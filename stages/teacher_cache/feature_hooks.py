"""Teacher features for feature distillation (`teacher-cache --record-features BLOCKS`), read by forward hooks
that only look (they return nothing: the targets stay bit-identical) on the conditional half of the batch
(docs/architecture.md, "Feature distillation")."""

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
