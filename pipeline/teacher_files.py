"""A teacher folder's files, the same for every command: what it may hold (`check_folder`: regular files, or a Hub
snapshot's links into its own repository's blobs/; no pickled weights), its configs read bounded and typed
(`read_index`, `read_component`), its files copied (`copy_tree`) and what identifies them: a config's hash and a
weight file's sampled digest (stage one's `teacher_identity`, and stage two's LoRA check that its base is the
cache's teacher)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from cache import safe_open

from .user_error import UserError

T2V_PIPELINE, I2V_PIPELINE = "WanPipeline", "WanImageToVideoPipeline"  # the diffusers classes of a Wan teacher
PIPELINES = (T2V_PIPELINE, I2V_PIPELINE)

SAMPLE_BYTES = 1 << 16  # bytes read at each end of a weight file for its identity
FIX = "rerun with a complete teacher folder (or download the teacher again)"
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # weights only unpickling reads: unpickling can run code
COMPONENTS = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer", "transformer_2")
# The classes WanDistiller loads for each component (stage one, plan, sample and export); None: any diffusers scheduler
LOADABLE = {"tokenizer": ("transformers", {"T5Tokenizer", "T5TokenizerFast"}),
            "text_encoder": ("transformers", {"UMT5EncoderModel"}), "vae": ("diffusers", {"AutoencoderKLWan"}),
            "transformer": ("diffusers", {"WanTransformer3DModel"}),
            "transformer_2": ("diffusers", {"WanTransformer3DModel"}), "scheduler": ("diffusers", None)}
# The numbers of a component config that commands compute with or build models from: each an int in [1, top] where
# set; the `_REQUIRED` ones are read without a default.
_INTS = {"transformer": dict(in_channels=4096, out_channels=4096, text_dim=1 << 16, num_attention_heads=1024,
                             attention_head_dim=4096, ffn_dim=1 << 20, num_layers=1024, freq_dim=4096,
                             rope_max_seq_len=1 << 20),
         "vae": dict(scale_factor_spatial=64, scale_factor_temporal=64, z_dim=4096, base_dim=4096),
         "text_encoder": dict(d_model=1 << 16, d_ff=1 << 20, d_kv=4096, num_layers=1024, num_heads=1024,
                              vocab_size=1 << 22)}
_REQUIRED = {"transformer": ("in_channels", "text_dim", "num_attention_heads", "attention_head_dim", "ffn_dim")}


def hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def sample_file(path: Path) -> str:
    """sha256 of size + first and last 64 KiB: cheap, and tells apart teachers that share configs. (`path` lies in a
    folder `check_folder` passed: a regular file, never waited on.)"""
    with os.fdopen(safe_open.open_named(path, "the teacher's weight file"), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(str(size).encode())
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(size - SAMPLE_BYTES, SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def snapshot_blobs(folder: str | os.PathLike) -> Path | None:
    """The blobs/ folder of the Hub cache repository whose snapshot `folder` is (models--ORG--NAME/snapshots/REV): the
    one place a teacher folder's links may lead. None for any other folder."""
    real = Path(os.path.realpath(folder))
    blobs = real.parent.parent / "blobs"
    hub = real.parent.name == "snapshots" and blobs.parent.name.startswith("models--")
    return blobs if hub and blobs.is_dir() and not blobs.is_symlink() else None


def check_folder(folder: Path, fix: str = FIX) -> None:
    """Refuse a teacher folder holding anything but regular files (and a Hub snapshot's links into its own blobs/):
    a link out of it, a link loop, a FIFO, a device; pickled weights, which nothing here ever loads; or a
    model_index.json naming classes WanDistiller does not load (`check_index`), whichever command loads it."""
    for rel in safe_open.walk(folder, fix, snapshot_blobs(folder)):
        if rel.endswith(PICKLED):
            raise UserError(f"{folder / rel} holds pickled weights, which WanDistiller never loads (unpickling can run "
                            f"code): remove it (the *.safetensors weights are what is loaded) and {fix}")
    with contextlib.suppress(FileNotFoundError):  # (a folder of a VAE alone; the commands say what they miss)
        read_index(folder, fix)


def copy_tree(src: Path, dst: Path, fix: str = FIX, blobs: Path | None = None) -> None:
    """Copy every file below `src` to `dst` (being built): the bytes, not their modes; a link refused, never followed,
    but one into `blobs` (`snapshot_blobs` of the teacher's folder), copied as the file it points to."""
    from cache import safe_write  # (imports torch: not at load, the CLI imports this module through pipeline/hub.py)

    for rel in safe_open.walk(src, fix, blobs):
        path, to = src / rel, dst / rel
        to.parent.mkdir(parents=True, exist_ok=True)
        safe_write.copy_file(os.path.realpath(path) if path.is_symlink() else path, to)  # (walk checked its end)


