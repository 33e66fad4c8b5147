"""Folders someone else handed us (issue 41, locks and stage-one folders): a lock file that is a link, a hard link or a
FIFO; a cache's `locks/`, `parts/part-N` or `shards/` that is a link out of the cache; a folder that merely holds
`offload/` and `shards/`. Each is refused in one line (or, for a reader's liveness probe, taken as "no live writer"),
nothing is written, deleted or read through it, and nothing hangs. The same inputs are rows of the fault suite's
hostile-input table (tests/faults/hostile.py)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from cache import format as F
from pipeline import lock
from pipeline.errors import UserError
from stages.teacher_cache import group_offload, outdir
from test_teacher_cache_cli import _args, assert_one_line_error, invoke

pytestmark = pytest.mark.timeout(120)  # a FIFO opened the old way blocks forever: fail instead


@pytest.fixture
def cache_copy(tiny_cache, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(tiny_cache, dst)
    return dst


def _tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry below `folder`, links as their target (never followed), files by content."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


# --- lock files (pipeline/lock.py) ----------------------------------------------------------------------------

def test_lock_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path, home):
    run = tmp_path / "run"
    run.mkdir()
    (run / lock.RUN_LOCK).symlink_to(home / "thesis.tex")
    with pytest.raises(UserError, match=rf"lock file {run / lock.RUN_LOCK} is a symbolic link.*delete it"):
        lock.acquire(run / lock.RUN_LOCK, "run folder run")
    assert (home / "thesis.tex").read_text() == "precious"
    (run / "dangling.lock").symlink_to(home / "nothing-yet")  # O_CREAT must not create the link's target either
    with pytest.raises(UserError, match="symbolic link"):
        lock.acquire(run / "dangling.lock", "run folder run")
    assert not (home / "nothing-yet").exists()


def test_lock_that_is_a_hard_link_is_refused_and_its_bytes_kept(tmp_path, home):
    run = tmp_path / "run"
    run.mkdir()
    os.link(home / "thesis.tex", run / lock.RUN_LOCK)
    with pytest.raises(UserError, match=r"writer.lock has 2 hard links.*delete it"):
        lock.acquire(run / lock.RUN_LOCK, "run folder run")
    assert (home / "thesis.tex").read_text() == "precious"


def test_fifo_lock_neither_hangs_the_writer_nor_the_probe(tmp_path):
    path = lock.part_lock_path(tmp_path, 0)
    path.parent.mkdir()
    os.mkfifo(path)
    with pytest.raises(UserError, match=r"part-00000.lock is a FIFO.*delete it"):
        lock.acquire(path, "part 0 (test)")
    assert lock.live_writer(path) is None  # junk is no live writer: a reader is not failed by it
    assert lock.live_writers(tmp_path) == {}
    path.unlink()
    path.mkdir()  # a folder where the lock belongs
    with pytest.raises(UserError, match="is a folder"):
        lock.acquire(path, "part 0 (test)")
    assert lock.live_writer(path) is None


def test_probe_skips_links_and_names_that_are_no_lock(tmp_path, home):
    locks = tmp_path / F.LOCKS_DIR
    locks.mkdir()
    (locks / "part-00000.lock").symlink_to(home / "thesis.tex")
    (locks / "part-x.lock").write_text("{}")  # not a name acquire gives: once a traceback (int("x"))
    assert lock.live_writers(tmp_path) == {}
    assert (home / "thesis.tex").read_text() == "precious"


def test_locks_folder_that_is_a_symlink_is_refused(tmp_path, home):
    elsewhere = home / "locks"
    elsewhere.mkdir()
    (tmp_path / F.LOCKS_DIR).symlink_to(elsewhere)
    with pytest.raises(UserError, match=rf"{tmp_path / F.LOCKS_DIR} is a symbolic link.*remove it"):
        lock.acquire(lock.part_lock_path(tmp_path, 0), "part 0 (test)")
    assert list(elsewhere.iterdir()) == []
    assert lock.live_writers(tmp_path) == {}


def test_a_sound_lock_still_works_after_the_checks(tmp_path):
    path = lock.part_lock_path(tmp_path, 3)
    lock.acquire(path, "part 3 (test)")
    try:
        assert os.stat(path).st_nlink == 1 and lock.live_writers(tmp_path)[3]["pid"] == os.getpid()
    finally:
        lock.release(path)
    assert not path.exists() and not path.parent.exists()


def test_offload_lock_is_opened_the_same_safe_way(tmp_path, home):
    (tmp_path / ".transformer-0123456789abcdef.lock").symlink_to(home / "thesis.tex")
    with pytest.raises(UserError, match="offload lock file .* is a symbolic link"):
        with group_offload._locked(tmp_path / ".transformer-0123456789abcdef.lock"):
            pass
    assert (home / "thesis.tex").read_text() == "precious"
    with group_offload._locked(tmp_path / ".transformer-fedcba9876543210.lock"):  # a new one is made and locked
        assert (tmp_path / ".transformer-fedcba9876543210.lock").is_file()


# --- stage one's --out (stages/teacher_cache/outdir.py) ---------------------------------------------------------

def test_part_folder_linked_out_of_the_cache_is_refused_with_and_without_overwrite(tiny_teacher, prompts_file,
                                                                                     cache_copy, home):
    part0 = cache_copy / F.PARTS_DIR / "part-00000"
    shutil.move(part0, home / "part-copy")
    part0.symlink_to(home / "part-copy")
    before = _tree(home)
    for extra in ([], ["--overwrite"], ["--dry-run"]):
        r = invoke(_args(tiny_teacher, prompts_file, cache_copy) + extra)
        assert_one_line_error(r, f"{part0} is a symbolic link", "remove the link")
    assert _tree(home) == before and part0.is_symlink()


@pytest.mark.parametrize("name", [F.SHARDS_DIR, F.LOCKS_DIR, F.MANIFEST, f"{F.PARTS_DIR}/part-00000/{F.PROMPTS_ZARR}"])
def test_any_link_the_cache_owns_is_refused(cache_copy, home, name):
    owned = cache_copy / name
    if owned.is_dir():
        shutil.move(owned, home / "moved")
    else:
        owned.parent.mkdir(exist_ok=True)
        owned.unlink(missing_ok=True)
        (home / "moved").write_text("{}")
    owned.symlink_to(home / "moved")
    with pytest.raises(UserError, match=rf"{owned} is a symbolic link inside the cache"):
        outdir.refuse_foreign(cache_copy)


def test_fifo_manifest_is_refused_without_hanging(cache_copy):
    (cache_copy / F.MANIFEST).unlink()
    os.mkfifo(cache_copy / F.MANIFEST)
    with pytest.raises(UserError, match=rf"{F.MANIFEST} is a FIFO inside the cache .* delete it"):
        outdir.refuse_foreign(cache_copy)


def test_overwrite_of_a_folder_that_is_no_cache_deletes_nothing(tiny_teacher, prompts_file, tmp_path):
    foreign = tmp_path / "results"
    for sub in ("offload", "shards"):
        (foreign / sub).mkdir(parents=True)
        (foreign / sub / "results.csv").write_text("a,b\n1,2\n")
    before = _tree(foreign)
    for extra in (["--overwrite"], ["--overwrite", "--dry-run"], []):
        r = invoke(_args(tiny_teacher, prompts_file, foreign) + extra)
        assert_one_line_error(r, f"output {foreign} is not empty and is not a WanDistiller cache",
                              "'offload', 'shards'", "choose a new or empty directory")
    assert _tree(foreign) == before


def test_what_counts_as_a_cache_of_ours(cache_copy, tmp_path):
    outdir.refuse_foreign(cache_copy)  # a finished cache
    outdir.refuse_foreign(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    outdir.refuse_foreign(tmp_path / "empty")
    # what a first run refused or killed before its first record leaves: empty folders, its lock, temporary files
    skel = tmp_path / "skeleton"
    (skel / F.SHARDS_DIR).mkdir(parents=True)
    (skel / F.PARTS_DIR / "part-00000").mkdir(parents=True)
    (skel / F.LOCKS_DIR).mkdir()
    (skel / F.LOCKS_DIR / "part-00000.lock").write_text("{}")
    (skel / f".write-probe-1{F.TMP_SUFFIX}").write_text("")
    outdir.refuse_foreign(skel)
    (skel / F.PARTS_DIR / "part-00000" / F.RESOLVED_CONFIG).write_text("{}")  # a config.json that is not ours
    with pytest.raises(UserError, match="is not a WanDistiller cache"):
        outdir.refuse_foreign(skel)
    # one record of ours is enough: the manifest, a part's progress record, or the resolved config it ran with
    manifest = (cache_copy / F.MANIFEST).read_bytes()
    (cache_copy / F.MANIFEST).write_text("{")
    outdir.refuse_foreign(cache_copy)
    (cache_copy / F.PARTS_DIR / "part-00000" / F.PROGRESS).write_text("[]")
    outdir.refuse_foreign(cache_copy)
    (cache_copy / F.PARTS_DIR / "part-00000" / F.RESOLVED_CONFIG).write_text("[]")
    with pytest.raises(UserError, match="is not a WanDistiller cache"):
        outdir.refuse_foreign(cache_copy)
    (cache_copy / F.MANIFEST).write_bytes(manifest)
    outdir.refuse_foreign(cache_copy)


def test_a_cache_whose_records_were_deleted_as_advised_is_still_ours(cache_copy):
    """A damaged part's refusal says to delete its folder and rerun: with no manifest yet, shards of ours and the
    root's negative are left, and the rerun must not be refused. A shard's name alone proves nothing."""
    shutil.rmtree(cache_copy / F.PARTS_DIR / "part-00000")
    (cache_copy / F.MANIFEST).unlink()
    outdir.refuse_foreign(cache_copy)
    shard = sorted((cache_copy / F.SHARDS_DIR).iterdir())[0]
    shard.write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="is not a WanDistiller cache"):
        outdir.refuse_foreign(cache_copy)
    shard.unlink()
    (cache_copy / F.NEGATIVE).write_text("not safetensors")
    with pytest.raises(UserError, match="is not a WanDistiller cache"):
        outdir.refuse_foreign(cache_copy)


def test_clear_removes_only_the_caches_own_entries(cache_copy):
    (cache_copy / f"manifest.json.1{F.TMP_SUFFIX}").write_text("")
    outdir.clear(cache_copy, None)
    assert sorted(p.name for p in cache_copy.iterdir()) == [f"manifest.json.1{F.TMP_SUFFIX}", F.SHARDS_DIR]
    assert list((cache_copy / F.SHARDS_DIR).iterdir()) == []


def test_clear_never_follows_a_link_and_says_when_it_cannot_remove(cache_copy, home, monkeypatch):
    (home / "keep").mkdir()
    (home / "keep" / "data.bin").write_bytes(b"x")
    (cache_copy / F.PARTS_DIR / "part-00001").symlink_to(home / "keep")  # planted after the check
    (cache_copy / F.SHARDS_DIR / "part-00000-999999.tar").symlink_to(home / "thesis.tex")
    outdir.clear(cache_copy, 0)
    assert not (cache_copy / F.PARTS_DIR / "part-00000").exists()
    assert (home / "thesis.tex").read_text() == "precious"
    outdir.clear(cache_copy, None)
    assert (home / "keep" / "data.bin").read_bytes() == b"x"

    def refused(path, onerror):  # a file someone made undeletable (root deletes anything: simulated)
        onerror(os.unlink, str(Path(path) / "f"), (PermissionError, PermissionError(errno.EACCES, "Permission "
                                                                                    "denied"), None))

    (cache_copy / F.PARTS_DIR / "part-00000").mkdir(parents=True)
    monkeypatch.setattr(outdir.shutil, "rmtree", refused)
    with pytest.raises(UserError, match=r"--overwrite cannot remove .*shards/f \(Permission denied\); remove it"):
        outdir.clear(cache_copy, None)


def test_write_probe_is_not_written_through_a_planted_link(tmp_path, home, monkeypatch):
    out = tmp_path / "new"
    out.mkdir()
    (out / f".write-probe-{os.getpid()}{F.TMP_SUFFIX}").symlink_to(home / "thesis.tex")
    with pytest.raises(UserError, match="symbolic link"):  # refused first ...
        outdir.check_out_dir(out)
    monkeypatch.setattr(outdir, "refuse_foreign", lambda out: None)  # ... and were the check raced, not written through
    outdir.check_out_dir(out)
    assert (home / "thesis.tex").read_text() == "precious"
