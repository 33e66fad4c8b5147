"""Streaming a transformer's weights to where it computes: from CPU RAM (`offload`, leaf level) or from a folder of
one file per block (`disk`), built once per expert from the checkpoint on a meta model (docs/placements.md)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

import filelock
import torch

from cache import safe_open, safe_write
from cache.cache_error import CacheError
from pipeline import diffusers_private, lock
from pipeline.errors import UserError
from pipeline.teacher_files import hash_json, sample_file, snapshot_blobs

from .teacher import TeacherSpec

MARKER = "wandistiller-offload.json"
# Bump when the way a folder is laid out changes: older folders then fail their fingerprint and are rebuilt.
LAYOUT_VERSION = 1
_GROUPING = {"offload_type": "block_level", "num_blocks_per_group": 1}  # disk: one file per block


def param_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of every parameter as `from_pretrained(torch_dtype=dtype)` loads it."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    return {name: (torch.float32 if any(k in name.split(".") for k in keep) else dtype) if p.is_floating_point()
            else p.dtype for name, p in model.named_parameters()}


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of `model`'s parameters once loaded in `dtype` (works on the meta device)."""
    dtypes = param_dtypes(model, dtype)
    return sum(p.numel() * dtypes[n].itemsize for n, p in model.named_parameters())


