"""Distributed runtime: who am I (rank/world), process-group setup and teardown, rank-0 printing."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env() -> DistEnv:
    """Rank and world size as torchrun sets them (a plain process is rank 0 of 1)."""
    return DistEnv(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Join the torchrun process group (NCCL with CUDA, gloo otherwise); no-op for one process."""
    env = dist_env()
    if env.world_size > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return env


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if dist_env().rank == 0:
        print(*args, **kwargs, flush=True)
