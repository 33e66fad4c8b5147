"""Training checkpoints: safetensors weights, the optimizer state, JSON trainer state; atomic.

A checkpoint is written into `step-NNNNNNNN.<pid>.tmp/` and renamed to `step-NNNNNNNN/` once every file in
it is complete and fsynced, so a checkpoint folder without the suffix is always whole; `latest` only
looks at those. The optimizer state is a `torch.save` of tensors and numbers only and is read back
with `weights_only=True` (no pickled objects are executed).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from cache.atomic import fsync_dir
from pipeline.faults import fault_point

from pipeline.artifact import CHECKPOINTS

MODEL = "model.safetensors"
EMA = "ema.safetensors"
HEADS = "objective.safetensors"  # the objective's own trainable modules (projection heads), never exported
OPTIMIZER = "optimizer.pt"
STATE = "trainer_state.json"
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
    py_state = random.getstate()
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def as_os_error(e: Exception, path: Path) -> OSError | None:
    """The OSError behind a safetensors write failure (it reports errno only in its message), or None."""
    m = _OS_ERROR.search(str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), str(path))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; a failed write (full disk, quota) raises the OSError it is, which the CLI
    turns into one line, instead of a SafetensorError and a traceback."""
    try:
        save_file(tensors, path)
    except Exception as e:
        err = as_os_error(e, path)
        if err is None:
            raise
        raise err from e


class _WriteRecorder:
    """File wrapper that keeps the OSError of a failed write: torch.save reports it only as a RuntimeError."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _torch_save(obj, path: Path) -> None:
    """torch.save; a failed write raises the OSError it is, naming the file."""
    sink = None
    try:
        with open(path, "wb") as f:
            sink = _WriteRecorder(f)
            torch.save(obj, sink)
    except RuntimeError as e:
        if sink is None or sink.error is None:
            raise
        raise OSError(sink.error.errno, sink.error.strerror, str(path)) from e
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e  # the final flush, on close


def _state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


def save(out: str | os.PathLike, step: int, model: torch.nn.Module, ema: dict[str, torch.Tensor] | None,
         optimizer: torch.optim.Optimizer, trainer_state: dict, keep: int, heads: torch.nn.Module | None = None) -> Path:
    """Write checkpoint `step` (rank 0 only) and drop all but the newest `keep`; returns its folder."""
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dirname(step)
    tmp = root / f"{step_dirname(step)}.{os.getpid()}{TMP}"  # the pid: never another writer's folder
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_tensors(_state_dict(model), tmp / MODEL)
    fault_point("in_checkpoint")
    if ema is not None:
        save_tensors({k: v.detach().cpu().contiguous() for k, v in ema.items()}, tmp / EMA)
    if heads is not None:
        save_tensors(_state_dict(heads), tmp / HEADS)
    _torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
    (tmp / STATE).write_text(json.dumps(trainer_state, indent=1) + "\n")
    for f in tmp.iterdir():
        _fsync(f)
    fsync_dir(tmp)
    fault_point("before_checkpoint_rename")
    if final.exists():  # the same step written again (a resumed run that re-reached it): replace whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    fault_point("after_checkpoint_rename")
    prune(out, keep)
    return final


def complete(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir() if (m := _NAME.match(d.name)) and (d / STATE).is_file()]
    return [d for _, d in sorted(found)]


def latest(out: str | os.PathLike) -> Path | None:
    found = complete(out)
    return found[-1] if found else None


def prune(out: str | os.PathLike, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; remove leftovers of interrupted writes."""
    for d in complete(out)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)
    root = Path(out) / CHECKPOINTS
    for d in root.glob(f"*{TMP}"):
        shutil.rmtree(d, ignore_errors=True)


def read_state(path: Path) -> dict:
    return json.loads((path / STATE).read_text())


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
         heads: torch.nn.Module | None = None) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Restore weights (the objective's heads too) and optimizer from checkpoint `path`; returns (trainer state,
    EMA tensors or None)."""
    model.load_state_dict(load_file(path / MODEL), strict=True)
    if heads is not None:
        heads.load_state_dict(load_file(path / HEADS), strict=True)
    optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location=device, weights_only=True))
    ema = load_file(path / EMA) if (path / EMA).is_file() else None
    return read_state(path), ema
