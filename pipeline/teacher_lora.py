"""The user's LoRAs fused into the teacher (`teacher-cache --teacher-lora [EXPERT=]FILE[:SCALE]`): stage one caches
the teacher as it draws with them, and sample and eval fuse the same files (checked by sha256) into the teacher
they draw beside a student of that cache.

A file is read once, through the trust boundary (a regular file, bounded, safetensors only: nothing in it runs), in
diffusers' or the original Wan key names (diffusers' `WanPipeline.lora_state_dict` converts the latter); it is fused
into each expert it names by peft (`fuse_lora`, then the adapter unloaded), leaving plain Linear layers whose weights
are W + scale * B A alpha / rank: the teacher that runs is an ordinary transformer, at no cost per step.
docs/usage.md, "Your LoRA in the teacher"."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cache import safe_open
from cache.records import TeacherLora

from .user_error import UserError

if TYPE_CHECKING:
    import torch

EXPERTS = {"1": 1, "high": 1, "2": 2, "low": 2}  # EXPERT= of --teacher-lora: the header's expert numbers
EXPERT_NAMES = {1: "transformer", 2: "transformer_2"}  # the pipeline's components
CAP = 16 << 30  # the largest LoRA file read (a rank-256 LoRA of a 14B expert is ~5 GB in float32)
FORM = "[EXPERT=]FILE[:SCALE], EXPERT 1|high or 2|low (default: every expert), SCALE default 1"


@dataclass(frozen=True)
class Loaded:
    """One --teacher-lora: its record (what the header holds), where it was, and its tensors."""

    record: TeacherLora
    path: str
    state: dict[str, torch.Tensor]
    metadata: dict | None = None  # diffusers' LoraConfig beside the tensors (its alpha), where the file holds one


def parse(text: str) -> tuple[str, float, tuple[int, ...] | None]:
    """(file, scale, experts or None: every expert) of one `--teacher-lora` value; ValueError otherwise."""
    expert, sep, rest = text.partition("=")
    if not sep or expert not in EXPERTS:
        expert, rest = None, text  # (a file whose name holds "=": no expert given)
    file, sep, scale = rest.rpartition(":")
    try:
        value = float(scale) if sep else 1.0
    except ValueError:
        sep = ""  # (a file whose name holds ":")
    if not sep:
        file, value = rest, 1.0
    if not file:
        raise ValueError(f"teacher-lora {text!r}: no file; give {FORM}")
    if not (value == value and abs(value) < 1e3):
        raise ValueError(f"teacher-lora {text!r}: scale {scale} is not a number of at most 1000; give {FORM}")
    return file, value, None if expert is None else (EXPERTS[expert],)


def read(text: str, experts: int) -> Loaded:
    """The --teacher-lora `text` read for a teacher of `experts` experts; UserError in one line where the file is
    not a regular safetensors file of floating-point tensors, or names an expert the teacher lacks."""
    file, scale, which = parse(text)
    if which is not None and which[0] > experts:
        raise UserError(f"--teacher-lora {text}: the teacher has one expert (transformer); drop {text.split('=')[0]}=")
    path = os.path.abspath(file)
    data = _read(path, "the teacher LoRA", f"pass the LoRA's .safetensors file ({FORM})")
    return Loaded(TeacherLora(file=Path(path).name, sha256=hashlib.sha256(data).hexdigest(), scale=scale,
                              experts=list(which or range(1, experts + 1))), path, *_tensors(data, path))


def _read(path: str, what: str, fix: str, hashed: bool = False) -> bytes | str:
    """The bytes of the LoRA file at `path` (a regular file of at most CAP bytes; `hashed`: their sha256, in bounded
    memory), or a UserError naming it."""
    try:
        return (safe_open.sha256_named if hashed else safe_open.read_named)(path, what, CAP, fix)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist; {fix}") from None
    except OSError as e:  # (permissions, I/O; a FIFO, a folder or too large a file: UnsafeFileError, one line)
        raise UserError(f"{what} {path} cannot be read ({getattr(e, 'strerror', None) or e}); {fix}") from None


def _tensors(data: bytes, where: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The file's tensors and diffusers' adapter config in its header (`save_lora_weights` writes it: without it a
    LoRA's alpha would read as its rank)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
    from safetensors.torch import load

    try:
        state = load(data)
    except Exception as e:  # (safetensors' own errors name no file)
        raise UserError(f"the teacher LoRA {where} is not a safetensors file ({str(e).splitlines()[0][:120]}); "
                        "pass a LoRA saved as .safetensors (a .pt/.ckpt pickle is never loaded)") from None
    if not state or any(not t.is_floating_point() for t in state.values()):
        raise UserError(f"the teacher LoRA {where} holds {'no tensors' if not state else 'non-float tensors'}: it is "
                        "not a LoRA; pass one saved by diffusers, peft or a Wan trainer")
    header = safe_open.parse_json(data[8:8 + int.from_bytes(data[:8], "little")], f"the header of {where}")
    raw = (header.get("__metadata__") or {}).get(LORA_ADAPTER_METADATA_KEY)  # (load above checked the header)
    metadata = safe_open.parse_json(raw, f"the adapter config in {where}") if raw else None
    if metadata is not None and not isinstance(metadata, dict):
        raise UserError(f"the teacher LoRA {where}: its {LORA_ADAPTER_METADATA_KEY} is not an object; save it again "
                        "with diffusers' save_lora_weights")
    return state, metadata


def recorded(loras: list[TeacherLora] | None, paths: list[str] | None, where: str) -> list[Loaded]:
    """The LoRAs a cache's or a run's record (`where`) says its teacher carried, read again from their paths and
    refused in one line unless each is still the file it was (its sha256)."""
    if not loras:
        return []
    if not paths or len(paths) != len(loras):
        raise UserError(f"{where}: its teacher carried LoRAs ({', '.join(r.file for r in loras)}) but the record has no "
                        "paths to them (an export's copy); sample or evaluate the training run's folder instead")
    out = []
    for rec, path in zip(loras, paths):
        fix = f"put the file {where} names back at {path} (sha256 {rec.sha256})"
        what = f"the teacher LoRA {where} names:"
        # (hashed a chunk at a time before it is read whole, and the bytes read hashed again: changed in between)
        if _read(path, what, fix, hashed=True) != rec.sha256 or hashlib.sha256(
                data := _read(path, what, fix)).hexdigest() != rec.sha256:
            raise UserError(f"the teacher LoRA {path} is not the one {where} was made with (its sha256 differs); {fix}")
        out.append(Loaded(rec, path, *_tensors(data, path)))
    return out


def fuse(model: torch.nn.Module, loras: list[Loaded], expert: int) -> torch.nn.Module:
    """`model` (expert `expert`, its weights on real devices) with each LoRA that names it fused in, in order."""
    from diffusers import WanPipeline

    for i, lora in enumerate(x for x in loras if expert in x.record.experts):
        name = f"teacher_lora_{i}"
        try:
            state = WanPipeline.lora_state_dict(dict(lora.state))
        except (ValueError, KeyError) as e:
            raise UserError(f"the teacher LoRA {lora.path} is in no key layout diffusers reads for Wan "
                            f"({str(e).splitlines()[0][:120]}); save it with diffusers' or Wan's key names") from None
        if isinstance(state, tuple):
            state = state[0]
        wanted = sum(k.endswith(".lora_A.weight") for k in state if k.startswith("transformer."))
        try:
            WanPipeline.load_lora_into_transformer(state, transformer=model, adapter_name=name, metadata=lora.metadata)
        except (RuntimeError, ValueError) as e:  # (a LoRA of another model: shapes differ)
            raise UserError(f"the teacher LoRA {lora.path} does not fit expert {expert} ({EXPERT_NAMES[expert]}) of "
                            f"this teacher ({str(e).splitlines()[0][:160]}); pass a LoRA trained on this teacher"
                            ) from None
        found = sum(1 for n, _ in model.named_parameters() if n.endswith(f"lora_A.{name}.weight"))
        if wanted == 0 or found < wanted:
            if found:
                model.unload_lora()
            raise UserError(f"the teacher LoRA {lora.path}: {found} of its {wanted} adapted layers are layers of "
                            f"expert {expert} ({EXPERT_NAMES[expert]}) of this teacher; pass a LoRA trained on it")
        model.fuse_lora(lora_scale=lora.record.scale, adapter_names=[name])
        model.unload_lora()
    return model


def read_fitted(texts: tuple[str, ...] | None, experts: int, configs: dict[str, dict]) -> list[Loaded]:
    """`read` of each of `texts` for a teacher of `experts` experts, refused in one line where it does not fit the
    transformer `configs` (by component): fused into them built on the meta device (stage one and its dry run)."""
    import warnings

    import torch
    from diffusers import WanTransformer3DModel

    loras = [read(t, experts) for t in texts or ()]
    for expert, comp in EXPERT_NAMES.items():
        if comp in configs and any(expert in x.record.experts for x in loras):
            with torch.device("meta"):
                model = WanTransformer3DModel.from_config(configs[comp])
            with warnings.catch_warnings():  # (torch: "copying from a non-meta parameter ... is a no-op")
                warnings.simplefilter("ignore")
                fuse(model, loras, expert)
    return loras


def fuse_pipeline(pipe, loras: list[Loaded]):
    """A diffusers Wan pipeline (still on the CPU) with `loras` fused into its experts."""
    for expert, comp in EXPERT_NAMES.items():
        if getattr(pipe, comp, None) is not None:
            fuse(getattr(pipe, comp), loras, expert)
    return pipe
