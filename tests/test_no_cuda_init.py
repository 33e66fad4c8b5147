"""CPU runs never initialise CUDA, even where torch sees a GPU; more torchrun ranks than GPUs are refused up front.

A process forked after CUDA started (a DataLoader worker, a test runner, a launcher) cannot initialise it
again ("Cannot re-initialize CUDA in forked subprocess"), so a `--placement cpu` / `--device cpu` run must not
try. Here torch reports one GPU whose initialisation raises, on any machine: every command run on the CPU has
to finish without touching it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import ROOT, TINY_CACHE_ARGS
from pipeline.cli import main
from pipeline.config import TeacherCacheConfig, TrainStudentConfig
from pipeline.errors import UserError
from pipeline.runtime import DistEnv, hide_gpus

CUDA_STARTED = "test: CUDA was initialised"


class FakeGPU:
    """torch sees one GPU, as on a GPU box: `torch.cuda` and `torch.accelerator` (the current accelerator is
    cuda) answer as CUDA does, and whatever would initialise CUDA, or needs it initialised (a stream query, as
    torch's optimizers make at every step), raises. Like CUDA, it reads CUDA_VISIBLE_DEVICES once, at the first
    query of a process: a process that hid the GPUs before that sees none. `new_process()` starts the next
    command as a fresh process would (the GPUs visible again, nothing queried yet)."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.visible = monkeypatch, None
        self.environ = os.environ.get("CUDA_VISIBLE_DEVICES")

    def new_process(self) -> None:
        self.visible = None
        if self.environ is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.environ

    def count(self, *args, **kwargs) -> int:
        if self.visible is None:
            self.visible = os.environ.get("CUDA_VISIBLE_DEVICES") != ""
        return int(self.visible)

    @staticmethod
    def starts_cuda(name: str):
        """A stand-in for torch's `name` that raises (its own function: torch.compile's trace rules, which the
        optimizers read, refuse one function object under two names)."""

        def start(*args, **kwargs):
            raise RuntimeError(f"{CUDA_STARTED} ({name})")

        return start

    def install(self) -> None:
        def current_accelerator(check_available: bool = False):
            return None if check_available and not self.count() else torch.device("cuda")

        mp = self.monkeypatch
        mp.setattr(torch.cuda, "is_available", lambda: self.count() > 0)
        mp.setattr(torch.cuda, "device_count", self.count)
        mp.setattr(torch.cuda, "is_initialized", lambda: False)
        # _lazy_init is also what torch's C++ calls before the first CUDA tensor.
        for name in ("_lazy_init", "init", "mem_get_info", "set_device", "current_device", "synchronize",
                     "get_device_properties", "reset_peak_memory_stats", "max_memory_allocated", "current_stream"):
            mp.setattr(torch.cuda, name, self.starts_cuda(f"torch.cuda.{name}"))
        mp.setattr(torch.cuda.memory, "mem_get_info", self.starts_cuda("torch.cuda.memory.mem_get_info"))
        mp.setattr(torch.accelerator, "current_accelerator", current_accelerator)
        mp.setattr(torch.accelerator, "is_available", lambda: self.count() > 0)
        mp.setattr(torch.accelerator, "device_count", self.count)
        for name in ("current_stream", "current_device_index", "set_device_index", "synchronize"):
            mp.setattr(torch.accelerator, name, self.starts_cuda(f"torch.accelerator.{name}"))


@pytest.fixture
def gpu_that_must_not_start(monkeypatch):
    gpu = FakeGPU(monkeypatch)
    gpu.install()
    return gpu


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_the_fake_gpu_fails_an_optimizer_step_unless_the_gpus_are_hidden(gpu_that_must_not_start):
    """What the GPU box showed: AdamW asks the current accelerator's stream at every step, even for CPU
    parameters; hidden GPUs are never asked."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w])
    w.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match=CUDA_STARTED):
        opt.step()
    gpu_that_must_not_start.new_process()
    hide_gpus()
    opt.step()
    assert not torch.cuda.is_available() and torch.accelerator.current_accelerator(check_available=True) is None


def test_cpu_commands_never_initialise_cuda(gpu_that_must_not_start, tiny_teacher, prompts_file, tmp_path):
    """Each command, as its own process: teacher-cache --placement cpu, cache verify, train-student --device cpu
    (optimizer steps included), sample, eval and export on the CPU."""
    gpu = gpu_that_must_not_start
    cache, run = tmp_path / "cache", tmp_path / "run"
    flags = [x for k, v in TINY_CACHE_ARGS.items() for x in (f"--{k.replace('_', '-')}", v)]
    r = invoke("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", cache,
               "--placement", "cpu", *flags)
    assert r.exit_code == 0, r.output
    assert "float32 on cpu" in r.output
    gpu.new_process()
    r = invoke("cache", "verify", cache)
    assert r.exit_code == 0, r.output

    gpu.new_process()
    r = invoke("train-student", "--cache", cache, "--student-config", ROOT / "configs" / "student-tiny.json",
               "--out", run, "--device", "cpu", "--max-steps", 2, "--batch-size", 4, "--num-workers", 0,
               "--warmup-steps", 1, "--checkpoint-every", 0, "--holdout-prompts", 2)
    assert r.exit_code == 0, r.output
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in ln][-1] == 2  # two optimizer steps taken
    gpu.new_process()
    r = invoke("sample", "--student", run, "--teacher", tiny_teacher, "--prompts", prompts_file,
               "--out", tmp_path / "grid.png", "--device", "cpu", "--max-prompts", 1, "--steps", 2)
    assert r.exit_code == 0, r.output
    gpu.new_process()
    r = invoke("eval", "--student", run, "--cache", cache, "--device", "cpu", "--max-prompts", 1,
               "--no-teacher-timing", "--report", tmp_path / "eval.json")
    assert r.exit_code == 0, r.output
    gpu.new_process()
    r = invoke("export", "--student", run, "--teacher", tiny_teacher, "--out", tmp_path / "pipe")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "pipe" / "model_index.json").is_file()


def test_the_command_server_of_the_fault_suite_sees_no_gpu():
    """tests/faults/proc.py forks every command from one preloaded server, and diffusers' import queries the
    accelerator there: the server must see no GPU, or its children die in their first CUDA query."""
    from multiprocessing import forkserver

    from faults import proc

    proc.warm_up()
    pid = forkserver._forkserver._forkserver_pid
    environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    assert environ.get("CUDA_VISIBLE_DEVICES") == ""


def test_auto_placement_without_cuda_measures_no_gpu(monkeypatch, tiny_teacher, prompts_file, tmp_path):
    """auto asks CUDA for free memory only when torch reports a GPU."""
    from stages.teacher_cache.placements import choose_placement
    from stages.teacher_cache.teacher import resolve_teacher

    def no_query(*args, **kwargs):
        raise AssertionError("mem_get_info on a machine without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_query)
    cfg = TeacherCacheConfig(**TINY_CACHE_ARGS, teacher=str(tiny_teacher), prompts=str(prompts_file),
                             out=str(tmp_path / "c"))
    p = choose_placement(cfg, resolve_teacher(str(tiny_teacher)))
    assert (p.kind, p.device.type, p.dtype) == ("cpu", "cpu", "float32")


# --- more torchrun ranks than GPUs -------------------------------------------------------------------------------

@pytest.fixture
def two_ranks_one_gpu(monkeypatch):
    """Rank 1 of `torchrun --nproc-per-node 2` on a node with one GPU (which nothing may touch)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def touched(*args, **kwargs):
        raise AssertionError("a device was touched before the refusal")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("_lazy_init", "set_device", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, touched)
    stage_one = importlib.import_module("stages.teacher_cache.make_cache")  # the package re-exports run() as `run`
    monkeypatch.setattr(stage_one, "init_distributed", touched)


@pytest.mark.parametrize("placement", ["cuda", "offload", "disk", "auto"])
def test_stage_one_refuses_more_ranks_than_gpus(two_ranks_one_gpu, placement, tiny_teacher, prompts_file, tmp_path):
    r = invoke("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", tmp_path / "c",
               "--placement", placement)
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "2 torchrun ranks on this node but 1 GPU(s) visible" in errors[0]
    assert "--nproc-per-node 1" in errors[0]
    assert not (tmp_path / "c").exists()


def test_stage_one_on_the_cpu_is_not_refused(two_ranks_one_gpu, tiny_teacher, prompts_file, tmp_path):
    """--placement cpu under torchrun needs no GPU per rank: the same check passes it."""
    from stages.teacher_cache import placements

    cfg = TeacherCacheConfig(**TINY_CACHE_ARGS, teacher=str(tiny_teacher), prompts=str(prompts_file),
                             out=str(tmp_path / "c"), placement="cpu")
    placements.get(cfg.placement).validate(cfg)
    with pytest.raises(UserError, match="2 torchrun ranks on this node but 1 GPU"):
        placements.get("cuda").validate(dataclasses.replace(cfg, placement="cuda"))


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_stage_two_refuses_more_ranks_than_gpus(two_ranks_one_gpu, device):
    from stages.train_student.train import _device

    cfg = TrainStudentConfig(cache=("c",), student_config="s.json", out="o", device=device)
    with pytest.raises(UserError, match=r"2 torchrun ranks on this node but 1 GPU\(s\) visible") as e:
        _device(cfg, DistEnv(rank=1, world_size=2, local_rank=1))
    assert "--nproc-per-node 1" in str(e.value) and e.value.all_ranks
    cpu = TrainStudentConfig(cache=("c",), student_config="s.json", out="o", device="cpu")
    assert _device(cpu, DistEnv(rank=1, world_size=2, local_rank=1)) == torch.device("cpu")
