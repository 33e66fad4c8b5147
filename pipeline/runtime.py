"""Distributed runtime: who am I (rank/world), process-group setup, barrier and teardown, rank-0 printing."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    is_main = property(lambda self: self.rank == 0)


def dist_env() -> DistEnv:
    """Rank and world size as torchrun sets them (a plain process is rank 0 of 1)."""
    return DistEnv(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def hide_gpus() -> None:
    """Hide the GPUs from this process and its children, for a run that asked for the CPU, before anything asks
    CUDA (importing diffusers does, torch's optimizers do at every step): each query starts a CUDA context nobody
    wanted, and breaks a process forked later (docs/architecture.md, "Devices: a CPU run never touches CUDA")."""
    if torch.cuda.is_initialized():  # too late to hide (an in-process caller used CUDA already): nothing to gain
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def init_distributed(timeout_s: float = 600.0, *, use_cuda: bool) -> DistEnv:
    """Join the torchrun process group: NCCL when the ranks compute on CUDA, each on its LOCAL_RANK GPU, gloo
    otherwise; a no-op for one process."""
    env = dist_env()
    if env.world_size > 1 and not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return env


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(device: torch.device | None = None) -> None:
    """Wait until every rank gets here (NCCL: through a CUDA tensor on `device`, by default the current one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    if dist.get_backend() == "nccl":
        # Named explicitly: torch would otherwise guess (and warn) from the current context.
        index = device.index if device is not None and device.type == "cuda" else torch.cuda.current_device()
        dist.barrier(device_ids=[index])
    else:
        dist.barrier()


def print0(msg: str) -> None:
    """Print a line on rank 0 only, through tqdm, so that a progress bar is redrawn below it, not cut by it."""
    if dist_env().is_main:
        tqdm.write(msg)
