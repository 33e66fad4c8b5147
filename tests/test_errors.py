"""The exit-code table (pipeline/errors.py): each kind of failure gets its code and its one line, alike from the
CLI decorator and from a failing torchrun rank, and torchrun's closing summary quotes that line."""

from __future__ import annotations

import errno
import os

import click
import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cache.cache_error import CacheError
from pipeline import errors
from pipeline.errors import UserError, classify, exit_rank, user_errors
from pipeline.runtime import DistEnv
from pipeline.signals import Terminated

STAGE = "train-student"
DISK = ("; free space (or raise the quota / file-size limit) and rerun the same command with --resume: everything "
        "finished so far is kept and the run resumes where it stopped")
GLOO_PEER = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"

# (exception, exit code, first line of the message after "error: ")
TABLE = [
    (UserError("--batch-size 9 is larger than a rank's share; lower it"), 2,
     "--batch-size 9 is larger than a rank's share; lower it"),
    (CacheError("shard shards/part-00000-00001.tar is corrupt; delete it and rerun teacher-cache"), 2,
     "shard shards/part-00000-00001.tar is corrupt; delete it and rerun teacher-cache"),
    (OSError(errno.ENOSPC, "No space left on device", "/run/ckpt/model.safetensors"), 2,
     "No space left on device while writing /run/ckpt/model.safetensors" + DISK),
    (OSError(errno.EFBIG, "File too large"), 2, "File too large" + DISK),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details"), 3,
     "out of memory in train-student: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (MemoryError(), 3, "out of host memory in train-student: MemoryError"),
    (dist.DistError("wait timeout after 600000ms"), 4,
     "lost contact with another rank (wait timeout after 600000ms); the rank that failed first prints why"),
    (dist.DistNetworkError("Connection reset by peer"), 4,
     "lost contact with another rank (Connection reset by peer); the rank that failed first prints why"),
    (RuntimeError(GLOO_PEER), 4, f"lost contact with another rank ({GLOO_PEER}); the rank that failed first prints why"),
    (KeyboardInterrupt(), 130, "interrupted; rerun the same command with --resume to continue"),
    (Terminated(), 143, "terminated (SIGTERM); rerun the same command with --resume to continue"),
    (Terminated("terminated (SIGTERM) at step 7 of 10; checkpoint step-00000007 written; rerun the same command "
                "with --resume to continue"), 143,
     "terminated (SIGTERM) at step 7 of 10; checkpoint step-00000007 written; rerun the same command with --resume "
     "to continue"),
    (RuntimeError("injected failure"), 1, "RuntimeError: injected failure"),
    (OSError(errno.EACCES, "Permission denied"), 1, "PermissionError: [Errno 13] Permission denied"),
]
IDS = [f"{type(e).__name__}-{code}" for e, code, _ in TABLE]


@pytest.mark.parametrize("exc,code,line", TABLE, ids=IDS)
def test_classify(exc, code, line):
    got_code, message = classify(exc, STAGE)
    assert (got_code, message.splitlines()[0]) == (code, line)
    if code == errors.EXIT_OOM:  # the report: memory figures, then the stage's remedies (the GPU's or the host's)
        gpu = isinstance(exc, torch.OutOfMemoryError)
        assert "  memory: peak host RSS" in message
        assert ("    - add --gradient-checkpointing" in message) == gpu, message
        assert ("    - lower --num-workers" in message) == (not gpu), message


def test_oom_remedies_are_the_stages():
    _, message = classify(torch.OutOfMemoryError("CUDA out of memory"), "teacher-cache")
    assert message.startswith("out of memory in teacher-cache: CUDA") and "--placement offload" in message
    assert "--gradient-checkpointing" not in message


def test_host_memory_is_not_reported_as_the_gpus():
    """A MemoryError is the host's RAM (or address-space limit): its remedies are the host's, not a GPU's."""
    code, message = classify(MemoryError(), "teacher-cache")
    assert code == errors.EXIT_OOM and message.startswith("out of host memory in teacher-cache: MemoryError")
    assert "--placement disk" in message and "more RAM" in message and "far larger than its kind" in message
    assert "--placement offload" not in message and "CUDA" not in message


def test_interrupt_without_resume_flag_outside_stage_two():
    assert classify(KeyboardInterrupt(), "teacher-cache") == (130, "interrupted; rerun the same command to continue")


