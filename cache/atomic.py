"""Atomic file replacement: write to a temporary name, fsync, rename, fsync the folder.

A reader either sees the old complete file or the new complete file, never a torn one, even if the
writer is SIGKILLed or the machine loses power between any two instructions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .format import TMP_SUFFIX


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, before_replace: Callable[[], None] | None = None) -> None:
    """Replace `path` with `data` atomically; `before_replace` (fault injection) runs just before the rename."""
    path = Path(path)
    # The pid keeps two writers of the same name (e.g. two parts finishing together) off each other's file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj, before_replace: Callable[[], None] | None = None) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode(), before_replace)
