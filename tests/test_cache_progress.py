"""Progress across the parts of an unfinished cache: `cache info` shows each part (prompts done of its total,
shards, samples, and who writes it with an ETA while a live process does), and every reader that refuses it
(`cache verify`, `train-student`) names the unfinished parts and the command that finishes them."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time

import pytest
from click.testing import CliRunner

from cache.part_progress import PartProgress
from conftest import TEST_PROMPTS, make_cache
from pipeline import faults, lock
from pipeline.cache_status import eta_s, parts_status
from pipeline.cli import main

pytestmark = pytest.mark.slow


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def half_done(tiny_teacher, prompts_file, tmp_path_factory):
    """A 2-part cache of the 7 test prompts (part 0: 4 prompts, part 1: 3) with 2 trajectories a block and 8
    samples a shard: part 0 finished; part 1 stopped by a full disk as its second shard was renamed, so one shard
    (2 of its 3 prompts) is recorded, as a killed run leaves it."""
    out = tmp_path_factory.mktemp("half") / "cache"
    args = dict(num_parts=2, batch_size=2, samples_per_shard=8)
    make_cache(tiny_teacher, prompts_file, out, part=0, **args)
    mp = pytest.MonkeyPatch()
    mp.setenv(faults.KILL_AT_ENV, "after_rename:2:enospc")
    importlib.reload(faults)  # (reads KILL_AT_ENV afresh)
    try:
        with pytest.raises(OSError, match="No space left"):
            make_cache(tiny_teacher, prompts_file, out, part=1, **args)
    finally:
        mp.undo()
        importlib.reload(faults)  # (reads KILL_AT_ENV afresh)
    return out


def test_cache_info_shows_every_part_of_a_half_done_cache(half_done):
    r = invoke(["cache", "info", half_done])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == f"{half_done}: unfinished, 1 of 2 part(s) finished, 24 samples (270.0 KiB) so far"
    assert lines[1] == "  part 0: finished, 4 of 4 prompts, 2 shards, 16 of 16 samples, 180.0 KiB"
    assert lines[2] == "  part 1: stopped, 2 of 3 prompts, 1 shard, 8 of 12 samples, 90.0 KiB"
    assert lines[3] == ("to finish: rerun the same `wandistiller teacher-cache` command with --part 1 --num-parts 2 "
                        "(or the same torchrun, or SLURM array task) to finish it")
    info = json.loads(invoke(["cache", "info", half_done, "--json"]).output)
    assert info["finished"] is False and info["num_parts"] == 2 and info["parts_finished"] == 1
    assert [(p["part"], p["state"], p["prompts_done"], p["prompts"], p["shards"]) for p in info["parts"]] == [
        (0, "finished", 4, 4, 2), (1, "stopped", 2, 3, 1)]


def test_an_unfinished_video_cache_counts_its_frames(tiny_teacher, tmp_path):
    """Part 0 of 2 of a 5-frame cache written: the head line says its samples' frames, decoded and latent."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    out = make_cache(tiny_teacher, prompts, tmp_path / "cache", frames=5, part=0, num_parts=2)
    r = invoke(["cache", "info", out])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"{out}: unfinished, 1 of 2 part(s) finished, 4 samples of 5 frames (2 latent) (")
    info = json.loads(invoke(["cache", "info", out, "--json"]).output)
    assert info["frames"] == 5 and info["latent_frames"] == 2


def test_readers_name_the_unfinished_part_and_the_command(half_done, tmp_path):
    want = (f"error: {half_done} has no manifest.json: stage one has not finished there (1 of 2 parts finished; "
            "part 1: stopped, 2 of 3 prompts, 1 shard); rerun the same `wandistiller teacher-cache` command with "
            "--part 1 --num-parts 2 (or the same torchrun, or SLURM array task) to finish it")
    r = invoke(["cache", "verify", half_done])
    assert r.exit_code == 2 and r.output.strip() == want and "BAD" not in r.output
    r = invoke(["train-student", "--cache", half_done, "--student-config", "configs/student-tiny.json", "--out",
                tmp_path / "run", "--device", "cpu", "--report-to", "none"])
    assert r.exit_code == 2 and r.output.strip() == want
    assert not (tmp_path / "run").exists()


def test_a_part_not_started_is_named(half_done, tmp_path):
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(half_done, copy)
    shutil.rmtree(copy / "parts" / "part-00001")
    for shard in (copy / "shards").glob("part-00001-*"):
        shard.unlink()
    r = invoke(["cache", "info", copy])
    assert "  part 1: not started" in r.output.splitlines()
    assert "--part 1 --num-parts 2" in r.output


def test_a_live_part_shows_its_writer_and_an_eta(half_done):
    """A process holding part 1's stage-one lock is its live writer: `cache info` names it, with an ETA from the
    shards it wrote since it started: between its first shard and its last (loading the teacher before the first
    does not count), or from its start while it has written one."""
    path = lock.part_lock_path(half_done, 1)
    prog = PartProgress.load(half_done, 1)
    first = prog.shards[0]  # 8 samples; the part holds 12
    extra = half_done / "shards" / "part-00001-000099.tar"
    lock.acquire(path, "part 1 (test)")
    try:
        started = json.loads(path.read_text())["started"]
        os.utime(half_done / first.path, (started + 2, started + 2))
        _, statuses = parts_status(half_done)
        assert statuses[1].state == "running" and statuses[1].holder["pid"] == os.getpid()
        assert eta_s(half_done, statuses[1]) == pytest.approx(4 / (8 / 2))  # 4 samples left at 8 samples in 2 s
        r = invoke(["cache", "info", half_done])
        assert (f"  part 1: running, 2 of 3 prompts, 1 shard, 8 of 12 samples, 90.0 KiB (pid {os.getpid()} on "
                in r.output) and ", ETA 1 s" in r.output
        assert "to finish: wait for it (`wandistiller cache info` shows the ETA)" in r.output

        extra.write_bytes(b"")  # a second shard of 2 samples a second after the first: 2 samples/s, 2 left
        os.utime(extra, (started + 3, started + 3))
        prog.shards = [first, dataclasses.replace(first, path=extra.relative_to(half_done).as_posix(), samples=2)]
        prog.save(half_done)
        assert eta_s(half_done, parts_status(half_done)[1][1]) == pytest.approx(2 / (2 / 1))
    finally:
        lock.release(path)
        extra.unlink(missing_ok=True)
        prog.shards = [first]
        prog.save(half_done)
    assert parts_status(half_done)[1][1].state == "stopped"  # the lock is released: no live writer


def test_the_liveness_probe_never_keeps_a_writer_out(tmp_path):
    """`cache info` probes a lock with a shared flock for an instant; a writer arriving then waits it out."""
    import threading

    path = lock.part_lock_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    fd = os.open(path, os.O_RDONLY)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe caught in the act
    threading.Timer(0.1, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd))).start()
    t0 = time.monotonic()
    lock.acquire(path, "part 0 (test)")
    try:
        assert time.monotonic() - t0 < 1.0
        assert lock.live_writer(path)["pid"] == os.getpid()
    finally:
        lock.release(path)
    assert lock.live_writer(path) is None