def _command(exc: BaseException) -> click.Command:
    @click.command()
    @user_errors(STAGE)
    def cmd():
        raise exc

    return cmd


@pytest.mark.parametrize("exc,code,line", TABLE, ids=IDS)
def test_cli_decorator(exc, code, line, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    if code == errors.EXIT_BUG:  # a bug propagates with its traceback
        with pytest.raises(type(exc)):
            CliRunner().invoke(_command(exc), [], catch_exceptions=False)
        return
    result = CliRunner().invoke(_command(exc), [], catch_exceptions=False)
    assert result.exit_code == code
    assert result.stderr.splitlines()[0] == f"error: {line}" and result.stdout == ""
    if code != errors.EXIT_OOM:
        assert len(result.stderr.splitlines()) == 1


def test_cli_decorator_lets_click_and_exits_through():
    for exc, code in ((click.BadParameter("no"), 2), (SystemExit(0), 0), (click.exceptions.Exit(5), 5)):
        assert CliRunner().invoke(_command(exc), [], catch_exceptions=False).exit_code == code


class _Exited(Exception):
    def __init__(self, code: int):
        self.code = code


@pytest.fixture
def rank_exit(monkeypatch, capsys):
    """Run exit_rank on an exception raised as `rank` of 2; returns (exit code, stderr). os._exit is replaced by
    a raise, so that the test process lives on."""

    def fake_exit(code):
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)

    def go(exc: BaseException, rank: int = 1, stage: str = STAGE) -> tuple[int, str]:
        capsys.readouterr()
        try:
            raise exc
        except BaseException as e:
            with pytest.raises(_Exited) as exited:
                exit_rank(e, DistEnv(rank, 2, rank), stage)
        return exited.value.code, capsys.readouterr().err

    return go


@pytest.mark.parametrize("exc,code,line", TABLE, ids=IDS)
def test_exit_rank(exc, code, line, rank_exit, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    got, err = rank_exit(exc)
    assert got == code
    own = [ln for ln in err.splitlines() if ln.startswith("[rank 1] error:")]
    assert own == [f"[rank 1] error: {line}"], err
    assert ("Traceback (most recent call last)" in err) == (code == errors.EXIT_BUG)


def test_an_error_every_rank_raises_is_printed_by_rank_0_alone(rank_exit):
    err = CacheError("shard x is corrupt")
    err.all_ranks = True
    assert rank_exit(err, rank=1) == (2, "")
    assert rank_exit(err, rank=0)[1].strip() == "[rank 0] error: shard x is corrupt"


def _summary(error_file, exitcode: int) -> str:
    """torchrun's closing summary of one failed rank that wrote `error_file`, as torchrun prints it."""
    return ChildFailedError("wandistiller", {1: ProcessFailure(1, 4242, exitcode, str(error_file))}).format_msg()


def test_torchrun_summary_quotes_the_ranks_line(rank_exit, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    code, _ = rank_exit(UserError("--out is a file; pass a directory"))
    summary = _summary(tmp_path / "error.json", code)
    assert "traceback : [rank 1] error: --out is a file; pass a directory" in summary
    assert "exitcode  : 2" in summary and "Traceback" not in summary

    code, _ = rank_exit(torch.OutOfMemoryError("CUDA out of memory"))  # the whole report, remedies included
    summary = _summary(tmp_path / "error.json", code)
    assert "[rank 1] error: out of memory in train-student" in summary and "--gradient-checkpointing" in summary

    code, _ = rank_exit(RuntimeError("injected failure"))  # a bug: its traceback too
    summary = _summary(tmp_path / "error.json", code)
    assert "Traceback (most recent call last)" in summary and "[rank 1] error: RuntimeError: injected failure" in summary


def test_cli_decorator_records_for_torchrun_too(tmp_path, monkeypatch):
    """A refusal before a stage starts (a bad flag under torchrun) reaches torchrun's summary as well."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(_command(UserError("--part/--num-parts cannot be combined with torchrun")), [])
    assert result.exit_code == 2
    assert result.stderr.strip() == "[rank 1] error: --part/--num-parts cannot be combined with torchrun"
    assert "traceback : [rank 1] error: --part/--num-parts" in _summary(tmp_path / "error.json", 2)
