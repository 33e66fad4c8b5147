"""Durability (issue 21, item 5): what a stage says is written is on disk first, and every folder it publishes is
the old one or the new one at every instant.

- The prompt store's rows and final latents are fsynced before `progress.json` calls them written (a power loss
  must not leave a record vouching for chunks that never reached the disk).
- `student/`, `student_ema/`, an export and the resolved config go through tmp + fsync + rename
  (`cache.atomic.publish_dir`, `atomic_write_bytes`): a SIGKILL at any point leaves the old or the new, whole.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache import atomic
from cache import format as F
from cache.part_progress import PartProgress
from cache.prompt_store import prompt_store_path
from conftest import make_cache

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "student-tiny.json"


def tree(path: Path) -> dict[str, str]:
    """Relative path -> sha256 (or the link target) of everything below `path`."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# --- publish_dir: a real SIGKILL at every point --------------------------------------------------------------

_PUBLISH = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from cache import atomic
if {no_exchange}:
    atomic._exchange = lambda a, b: False
dest, kill = Path({dest!r}), {kill!r}
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
tmp = dest.with_name(dest.name + ".%d.tmp" % os.getpid())
tmp.mkdir()
for i in range(4):
    if kill == "file:%d" % i:
        die()
    (tmp / ("f%d" % i)).write_bytes(b"new %d" % i)
atomic.publish_dir(tmp, dest, before_replace=die if kill == "before" else None,
                   after_replace=die if kill == "after" else None)
