"""The fixed projection that teacher features are stored through (`teacher-cache --record-features`).

A Wan2.2-A14B block output at 480x832 is 1,560 tokens x 5,120 x 2 bytes = 16 MB per sample; the cache keeps
it small by storing `hidden @ P`, P a fixed [dim, feature_dim] Gaussian matrix scaled by 1/sqrt(dim) (a
random projection keeps the geometry of the features: Johnson-Lindenstrauss), optionally pooled over tokens.
P is a function of (dim, feature_dim, seed) alone and is written into the cache beside the manifest; its
seed, size and sha256 are in the fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from .atomic import fsync_dir, honour_umask
from .cache_error import CacheError, UnsafeFileError
from .format import FEATURE_PROJECTION, P_MATRIX, TMP_SUFFIX
from .safe_open import read_bytes

POOLS = ("none", "mean")


def projection_matrix(dim: int, feature_dim: int, seed: int) -> torch.Tensor:
    """[dim, feature_dim] float32, N(0, 1/dim) entries from a CPU generator seeded with `seed` alone."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn(dim, feature_dim, generator=g, dtype=torch.float32) / dim ** 0.5


def matrix_sha256(matrix: torch.Tensor) -> str:
    return hashlib.sha256(matrix.contiguous().numpy().tobytes()).hexdigest()


def write_projection(cache_dir: str | os.PathLike, matrix: torch.Tensor) -> Path:
    """CACHE_DIR/feature_projection.safetensors, written to a temporary name and renamed."""
    path = Path(cache_dir) / FEATURE_PROJECTION
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")  # parts on other processes write it too
    save_file({P_MATRIX: matrix.contiguous()}, tmp)
    honour_umask(tmp)  # (safetensors writes 0600 whatever the umask)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
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
