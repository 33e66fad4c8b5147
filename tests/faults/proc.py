"""Run `wandistiller` commands in child processes forked from one preloaded server.

Python + torch + diffusers take seconds to import; a suite that SIGKILLs stage one a dozen times would
spend most of its time starting interpreters. A `forkserver` imports them once, and every command runs
in a fresh fork of it: a real, separate process (its own exit code, its own SIGKILL, its own file-size
limit), started in milliseconds. The server never runs torch kernels before forking, so its children
start with clean thread pools.

The server and its children never see a GPU (CUDA_VISIBLE_DEVICES is empty for them): importing diffusers
queries the accelerator, which initialises the CUDA driver, and a process forked after that cannot use CUDA
("CUDA error: initialization error"). Every command run here is a CPU run.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
from multiprocessing import forkserver
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNSAFE_PICKLE = "NUMCODECS_ALLOW_UNSAFE_PICKLE_DECODE"
# Imported once in the server; everything a command needs before its first output.
PRELOAD = ["torch", "pipeline.cli", "stages.teacher_cache.make_cache", "stages.train_student.train", "stages.sample.sample",
           "stages.sample.export", "stages.sample.evaluate"]
# Variables a command inherits only when the scenario sets them.
FAULT_ENV = ("WANDISTILLER_KILL_AT", "WANDISTILLER_KILL_RANK", "WANDISTILLER_FAIL_AT", "WANDISTILLER_DEBUG_DIR")

_ctx = None
_logs: Path | None = None


def _context():
    global _ctx, _logs
    if _ctx is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD + [__name__, __name__.rsplit(".", 1)[0] + ".preload"])
        # The server imports the preload list with the environment's path only (Python 3.11 ignores the
        # sys.path it is handed; an import that fails is skipped silently and every command would then
        # import diffusers' models itself): start it now with the repository and this package on it.
        here = str(Path(__file__).resolve().parents[1])
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), here] + [p for p in [saved["PYTHONPATH"]] if p])
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (see the module's docstring)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        atexit.register(cleanup)
    if _logs is None:  # (again) after a cleanup(): the server lives on, the log folder is per use
        _logs = Path(tempfile.mkdtemp(prefix="wandistiller-faults-logs-"))
    return _ctx


@dataclass
class Result:
    """How a command ended: `code` is its exit status (-9 after SIGKILL, 143 after a clean stop on SIGTERM, None
    if it hung)."""

    argv: list[str]
    code: int | None
    out: str
    err: str
    wall_s: float

    @property
    def killed(self) -> bool:
        return self.code == -signal.SIGKILL

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("error:") or "] error:" in ln]

    def describe(self) -> str:
        tail = "\n".join((self.out + self.err).strip().splitlines()[-12:])
        return f"`wandistiller {' '.join(self.argv)}` -> exit {self.code}\n{tail}"


def _child(argv: list[str], env: dict[str, str], out_path: str, err_path: str, fsize: int | None,
           umask: int | None = None, mem: int | None = None) -> None:
    for k in FAULT_ENV:
        os.environ.pop(k, None)
    os.environ.update(env)
    if env.get(UNSAFE_PICKLE) == "1":  # numcodecs < 0.16.6 decoded pickles as this does (read at its import)
        import numcodecs.pickles

        numcodecs.pickles.ALLOW_UNSAFE_PICKLE_DECODE = True
    if "HF_HOME" in env:  # huggingface_hub read its cache's place when the server imported it: point it here
        from huggingface_hub import constants

        constants.HF_HUB_CACHE = os.path.join(env["HF_HOME"], "hub")
        constants.HF_HUB_OFFLINE = env.get("HF_HUB_OFFLINE") == "1"
    # Ctrl-C as a terminal delivers it, even where the suite itself runs with SIGINT ignored (a background job of
    # a non-interactive shell, `cmd &`, inherits SIG_IGN for SIGINT, and Python then never raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Started as a daemon (it dies with the suite), it may still start processes of its own as a command run from a
    # shell does: train-student's DataLoader workers, forked (a forkserver's child would default to the forkserver,
    # whose workers outlive the command). multiprocessing refuses children to daemons unless told otherwise.
    mp.current_process()._config["daemon"] = False
    mp.set_start_method("fork", force=True)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if umask is not None:  # the user's umask (the server's is the suite's own)
        os.umask(umask)
    if fsize is not None:  # stands in for a full disk: writes past `fsize` bytes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    import torch

    torch.set_num_threads(1)
    from pipeline.cli import main

    if mem is not None:  # `prlimit --as`: `mem` bytes of address space beyond what the imports already take
        vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + mem, vm + mem))

    code = 0
    try:
        main(argv, prog_name="wandistiller", standalone_mode=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # an escaped exception is what the suite looks for: keep its traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cli(argv: list[str], env: dict[str, str] | None = None, fsize: int | None = None,
            kill_after_s: float | None = None, timeout_s: float = 300.0, sig: int = signal.SIGKILL,
            umask: int | None = None, mem: int | None = None) -> Result:
    """Run `wandistiller argv...` in a fresh process; send it `sig` (SIGKILL) after `kill_after_s` if given; `mem`:
    the bytes of address space it may take beyond what it starts with."""
    return start_cli(argv, env, fsize, umask, mem).wait(timeout_s, kill_after_s, sig)


@dataclass
class Running:
    """A command started by `start_cli`, still running (or stopped: see `is_stopped`)."""

    argv: list[str]
    process: object
    out_path: str
    err_path: str
    t0: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP), as the fault point's `stop` leaves it."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def wait(self, timeout_s: float = 300.0, kill_after_s: float | None = None, sig: int = signal.SIGKILL) -> Result:
        p = self.process
        p.join(kill_after_s if kill_after_s is not None else timeout_s)
        if p.is_alive() and kill_after_s is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended on its own between the two lines
                os.kill(p.pid, sig)
            p.join(timeout_s)
        wall = time.perf_counter() - self.t0
        code = p.exitcode
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.join()
            code = None
        out, err = (Path(x).read_text(errors="replace") if Path(x).exists() else "" for x in (self.out_path, self.err_path))
        for x in (self.out_path, self.err_path):
            Path(x).unlink(missing_ok=True)
        return Result(self.argv, code, out, err, wall)


def start_cli(argv: list[str], env: dict[str, str] | None = None, fsize: int | None = None,
              umask: int | None = None, mem: int | None = None) -> Running:
    """Start `wandistiller argv...` in a fresh process and return at once (`.wait()` for its Result)."""
    ctx = _context()
    argv = [str(a) for a in argv]
    fd, out_path = tempfile.mkstemp(dir=_logs, suffix=".out")
    os.close(fd)
    err_path = out_path[:-4] + ".err"
    t0 = time.perf_counter()
    p = ctx.Process(target=_child, args=(argv, dict(env or {}), out_path, err_path, fsize, umask, mem),
                    daemon=True)
    p.start()
    return Running(argv, p, out_path, err_path, t0)


def warm_up() -> float:
    """Start the server (imports torch & co. once); returns the seconds it took."""
    t0 = time.perf_counter()
    r = run_cli(["--version"])
    if r.code != 0:
        raise RuntimeError(f"the command server does not start: {r.describe()}")
    return time.perf_counter() - t0


def cleanup() -> None:
    global _logs
    if _logs is not None:
        shutil.rmtree(_logs, ignore_errors=True)
        _logs = None


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` at `path` (root only); yields a function that grows it, or None if not allowed."""
    path.mkdir(parents=True)
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0

    def grow(new: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True, capture_output=True)

    try:
        yield grow if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
