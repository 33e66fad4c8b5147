"""The compact student kind (`train-student --student-config`): a small WanTransformer3DModel built from a JSON
config with the run's seed (teacher blocks copied in with --init-from-teacher) and trained whole; a run's student/
is its model folder, and a bare model folder is one too."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

import torch

from cache import safe_open
from pipeline import guidance_input
from pipeline.artifact import DISTILL, STUDENT, STUDENT_EMA, STUDENT_INIT, RunLayout, tensor_mismatch
from pipeline.config_types import read_object
from pipeline.errors import UserError
from pipeline.hub import FIRST_TRANSFORMER, teacher_folder
from pipeline.teacher_files import PICKLED

from .student_kind import (
    FIX, PAIR, TRANSFORMER_CLASS, Student, StudentKind, check_compatible, meta_model, model_class, read_distill,
    with_guidance,
)

log = logging.getLogger(__name__)
_BLOCK_PREFIX = "blocks."


class CompactStudent(StudentKind):
    """A compact student: a small WanTransformer3DModel from --student-config, trained whole; found as a
    WanTransformer3DModel folder (student/, or student_ema/)."""

    marker = "config.json"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.config = load_student_config(cfg.student_config)

    def prepare(self, manifest, cache, requested):
        check_compatible(self.config, manifest, self.cfg.student_config)
        return requested

    def build(self, seed, dtype):
        return build_student(self.config, self.cfg.student_config, seed)

    @classmethod
    def find(cls, p, run, chosen, which):
        cfg = transformer_config(chosen, run.root)
        if cfg is None:
            raise UserError(f"{p} holds no student: {chosen.name}/config.json is missing; pass the --out folder of "
                            "a finished `wandistiller train-student` run")
        distill = read_distill(run.distill) if os.path.lexists(run.distill) else None
        if distill is None:
            log.warning("%s has no %s: assuming the student learned guided targets", p, DISTILL)
        return Student(root=p, path=chosen, weights=which, config=cfg, kind=cls, distill=distill)

    @classmethod
    def find_folder(cls, p: Path) -> Student:
        """A folder that is no run: a model folder itself (OUT/student given: its distill.json one level up)."""
        bare = transformer_config(p)
        if bare is None:
            raise UserError(f"{p} holds no student: neither {STUDENT}/ nor a model config.json; pass the --out "
                            "folder of a finished `wandistiller train-student` run")
        parent = RunLayout(p.parent)
        distill = (read_distill(parent.distill) if p.name in (STUDENT, STUDENT_EMA) and os.path.lexists(parent.distill)
                   else None)
        return Student(root=p.parent if distill else p, path=p, weights="folder", config=bare, kind=cls,
                       distill=distill)

    @classmethod
    def load(cls, student, dtype, device):
        try:
            model = _from_pretrained(student.path, student.config, dtype)
        except (OSError, ValueError, RuntimeError) as e:
            raise UserError(f"cannot load the student from {student.path} ({str(e).splitlines()[0]}); "
                            "rerun train-student or pass another --student") from e
        return model.to(device).eval().requires_grad_(False)

    @classmethod
    def init_exact(cls, student, seed):
        """Saved starting weights, or the recorded seed and no teacher blocks."""
        return seed is None and (_has_init_dir(student) or student.setting("init_seed") is not None
                                 and not student.setting("init_from_teacher"))

    @classmethod
    def untrained(cls, student, seed, dtype, device):
        """OUT/student_init/ when saved, else config.json after `torch.manual_seed` (--init-seed, else distill.json's
        `init_seed`, else 0), as train-student builds it."""
        exact = cls.init_exact(student, seed)
        if seed is None and _has_init_dir(student):
            model = _from_pretrained(RunLayout(student.root).student_init, student.config, dtype)
            how = {"source": f"{STUDENT_INIT}/", "exact": exact}
        else:
            if seed is None:
                seed = int(student.setting("init_seed", 0))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = with_guidance(_quiet(student.config, model_class().from_config, student.config), student.config)
            how = {"source": "config.json + torch.manual_seed", "seed": seed, "exact": exact}
        return model.to(device, dtype).eval().requires_grad_(False), how

    @classmethod
    def pair(cls, members, names):
        raise UserError(f"{PAIR.join(names)}: {names[0]} is a compact student, and a pair joins two LoRA runs of one "
                        "teacher, one per expert (train-student --lora-of TEACHER --lora-experts 1, and 2)")


def load_student_config(path: str | os.PathLike) -> dict:
    """Read and check a student JSON config; keys starting with '_' (diffusers metadata) are ignored."""
    p = Path(path)
    raw = read_object(p, "student config", "pass a JSON file of WanTransformer3DModel arguments like "
                      "configs/student-tiny.json")
    cfg = {k: v for k, v in raw.items() if not k.startswith("_")}
    valid = {p for p in inspect.signature(model_class().__init__).parameters if p != "self"}
    if unknown := sorted(set(cfg) - valid):
        raise UserError(f"student config {p}: unknown key(s) {', '.join(unknown)}; WanTransformer3DModel takes "
                        f"{', '.join(sorted(valid))}")
    if "patch_size" in cfg:
        cfg["patch_size"] = tuple(cfg["patch_size"])
    return cfg


def build_student(cfg: dict, path: str, seed: int) -> torch.nn.Module:
    """A float32 student with weights drawn from `seed` (same seed, same weights on every rank)."""
    torch.manual_seed(seed)
    try:
        return model_class()(**cfg).float()
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise UserError(f"student config {path} cannot build a WanTransformer3DModel: {e}") from e


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
    from safetensors import safe_open as open_weights

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
            with open_weights(str(file), framework="pt") as f:
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


def transformer_config(folder: Path, run: Path | None = None) -> dict | None:
    """config.json of a WanTransformer3DModel folder, its weights checked against it (`check_weights`); None if
    `folder` holds no model config. `run`: the run folder `folder` lies in (then `folder` must not be a link)."""
    try:
        cfg = safe_open.read_json(*((run, f"{folder.name}/config.json") if run else (folder, "config.json")),
                                  "config", fix=FIX)
    except FileNotFoundError:
        return None
    if not isinstance(cfg, dict) or cfg.get("_class_name") != TRANSFORMER_CLASS:
        name = cfg.get("_class_name") if isinstance(cfg, dict) else cfg
        raise UserError(f"{folder} holds a {name!r}, not a {TRANSFORMER_CLASS} student")
    check_weights(folder, cfg)
    return cfg


def check_weights(folder: Path, config: dict) -> None:
    """Refuse a transformer folder whose weights are not what its config.json builds, before any is read: a pickled
    weight file (`PICKLED`), no *.safetensors, or tensors (their headers, bounded) of other names or shapes."""
    files = list(safe_open.walk(folder, FIX))  # (a link or a FIFO anywhere in it: refused)
    if pickled := [f for f in files if f.endswith(PICKLED)]:
        raise UserError(f"student folder {folder} holds {pickled[0]}, a pickled weight file, which WanDistiller never "
                        f"loads (unpickling runs code); a student's weights are *.safetensors: remove it, or {FIX}")
    found = {}
    for f in (f for f in files if "/" not in f and f.endswith(".safetensors")):
        found |= {k: shape for k, (_, shape) in safe_open.safetensors_header(folder, f, FIX).items()}
    if not found:
        raise UserError(f"student folder {folder} has a config but no *.safetensors weights; "
                        "rerun train-student or point --student at a finished run")
    layers = config.get("num_layers", 0)
    if not (type(layers) is int and 0 < layers <= len(found)):  # (each block holds tensors: none left unbuilt)
        raise UserError(f"{folder / 'config.json'}: num_layers {layers!r} is not what its {len(found)} weight "
                        f"tensors hold; {FIX}")
    model = meta_model(config, folder / "config.json")
    if problem := tensor_mismatch(found, {k: tuple(v.shape) for k, v in model.state_dict().items()}):
        raise UserError(f"student folder {folder}: its weights are not what its config.json builds ({problem}); "
                        f"{FIX}")


def _from_pretrained(folder: Path, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The student in `folder` (checked by `check_weights`); a guidance-conditioned one with its embedding's tensors,
    which diffusers' loader does not know (pipeline/guidance_input.py)."""
    model = _quiet(config, model_class().from_pretrained, folder, torch_dtype=dtype, use_safetensors=True)
    if guidance_input.trained_range(config) is not None:
        guidance_input.load_tensors(with_guidance(model, config), folder, sorted(
            f.name for f in folder.glob("*.safetensors")))
    return model


def _quiet(config: dict, build, *args, **kw):
    """`build(*args, **kw)`; for a guidance-conditioned student's `config`, without diffusers' warnings about its
    embedding's config key and tensors, which diffusers skips (and `_from_pretrained` loads)."""
    from diffusers.utils import logging as dlog

    if guidance_input.trained_range(config) is None:
        return build(*args, **kw)
    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        return build(*args, **kw)
    finally:
        dlog.set_verbosity(level)


def _has_init_dir(student: Student) -> bool:
    return transformer_config(RunLayout(student.root).student_init, student.root) is not None
