"""Training checkpoints: safetensors weights, the optimizer state, JSON trainer state; atomic, recorded and checked.
No byte of a checkpoint is ever unpickled freely (`optimizer.pt` with `weights_only=True`, a sharded checkpoint's
DCP index through `_IndexUnpickler`). docs/reliability.md "Checkpoints", docs/multi-gpu.md for the sharded layout."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import io
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from cache import safe_open
from cache.atomic import fsync_dir, honour_umask
from pipeline.artifact import CHECKPOINTS
from pipeline.errors import UserError
from pipeline.faults import fault_point
from pipeline.runtime import DistEnv, barrier
from pipeline.torch_private import internal, planner_loading_with

from .comm import all_gather_bytes

MODEL = "model.safetensors"
EMA = "ema.safetensors"
HEADS = "objective.safetensors"  # the objective's own trainable modules (projection heads), never exported
OPTIMIZER = "optimizer.pt"
STATE = "trainer_state.json"
DIGESTS = "digests.json"  # {"format": 1, "files": {name: {"bytes": n, "sha256": hex}}} of every other file
DIGESTS_KEY = "digests"  # in trainer_state.json: the checkpoint has a digest record
DIGESTS_FORMAT = 1
FILES = (MODEL, EMA, HEADS, OPTIMIZER, STATE)  # every name a checkpoint may hold besides DIGESTS
SHARDED = "sharded"  # the DCP folder of a sharded checkpoint, instead of MODEL, EMA, HEADS and OPTIMIZER
SHARDED_INDEX = ".metadata"  # DCP's index in it, written by rank 0 once every rank's shards are written
# Top-level keys of the state a sharded checkpoint holds (DCP names each tensor "<key>.<name>").
DCP_MODEL, DCP_OPTIMIZER, DCP_EMA = "model", "optimizer", "ema"
TMP = ".tmp"
_NAME = re.compile(r"^step-(\d{8})$")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports the OS error of a failed write


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """This process's RNG states (torch CPU and CUDA, numpy, python) as JSON-able values."""
    np_state = np.random.get_state()
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),  # (tuples: JSON writes them as the lists set_rng_state reads)
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def _fsync_and_digest(path: Path) -> dict:
    """fsync `path` and return its digest, in one pass over it (just written: read from the page cache)."""
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256")
        os.fsync(f.fileno())
        return {"bytes": f.tell(), "sha256": sha.hexdigest()}


@contextlib.contextmanager
def os_errors(path: Path) -> Iterator[None]:
    """A safetensors write failure (full disk, quota; it reports errno only in its message) raised as the OSError it
    is, naming `path`: one line from the CLI, not a SafetensorError traceback."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        if (m := _OS_ERROR.search(str(e))) is None:
            raise
        raise OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(path)) from e


class _WriteRecorder:
    """File wrapper that keeps the OSError of a failed write (torch.save reports it only as a RuntimeError) and
    hashes what is written: torch.save writes its zip strictly in order (it never seeks), so that is the file."""

    def __init__(self, f):
        self.f, self.error, self.sha = f, None, hashlib.sha256()

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def _torch_save(obj, path: Path) -> dict:
    """torch.save, fsynced; returns the file's digest. A failed write raises the OSError it is, naming the file."""
    sink = None
    try:
        with open(path, "wb") as f:
            sink = _WriteRecorder(f)
            torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
            return {"bytes": f.tell(), "sha256": sink.sha.hexdigest()}
    except (RuntimeError, OSError) as e:  # an OSError too from the final flush, on close
        err = sink.error if sink is not None and sink.error is not None else e
        if not isinstance(err, OSError) or err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from e


