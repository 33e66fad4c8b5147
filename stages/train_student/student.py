"""The student kind (`StudentKind`, docs/architecture.md "The student kind"): `CompactStudent` here
(`--student-config`), `LoraStudent` in lora_student.py; `trained_parameters` is what trains for both."""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import torch

from pipeline.artifact import LoraRecord
from pipeline.config_types import read_object
from pipeline.errors import UserError
from pipeline.hub import FIRST_TRANSFORMER, teacher_folder

_BLOCK_PREFIX = "blocks."


def _model_class():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


def load_student_config(path: str | os.PathLike) -> dict:
    """Read and check a student JSON config; keys starting with '_' (diffusers metadata) are ignored."""
    p = Path(path)
    raw = read_object(p, "student config", "pass a JSON file of WanTransformer3DModel arguments like "
                      "configs/student-tiny.json")
    cfg = {k: v for k, v in raw.items() if not k.startswith("_")}
    valid = {p for p in inspect.signature(_model_class().__init__).parameters if p != "self"}
    if unknown := sorted(set(cfg) - valid):
        raise UserError(f"student config {p}: unknown key(s) {', '.join(unknown)}; WanTransformer3DModel takes "
                        f"{', '.join(sorted(valid))}")
    if "patch_size" in cfg:
        cfg["patch_size"] = tuple(cfg["patch_size"])
    return cfg