def brief(value) -> str:
    """`value` as an error line shows it: its repr, cut at 60 characters (a file may hold megabytes of it)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_config(folder: Path, rel: str, fix: str = FIX) -> dict:
    """The JSON object FOLDER/`rel` of a teacher folder, read bounded (safe_open; a Hub snapshot's link only into its
    own blobs/); FileNotFoundError where it is absent."""
    blobs = snapshot_blobs(folder)
    if blobs is None:
        obj = safe_open.read_json(folder, rel, "config", fix)
    else:
        path = safe_open.resolve_inside(folder, rel, fix, blobs)
        obj = safe_open.parse_json(safe_open.read_named(path, "the teacher file", safe_open.CAPS["config"]), path)
    if not isinstance(obj, dict):
        raise UserError(f"{folder / rel} holds a JSON {type(obj).__name__}, not an object; {fix}")
    return obj


def is_scheduler(name: str) -> bool:
    import diffusers

    cls = getattr(diffusers, name, None) if name.isidentifier() else None
    return isinstance(cls, type) and issubclass(cls, diffusers.SchedulerMixin)


def check_index(mi: dict, where) -> dict:
    """`mi`, the model_index.json at `where`, checked for what every command reads of it: each component absent,
    [null, null] or a [library, class] pair naming a class WanDistiller loads; boundary_ratio null or a number in
    [0, 1]; expand_timesteps a boolean."""
    for comp in COMPONENTS:
        entry = mi.get(comp)
        if entry is None or entry == [None, None]:
            continue
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            raise UserError(f"{where}: {comp} is {brief(entry)}, not a [library, class] pair of names (or [null, "
                            f"null]); {FIX}")
        lib, names = LOADABLE[comp]
        if entry[0] != lib or not (entry[1] in names if names else is_scheduler(entry[1])):
            known = " or ".join(f"{lib}.{n}" for n in sorted(names)) if names else f"a {lib} scheduler"
            raise UserError(f"{where}: {comp} is {brief('.'.join(entry))}, a class WanDistiller does not load (it "
                            f"loads {known}); pass a Wan pipeline in diffusers format")
    ratio = mi.get("boundary_ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
        raise UserError(f"{where}: boundary_ratio is {brief(ratio)}, not a number in [0, 1] (or null); {FIX}")
    if not isinstance(mi.get("expand_timesteps", False), bool):
        raise UserError(f"{where}: expand_timesteps is {brief(mi['expand_timesteps'])}, not true or false; {FIX}")
    return mi


def check_config(comp: str, cfg: dict, where) -> dict:
    """`cfg`, the config of the teacher's component `comp` at `where`, checked for the numbers commands use: ints in
    range (a size in patches, heads, layers), patch_size three of them, a scheduler's class one diffusers has."""
    kind = "transformer" if comp.startswith("transformer") else comp
    for key, top in _INTS.get(kind, {}).items():
        v = cfg.get(key)
        if v is None and key not in _REQUIRED.get(kind, ()):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise UserError(f"{where}: {key} is {brief(v)}, not a whole number in [1, {top}]; {FIX}")
    patch = cfg.get("patch_size")
    if kind == "transformer" and patch is not None and not (
            isinstance(patch, list) and len(patch) == 3 and all(type(p) is int and 1 <= p <= 64 for p in patch)):
        raise UserError(f"{where}: patch_size is {brief(patch)}, not three whole numbers in [1, 64]; {FIX}")
    name = cfg.get("_class_name")
    if comp == "scheduler" and not (isinstance(name, str) and is_scheduler(name)):
        raise UserError(f"{where}: the scheduler class {brief(name)} is not one of diffusers' schedulers; pass a Wan "
                        "pipeline in diffusers format")
    return cfg


def missing_weights(folder: Path, comp: str, fix: str = FIX) -> list[str]:
    """The weight files of component `comp` that FOLDER lacks, none of them read: each file its
    `*.safetensors.index.json` names (a regular file past its 8-byte header length; together at least the index's
    total_size), else a `*.safetensors` at all. What a configs-only or half-downloaded Hub snapshot misses."""
    index = sorted((folder / comp).glob("*.safetensors.index.json"))
    if not index:
        return [] if any((folder / comp).glob("*.safetensors")) else [f"{comp}/*.safetensors"]
    raw = read_config(folder, f"{comp}/{index[0].name}", fix)
    names, meta = raw.get("weight_map"), raw.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise UserError(f"{folder / comp / index[0].name} has no weight_map of tensor names to file names; {fix}")
    missing, size, blobs = [], 0, snapshot_blobs(folder)
    for name in sorted(set(names.values())):
        try:  # (a Hub snapshot's link only into its own blobs/)
            size += (n := os.stat(safe_open.resolve_inside(folder, f"{comp}/{name}", fix, blobs)).st_size)
        except FileNotFoundError:
            missing.append(f"{comp}/{name}")
            continue
        if n <= 8:
            missing.append(f"{comp}/{name} (empty)")
    if not missing and type(total) is int and size < total:
        missing.append(f"{comp}/ weights ({size:,} of the {total:,} bytes its index names: a file cut short)")
    return missing


def read_index(folder: Path, fix: str = FIX) -> dict:
    """The teacher's model_index.json, read and checked (`check_index`); FileNotFoundError where it is absent."""
    return check_index(read_config(folder, "model_index.json", fix), folder / "model_index.json")


def read_component(folder: Path, comp: str, name: str = "config.json", fix: str = FIX) -> dict:
    """The config `name` of component `comp`, read and checked (`check_config`); FileNotFoundError where absent."""
    return check_config(comp, read_config(folder, f"{comp}/{name}", fix), folder / comp / name)