def save(out: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
         ema: dict[str, torch.Tensor] | None, optimizer: torch.optim.Optimizer, trainer_state: dict, keep: int,
         heads: torch.nn.Module | None = None) -> Path:
    """Write checkpoint `step` (rank 0 only) with its digest record and drop all but the newest `keep`; returns
    its folder. `model_state`: what the student kind keeps of the student (`StudentKind.checkpoint_state`)."""
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{step_dirname(step)}.{os.getpid()}{TMP}"  # the pid: never another writer's folder
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # Each weights file is fsynced and hashed by a helper thread while the next one is written (hashlib and
    # fsync release the GIL): the digests cost little more than the slowest of the two.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = {}
        heads_state = None if heads is None else heads.state_dict()
        for name, tensors in ((MODEL, model_state), (EMA, ema), (HEADS, heads_state)):
            if tensors is not None:
                with os_errors(tmp / name):
                    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / name)
                pending[name] = pool.submit(_fsync_and_digest, tmp / name)
            if name == MODEL:
                fault_point("in_checkpoint")
        optimizer_digest = _torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
        files = {name: f.result() for name, f in pending.items()}
    files[OPTIMIZER] = optimizer_digest
    return _seal(out, tmp, step, files, trainer_state, keep)


def _seal(out: str | os.PathLike, tmp: Path, step: int, files: dict[str, dict], trainer_state: dict, keep: int) -> Path:
    """Write the trainer state and the digest record of `files` (and of the state) into the temporary folder `tmp`,
    rename it to checkpoint `step`'s final name and prune; rank 0 only. Returns the final folder."""
    root = Path(out) / CHECKPOINTS
    final = root / step_dirname(step)
    state = {**trainer_state, DIGESTS_KEY: DIGESTS}
    (tmp / STATE).write_text(json.dumps(state, indent=1) + "\n")
    files[STATE] = _fsync_and_digest(tmp / STATE)
    (tmp / DIGESTS).write_text(json.dumps({"format": DIGESTS_FORMAT, "files": files}, indent=1) + "\n")
    _fsync_and_digest(tmp / DIGESTS)
    honour_umask(tmp)  # (safetensors writes 0600 whatever the umask: colleagues could not read the checkpoint)
    fsync_dir(tmp)
    fault_point("before_checkpoint_rename")
    if final.exists():  # the same step written again (a resumed run that re-reached it, e.g. past a damaged one)
        _set_aside(final)
    os.replace(tmp, final)
    fsync_dir(root)
    fault_point("after_checkpoint_rename")
    prune(out, keep, step)
    return final


def save_sharded(out: str | os.PathLike, step: int, state_dict: dict, trainer_state: dict, keep: int, env: DistEnv,
                 device: torch.device) -> None:
    """Write checkpoint `step` of a sharded run; every rank calls this, writes and hashes its shards of `state_dict`
    into SHARDED/, and rank 0 records them all and renames the folder into place as `save` does. Ends with a barrier."""
    import torch.distributed.checkpoint as dcp

    root = Path(out) / CHECKPOINTS
    pid = all_gather_bytes(str(os.getpid()).encode(), device)[0].decode()  # rank 0's: one folder for all ranks
    tmp = root / f"{step_dirname(step)}.{pid}{TMP}"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier(device)
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp / SHARDED))  # returns once the index is written
    fault_point("in_checkpoint")
    shards = tmp / SHARDED
    mine = {f"{SHARDED}/{p.name}": _fsync_and_digest(p) for p in sorted(shards.iterdir())
            if p.name.startswith(f"__{env.rank}_") or (env.is_main and p.name == SHARDED_INDEX)}
    gathered = all_gather_bytes(json.dumps(mine).encode(), device)
    if env.is_main:
        files = {name: d for part in gathered for name, d in json.loads(part).items()}
        for p in sorted(shards.iterdir()):  # a file of a layout DCP may use one day: recorded all the same
            if f"{SHARDED}/{p.name}" not in files:
                files[f"{SHARDED}/{p.name}"] = _fsync_and_digest(p)
        fsync_dir(shards)
        _seal(out, tmp, step, files, trainer_state, keep)
    barrier(device)


