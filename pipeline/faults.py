"""Fault injection for the fault-tolerance suite (tests/faults): die or fail at a named point of a stage.

WANDISTILLER_KILL_AT="<point>:<n>[:<how>]" makes the process stop the n-th time (1-based) it reaches
`<point>`: `kill` (default) sends itself SIGKILL (no cleanup, no `finally`, exactly like the OOM killer or
a preempted node); `enospc` raises OSError(ENOSPC) there, as a full disk would; `stop` sends itself SIGSTOP
(the test resumes it with SIGCONT): a writer caught in the middle of its work, for concurrency tests. Points:

  stage one  after_encode_rows  prompt rows are in prompts.zarr, the progress record does not say so yet
             mid_shard          samples of a block are in the shard's temporary file, not yet renamed
             after_rename       a shard has its final name; its final latents and progress record are not written
             before_progress    final latents written; the progress record does not list the shard yet
             in_manifest        manifest.json's temporary file is written and fsynced, not yet renamed
  stage two  train_step         an optimizer step begins
             in_checkpoint      the checkpoint's weights are written into its temporary folder, the rest not
             before_checkpoint_rename   the temporary folder is complete and fsynced, not yet renamed
             after_checkpoint_rename    the checkpoint has its final name; older ones are not yet pruned

Unset (every real run), `fault_point` returns after one global lookup. The variable is read on the
first call, not at import, so processes forked from a preloaded server still see their own setting.
"""

from __future__ import annotations

import errno
import os
import signal

KILL_AT_ENV = "WANDISTILLER_KILL_AT"
POINTS = ("after_encode_rows", "mid_shard", "after_rename", "before_progress", "in_manifest",
          "train_step", "in_checkpoint", "before_checkpoint_rename", "after_checkpoint_rename")
HOWS = ("kill", "enospc", "stop")

_UNREAD = object()
_target = _UNREAD  # None (unset) or (point, n, how), parsed on first use
_seen: dict[str, int] = {}


def _parse(spec: str | None) -> tuple[str, int, str] | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in POINTS or not parts[1].isdigit() or int(parts[1]) < 1 \
            or (len(parts) == 3 and parts[2] not in HOWS):
        raise ValueError(f"{KILL_AT_ENV}={spec!r}: expected <point>:<n>[:{'|'.join(HOWS)}] with point one of "
                         f"{', '.join(POINTS)} and n >= 1")
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "kill"


def fault_point(name: str) -> None:
    """Mark a point where a fault may be injected (see the module docstring); a no-op unless asked for."""
    global _target
    if _target is None:
        return
    if _target is _UNREAD:
        _target = _parse(os.environ.get(KILL_AT_ENV))
        if _target is None:
            return
    point, n, how = _target
    if name != point:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] != n:
        return
    if how == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {KILL_AT_ENV} at {name}:{n})")
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def reset() -> None:
    """Forget the parsed setting and the counts (for in-process tests that change the variable)."""
    global _target
    _target = _UNREAD
    _seen.clear()
