"""Stopping cleanly on SIGTERM (docs/reliability.md, "SIGTERM: preemption and time limits"): outside a `deferred()`
block SIGTERM raises `Terminated` at once; inside one it sets a flag, and the loop stops at its next boundary. Under
torchrun `agree` reduces every rank's flag once per step, so all ranks stop at one step."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

from .errors import EXIT_BUG, Terminated, classify

_installed = False
_requested = False
_deferring = 0


def _handler(signum, frame) -> None:
    global _requested
    first = not _requested
    _requested = True
    # A second SIGTERM (torchrun forwarding the scheduler's, say) never interrupts the stop the first began.
    if first and not _deferring:
        raise Terminated()


@contextlib.contextmanager
def handle_sigterm():
    """SIGTERM raises `Terminated` while this block runs (a no-op off the main thread, or with a handler installed)."""
    global _installed, _requested, _deferring
    if _installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _handler)
    _installed, _requested, _deferring = True, False, 0
    try:
        yield
    except Exception as e:
        # A library that catches everything turns our `Terminated` into its own error (diffusers' weight loader: any
        # failure becomes "Unable to load weights"): after a SIGTERM an error that is no user's is the SIGTERM's.
        if _requested and classify(e, "")[0] == EXIT_BUG:
            raise Terminated() from e
        raise
    finally:  # (None: a handler installed outside Python, which cannot be put back; the default then)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        _installed, _requested, _deferring = False, False, 0


@contextlib.contextmanager
def deferred():
    """Inside this block SIGTERM only sets the flag: the code stops at its own boundaries (`requested`, `check`)."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


@contextlib.contextmanager
def held():
    """SIGTERM blocked in this thread while the block runs, so that a process forked inside starts with it blocked
    until it chooses what to do with it (`worker_ignores_sigterm`); this process still gets it, in other threads."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_ignores_sigterm(worker_id: int = 0) -> None:
    """A DataLoader `worker_init_fn`: ignore SIGTERM from anyone but the parent (the trainer). SLURM signals every
    process of a job step, and a dead worker would fail the trainer's next batch before it checkpoints and stops; the
    trainer sends SIGTERM only to end its workers. Forked in `held()`, an early SIGTERM waits for the thread below."""
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit it

    def watch() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(0)

    threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()


def requested() -> bool:
    """Whether a SIGTERM arrived since `handle_sigterm` began (cheap enough for every step)."""
    return _requested


def check() -> None:
    """Raise `Terminated` if a SIGTERM arrived: a boundary where the loop may stop."""
    if _requested:
        raise Terminated()


def agree(device: torch.device) -> bool:
    """Whether any rank got a SIGTERM: a collective on the process group's `device`, the same answer on all."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _requested
    flag = torch.tensor([int(_requested)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
