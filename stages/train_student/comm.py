"""Collectives of stage two on plain tensors (no pickled objects): sums, maxima, byte gathers. Each is a no-op
for one process; values travel on `device` (NCCL reduces CUDA tensors only) and come back on the CPU."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(t: torch.Tensor, device: torch.device, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `t` over all ranks; returns a CPU tensor."""
    if not active():
        return t.cpu()
    x = t.to(device)
    dist.all_reduce(x, op=op)
    return x.cpu()


def all_reduce_numpy(a: np.ndarray, device: torch.device, op=dist.ReduceOp.SUM) -> np.ndarray:
    return all_reduce(torch.from_numpy(np.ascontiguousarray(a)), device, op).numpy()


def all_gather_bytes(data: bytes, device: torch.device) -> list[bytes]:
    """Every rank's `data` (any length), in rank order."""
    if not active():
        return [data]
    world = dist.get_world_size()
    n = all_reduce(torch.tensor([len(data)], dtype=torch.int64), device, dist.ReduceOp.MAX).item()
    buf = torch.zeros(n + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[8:8]
    bufs = [torch.empty_like(buf, device=device) for _ in range(world)]
    dist.all_gather(bufs, buf.to(device))
    bufs = [b.cpu() for b in bufs]
    return [b[8:8 + int.from_bytes(bytes(b[:8].tolist()), "little")].numpy().tobytes() for b in bufs]