def largest_layer_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the largest group leaf-level offloading moves at once (a layer, or a module's loose parameters)."""
    dtypes = param_dtypes(model, dtype)
    groups: dict[str, int] = {}
    leaves = {n for n, m in model.named_modules() if isinstance(m, diffusers_private.leaf_layers())}
    owners = {n for n, _ in model.named_modules()}
    for name, p in model.named_parameters():
        atoms = name.split(".")[:-1]
        prefixes = [".".join(atoms[:i]) for i in range(len(atoms), -1, -1)]  # its modules, the closest first
        owner = next((m for m in prefixes if m in leaves), None) or next(m for m in prefixes if m in owners)
        groups[owner] = groups.get(owner, 0) + p.numel() * dtypes[name].itemsize
    return max(groups.values(), default=0)


def meta_transformer(path: Path, comp: str, real_buffers: bool = True) -> torch.nn.Module:
    """`WanTransformer3DModel` of `path/comp` on the meta device; `real_buffers` (the rotary tables, which streaming
    needs) makes accelerate build each weight on the CPU first, so callers that only measure pass False."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    config = WanTransformer3DModel.load_config(Path(path) / comp)
    with init_empty_weights(include_buffers=not real_buffers):
        model = WanTransformer3DModel.from_config(config)
    return model.eval().requires_grad_(False)


def hollow_transformer(path: Path, comp: str, dtype: torch.dtype) -> torch.nn.Module:
    """The meta model, every parameter an empty CPU tensor of its load dtype (group offloading fills it)."""
    model = meta_transformer(path, comp)
    dtypes = param_dtypes(model, dtype)
    for mname, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is not None:
                full = f"{mname}.{pname}" if mname else pname
                module._parameters[pname] = torch.nn.Parameter(torch.empty(0, dtype=dtypes[full]), requires_grad=False)
    return model


def stream_from_disk(model: torch.nn.Module, device: torch.device, folder: Path) -> None:
    """diffusers block-level group offloading onto `device`, each group read from its file in `folder` (`disk`)."""
    cuda = device.type == "cuda"
    model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), use_stream=cuda,
                               record_stream=cuda, offload_to_disk_path=str(folder), **_GROUPING)


def checkpoint_files(path: Path, comp: str) -> dict[str, Path]:
    """tensor name -> safetensors file of component `comp` (sharded via its index, or a single file); the index's
    files are read from the teacher folder down, as `safe_open` reads it (no link out of it)."""
    from safetensors import safe_open as open_weights

    path = Path(path)
    folder = path / comp
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        links = snapshot_blobs(path)  # (a Hub snapshot's links into its blobs/; any other folder: no link followed)
        fix = "re-download the teacher"
        src = safe_open.resolve_inside(path, f"{comp}/{index[0].name}", fix, links)
        raw = safe_open.parse_json(safe_open.read_named(src, "weight index", safe_open.CAPS["config"]), src)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{src} has no weight_map of tensor names to file names; {fix}")
        files = {}
        for v in sorted(set(weight_map.values())):
            try:
                files[v] = safe_open.resolve_inside(path, f"{comp}/{v}", fix, links)
            except FileNotFoundError:
                raise UserError(f"{src} lists {folder / v}, which is missing; {fix}") from None
        return {k: files[v] for k, v in weight_map.items()}
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open_weights(f, framework="pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def expert_fingerprint(spec: TeacherSpec, comp: str, dtype: torch.dtype) -> str:
    """Identity of one expert's offload folder: its config and weight files, dtype, and the group layout."""
    import diffusers

    weights = {f.name: sample_file(f) for f in sorted((spec.path / comp).glob("*.safetensors"))}
    return hash_json({"component": comp, "config": hash_json(spec.configs[comp]), "weights": weights,
                       "dtype": str(dtype), "layout": LAYOUT_VERSION, "grouping": _GROUPING,
                       "diffusers": diffusers.__version__})


def _marker_files(folder: Path, fp: str | None = None) -> dict[str, int] | None:
    """The files (name -> bytes) the marker of `folder` lists, where it is a sound marker (of fingerprint `fp`, when
    given); None for a folder without one, or with a marker this process did not write (a link, a FIFO, not JSON)."""
    try:
        marker = safe_open.read_json(folder, MARKER, "record", f"delete {folder}")
    except (OSError, CacheError):
        return None
    files = marker.get("files") if isinstance(marker, dict) and fp in (None, marker.get("fingerprint")) else None
    ok = isinstance(files, dict) and all(type(size) is int for size in files.values())
    return files if ok else None


def _folder_ok(folder: Path, fp: str) -> bool:
    """True if `folder` is a complete folder for fingerprint `fp`: marker matches, every listed file whole (a regular
    file of the folder, not a link out of it)."""
    files = _marker_files(folder, fp)
    try:
        return files is not None and all(_size(folder, n) == size for n, size in files.items())
    except (OSError, CacheError):
        return False


def _size(folder: Path, rel: str) -> int:
    with os.fdopen(safe_open.open_fd(folder, rel, f"delete {folder}"), "rb") as f:
        return os.fstat(f.fileno()).st_size


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_stale(root: Path, comp: str, keep: Path) -> None:
    """Delete this component's folders for other weights, and build folders of dead processes on this host."""
    host = socket.gethostname()
    for p in root.iterdir() if root.is_dir() else ():
        if not p.is_dir() or p == keep:
            continue
        name = p.name
        if name.startswith(f"{comp}-") and len(name) == len(comp) + 17 and name[len(comp) + 1:].isalnum():
            shutil.rmtree(p, ignore_errors=True)
            (root / f".{name}.lock").unlink(missing_ok=True)
        elif name.startswith(f".{comp}-") and ".build-" in name:
            owner = name.rsplit(".build-", 1)[1]
            h, _, pid = owner.rpartition("-")
            if h == host and pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)