# Everything a DCP index (`.metadata`) of ours references, listed from a real sharded checkpoint written with torch
# 2.13 (pickletools over its `.metadata`): DCP's metadata dataclasses, the path it records its folder as, torch.Size,
# the layout lookup torch pickles `torch.strided` as, and any torch dtype (INDEX_DTYPES: a shard may be of any).
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
INDEX_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                          "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                          "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _IndexUnpickler(pickle.Unpickler):
    """pickle's Unpickler resolving INDEX_GLOBALS and torch dtypes only: anything else a pickle names (a function to
    call, a class to build) raises `Untrusted` before it is imported, so nothing of it runs."""

    def find_class(self, module: str, name: str):
        if (module, name) in INDEX_GLOBALS or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise Untrusted(f"{module}.{name}")


class Untrusted(Exception):
    """A checkpoint file that references code train-student never writes there (the name of what it references)."""


def untrusted(ckpt: Path, name: str, reference: str, holds: str) -> UserError:
    """The one-line refusal of checkpoint `ckpt`, whose file `name` references `reference` where train-student writes
    `holds` only. Raised alike by every rank (each reads the same file): rank 0 prints it."""
    err = UserError(f"checkpoint {ckpt}: {name} references {reference}, but train-student writes {holds} there: "
                    "it was planted or made by another program, and reading it could run code, so the run stops here, "
                    f"before using it; delete {ckpt} and resume only from checkpoints train-student wrote (or start "
                    "without --resume in a new --out)")
    err.all_ranks = True
    return err


_INDEX_HOLDS = "only the index classes of torch.distributed.checkpoint"
_VALUES_HOLDS = "only tensors, numbers and containers"


def read_index(path: Path):
    """The DCP index of sharded checkpoint `path`, unpickled by `_IndexUnpickler` and checked: every item a file
    directly in SHARDED/ with a plain offset and length, no stream transform (DCP's extensions, never used here).
    UserError (`untrusted`) for a reference to anything else; ValueError for an index that does not read (damage)."""
    from torch.distributed.checkpoint.metadata import Metadata

    name = f"{SHARDED}/{SHARDED_INDEX}"
    try:
        with os.fdopen(safe_open.open_fd(path, name, _FIX), "rb") as f:
            index = _IndexUnpickler(f).load()
    except Untrusted as e:
        raise untrusted(path, name, str(e), _INDEX_HOLDS) from None
    except Exception as e:  # noqa: BLE001 - any other failure to unpickle is damage
        raise ValueError(f"{name}: unreadable ({_first_line(e)})") from e
    if not isinstance(index, Metadata) or not isinstance(index.state_dict_metadata, dict) \
            or not isinstance(index.storage_data, dict):
        raise ValueError(f"{name}: not a torch.distributed.checkpoint index")
    files = {p.name for p in (path / SHARDED).iterdir()}
    for info in index.storage_data.values():
        where = getattr(info, "relative_path", None)
        if not (isinstance(info, internal("storage_info")) and _is_shard_name(f"{SHARDED}/{where}") and where in files
                and type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
                and not info.transform_descriptors):
            raise untrusted(path, name, f"{str(where)[:80]!r} as a place of its data",
                            f"only names of the files in {SHARDED}/ itself")
    return index


def sharded_keys(path: Path, index=None) -> set[str]:
    """The top-level keys (DCP_MODEL, DCP_OPTIMIZER, DCP_EMA) held by sharded checkpoint `path` (its `read_index`)."""
    index = read_index(path) if index is None else index
    return {k.split(".", 1)[0] for k in index.state_dict_metadata}