"""
NEW = {f"f{i}": hashlib.sha256(b"new %d" % i).hexdigest() for i in range(4)}


def _publish(dest: Path, kill: str | None, no_exchange: bool = False) -> int:
    code = _PUBLISH.format(root=str(ROOT), dest=str(dest), kill=kill, no_exchange=no_exchange)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("kill", ["file:0", "file:2", "before", "after", None])
def test_publish_dir_leaves_the_old_folder_or_the_new_one(tmp_path, kill):
    dest = tmp_path / "student"
    dest.mkdir()
    (dest / "f0").write_bytes(b"old")
    (dest / "old-only").write_bytes(b"old")
    old = tree(dest)
    code = _publish(dest, kill)
    assert code == (-9 if kill else 0)
    assert tree(dest) == (NEW if kill in ("after", None) else old)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "student")
    assert len(leftovers) == (0 if kill is None else 1)  # a killed writer's `.tmp` folder: never read
    assert all(n.endswith(F.TMP_SUFFIX) for n in leftovers)
    assert _publish(dest, None) == 0 and tree(dest) == NEW  # the next writer replaces it as usual


def test_publish_dir_onto_a_new_name_and_without_an_exchange(tmp_path):
    assert _publish(tmp_path / "a", None) == 0 and tree(tmp_path / "a") == NEW
    dest = tmp_path / "b"
    dest.mkdir()
    (dest / "x").write_bytes(b"old")
    assert _publish(dest, None, no_exchange=True) == 0  # rename aside, rename in, delete the old
    assert tree(dest) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_resolved_config_is_written_atomically(tmp_path, monkeypatch):
    from pipeline.config import TrainStudentConfig, save_resolved

    path = tmp_path / "config.json"
    path.write_text('{"old": true}\n')
    cfg = TrainStudentConfig(cache=("c",), student_config="s.json", out=str(tmp_path))

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full_disk)
    with pytest.raises(OSError):
        save_resolved(cfg, path)
    assert path.read_text() == '{"old": true}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    monkeypatch.undo()
    save_resolved(cfg, path)
    assert json.loads(path.read_text())["cache"] == ["c"]


# --- the order: fsync, then progress.json ---------------------------------------------------------------------

@pytest.mark.slow
def test_prompt_store_is_fsynced_before_progress_records_it(tiny_teacher, prompts_file, tmp_path, monkeypatch):
    """At every progress.json write, every file of the part's prompt store and every shard it lists is unchanged
    since it was last fsynced (by size and mtime, by inode: a shard is fsynced under its temporary name), and the
    folders holding them listed each of them when they were last fsynced. Folders are judged by their listing, not
    their mtime: the writer thread starts the next shard's temporary file while the previous shard's progress is
    recorded, which changes the folder without touching what the record vouches for. Stage one in-process, with
    os.fsync recording what it made durable."""
    synced: dict[tuple, tuple] = {}
    listed: dict[tuple, set] = {}
    real_fsync = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            names = set(os.listdir(f"/proc/self/fd/{fd}"))
            real_fsync(fd)
            listed[(st.st_dev, st.st_ino)] = names  # listed before the fsync: no later entry counted as durable
            return
        real_fsync(fd)
        st = os.fstat(fd)
        synced[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns)

    out = tmp_path / "cache"
    checked = []
    real_save = PartProgress.save

    def save(prog, cache_dir):
        store = prompt_store_path(out, prog.part)
        files = [p for p in store.rglob("*") if p.is_file()] if store.exists() else []
        entries = [store, *store.rglob("*")] if store.exists() else []
        shards = [out / s.path for s in prog.shards]
        entries += [out / F.SHARDS_DIR] if shards else []
        stale = []
        for p in [*files, *shards]:
            st = os.stat(p)
            if synced.get((st.st_dev, st.st_ino)) != (st.st_size, st.st_mtime_ns):
                stale.append(str(p.relative_to(out)))
        for p in [*entries, *shards]:
            folder = os.stat(p.parent)
            if p.name not in listed.get((folder.st_dev, folder.st_ino), ()):
                stale.append(f"{p.relative_to(out)} (its folder not fsynced since it appeared)")
        assert not stale, f"progress.json (encoded={prog.encoded}, done {prog.done_blocks}) written before {stale[:5]}"
        checked.append((prog.encoded, len(prog.done_blocks), len(files) + len(shards)))
        real_save(prog, cache_dir)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(PartProgress, "save", save)
    make_cache(tiny_teacher, prompts_file, out, seeds_per_prompt=2, batch_size=3)  # a row's seeds in two blocks
    assert any(enc and n == 0 and files > 10 for enc, n, files in checked)  # the encoded rows were checked
    assert checked[-1][1] == 5  # ... and every block's final latents (7 prompts x 2 seeds / 3 per block)


# --- the artifacts: a SIGKILL while each is published ----------------------------------------------------------

def _student_folder(path: Path, seed: int) -> Path:
    from stages.students.compact import build_student, load_student_config

    build_student(load_student_config(str(TINY)), str(TINY), seed).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.slow
def test_export_killed_while_replacing_an_export(tiny_teacher, tmp_path):
    """`export --overwrite` over an earlier export, SIGKILLed just before and just after its rename: the earlier
    export or the new one, whole, at --out."""
    from faults.proc import run_cli

    a, b = _student_folder(tmp_path / "a", 0), _student_folder(tmp_path / "b", 1)
    out = tmp_path / "pipe"
    export = lambda student, *extra, env=None: run_cli(  # noqa: E731
        ["export", "--student", student, "--teacher", tiny_teacher, "--out", out, *extra], env=env)
    assert export(a).code == 0
    old = tree(out)
    assert export(b, "--overwrite", env={"WANDISTILLER_KILL_AT": "before_dir_rename:1"}).killed
    assert tree(out) == old
    assert export(b, "--overwrite", env={"WANDISTILLER_KILL_AT": "after_dir_rename:1"}).killed
    new = tree(out)
    assert new != old and new["transformer/diffusion_pytorch_model.safetensors"] == \
        tree(b)["diffusion_pytorch_model.safetensors"]
    assert export(b, "--overwrite").code == 0 and tree(out) == new


@pytest.mark.slow
def test_student_killed_while_replacing_the_student(tiny_cache, tmp_path):
    """A finished run's student/ rewritten by `--resume` (more steps), SIGKILLed just before and just after the
    rename: the old student/ or the new one, whole; the next run tidies what the kill left."""
    from faults.proc import run_cli

    out = tmp_path / "run"
    train = lambda steps, *extra, env=None: run_cli(  # noqa: E731
        ["train-student", "--cache", tiny_cache, "--student-config", TINY, "--out", out, "--num-workers", "0",
         "--batch-size", "4", "--device", "cpu", "--checkpoint-every", "0", "--max-steps", str(steps), *extra], env=env)
    assert train(1).code == 0
    old = tree(out / "student")
    assert train(2, "--resume", env={"WANDISTILLER_KILL_AT": "before_dir_rename:1"}).killed
    assert tree(out / "student") == old
    assert train(2, "--resume", env={"WANDISTILLER_KILL_AT": "after_dir_rename:1"}).killed
    new = tree(out / "student")
    assert new != old and set(new) == set(old)
    assert any(p.name.startswith("student.") for p in out.iterdir())  # the old copy, under a `.tmp` name
    assert train(2, "--resume").code == 0 and tree(out / "student") == new  # same steps, same seed: same weights
    assert not [p.name for p in out.iterdir() if p.name.endswith(F.TMP_SUFFIX)]


def test_a_killed_student_save_leaves_no_half_folder(tmp_path, monkeypatch):
    """In-process: a failure after the student's files are written but before its rename (a full disk at the
    fsync) leaves the old student/ untouched and no temporary folder."""
    import importlib

    run_mod = importlib.import_module("stages.train_student.train")  # (the package's `run` is the function)
    dest = _student_folder(tmp_path / "student", 0)
    old = tree(dest)
    from stages.students.compact import build_student, load_student_config

    model = build_student(load_student_config(str(TINY)), str(TINY), 1)

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full_disk)
    with pytest.raises(OSError) as e:
        run_mod._save_pretrained(model, dest)
    assert e.value.errno == errno.ENOSPC
    assert tree(dest) == old and sorted(p.name for p in tmp_path.iterdir()) == ["student"]
    monkeypatch.undo()
    run_mod._save_pretrained(model, dest)
    assert tree(dest) != old and sorted(p.name for p in tmp_path.iterdir()) == ["student"]
