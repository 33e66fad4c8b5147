"""SIGTERM, what SLURM and Kubernetes send a grace period before they kill a job, in real CLI processes: each stage
stops at its next boundary with exit 143 and one line saying how to continue, keeps everything it finished, and
the rerun is bit-identical to an uninterrupted run. (tests/faults/sigterm.py counts the same at more moments, and
under torchrun.)"""

from __future__ import annotations

import importlib
import re
import signal
from pathlib import Path

import pytest

from cache import format as F
from cache.cache_error import CacheError
from conftest import TINY_CACHE_ARGS
from faults.check import compare_caches, read_progress, temp_files
from faults.proc import cleanup, run_cli
from pipeline import signals
from pipeline.faults import KILL_AT_ENV
from test_train_student import TINY, assert_same_students, metrics

# Stage two's run: 24 training samples at batch 4, 6 steps an epoch; step 7 is in the second epoch.
TRAIN = dict(max_steps=10, batch_size=4, lr=1e-3, warmup_steps=2, ema_decay=0.8, holdout_prompts=1, eval_every=4,
             checkpoint_every=4, log_every=1, num_workers=0, device="cpu")


def _flags(**kw) -> list[str]:
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module", autouse=True)
def _command_server():
    yield
    cleanup()


# -- the handler ---------------------------------------------------------------------------------------------

def test_sigterm_raises_at_once_outside_a_deferred_block_and_only_flags_inside():
    before = signal.getsignal(signal.SIGTERM)
    with signals.handle_sigterm():
        with pytest.raises(signals.Terminated):
            signal.raise_signal(signal.SIGTERM)
        assert signals.requested()
        signal.raise_signal(signal.SIGTERM)  # a second one never interrupts the stop the first began
    with signals.handle_sigterm():
        assert not signals.requested()
        with signals.deferred():
            signal.raise_signal(signal.SIGTERM)
            assert signals.requested() and signals.agree(None)  # one process: no collective
            with pytest.raises(signals.Terminated):
                signals.check()
    assert signal.getsignal(signal.SIGTERM) is before and not signals.requested()


def test_a_sigterm_a_library_wraps_in_its_own_error_still_ends_as_terminated():
    """diffusers' weight loader turns any failure into OSError("Unable to load weights ..."): a SIGTERM arriving while
    the teacher loads surfaced as that traceback. After a SIGTERM such an error is the SIGTERM's; a user's error
    (a bad cache, say) is still reported as itself."""

    def load_weights():
        try:
            signal.raise_signal(signal.SIGTERM)
        except BaseException:
            raise OSError("Unable to load weights from checkpoint file") from None

    with pytest.raises(signals.Terminated) as got:
        with signals.handle_sigterm():
            load_weights()
    assert isinstance(got.value.__cause__, OSError)
    with pytest.raises(CacheError, match="bad cache"):
        with signals.handle_sigterm():
            with signals.deferred():
                signal.raise_signal(signal.SIGTERM)
            raise CacheError("bad cache")
    with pytest.raises(OSError, match="Unable to load"):  # no SIGTERM: the library's error is what it is
        with signals.handle_sigterm():
            raise OSError("Unable to load weights from checkpoint file")


# -- stage one -----------------------------------------------------------------------------------------------

def test_stage_one_waiting_for_the_other_parts_stops_as_terminated_when_a_sigterm_ended_them(monkeypatch):
    """Under torchrun a rank whose part is complete waits at a barrier for the others. torchrun forwards a SIGTERM to
    every rank: the others stop and leave, the barrier fails with a lost peer, and this rank reports the SIGTERM
    (exit 143, rerun to finish), not the loss of a rank. Without a SIGTERM a lost peer is what it is."""
    run = importlib.import_module("stages.teacher_cache.make_cache")  # (the package's `run` is the stage's function)

    def barrier_after_sigterm():
        signal.raise_signal(signal.SIGTERM)  # arrives while the collective blocks; its handler runs after it
        raise RuntimeError("[gloo] Connection closed by peer")

    job = type("Job", (), {"part": 1})()
    with signals.handle_sigterm():
        monkeypatch.setattr(run, "barrier", barrier_after_sigterm)
        with pytest.raises(signals.Terminated, match=r"terminated \(SIGTERM\) with every block of part 1 cached.*"
                                                     "rerun the same command"):
            run._wait_for_parts(job)

    def barrier_peer_lost():
        raise RuntimeError("[gloo] Connection closed by peer")

    with signals.handle_sigterm():
        monkeypatch.setattr(run, "barrier", barrier_peer_lost)
        with pytest.raises(RuntimeError, match="Connection closed"):
            run._wait_for_parts(job)


