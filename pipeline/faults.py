"""Fault injection for the fault-tolerance suite (tests/faults): die or fail at a named point of a stage, as
WANDISTILLER_KILL_AT="<point>:<n>[:<how>]" says (docs/reliability.md, "What the suite does"). The variable is read on
the first call, not at import, so processes forked from a preloaded server see their own."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from pathlib import Path

KILL_AT_ENV = "WANDISTILLER_KILL_AT"
KILL_RANK_ENV = "WANDISTILLER_KILL_RANK"
POINTS = ("after_encode_rows", "mid_shard", "after_rename", "before_progress", "in_manifest", "denoise_step",
          "train_step", "in_checkpoint", "before_checkpoint_rename", "after_checkpoint_rename",
          "before_dir_rename", "after_dir_rename")
HOWS = ("kill", "enospc", "stop", "term", "int")

_UNREAD = object()
_target = _UNREAD  # None (unset) or (point, n, how), parsed on first use
_seen: dict[str, int] = {}


def _parse(spec: str | None) -> tuple[str, int, str] | None:
    if not spec:
        return None
    rank = os.environ.get(KILL_RANK_ENV)
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in POINTS or not parts[1].isdigit() or int(parts[1]) < 1 \
            or (len(parts) == 3 and parts[2] not in HOWS):
        raise ValueError(f"{KILL_AT_ENV}={spec!r}: expected <point>:<n>[:{'|'.join(HOWS)}] with point one of "
                         f"{', '.join(POINTS)} and n >= 1")
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "kill"


def fault_point(name: str) -> None:
    """Mark a point where a fault may be injected; a no-op unless asked for."""
    global _target
    if _target is _UNREAD:
        _target = _parse(os.environ.get(KILL_AT_ENV))
    if _target is None or name != _target[0]:
        return
    n, how = _target[1:]
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] != n:
        return
    if how == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {KILL_AT_ENV} at {name}:{n})")
    if how == "term":
        # The shell's `kill` is the sender (a DataLoader worker tells its trainer's SIGTERM from others'); it has
        # signalled when this returns, and the handler runs in the main thread before the next step.
        pids = [str(p) for p in [os.getpid(), *children(os.getpid())]]
        subprocess.run(["sh", "-c", 'kill -s TERM "$@"', "sh", *pids], check=True)
        return
    os.kill(os.getpid(), {"stop": signal.SIGSTOP, "int": signal.SIGINT}.get(how, signal.SIGKILL))


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux: every thread's `children` list in /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            out += [int(c) for c in (task / "children").read_text().split()]
    return out
