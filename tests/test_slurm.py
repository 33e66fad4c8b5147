"""The SLURM examples (examples/slurm/*.sbatch) run as a SLURM allocation would run them, with stand-ins for
`srun` (runs its command once per node, SLURM_NODEID set, adding --dry-run to a `wandistiller` command),
`torchrun` (parses its arguments with torchrun's own parser, then, on node 0, runs its program with --dry-run as one
process: train-student's dry run joins the process group and measures steps, so the stand-in starts no ranks that
would wait for each other) and `scontrol` (host names, requeue): every command they build is a valid CLI invocation
(the dry run checks settings, inputs and --out), torchrun gets SLURM's nodes, head host and node ranks, and a job
stopped by SIGTERM requeues itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # each dry run starts the CLI and imports the stage (~5-15 s on 2 shared cores)

SRUN = r"""#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
echo "env HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-}" >> "$FAKE_LOG"  # what the job's steps see
while [[ "$1" == -* ]]; do shift; done  # srun's own options
if [ -n "${FAKE_SRUN_WAIT:-}" ]; then  # a step that runs until SIGTERM, then stops as a stage does (exit 143)
    trap 'kill $sleeper; echo "step: SIGTERM" >> "$FAKE_LOG"; exit 143' TERM  # (the sleep holds the job's stdout)
    sleep 60 & sleeper=$!; wait; exit 0
fi
if [ -n "${FAKE_SRUN_RC:-}" ]; then exit "$FAKE_SRUN_RC"; fi
rc=0
for ((node = 0; node < ${SLURM_NNODES:-1}; node++)); do
    if [ "$1" = wandistiller ]; then SLURM_NODEID=$node "$@" --dry-run || rc=$?
    else SLURM_NODEID=$node "$@" || rc=$?; fi
done
exit $rc
"""

SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
if [ "$1 $2" = "show hostnames" ]; then printf '%s\n' $FAKE_HOSTS; fi
"""

TORCHRUN = r"""#!{python}
import json, os, subprocess, sys
from torch.distributed.run import get_args_parser
if os.environ.get("FAKE_TORCHRUN_OLD"):  # the torchrun of torch < 2.12: no --shutdown-timeout
    if "--help" in sys.argv:
        sys.exit(print("usage: torchrun [-h] [--nnodes NNODES] [--nproc-per-node NPROC_PER_NODE] ..."))
    if any(a.startswith("--shutdown") for a in sys.argv):
        sys.exit("torchrun: error: unrecognized arguments: --shutdown-timeout")
args = get_args_parser().parse_args(sys.argv[1:])  # torchrun's own parser: a bad flag fails here as it would there
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write("torchrun " + json.dumps({{k: v for k, v in vars(args).items()}}) + "\n")
# Only its arguments are checked: on request, and on every node but the first (their commands differ only in
# --node-rank, which the parser above checked; the dry run would check the same command again).
if os.environ.get("FAKE_TORCHRUN_LOG_ONLY") or os.environ.get("SLURM_NODEID", "0") != "0":
    sys.exit(0)
# One process, no WORLD_SIZE/RANK: the dry run of each node is a single-process run, not a rank of the job.
prog = [args.training_script] if args.no_python else [sys.executable, args.training_script]
sys.exit(subprocess.call(prog + args.training_script_args + ["--dry-run"]))
"""