@pytest.mark.slow
def test_stage_one_records_the_finished_blocks_exits_143_and_the_rerun_equals_the_uninterrupted_cache(
        tiny_teacher, prompts_file, tmp_path):
    def argv(out: Path) -> list:
        # 7 prompts in blocks of 3 trajectories x 4 steps; a shard every 2 blocks, so the stop lands mid-shard.
        return ["teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", out, "--placement",
                "cpu", *_flags(**(TINY_CACHE_ARGS | dict(samples_per_shard=24)))]

    ref, out = tmp_path / "ref", tmp_path / "cache"
    assert run_cli(argv(ref)).code == 0
    r = run_cli(argv(out), env={KILL_AT_ENV: "denoise_step:6:term"})  # block 1's second step: block 0 is done
    assert r.code == 143, r.describe()
    assert r.error_lines == ["error: terminated (SIGTERM) with 1 of 3 blocks of part 0 cached; rerun the same "
                             "command to resume"], r.describe()
    assert "Traceback" not in r.err
    prog = read_progress(out)[0]
    assert prog["done_blocks"] == [0] and [s["samples"] for s in prog["shards"]] == [12]  # a shorter shard
    assert not temp_files(out) and not (out / F.MANIFEST).exists()

    again = run_cli(argv(out))
    assert again.code == 0, again.describe()
    assert "(1 done)" in again.out + again.err
    assert compare_caches(ref, out) == (0, 0, [])  # same samples, bit for bit, and prompt store


# -- stage two -----------------------------------------------------------------------------------------------

def _train_argv(cache: Path, out: Path, **over) -> list:
    return ["train-student", "--cache", cache, "--student-config", TINY, "--out", out, *_flags(**(TRAIN | over))]


@pytest.mark.slow
def test_stage_two_checkpoints_the_step_exits_143_and_resume_is_bit_identical(tiny_cache, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli(_train_argv(tiny_cache, full)).code == 0  # a CLI process too: the same torch thread count
    # As step 7 begins, from outside, to the trainer and its DataLoader worker (SLURM signals both).
    r = run_cli(_train_argv(tiny_cache, cut, num_workers=1), env={KILL_AT_ENV: "train_step:7:term"})
    assert r.code == 143, r.describe()
    assert r.error_lines == ["error: terminated (SIGTERM) at step 7 of 10; checkpoint step-00000007 written; rerun "
                             "the same command with --resume to continue"], r.describe()
    assert "Traceback" not in r.err
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000004", "step-00000007"]
    assert [m["step"] for m in metrics(cut)] == list(range(1, 8))  # every step it finished is in the checkpoint
    assert not (cut / "student").exists()

    resumed = run_cli(_train_argv(tiny_cache, cut, num_workers=1) + ["--resume"])
    assert resumed.code == 0, resumed.describe()
    assert re.search(r"resuming from \S+step-00000007 \(step 7,", resumed.out + resumed.err), resumed.describe()
    keys = ("step", "epoch", "loss", "lr", "grad_norm", "samples")  # the rest are timings
    assert [{k: m[k] for k in keys} for m in metrics(cut)] == [{k: m[k] for k in keys} for m in metrics(full)]
    assert metrics(cut, "eval") == metrics(full, "eval")
    assert_same_students(cut, full)


@pytest.mark.slow
def test_stage_two_sigterm_after_the_last_step_lets_the_run_finish(tiny_cache, tmp_path):
    r = run_cli(_train_argv(tiny_cache, tmp_path / "run"), env={KILL_AT_ENV: "train_step:10:term"})
    assert r.code == 0 and (tmp_path / "run" / "student").is_dir(), r.describe()


@pytest.mark.slow
def test_stage_two_ctrl_c_names_resume(tiny_cache, tmp_path):
    r = run_cli(_train_argv(tiny_cache, tmp_path / "run"), env={KILL_AT_ENV: "train_step:3:int"})
    assert r.code == 130, r.describe()
    assert r.error_lines == ["error: interrupted; rerun the same command with --resume to continue"], r.describe()