def check_compatible(cfg: dict, manifest: dict, path: str) -> None:
    """Refuse a student that cannot consume the cache's latents and prompt embeddings."""
    defaults = {k: v.default for k, v in inspect.signature(_model_class().__init__).parameters.items()}
    get = lambda k: cfg.get(k, defaults.get(k))  # noqa: E731
    c, f, h, w = manifest.latent_shape
    problems = []
    if get("in_channels") != c:
        problems.append(f"in_channels {get('in_channels')} but the cache's latents have {c} channels")
    if (get("out_channels") or get("in_channels")) != c:
        problems.append(f"out_channels {get('out_channels')} but the targets have {c} channels")
    text_dim = manifest.text_dim
    if text_dim is not None and get("text_dim") != text_dim:
        problems.append(f"text_dim {get('text_dim')} but the cache's prompt embeddings have {text_dim}")
    pt, ph, pw = tuple(get("patch_size"))
    if f % pt or h % ph or w % pw:
        problems.append(f"patch_size {[pt, ph, pw]} does not divide the latent grid {[f, h, w]}")
    else:  # Wan's rotary table (WanRotaryPosEmbed) holds rope_max_seq_len positions per axis, in patches
        rope = int(get("rope_max_seq_len"))
        axes = (("frames", f // pt), ("height", h // ph), ("width", w // pw))
        if over := [f"{name} {n}" for name, n in axes if n > rope]:
            problems.append(f"rope_max_seq_len {rope} is fewer positions than the cache's latents have patches "
                            f"along an axis ({', '.join(over)}); set rope_max_seq_len to at least "
                            f"{max(f // pt, h // ph, w // pw)}")
    teacher_patch = manifest.patch_size
    if manifest.expand_timesteps and [pt, ph, pw] != list(teacher_patch):
        problems.append(f"patch_size {[pt, ph, pw]} differs from the teacher's {teacher_patch}, and this cache "
                        "uses per-token timesteps laid out on the teacher's patch grid")
    if problems:
        raise UserError(f"student config {path} does not fit the cache: " + "; ".join(problems)
                        + f" (cache: latent {[c, f, h, w]}, text_dim {text_dim}, patch {teacher_patch})")


class StudentKind:
    """One kind of student, as stage two trains it (the module docstring)."""

    config: dict  # its WanTransformer3DModel config, checked against the cache (set by `prepare` at the latest)
    bf16_policy = True  # --strategy fsdp may gather its float32 master weights in bf16 (a MixedPrecisionPolicy)

    def __init__(self, cfg):
        self.cfg = cfg

    def prepare(self, manifest: dict, cache: str, requested: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Refuse (one line) a cache this student cannot learn from; returns the cached steps to train on."""
        raise NotImplementedError

    def build(self, seed: int, dtype: torch.dtype) -> torch.nn.Module:
        """The untrained student, the same on every rank for `seed` (`dtype`: the autocast dtype, float32 without)."""
        raise NotImplementedError

    def describe(self, model: torch.nn.Module) -> str:
        """What the run's first line adds about the student."""
        return ""

    def record(self) -> LoraRecord | None:
        """distill.json's `lora` entry."""
        return None

    def identity(self) -> dict | None:
        """The run identity's entry of what this kind adds to its config (a resume must find it again)."""
        return None

    def teacher_flag(self) -> tuple[str, str | None]:
        """(flag, teacher) of the teacher this run names, if any."""
        return "--init-from-teacher", self.cfg.init_from_teacher

    def checkpoint_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the student (a DDP checkpoint's model.safetensors), in host memory."""
        return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}

    def load_checkpoint_state(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Put a checkpoint's `checkpoint_state` back, strictly."""
        model.load_state_dict(tensors, strict=True)

    def shard(self, model: torch.nn.Module, **kw) -> None:
        """FSDP2 units below the root one (`kw`: fully_shard's mesh and policy): one per transformer block."""
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, **kw)

    def gathered(self, model: torch.nn.Module, is_main: bool):
        """What rank 0 saves of an FSDP-sharded student (every rank calls this; None off rank 0): the full weights
        in host memory, in the unsharded class."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_main:
            return None
        with torch.device("meta"):  # no memory behind its weights: the gathered tensors become them
            plain = _model_class()(**{k: v for k, v in model.config.items() if not k.startswith("_")})
        plain.load_state_dict(full, assign=True)
        return plain


def student_kind(cfg) -> StudentKind:
    """The student `cfg` asks for, chosen once: LoRA adapters on the teacher with --lora-of, else a compact one."""
    if cfg.lora_of is None:
        return CompactStudent(cfg)
    # (declared by import path, as the registries declare implementations: lora_student.py builds on this module)
    return importlib.import_module("stages.train_student.lora_student").LoraStudent(cfg)


class CompactStudent(StudentKind):
    """A compact student: a small WanTransformer3DModel from --student-config, trained whole."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.config = load_student_config(cfg.student_config)

    def prepare(self, manifest, cache, requested):
        check_compatible(self.config, manifest, self.cfg.student_config)
        return requested

    def build(self, seed, dtype):
        return build_student(self.config, self.cfg.student_config, seed)


def build_student(cfg: dict, path: str, seed: int) -> torch.nn.Module:
    """A float32 student with weights drawn from `seed` (same seed, same weights on every rank)."""
    torch.manual_seed(seed)
    try:
        return _model_class()(**cfg).float()
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise UserError(f"student config {path} cannot build a WanTransformer3DModel: {e}") from e


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The student's parameters that training changes, by name: all of a compact student's, a LoRA student's adapters
    (its base is frozen). What the optimizer, the EMA and the checkpoints hold."""
    return [(k, p) for k, p in model.named_parameters() if p.requires_grad]


def _teacher_weights(path: str, revision: str | None = None,
                     flag: str = "--init-from-teacher") -> tuple[list[Path], dict]:
    """The safetensors files of a teacher transformer and its config (pipeline folder, transformer folder, a single
    .safetensors file, or a Hub id: its first transformer alone is fetched, or found in the local Hub cache)."""
    p = teacher_folder(path, revision, files=FIRST_TRANSFORMER, flag=flag)
    if (p / "model_index.json").is_file():
        p = p / "transformer"
    single = p.is_file() and p.suffix == ".safetensors"
    if not single and not p.is_dir():
        raise UserError(f"{flag} {path} is neither a Wan pipeline folder, a transformer folder nor a .safetensors file")
    if not (files := [p] if single else sorted(p.glob("*.safetensors"))):
        raise UserError(f"{flag} {path}: no .safetensors weights in {p}")
    cfg_path = (p.parent if single else p) / "config.json"
    return files, read_object(cfg_path, f"{flag} {path}: config") if cfg_path.is_file() else {}


def init_from_teacher(model: torch.nn.Module, path: str, blocks: tuple[int, ...] | None,
                      revision: str | None = None, flag: str = "--init-from-teacher") -> dict:
    """Copy into `model` the teacher tensors whose names and shapes match; student block i takes teacher
    block blocks[i]. Only the needed tensors are read (safetensors `safe_open`, shapes from headers).
    Returns counts of copied and skipped tensors."""
    from safetensors import safe_open

    files, tcfg = _teacher_weights(path, revision, flag)
    n_student = len(model.blocks)
    n_teacher = tcfg.get("num_layers")
    if blocks is None:
        if n_teacher is None:
            raise UserError(f"{flag} {path} has no config.json giving num_layers; pass --teacher-blocks")
        # spread evenly over the teacher's depth, first and last included
        blocks = tuple(round(i * (n_teacher - 1) / max(n_student - 1, 1)) for i in range(n_student))
    if len(blocks) != n_student:
        raise UserError(f"--teacher-blocks lists {len(blocks)} blocks but the student has {n_student} "
                        f"(num_layers); give one teacher block per student block")
    if n_teacher is not None and max(blocks) >= n_teacher:
        raise UserError(f"--teacher-blocks {','.join(map(str, blocks))}: the teacher has blocks 0..{n_teacher - 1}")
    state = model.state_dict()
    by_teacher = {}  # teacher name -> student name
    for name in state:
        i, _, rest = name.removeprefix(_BLOCK_PREFIX).partition(".")
        by_teacher[f"{_BLOCK_PREFIX}{blocks[int(i)]}.{rest}" if name.startswith(_BLOCK_PREFIX) else name] = name
    copied, shape_mismatch = [], []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for tname in (k for k in f.keys() if k in by_teacher):
                    sname = by_teacher[tname]
                    if list(f.get_slice(tname).get_shape()) != list(state[sname].shape):
                        shape_mismatch.append(sname)
                    else:
                        state[sname].copy_(f.get_tensor(tname).to(state[sname].dtype))
                        copied.append(sname)
    if not copied:
        raise UserError(f"{flag} {path}: no teacher tensor matches the student's names and shapes "
                        f"({len(shape_mismatch)} differ in shape); use a student as wide as the teacher "
                        f"(same num_attention_heads x attention_head_dim, ffn_dim) or drop {flag}")
    return {"copied": len(copied), "shape_mismatch": len(shape_mismatch),
            "missing": len(state) - len(copied) - len(shape_mismatch), "teacher_blocks": list(blocks)}