def _write_groups(spec: TeacherSpec, comp: str, dtype: torch.dtype, device: torch.device, build: Path) -> dict:
    """Lay the expert's groups out in `build`, one safetensors file per group, reading one group at a time."""
    from safetensors import safe_open as open_weights
    from safetensors.torch import save_file

    model = hollow_transformer(spec.path, comp, dtype)
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # offloading empties them; keep the values
    stream_from_disk(model, device, build)  # writes empty placeholder files that we overwrite below
    names = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False)]}
    params = dict(model.named_parameters())
    where = checkpoint_files(spec.path, comp)
    missing = sorted(set(params) - set(where))
    unexpected = sorted(set(where) - set(params))
    if missing or unexpected:
        raise UserError(f"teacher {spec.name!r}: {comp} weights do not match its config "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]}); re-download the teacher")
    files = {}
    for _, tensor_keys, path in diffusers_private.disk_groups(model):
        tensors, by_file = {}, {}  # by_file: checkpoint file -> [(group key, tensor name)]
        for t, key in tensor_keys.items():
            name = names[id(t)]
            if name in buffers:
                tensors[key] = buffers[name].contiguous()
            else:
                by_file.setdefault(where[name], []).append((key, name))
        for f, items in by_file.items():
            # Opened per group: the pages read count towards RSS only while the file is mapped.
            with open_weights(f, framework="pt") as st:
                for key, name in items:
                    tensors[key] = st.get_tensor(name).to(params[name].dtype).contiguous()
        dest = Path(path)
        save_file(tensors, dest)
        files[dest.name] = dest.stat().st_size
    return files


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive filelock (the ranks of one node build a folder once), its file checked as every lock is."""
    os.close(lock.open_regular(path, os.O_RDWR | os.O_CREAT, what="offload lock file"))
    with filelock.FileLock(path):
        yield


def prepare_disk_folder(spec: TeacherSpec, comp: str, dtype: torch.dtype, device: torch.device, root: Path,
                        log=print) -> Path:
    """The offload folder of expert `comp`: reused if complete and made for these weights, else (re)built."""
    root = Path(root)
    fp = expert_fingerprint(spec, comp, dtype)
    folder = root / f"{comp}-{fp[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{folder.name}.lock"):
        if _folder_ok(folder, fp):
            _remove_stale(root, comp, folder)
            return folder
        need = weight_bytes(meta_transformer(spec.path, comp, real_buffers=False), dtype)
        free = shutil.disk_usage(root).free
        if need > free:
            raise UserError(f"--offload-dir {root} has {free / 2**30:.1f} GiB free; expert {comp} needs "
                            f"{need / 2**30:.1f} GiB there; free space or pass another --offload-dir")
        _remove_stale(root, comp, folder)
        shutil.rmtree(folder, ignore_errors=True)  # incomplete, or not made for these weights: never reused
        # Built under another name and renamed when complete: a crash never leaves a folder that looks whole.
        build = root / f".{folder.name}.build-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(build, ignore_errors=True)
        log(f"building the offload folder of {comp} in {folder} (once per weights and dtype)")
        try:
            files = _write_groups(spec, comp, dtype, device, build)
            safe_write.write_json(build / MARKER, {"fingerprint": fp, "component": comp, "teacher": spec.name,
                                                   "dtype": str(dtype), "files": files}, indent=1)
            os.rename(build, folder)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return folder


def _map_large_allocations() -> None:
    """Have glibc serve allocations of 128 KiB and more from their own mappings, unmapped when freed: diffusers'
    placeholders then cost address space, not RSS (docs/placements.md, "disk")."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: its allocator is left as it is


def load_disk_expert(spec: TeacherSpec, comp: str, dtype: torch.dtype, device: torch.device, root: Path,
                     log=print) -> torch.nn.Module:
    """Expert `comp` with its weights streamed from its offload folder, one block at a time."""
    _map_large_allocations()
    folder = prepare_disk_folder(spec, comp, dtype, device, root, log)
    model = hollow_transformer(spec.path, comp, dtype)
    stream_from_disk(model, device, folder)
    listed = set(_marker_files(folder) or ())  # (checked, or just written, by prepare_disk_folder)
    stray = [g for g, _, path in diffusers_private.disk_groups(model) if Path(path).name not in listed]
    if stray:  # diffusers would have written (empty) files of its own: the layout changed under us
        raise RuntimeError(f"offload folder {folder} lacks groups {[g.group_id for g in stray][:3]}; delete it")
    return model


def load_ram_expert(spec: TeacherSpec, comp: str, dtype: torch.dtype, device: torch.device,
                    fuse=None) -> torch.nn.Module:
    """Expert `comp` in CPU RAM, streamed layer by layer to a GPU `device` (`offload`: docs/placements.md); `fuse`
    (the --teacher-lora LoRAs) applied before the streaming copies are made."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp, torch_dtype=dtype, use_safetensors=True)
    model = (fuse or (lambda m: m))(model).eval().requires_grad_(False)
    if device.type == "cuda":
        model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="leaf_level", use_stream=True, record_stream=True,
                                   low_cpu_mem_usage=False)
    return model