@pytest.fixture
def slurm(tmp_path):
    """A folder of stand-ins first on PATH (then the venv's `wandistiller`), and the environment SLURM gives a job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("torchrun", TORCHRUN.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", FAKE_LOG=str(log))
    return env, log


def _run(script: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / "slurm" / script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, **kw)


def _calls(log: Path, prefix: str) -> list[str]:
    return [line[len(prefix) + 1:] for line in log.read_text().splitlines() if line.startswith(prefix + " ")]


def test_teacher_cache_array_task_runs_its_part(slurm, tiny_teacher, prompts_file, tmp_path):
    env, log = slurm
    env.update(SLURM_JOB_ID="7001", SLURM_ARRAY_JOB_ID="7000", SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="2",
               TEACHER=str(tiny_teacher), PROMPTS=str(prompts_file), CACHE=str(tmp_path / "cache"),
               CONFIG="configs/tiny-teacher-cache.toml")
    r = _run("teacher-cache.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    (srun,) = _calls(log, "srun")
    assert srun.startswith("wandistiller teacher-cache --config configs/tiny-teacher-cache.toml")
    assert "--part 1 --num-parts 2" in srun
    # a replica on the task's GPU, as `plan` prints for an array; the teacher was downloaded before the array
    assert "--placement cuda " in srun and _calls(log, "env") == ["HF_HUB_OFFLINE=1"]
    assert "teacher-cache --dry-run: the command is valid" in r.stdout + r.stderr
    assert "part 1 of 2: 3 prompts" in r.stdout + r.stderr and _calls(log, "scontrol") == []
    assert not (tmp_path / "cache").exists()  # the dry run wrote nothing

    env["FAKE_SRUN_RC"] = "143"  # the part stopped on the SIGTERM of --signal: the task requeues itself
    r = _run("teacher-cache.sbatch", env)
    assert r.returncode == 143 and _calls(log, "scontrol") == ["requeue 7001"]
    env["FAKE_SRUN_RC"] = "2"  # a user error: no requeue
    r = _run("teacher-cache.sbatch", env)
    assert r.returncode == 2 and _calls(log, "scontrol") == ["requeue 7001"]


@pytest.mark.parametrize("script", ["teacher-cache.sbatch", "train-student.sbatch"])
def test_every_sbatch_option_is_read_and_memory_is_asked_for(script):
    """sbatch reads #SBATCH lines up to the first command only: each must come before it; --mem is among them (a
    cluster's default memory per job can be far below what a stage holds)."""
    lines = (ROOT / "examples" / "slurm" / script).read_text().splitlines()
    first = next(i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#"))
    options = [line.split()[1] for line in lines if line.startswith("#SBATCH")]
    assert all(not line.startswith("#SBATCH") for line in lines[first:])
    assert any(o.startswith("--mem=") for o in options), options


def _train_env(env: dict, tiny_cache: Path, out: Path) -> dict:
    return env | dict(SLURM_JOB_ID="8123", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[07-08]",
                      FAKE_HOSTS="gpu07 gpu08", SLURM_GPUS_ON_NODE="2", CACHE=str(tiny_cache), OUT=str(out),
                      STUDENT_CONFIG="configs/student-tiny.json",
                      TRAIN_ARGS="--batch-size 1 --lr 1e-3 --warmup-steps 0 --device cpu --report-to none")


def test_train_student_job_runs_one_torchrun_per_node(slurm, tiny_cache, tmp_path):
    env, log = slurm
    out = tmp_path / "run"
    r = _run("train-student.sbatch", _train_env(env, tiny_cache, out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _calls(log, "scontrol") == ["show hostnames gpu[07-08]"]
    runs = [json.loads(c) for c in _calls(log, "torchrun")]
    assert sorted(a["node_rank"] for a in runs) == [0, 1]
    for a in runs:
        assert (a["nnodes"], a["nproc_per_node"], a["master_addr"], a["master_port"]) == ("2", "2", "gpu07", 29500)
        assert a["no_python"] and a["training_script"] == "wandistiller" and a["shutdown_timeout"] == 270
        assert a["training_script_args"][:1] == ["train-student"] and "--resume" in a["training_script_args"]
        args = a["training_script_args"]
        assert args[args.index("--verify") + 1] == "checksum"
    text = r.stdout + r.stderr
    # node 0's stand-in torchrun ran one single-process dry run: two measured steps of --batch-size 1
    assert text.count("train-student --dry-run: nothing trained, nothing written to --out") == 1
    assert text.count("measured    a step of 1 samples in") == 1 and "samples/s" in text
    assert not out.exists()

    # A later start of the same run (a checkpoint exists: the cache was checksummed before it) checks sizes only.
    (out / "checkpoints" / "step-00000010").mkdir(parents=True)
    r = _run("train-student.sbatch", _train_env(env, tiny_cache, out) | {"FAKE_TORCHRUN_LOG_ONLY": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [json.loads(c) for c in _calls(log, "torchrun")][2:]
    assert [a["training_script_args"][a["training_script_args"].index("--verify") + 1] for a in runs] == ["size"] * 2


def test_train_student_job_trains_a_lora_of_the_teacher(slurm, tiny_cache, tiny_teacher, tmp_path):
    """LORA_OF chooses LoRA adapters on the teacher (--lora-of) instead of a STUDENT_CONFIG student: the command is
    valid (train-student refuses --student-config beside --lora-of)."""
    env, log = slurm
    env = _train_env(env, tiny_cache, tmp_path / "run") | {"LORA_OF": str(tiny_teacher)}
    r = _run("train-student.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    for a in (json.loads(c) for c in _calls(log, "torchrun")):
        args = a["training_script_args"]
        assert args[args.index("--lora-of") + 1] == str(tiny_teacher) and "--student-config" not in args
    assert "train-student --dry-run: nothing trained, nothing written to --out" in r.stdout + r.stderr
    assert set(_calls(log, "env")) == {"HF_HUB_OFFLINE=1"}  # every rank reads the teacher: no download each


def test_train_student_job_runs_on_a_torchrun_without_shutdown_timeout(slurm, tiny_cache, tmp_path):
    """torchrun's --shutdown-timeout came with torch 2.12 (pyproject allows torch >= 2.4): an older one runs the job
    without it and the log says what that costs."""
    env, log = slurm
    env = _train_env(env, tiny_cache, tmp_path / "run") | {"FAKE_TORCHRUN_OLD": "1", "FAKE_TORCHRUN_LOG_ONLY": "1"}
    r = _run("train-student.sbatch", env)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [json.loads(c) for c in _calls(log, "torchrun")]
    assert len(runs) == 2 and all(a["shutdown_timeout"] is None for a in runs)
    assert "warning: this torchrun has no --shutdown-timeout (torch < 2.12)" in r.stderr


def test_train_student_job_stops_and_requeues_before_its_time_limit(slurm, tiny_cache, tmp_path):
    env, log = slurm
    env = _train_env(env, tiny_cache, tmp_path / "run") | {"FAKE_SRUN_WAIT": "1"}
    for sig, requeued in ((signal.SIGUSR1, True), (signal.SIGTERM, False)):  # --signal=B:USR1@300; scancel
        log.write_text("")
        job = subprocess.Popen(["bash", str(ROOT / "examples/slurm/train-student.sbatch")], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while not _calls(log, "srun") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        job.send_signal(sig)
        out, _ = job.communicate(timeout=60)
        assert "step: SIGTERM" in log.read_text(), out  # the ranks were told to stop at their next step
        assert ("requeue 8123" in _calls(log, "scontrol")) == requeued, out
