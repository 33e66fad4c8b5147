"""The old import path of the placement code, kept only for bench/*.py until they import from the new homes
(teacher.py loads the teacher's parts, placements/ holds the placements). Nothing in stages/ imports this
module; delete it once bench/ does not either."""

from __future__ import annotations

import torch

from .placements import Placement
from .placements.base import default_dtype as _default_dtype
from .teacher import ExpertSet, TeacherSpec, load_scheduler
from .teacher import load_experts as _load_experts
from .teacher import load_text_encoder as _load_text_encoder

__all__ = ["ExpertSet", "Placement", "default_dtype", "load_experts", "load_scheduler", "load_text_encoder"]


def default_dtype(placement: str, device: torch.device | None = None) -> str:
    if device is None:
        device = torch.device("cpu" if placement == "cpu" or not torch.cuda.is_available() else "cuda")
    return _default_dtype(device)


def load_text_encoder(spec: TeacherSpec, dtype: torch.dtype, device: torch.device, placement=None):
    return _load_text_encoder(spec, dtype, device, model_offload=placement is not None and placement.offloads_text_encoder)


def load_experts(spec: TeacherSpec, dtype: torch.dtype, device: torch.device, placement=None, log=print) -> ExpertSet:
    if placement is None:
        placement = Placement("cpu" if device.type == "cpu" else "cuda", device, str(dtype).removeprefix("torch."))
    return _load_experts(spec, placement, log)
