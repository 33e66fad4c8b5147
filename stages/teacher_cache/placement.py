"""Where the teacher's weights live while stage one runs, and loading them there.

This module owns the `--placement` choices. `cpu` and `cuda` keep a whole replica on one device.
"""

from __future__ import annotations

import torch

from pipeline.errors import UserError

from .teacher import TeacherSpec

AVAILABLE = ("auto", "cpu", "cuda")


def resolve_placement(placement: str) -> str:
    """The concrete placement for this machine; clear errors for what cannot run here."""
    if placement == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if placement not in AVAILABLE:
        raise UserError(f"placement {placement!r} is not available in this version; use one of "
                        f"{', '.join(AVAILABLE)}")
    if placement == "cuda" and not torch.cuda.is_available():
        raise UserError("placement 'cuda' needs a CUDA GPU and none is visible; use --placement cpu "
                        "(or check CUDA_VISIBLE_DEVICES and the driver)")
    return placement


def execution_device(placement: str, device_index: int) -> torch.device:
    if placement == "cpu":
        return torch.device("cpu")
    if device_index >= torch.cuda.device_count():
        raise UserError(f"--device {device_index} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", device_index)


def default_dtype(placement: str) -> str:
    """bfloat16 where the teacher runs on a GPU, float32 on CPU (bf16 matmuls are slow on most CPUs)."""
    return "float32" if placement == "cpu" else "bfloat16"


def load_text_encoder(spec: TeacherSpec, dtype: torch.dtype, device: torch.device):
    """Tokenizer and UMT5 encoder on `device`. T5 overflows in float16, so float16 runs it in bfloat16."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    enc_dtype = torch.bfloat16 if dtype == torch.float16 else dtype
    tokenizer = AutoTokenizer.from_pretrained(spec.path, subfolder="tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(spec.path, subfolder="text_encoder", dtype=enc_dtype)
    return tokenizer, encoder.to(device).eval().requires_grad_(False)


def load_experts(spec: TeacherSpec, dtype: torch.dtype, device: torch.device) -> list[torch.nn.Module]:
    """The transformer(s) in expert order (1 = high-noise `transformer`, 2 = low-noise `transformer_2`)."""
    from diffusers import WanTransformer3DModel

    models = []
    for comp in spec.experts:
        m = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp, torch_dtype=dtype)
        models.append(m.to(device).eval().requires_grad_(False))
    return models


def load_scheduler(spec: TeacherSpec):
    """The teacher's own scheduler class and config (UniPC flow for the released Wan 2.x pipelines)."""
    import diffusers

    cls_name = spec.configs["scheduler"].get("_class_name")
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise UserError(f"teacher scheduler class {cls_name!r} is unknown to diffusers {diffusers.__version__}")
    return cls.from_pretrained(spec.path, subfolder="scheduler")