def load_sharded(path: Path, state_dict: dict, index) -> None:
    """Fill `state_dict` (this rank's tensors, laid out as trained) in place from sharded checkpoint `path`, with
    `read_index`'s index and no pickled code run: a shard file that holds any is refused (`untrusted`) on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _CheckedReader(dcp.FileSystemReader):  # hands DCP the checked `index` instead of unpickling the file
        def read_metadata(self, *args, **kwargs):
            index.storage_meta = index.storage_meta or StorageMeta()
            index.storage_meta.load_id = self.load_id
            return index

    # The non-tensor values (the optimizer's param_groups: numbers, tuples) read with weights_only=True; DCP's own
    # planner reads them with torch.load(weights_only=False).
    def load(planner, read_item, value: io.BytesIO):
        try:
            return torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            where = planner.metadata.storage_data[read_item.storage_index].relative_path
            raise Untrusted(f"{SHARDED}/{where}\0{_pickled_global(e)}") from None

    try:
        dcp.load(state_dict, storage_reader=_CheckedReader(path / SHARDED), planner=planner_loading_with(load))
    except CheckpointException as e:  # DCP gathers every rank's failure into this one
        for failure, _ in e.failures.values():
            if isinstance(failure, Untrusted):
                name, reference = str(failure).split("\0", 1)
                raise untrusted(path, name, reference, _VALUES_HOLDS) from None
            if isinstance(failure, pickle.UnpicklingError):  # a tensor item's torch.load (DCP's, weights_only)
                raise untrusted(path, f"a shard file of {SHARDED}/", _pickled_global(failure), _VALUES_HOLDS) \
                    from None
        raise


_GLOBAL = re.compile(r"GLOBAL (\S+)")  # how torch's weights_only unpickler names what it refused


def _pickled_global(e: Exception) -> str:
    """What a refused weights_only load references, from torch's message (which also advises weights_only=False:
    never passed on)."""
    m = _GLOBAL.search(str(e))
    return m.group(1).rstrip(".,;") if m else "a pickled object"


def _named(out: str | os.PathLike) -> list[Path]:
    """The folders with a checkpoint's final name, oldest first (the names, zero-padded, sort by step)."""
    root = Path(out) / CHECKPOINTS
    return sorted(d for d in root.iterdir() if _NAME.match(d.name) and d.is_dir()) if root.is_dir() else []


