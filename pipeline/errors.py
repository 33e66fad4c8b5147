"""User-facing errors: one clear line, a remedy and a non-zero exit, from the CLI (`user_errors`) and from every
torchrun rank (`exit_rank`); the exit codes are one table (`classify`; docs/reliability.md, "Exit codes")."""

from __future__ import annotations

import errno
import functools
import os
import resource
import sys
import traceback
from typing import TYPE_CHECKING, NoReturn

import click

from cache.cache_error import CacheError, UnfinishedCacheError

from .user_error import UserError

if TYPE_CHECKING:
    from .runtime import DistEnv

EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_OOM = 3
EXIT_PEER_LOST = 4
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped cleanly when a scheduler preempts the job


class Terminated(BaseException):
    """SIGTERM stopped the stage; a BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it."""


# Stage-specific remedies printed with an out-of-memory report, most effective first.
OOM_REMEDIES = {
    "teacher-cache": [
        "use the next placement down: --placement offload (weights in RAM, streamed layer by layer) or "
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

# The same for the host's memory (a MemoryError: RAM or the address-space limit, not a GPU's), then for any stage.
HOST_OOM_REMEDIES = {
    "teacher-cache": ["use --placement disk (the weights streamed from --offload-dir, not held in RAM); `wandistiller "
                      "plan` shows what fits", "for a two-expert teacher, --expert-order expert", "lower --batch-size"],
    "train-student": ["lower --num-workers (each DataLoader worker holds its own buffers)", "lower --batch-size",
                      "lower --embedding-cache-size (prompt embeddings each reader process keeps)"],
    "sample": ["sample fewer prompts at once (--max-prompts) or at a lower --height/--width"],
}
HOST_OOM_ANY = ["run where the process may use more RAM (a larger node, SLURM's --mem, `ulimit -v`), or stop what "
                "else uses it", "check the files the command reads: one far larger than its kind (a config, a prompt "
                "file, a record of the run or cache folder) is not the file it should be"]

# How to pick up where a stage stopped (default: rerun the same command).
RERUN = {"train-student": "rerun the same command with --resume"}

# Write failures the user fixes by freeing space, raising a quota or fixing permissions.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}

# What gloo says when the peer of a collective died (a RuntimeError, not always a DistError).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _memory_report() -> list[str]:
    """Peak RSS, and each CUDA device's figures when this process uses CUDA (a CPU run's must not initialise it)."""
    lines = [f"peak host RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        for d in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(d)
            lines.append(f"cuda:{d} allocated {torch.cuda.memory_allocated(d) / 2**30:.2f} GiB, "
                         f"peak {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB, "
                         f"reserved {torch.cuda.memory_reserved(d) / 2**30:.2f} GiB, "
                         f"free {free / 2**30:.2f} / {total / 2**30:.2f} GiB")
    return lines


def classify(exc: BaseException, stage: str) -> tuple[int, str]:
    """(exit code, message after `error: `) of an exception that ends `stage`; EXIT_BUG keeps its traceback."""
    # Order matters: torch's OutOfMemoryError and DistError are RuntimeErrors, CacheError a ValueError.
    torch = sys.modules.get("torch")  # (only once imported: a bad flag must not wait seconds for torch to load)
    gpu = torch is not None and isinstance(exc, torch.OutOfMemoryError)
    if gpu or isinstance(exc, MemoryError):  # the GPU's memory, or the host's: each its own remedies
        lines = [f"out of {'' if gpu else 'host '}memory in {stage}: {first_line(exc)}",
                 *(f"  memory: {m}" for m in _memory_report())]
        remedies = OOM_REMEDIES.get(stage, []) if gpu else [*HOST_OOM_REMEDIES.get(stage, []), *HOST_OOM_ANY]
        return EXIT_OOM, "\n".join(lines + ["  remedies:"] + [f"    - {r}" for r in remedies])
    if isinstance(exc, UnfinishedCacheError):  # each unfinished part in words, and what finishes them
        from .cache_status import unfinished_problem  # (loads cache/: not at the CLI's load)

        try:
            return EXIT_USAGE, unfinished_problem(exc.cache_dir)
        except CacheError as e:  # a part's progress record that cannot be read: that is the problem to name
            return EXIT_USAGE, str(e)
    if isinstance(exc, (UserError, CacheError)):
        return EXIT_USAGE, str(exc)
    rerun = RERUN.get(stage, "rerun the same command")
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        where = f" while writing {exc.filename}" if exc.filename else ""
        return EXIT_USAGE, (f"{exc.strerror or exc}{where}; free space (or raise the quota / file-size limit) and "
                            f"{rerun}: everything finished so far is kept and the run resumes where it stopped")
    if isinstance(exc, Terminated):  # the stage's message says where it stopped; raised at once, it has none
        return EXIT_TERMINATED, str(exc) or f"terminated (SIGTERM); {rerun} to continue"
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, f"interrupted; {rerun} to continue"
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", ())
    if isinstance(exc, dist_error) or (isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOST)):
        return EXIT_PEER_LOST, (f"lost contact with another rank ({first_line(exc)}); the rank that failed first "
                                "prints why")
    return EXIT_BUG, f"{type(exc).__name__}: {exc}"


def _record_for_torchrun(text: str) -> None:
    """Our text into torch elastic's error file, so torchrun's closing summary quotes it. (`@record` does not fit:
    a failing rank leaves through `os._exit`, and it passes `user_errors`' `sys.exit(2)` through unrecorded.)"""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # not under torchrun: nothing to record, torch not needed
        from .torch_private import write_error_file

        write_error_file(text)


def user_errors(stage: str):
    """Decorator for CLI commands: an exception of the table becomes its message and exit code; a bug propagates."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                code, message = classify(e, stage)
                if code == EXIT_BUG:  # also click's own exceptions and SystemExit: they pass through as they are
                    raise
                rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") != "1" else None
                text = f"{'' if rank is None else f'[rank {rank}] '}error: {message}"
                click.echo(text, err=True)
                sys.stderr.flush()
                _record_for_torchrun(text)  # a no-op outside torchrun
                sys.exit(code)

        return wrapper

    return deco


def exit_rank(exc: BaseException, env: DistEnv, stage: str) -> NoReturn:
    """End a failing torchrun rank (in the `except` block): print its error (rank 0 alone for one all ranks raise alike,
    `exc.all_ranks`), record it for torchrun's summary and leave at once: no teardown, so a rank blocked in a collective
    with this one fails instead of waiting."""
    code, message = classify(exc, stage)
    text = f"[rank {env.rank}] error: {message}"
    if code == EXIT_BUG:
        text = f"{traceback.format_exc().rstrip()}\n{text}"
    if env.rank == 0 or not getattr(exc, "all_ranks", False):
        # The leading newline keeps the message off rank 0's progress-bar line.
        print("\n" + text, file=sys.stderr, flush=True)
    _record_for_torchrun(text)  # every rank: torchrun's summary lists each failed rank's cause
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
