"""`velocity+feature`: the teacher's prediction plus its hidden states (docs/architecture.md "Feature
distillation")."""

from __future__ import annotations

from dataclasses import asdict

import torch

from cache import format as F
from pipeline.errors import UserError
from pipeline.registries import FeatureSettings

from .objective_base import Batch, Objective, Outputs, block_output, mse


def parse_pairs(text) -> tuple[tuple[int, int], ...]:
    """"S:T,S:T" -> ((S, T), ...); ValueError with the expected form otherwise."""
    if isinstance(text, (list, tuple)):
        text = ",".join(str(x) for x in text)
    pairs = []
    for item in str(text or "").split(","):
        s, sep, t = item.strip().partition(":")
        if not sep or not s.strip().isdigit() or not t.strip().isdigit():
            raise ValueError(f"feature-pairs must look like 0:10,1:30 (student block:teacher block), got {text!r}")
        pairs.append((int(s), int(t)))
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"feature-pairs names a pair twice: {text!r}")
    return tuple(pairs)


class VelocityFeature(Objective):
    Config = FeatureSettings
    fields = (F.T_X_T, F.T_TARGET, F.T_FEATURES)

    def __init__(self, settings: dict | None = None):
        super().__init__(settings)
        self.pairs = parse_pairs(self.settings["feature_pairs"])
        self.weight = float(self.settings["feature_weight"])
        self.outputs = ("prediction", *dict.fromkeys(block_output(s) for s, _ in self.pairs))
        self.rows: dict[int, int] = {}  # teacher block -> row of the cached features (set by heads())
        self.pool = "none"

    @classmethod
    def from_config(cls, cfg) -> VelocityFeature:
        settings = cfg.objective_settings
        if not settings.feature_pairs:
            raise UserError("--objective velocity+feature needs --feature-pairs S:T,... (student block:teacher block "
                            "recorded by teacher-cache --record-features)")
        pairs = ",".join(f"{s}:{t}" for s, t in parse_pairs(settings.feature_pairs))
        return cls({**asdict(settings), "feature_pairs": pairs})

    def heads(self, student_config: dict, manifest: dict) -> torch.nn.Module:
        recorded = [int(b) for b in manifest.record_features or []]
        if unknown := sorted({t for _, t in self.pairs} - set(recorded)):
            raise UserError(f"--feature-pairs names teacher block(s) {unknown} that the cache did not record (it holds "
                            f"blocks {recorded}); pair with those or rebuild the cache with --record-features")
        self.rows = {b: i for i, b in enumerate(recorded)}
        self.pool = manifest.feature_pool
        width = int(student_config["num_attention_heads"]) * int(student_config["attention_head_dim"])
        dim = int(manifest.feature_dim)
        return torch.nn.ModuleDict({f"{s}:{t}": torch.nn.Linear(width, dim) for s, t in self.pairs})

    def terms(self, out: Outputs, batch: Batch, heads) -> dict[str, torch.Tensor]:
        cached = batch.fields[F.T_FEATURES]  # [B, recorded blocks, tokens or 1, D]
        feature = 0
        for s, t in self.pairs:
            mine = heads[f"{s}:{t}"](out.blocks[s].float())  # [B, tokens, D]
            feature = feature + mse(mine.mean(1, keepdim=True) if self.pool == "mean" else mine,
                                    cached[:, self.rows[t]])
        return {"velocity": mse(out.prediction, batch.fields[F.T_TARGET]),
                "feature": self.weight * feature / len(self.pairs)}