def complete(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    return [d for d in _named(out) if (d / STATE).is_file()]


def _set_aside(d: Path) -> None:
    """Rename checkpoint folder `d` to a temporary name (`prune` removes it): never half deleted under its final name."""
    aside = d.with_name(f"{d.name}.{os.getpid()}.old{TMP}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(d, aside)


def prune(out: str | os.PathLike, keep: int, step: int | None = None) -> None:
    """Keep the newest `keep` complete checkpoints at or before `step`; remove leftovers of interrupted writes.
    Those past `step` (damaged ones a resume skipped, written again) are left alone and not counted."""
    found = [d for d in complete(out) if step is None or d.name <= step_dirname(step)]
    for d in found[:-keep]:
        _set_aside(d)  # removed just below
    for d in (Path(out) / CHECKPOINTS).glob(f"*{TMP}"):
        shutil.rmtree(d, ignore_errors=True)


# What a refusal inside a checkpoint folder tells the user.
_FIX = "delete that checkpoint folder and rerun with --resume (an earlier checkpoint is used, or step 0)"


def read_state(path: Path) -> dict:
    """The checkpoint's trainer_state.json (through the trust boundary: no link, bounded, nesting capped)."""
    return safe_open.read_json(path, STATE, fix=_FIX)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def _read_record(path: Path) -> dict[str, dict]:
    """The files of `path`'s digest record; ValueError (its one-line reason) if it does not parse as one."""
    try:
        record = safe_open.read_json(path, DIGESTS, fix=_FIX)
    except (ValueError, OSError) as e:
        raise ValueError(f"{DIGESTS}: unreadable ({_first_line(e)})") from e
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != DIGESTS_FORMAT:
        raise ValueError(f"{DIGESTS}: not a digest record of format {DIGESTS_FORMAT}")
    sharded = {n for n in files if _is_shard_name(n)} if isinstance(files, dict) else set()
    if sharded:  # a sharded checkpoint: its DCP folder's files and the trainer state, nothing else
        if files.keys() - sharded != {STATE} or f"{SHARDED}/{SHARDED_INDEX}" not in sharded:
            raise ValueError(f"{DIGESTS}: does not list {SHARDED}/{SHARDED_INDEX} and {STATE} (and only files of "
                             f"{SHARDED}/ besides)")
    elif not isinstance(files, dict) or not files.keys() <= set(FILES) or not {MODEL, OPTIMIZER, STATE} <= files.keys():
        raise ValueError(f"{DIGESTS}: does not list {MODEL}, {OPTIMIZER} and {STATE} (and nothing else)")
    for name, d in files.items():
        if not (isinstance(d, dict) and type(d.get("bytes")) is int and isinstance(d.get("sha256"), str)):
            raise ValueError(f"{DIGESTS}: the entry of {name} is not {{bytes, sha256}}")
    return files


def _is_shard_name(name) -> bool:
    """`sharded/<file>`: a file directly in a sharded checkpoint's DCP folder (never a path out of it)."""
    rest = name.removeprefix(f"{SHARDED}/") if isinstance(name, str) and name.startswith(f"{SHARDED}/") else ""
    return rest not in ("", ".", "..") and "/" not in rest and "\\" not in rest


def check(path: Path) -> str | None:
    """Why checkpoint folder `path` may not be resumed from (one file and what is wrong with it); None when it may."""
    if not (path / DIGESTS).exists():
        return f"{DIGESTS}: missing"
    try:
        files = _read_record(path)
        for name, want in files.items():  # sizes first: no hashing of a short file
            if not (path / name).is_file() and not (path / name).is_symlink():
                return f"{name}: missing"
            os.close(safe_open.open_fd(path, name, _FIX))  # a link or a FIFO: refused as damage, never followed
            if (size := (path / name).stat().st_size) != (n := want["bytes"]):
                return (f"{name}: empty (0 of {n} bytes)" if size == 0 else f"{name}: truncated ({size} of {n} bytes)"
                        if size < n else f"{name}: {size} bytes, {n} recorded")
        for name, want in files.items():
            with os.fdopen(safe_open.open_fd(path, name, _FIX), "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != want["sha256"]:
                    return f"{name}: sha256 mismatch"
        try:
            read_state(path)
        except (ValueError, OSError) as e:
            return f"{STATE}: unreadable ({_first_line(e)})"
        if f"{SHARDED}/{SHARDED_INDEX}" in files:  # the index is a pickle: read safely now (a UserError if planted)
            read_index(path)
    except ValueError as e:  # (the record's or the index's one-line reason)
        return str(e)
    return None


def pick(out: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """What `--resume` restores: (the newest sound checkpoint, lines to print about the choice), (None, []) without
    any. Every folder with a final name is a candidate (one without trainer_state.json is reported as damaged)."""
    damaged: list[tuple[str, str]] = []
    for d in reversed(_named(out)):
        if (problem := check(d)) is not None:
            damaged.append((d.name, problem))
        elif not damaged:
            return d, []
        else:
            named = (f"checkpoint {damaged[0][0]} is damaged ({damaged[0][1]})" if len(damaged) == 1 else
                     "checkpoints " + ", ".join(f"{n} ({p})" for n, p in damaged) + " are damaged")
            return d, [f"warning: {named}; resuming from {d.name}"]
    if not damaged:
        return None, []
    listed = ", ".join(f"{n} ({p})" for n, p in damaged)
    raise UserError(f"--resume: no sound checkpoint in {Path(out) / CHECKPOINTS}: {listed}; delete the damaged "
                    "checkpoint folders and rerun with --resume to train again from step 0, or start without --resume "
                    "in a new --out")


def load(path: Path, load_model: Callable[[dict[str, torch.Tensor]], None], optimizer: torch.optim.Optimizer,
         device: torch.device, heads: torch.nn.Module | None = None) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Restore weights (handed to `load_model`: `StudentKind.load_checkpoint_state`; the objective's heads too) and
    optimizer from checkpoint `path`; returns (trainer state, EMA tensors or None)."""
    load_model(load_file(path / MODEL))
    if heads is not None:
        heads.load_state_dict(load_file(path / HEADS), strict=True)
    try:  # weights_only: anything but tensors, numbers and containers is refused, without torch's advice
        optim_state = torch.load(path / OPTIMIZER, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        raise untrusted(path, OPTIMIZER, _pickled_global(e), _VALUES_HOLDS) from None
    optimizer.load_state_dict(optim_state)
    ema = load_file(path / EMA) if (path / EMA).is_file() else None
    return read_state(path), ema
