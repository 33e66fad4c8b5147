"""User-facing errors: one clear line, a remedy, a non-zero exit; and the OOM report.

Exit codes: 2 = the user's input is wrong (paths, prompts, configs, caches), 3 = out of memory,
1 = anything else (a bug: the traceback is kept).
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import sys

import click
import torch

from cache.errors import CacheError

EXIT_USAGE = 2
EXIT_OOM = 3


class UserError(Exception):
    """A problem the user caused and can fix; the message says what and how."""


# Stage-specific remedies printed with an out-of-memory report, most effective first.
OOM_REMEDIES = {
    "teacher-cache": [
        "use the next placement down: --placement offload (weights in RAM, streamed per block) or "
        "--placement disk (weights streamed from --offload-dir); `wandistiller plan` shows what fits",
        "for a two-expert teacher, --expert-order expert (only one expert resident at a time)",
        "lower --batch-size (trajectories run together; each costs activations for 2x with CFG)",
        "use --dtype bfloat16 (half the weight and activation memory of float32)",
    ],
    "train-student": [
        "lower --batch-size and raise --grad-accum to keep the same global batch",
        "add --gradient-checkpointing (recomputes activations in the backward pass)",
        "use --mixed-precision bf16",
    ],
    "sample": ["lower --height/--width or sample fewer prompts at once", "use a GPU with more free memory"],
}


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""


def memory_report() -> list[str]:
    """Memory figures of this process: peak RSS, and per-CUDA-device allocated/reserved/free."""
    lines = [f"peak host RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"]
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(d)
            lines.append(
                f"cuda:{d} allocated {torch.cuda.memory_allocated(d) / 2**30:.2f} GiB, "
                f"peak {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB, "
                f"reserved {torch.cuda.memory_reserved(d) / 2**30:.2f} GiB, "
                f"free {free / 2**30:.2f} / {total / 2**30:.2f} GiB"
            )
    return lines


def oom_message(stage: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lines = [f"{_rank_prefix()}error: out of memory in {stage}: {first}"]
    lines += [f"  memory: {m}" for m in memory_report()]
    lines += ["  remedies:"] + [f"    - {r}" for r in OOM_REMEDIES.get(stage, [])]
    return "\n".join(lines)


# Write failures the user fixes by freeing space, raising a quota or fixing permissions.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


# How to pick up where a stage stopped (default: rerun the same command).
RERUN = {"train-student": "rerun the same command with --resume"}


def is_disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS


def disk_message(exc: OSError, stage: str | None = None) -> str:
    where = f" while writing {exc.filename}" if exc.filename else ""
    return (f"{exc.strerror or exc}{where}; free space (or raise the quota / file-size limit) and "
            f"{RERUN.get(stage, 'rerun the same command')}: everything finished so far is kept and the run "
            "resumes where it stopped")


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """Print one error line (prefixed with the rank under torchrun) to stderr and exit."""
    click.echo(f"{_rank_prefix()}error: {message}", err=True)
    sys.stderr.flush()
    sys.exit(code)


def user_errors(stage: str):
    """Decorator for CLI commands: turn the errors a user can cause into one line and an exit code."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (UserError, CacheError) as e:
                fail(str(e))
            except torch.OutOfMemoryError as e:
                click.echo(oom_message(stage, e), err=True)
                sys.stderr.flush()
                sys.exit(EXIT_OOM)
            except OSError as e:
                if e.errno not in _DISK_ERRNOS:
                    raise
                fail(disk_message(e, stage))
            except MemoryError as e:
                click.echo(oom_message(stage, e), err=True)
                sys.exit(EXIT_OOM)
            except KeyboardInterrupt:
                fail("interrupted; rerun the same command to resume", 130)

        return wrapper

    return deco
