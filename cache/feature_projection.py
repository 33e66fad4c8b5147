"""The fixed projection that teacher features are stored through (`teacher-cache --record-features`): P, a
[dim, feature_dim] Gaussian matrix scaled by 1/sqrt(dim), a function of (dim, feature_dim, seed) alone
(docs/architecture.md, "Feature distillation")."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load, save

from .atomic import atomic_write_bytes
from .cache_error import CacheError, UnsafeFileError
from .format import FEATURE_PROJECTION, P_MATRIX
from .safe_open import read_bytes

POOLS = ("none", "mean")


def projection_matrix(dim: int, feature_dim: int, seed: int) -> torch.Tensor:
    """[dim, feature_dim] float32, N(0, 1/dim) entries from a CPU generator seeded with `seed` alone."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn(dim, feature_dim, generator=g, dtype=torch.float32) / dim ** 0.5


def matrix_sha256(matrix: torch.Tensor) -> str:
    return hashlib.sha256(matrix.contiguous().numpy().tobytes()).hexdigest()


def write_projection(cache_dir: str | os.PathLike, matrix: torch.Tensor) -> Path:
    """CACHE_DIR/feature_projection.safetensors, written atomically (parts on other processes write it too)."""
    path = Path(cache_dir) / FEATURE_PROJECTION
    atomic_write_bytes(path, save({P_MATRIX: matrix.contiguous()}))
    return path


def read_projection(cache_dir: str | os.PathLike, sha256: str) -> torch.Tensor:
    """The cache's projection matrix; CacheError if it is missing or is not the one the manifest records."""
    path = Path(cache_dir) / FEATURE_PROJECTION
    try:
        matrix = load(read_bytes(cache_dir, FEATURE_PROJECTION))[P_MATRIX]
    except UnsafeFileError:
        raise
    except (OSError, KeyError, Exception) as e:  # missing file, foreign or corrupt safetensors
        raise CacheError(f"{path} is unreadable ({type(e).__name__}); rerun the same `wandistiller teacher-cache` "
                         "command to rewrite it") from e
    if matrix_sha256(matrix) != sha256:
        raise CacheError(f"{path} is not the projection this cache's features were made with (sha256 differs); "
                         "rerun the same `wandistiller teacher-cache` command to rewrite it")
    return matrix


def project(hidden: torch.Tensor, matrix: torch.Tensor, pool: str) -> torch.Tensor:
    """[B, tokens, dim] block output -> [B, tokens or 1, feature_dim] float32, on `hidden`'s device."""
    if pool not in POOLS:  # (FEATURE_POOLS of pipeline/registries.py declares the same names)
        raise ValueError(f"feature pool {pool!r} is none of {', '.join(POOLS)}")
    out = hidden.float() @ matrix.to(hidden.device)
    return out.mean(1, keepdim=True) if pool == "mean" else out
