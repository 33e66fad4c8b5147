"""One writer per output folder: the lock names its holder and dies with it; a resume with other shard sizes is
refused. Two real writers on one --out (the first paused mid-shard, the second refused, the first finishing to the
uninterrupted cache) are `make faults`' concurrent scenario (tests/test_faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline import lock
from pipeline.errors import UserError
from cache import format as F
from conftest import ROOT

HOLD = "import sys, time; from pipeline import lock; lock.acquire(sys.argv[1], 'x'); print('held', flush=True); time.sleep(60)"


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


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


def test_resume_with_other_samples_per_shard_is_refused(tiny_cache, tiny_teacher, prompts_file, tmp_path):
    import shutil

    from test_teacher_cache_cli import _args, assert_one_line_error, invoke

    out = tmp_path / "cache"
    shutil.copytree(tiny_cache, out)
    r = invoke(_args(tiny_teacher, prompts_file, out, samples_per_shard=5))
    assert_one_line_error(r, "--samples-per-shard 12", "--overwrite")
    assert not (out / F.LOCKS_DIR / "part-00000.lock").exists()
