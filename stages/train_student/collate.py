"""Stage two's batches: a micro-batch as lists of the samples' own tensors, laid out where they are used."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import get_worker_info

from pipeline.torch_private import shared_bytes


def _in_shared_memory(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors`, copied one after the other into one buffer in shared memory (views of it, same shapes)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = np.cumsum([0] + [-(-n // 64) * 64 for n in sizes])  # (each at a multiple of 64 bytes: any dtype's)
    buf = shared_bytes(int(starts[-1]))  # (shared: the batch reaches training uncopied)
    out, flat = [], buf.numpy()
    for t, n, at in zip(tensors, sizes, starts.tolist()):
        # (with numpy, never torch: torch's intra-op threads wait on each other on a busy machine, docs/architecture.md
        # "Batches"; as flat uint8 memory, whatever the dtype)
        np.copyto(flat[at:at + n], t.contiguous().reshape(-1).view(torch.uint8).numpy())
        out.append(buf[at:at + n].view(t.dtype).view(t.shape))
    return out


def collate(items: list[dict]) -> dict:
    """A micro-batch: every field the dataset read and the prompt embeddings, as lists of the samples' tensors
    (stacked and padded once, on the device, by `to_device` / `padded_context`; a loader worker's in one buffer of
    shared memory), and the per-sample metadata as tensors."""
    names = list(items[0]["fields"])
    tensors = [i["fields"][n] for n in names for i in items] + [i["context"] for i in items]
    if get_worker_info() is not None:
        tensors = _in_shared_memory(tensors)
    b = len(items)
    return {
        "fields": {n: tensors[k * b:(k + 1) * b] for k, n in enumerate(names)},
        "context": tensors[len(names) * b:],
        "max_len": items[0]["max_len"],
        "timestep": torch.tensor([i["timestep"] for i in items], dtype=torch.float32),
        "sigma": torch.tensor([i["sigma"] for i in items], dtype=torch.float32),
        "step": torch.tensor([i["step"] for i in items], dtype=torch.int64),
        "weight": torch.tensor([i["weight"] for i in items], dtype=torch.float32),
        "keys": [i["key"] for i in items if i["weight"] > 0],
    }


def to_device(tensors: list[torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A collated batch's field (a list of the samples' tensors, one shape) stacked on `device` as `dtype`: [B, ...]."""
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=dtype, device=device)
    for j, t in enumerate(tensors):
        out[j].copy_(t, non_blocking=True)
    return out


def padded_context(batch: dict, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A collated batch's prompt embeddings on `device` as the teacher saw them: [B, max_len, D], each sample's
    real tokens, then zeros (as WanPipeline pads them)."""
    ctx = batch["context"]
    out = torch.zeros((len(ctx), batch["max_len"], ctx[0].shape[-1]), dtype=dtype, device=device)
    for j, c in enumerate(ctx):
        out[j, :c.shape[0]].copy_(c, non_blocking=True)
    return out
