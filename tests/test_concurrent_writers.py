"""One writer per output folder: a second writer is refused with one line naming the holder, the first finishes
and its cache equals an uninterrupted run's. Real processes; the first one is paused mid-shard (SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import lock
from pipeline.errors import UserError
from cache import format as F
from cache.verify import verify_cache
from conftest import ROOT, TINY_CACHE_ARGS
from test_resume import _assert_same_cache

HOLD = "import sys, time; from pipeline import lock; lock.acquire(sys.argv[1], 'x'); print('held', flush=True); time.sleep(60)"


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_lock_names_its_holder_and_dies_with_it(tmp_path):
    path = tmp_path / "out" / lock.RUN_LOCK
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {holder.pid} on .*wait for it to finish, or use another --out"):
            lock.acquire(path, "run folder out")
    finally:
        holder.kill()  # SIGKILL: no cleanup, the lock file stays behind with the dead holder's record
        holder.wait()
    assert path.exists()
    lock.acquire(path, "run folder out")  # the kernel dropped the lock with its process
    assert str(os.getpid()) in path.read_text()
    lock.release(path)
    assert not path.exists()


@pytest.mark.slow
def test_two_teacher_cache_runs_on_one_out(tiny_teacher, prompts_file, tmp_path):
    out, ref = tmp_path / "cache", tmp_path / "ref"

    def cmd(out=out, **over):
        kw = dict(TINY_CACHE_ARGS, placement="cpu") | over
        args = [sys.executable, "-m", "pipeline.cli", "teacher-cache", "--teacher", str(tiny_teacher), "--prompts",
                str(prompts_file), "--out", str(out)]
        return args + [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]

    subprocess.run(cmd(ref), env=_env(), check=True, capture_output=True)  # uninterrupted, same thread count
    first = subprocess.Popen(cmd(), env=_env(WANDISTILLER_KILL_AT="mid_shard:1:stop"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not _stopped(first.pid):
            assert first.poll() is None and time.time() < deadline, "the first writer never reached mid_shard"
            time.sleep(0.2)
        # The worst case: other shard sizes, which used to interleave into a cache of wrong shards.
        second = subprocess.run(cmd(samples_per_shard=5), env=_env(), capture_output=True, text=True, timeout=300)
        said = second.stdout + second.stderr
        errors = [ln for ln in said.splitlines() if ln.startswith("error:")]
        assert second.returncode == 2, said
        assert len(errors) == 1 and "Traceback" not in said, said
        assert f"pid {first.pid}" in errors[0] and "locks/part-00000.lock" in errors[0], errors[0]
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=300) == 0, first.stdout.read()
    assert verify_cache(out, progress=False) == []
    _assert_same_cache(out, ref)
    assert not (out / F.LOCKS_DIR / "part-00000.lock").exists()


def test_resume_with_other_samples_per_shard_is_refused(tiny_cache, tiny_teacher, prompts_file, tmp_path):
    import shutil

    from test_teacher_cache_cli import _args, assert_one_line_error, invoke

    out = tmp_path / "cache"
    shutil.copytree(tiny_cache, out)
    r = invoke(_args(tiny_teacher, prompts_file, out, samples_per_shard=5))
    assert_one_line_error(r, "--samples-per-shard 12", "--overwrite")
    assert not (out / F.LOCKS_DIR / "part-00000.lock").exists()
