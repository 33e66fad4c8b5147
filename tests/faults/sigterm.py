"""SIGTERM, what SLURM and Kubernetes send when they preempt a job, a grace period before the kill: each stage
stops cleanly (exit 143, one line saying how to continue) and the rerun ends exactly where an uninterrupted run
does.

Stage one stops at the teacher step after the signal: the blocks it finished are recorded (in a shorter shard),
the block in flight is dropped. Stage two stops at the step boundary after the signal with a checkpoint of that
step, so `--resume` recomputes no optimizer step. Both are checked from outside: the progress records and
checkpoints on disk, the metrics the stopped run wrote, then the rerun's cache, or the resumed run's weights and
micro-batches, against the uninterrupted references. The signal comes from a fault point (`term`: the process
signals itself and its DataLoader workers at a chosen step) or from outside at a random moment. Under torchrun
(2 CPU ranks, gloo) it goes to one rank, or to torchrun itself, which forwards it to every rank (Kubernetes
signals PID 1 only).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pipeline.errors import EXIT_TERMINATED
from pipeline.faults import KILL_AT_ENV, KILL_RANK_ENV, children

from .check import compare_caches, manifest_problems, progress_problems, read_progress, temp_files, weights_equal
from .proc import FAULT_ENV, ROOT, Result, run_cli
from .report import Row
from .stage_two import WEIGHTS, _complete_checkpoints, _resume_and_compare
from .workspace import STAGE_ONE, STUDENT_CONFIG, TRAIN, Workspace, flags

TERMINATED = "terminated (SIGTERM)"
# Stage one's SIGTERM runs close a shard every 3 blocks (2 trajectories x 2 steps each), so a stop lands mid-shard.
SHARD = 12
BLOCK_SAMPLES = STAGE_ONE["batch_size"] * STAGE_ONE["steps"]
# Stage two under torchrun: 2 ranks x batch 2, the single process's global batch of 4.
TORCHRUN_TRAIN = TRAIN | dict(batch_size=2)


def _one_line(code: int | None, err: str, rerun: str) -> list[str]:
    """Exit 143 and exactly one `error:` line (its own, not a rank's quoted by torchrun) saying how to continue."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error:") or re.match(r"\[rank \d+\] error:", ln)]
    problems = [] if code == EXIT_TERMINATED else [f"exit {code}, expected {EXIT_TERMINATED}"]
    if len(lines) != 1 or TERMINATED not in lines[0] or rerun not in lines[0]:
        problems.append(f"expected one `error: {TERMINATED} ...` line naming `{rerun}`, got {lines or err[-600:]!r}")
    if "Traceback" in err:
        problems.append("a traceback was printed")
    return problems


def _done(cache: Path) -> dict[int, set[int]]:
    return {p: set(prog["done_blocks"]) for p, prog in read_progress(cache).items()}


# -- stage one ---------------------------------------------------------------------------------------------

def _stage_one_after(r: Result, out: Path, before: set[int], expect_new: int | None) -> tuple[int, list[str]]:
    """(samples lost, problems) of a run that was sent SIGTERM: stopped cleanly, nothing partial listed, every
    block it finished before the signal recorded (at most the block in flight dropped), as the line says."""
    problems = _one_line(r.code, r.err, "rerun the same command")
    problems += progress_problems(out) + [f"temporary file left after the stop: {t}" for t in temp_files(out)]
    after = _done(out).get(0, set())
    if before - after:
        problems.append(f"finished blocks dropped: {sorted(before - after)}")
    lost = 0
    new = len(after - before)
    if expect_new is not None:
        if new < expect_new:
            lost = (expect_new - new) * BLOCK_SAMPLES
        elif new > expect_new:
            problems.append(f"{new} blocks recorded, the signal came after block {expect_new}: it stopped late")
    m = re.search(r"with (\d+) of \d+ blocks", r.err)
    if m and int(m.group(1)) != len(after):
        problems.append(f"the line says {m.group(1)} blocks, the progress record lists {len(after)}")
    return lost, problems


def _rerun_equals_reference(ws: Workspace, out: Path, argv: list[str]) -> tuple[int, int, list[str]]:
    r = run_cli(argv)
    if r.code != 0:
        return 0, 0, [f"the rerun failed: {r.describe()}"]
    lost, dup, diff = compare_caches(ws.ref_cache, out, ws.ref_samples)
    return lost, dup, manifest_problems(out) + [f"temporary file left: {t}" for t in temp_files(out)] + diff


def stage_one(ws: Workspace, rng: random.Random) -> Row:
    """SIGTERM at chosen teacher steps, chained in one folder, then at random moments (each in a fresh folder)."""
    row = Row("stage 1 SIGTERM", min_attempts=4)
    t0 = time.perf_counter()
    steps = STAGE_ONE["steps"]
    out = ws.fresh("sigterm-cache")
    argv = ws.stage_one(out, samples_per_shard=SHARD)
    chain: list[tuple[str, list[str], int]] = []
    # Mid-block; the last step of a block (dropped with it); after a run that resumed.
    for n in (3, 8, 5):
        before = _done(out).get(0, set())
        r = run_cli(argv, env={KILL_AT_ENV: f"denoise_step:{n}:term"})
        lost, problems = _stage_one_after(r, out, before, expect_new=(n - 1) // steps)
        row.notes.append(f"SIGTERM at denoise_step:{n}: {r.error_lines[0] if r.error_lines else r.describe()}")
        chain.append((f"SIGTERM at denoise_step:{n}", problems, lost))
    lost, dup, final = _rerun_equals_reference(ws, out, argv)
    for label, problems, lost_here in chain:
        row.record(label, problems + final, lost_here)
    row.lost += lost  # the chain's one final cache: counted once
    row.duplicated += dup
    ws.ref_cache  # noqa: B018 - its wall time is the span the delays are drawn from
    for _ in range(2):
        delay = rng.uniform(0.3, 0.9) * ws.ref_cache_wall_s
        for _try in range(4):  # a loaded machine makes the reference slow and this run quick: try earlier
            out = ws.fresh("sigterm-cache")
            argv = ws.stage_one(out, samples_per_shard=SHARD)
            r = run_cli(argv, kill_after_s=delay, sig=signal.SIGTERM)
            label = f"SIGTERM after {delay:.2f}s"
            if r.code != 0:
                break
            row.notes.append(f"{label}: the run finished first (not counted)")
            delay /= 2
        else:
            continue
        lost_here, problems = _stage_one_after(r, out, set(), None)
        lost, dup, final = _rerun_equals_reference(ws, out, argv)
        row.notes.append(f"{label}: {r.error_lines[0] if r.error_lines else r.describe()}")
        row.record(label, problems + final, lost_here + lost, dup)
    row.wall_s = time.perf_counter() - t0
    return row


# -- stage two ---------------------------------------------------------------------------------------------

def _train_steps_done(out: Path) -> int:
    """The last optimizer step the run logged (log_every 1: every step it finished)."""
    path = out / "metrics.jsonl"
    steps = [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("type") == "train":
            steps.append(int(r["step"]))
    return max(steps)


def _stage_two_after(line: str, out: Path, expect_step: int | None) -> tuple[int, list[str]]:
    """(steps done, problems) of a run stopped by SIGTERM with `line`: a complete checkpoint of the last step it
    finished (no optimizer step to recompute), named by the line; no student."""
    problems = []
    done = _train_steps_done(out)
    steps, partial = _complete_checkpoints(out)
    problems += partial
    newest = max(steps, default=0)
    if newest != done:
        problems.append(f"the run finished step {done}, its newest checkpoint is step {newest}: "
                        f"{done - newest} optimizer step(s) to recompute")
    if expect_step is not None and done != expect_step:
        problems.append(f"stopped after step {done}, the signal came during step {expect_step}")
    if done and f"at step {done} " not in line:
        problems.append(f"the line does not name step {done}: {line!r}")
    if (out / "student").exists():
        problems.append("a student was saved although the run did not finish")
    return done, problems


def _stage_two_attempt(ws: Workspace, row: Row, label: str, env: dict | None = None,
                       term_after_s: float | None = None, expect_step: int | None = None) -> None:
    out = ws.fresh("sigterm-train")
    # One DataLoader worker: the `term` fault point signals it too, as SLURM does; it must not end the run.
    r = run_cli(ws.train(out, num_workers=1), env=env, kill_after_s=term_after_s, sig=signal.SIGTERM)
    if r.code == 0 and term_after_s is not None:
        row.notes.append(f"{label}: the run finished first (not counted)")
        return
    problems = _one_line(r.code, r.err, "--resume")
    done, more = _stage_two_after(r.error_lines[0] if r.error_lines else "", out, expect_step)
    problems += more
    lost, dup, final, note = _resume_and_compare(ws, out, done)
    row.notes.append(f"{label}: {r.error_lines[0] if r.error_lines else r.describe()}; {note}")
    row.record(label, problems + final, lost, dup)


def stage_two(ws: Workspace, rng: random.Random) -> Row:
    ws.ref_batches  # noqa: B018 - the uninterrupted run, built first
    row = Row("stage 2 SIGTERM", min_attempts=3)
    t0 = time.perf_counter()
    # Mid-epoch after the step-3 checkpoint; on a checkpoint step (no second write); in the second epoch.
    for step in (5, 6, 14):
        _stage_two_attempt(ws, row, f"SIGTERM as step {step} begins", env={KILL_AT_ENV: f"train_step:{step}:term"},
                           expect_step=step)
    _stage_two_attempt(ws, row, "SIGTERM at a random time", term_after_s=rng.uniform(0.4, 0.9) * ws.ref_run_wall_s)
    row.wall_s = time.perf_counter() - t0
    return row


# -- under torchrun ----------------------------------------------------------------------------------------

class _Torchrun:
    """`torchrun --nproc-per-node 2 -m pipeline.cli ARGV` in the background; each rank's error record (what
    `exit_rank` wrote) lands under `log_dir`."""

    def __init__(self, argv: list, env: dict[str, str], log_dir: Path):
        self.log_dir = log_dir
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--log-dir", str(log_dir), "-m", "pipeline.cli", *map(str, argv)]
        full = {k: v for k, v in os.environ.items() if k not in FAULT_ENV and k != "TORCHELASTIC_ERROR_FILE"}
        full |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **env}
        self.output = tempfile.TemporaryFile(mode="w+")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(args, cwd=ROOT, env=full, stdout=self.output, stderr=subprocess.STDOUT,
                                     text=True)

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def stopped_worker(self, timeout_s: float = 240.0) -> int | None:
        """The worker that stopped itself (fault point `stop`), once it has."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and self.proc.poll() is None:
            for pid in self.workers():
                try:
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                        return pid
                except (OSError, IndexError):
                    pass
            time.sleep(0.05)
        return None

    def wait(self, timeout_s: float = 240.0) -> tuple[int | None, str, float]:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
            self.proc.wait()
        self.output.seek(0)
        text = self.output.read()
        self.output.close()
        return code, text, time.perf_counter() - self.t0

    def rank_errors(self) -> dict[int, str]:
        """rank -> the error line it recorded for torchrun (every failing rank records its own)."""
        out = {}
        for p in self.log_dir.rglob("error.json"):
            text = json.loads(p.read_text())["message"]["message"]
            m = re.search(r"\[rank (\d+)\] error: (.*)", text)
            if m:
                out[int(m.group(1))] = m.group(2)
        return out


def _ranks_stopped(tr: _Torchrun, code: int | None, output: str, rerun: str) -> list[str]:
    """Every rank ended through its own SIGTERM line (exit 143), torchrun non-zero; the lines say the same."""
    problems = [] if code not in (0, None) else [f"torchrun exited {code}"]
    errors = tr.rank_errors()
    if sorted(errors) != [0, 1]:
        problems.append(f"ranks that recorded an error: {sorted(errors)}, expected both: {output[-2000:]}")
    for rank, line in errors.items():
        if TERMINATED not in line or rerun not in line:
            problems.append(f"rank {rank} ended with {line!r}")
    for m in re.finditer(r"exitcode\s*: (-?\d+)", output):
        if int(m.group(1)) != EXIT_TERMINATED:
            problems.append(f"a rank exited {m.group(1)}")
    # Each rank's line printed, a line the ranks share only once (torchrun's summary quotes them indented).
    own = [ln.split("] error: ", 1)[1] for ln in output.splitlines() if ln.startswith("[rank") and "] error: " in ln]
    if sorted(own) != sorted(set(errors.values())):
        problems.append(f"the ranks printed {own}, expected each of their lines once: {sorted(set(errors.values()))}")
    if re.search(r'File ".*/(stages|pipeline|cache)/', output):
        problems.append(f"a rank printed a traceback: {output[-2000:]}")
    return problems


def _train_argv(ws: Workspace, out: Path, *extra: str) -> list:
    return ["train-student", "--cache", ws.ref_cache, "--student-config", STUDENT_CONFIG, "--out", out,
            *flags(**TORCHRUN_TRAIN), *extra]


def _ref_two_ranks(ws: Workspace) -> tuple[Path, dict[int, list]]:
    """The uninterrupted run on 2 ranks (its own reference: 2 ranks sum in another order than 1 process)."""
    if "_sigterm_ref2" not in ws.__dict__:
        out = ws.root / "ref-run-2ranks"
        debug = ws.root / "ref-run-2ranks-debug"
        tr = _Torchrun(_train_argv(ws, out), {"WANDISTILLER_DEBUG_DIR": str(debug)}, ws.fresh("logs"))
        code, output, _ = tr.wait()
        if code != 0:
            raise RuntimeError(f"the 2-rank reference run failed:\n{output[-3000:]}")
        ws.__dict__["_sigterm_ref2"] = (out, {r: json.loads((debug / f"rank-{r}.json").read_text())["micro_batches"]
                                              for r in (0, 1)})
    return ws.__dict__["_sigterm_ref2"]


def _resume_two_ranks(ws: Workspace, out: Path, start: int) -> tuple[int, int, list[str]]:
    ref, ref_batches = _ref_two_ranks(ws)
    debug = out.with_name(out.name + "-debug")
    tr = _Torchrun(_train_argv(ws, out, "--resume"), {"WANDISTILLER_DEBUG_DIR": str(debug)}, ws.fresh("logs"))
    code, output, _ = tr.wait()
    if code != 0:
        return 0, 0, [f"the resume failed:\n{output[-3000:]}"]
    problems = []
    m = re.search(r"resuming from \S+ \(step (\d+),", output)
    if (int(m.group(1)) if m else 0) != start:
        problems.append(f"resumed from step {m.group(1) if m else 0}, the stopped run finished step {start}")
    for name in ("student", "student_ema"):
        if not weights_equal(out / name / WEIGHTS, ref / name / WEIGHTS):
            problems.append(f"{name} differs from the uninterrupted 2-rank run")
    lost = dup = 0
    for rank in (0, 1):
        got = json.loads((debug / f"rank-{rank}.json").read_text())["micro_batches"]
        want = ref_batches[rank][start * TORCHRUN_TRAIN.get("grad_accum", 1):]  # grad_accum micro-batches a step
        if len(got) != len(want):
            problems.append(f"rank {rank}: {len(got)} micro-batches after the resume, expected {len(want)}")
        for g, w in zip(got, want):
            lost += sum((Counter(w) - Counter(g)).values())
            dup += sum((Counter(g) - Counter(w)).values())
        lost += sum(len(w) for w in want[len(got):])
    return lost, dup, problems


def _stage_two_torchrun(ws: Workspace, row: Row, label: str, env: dict[str, str], forward: bool) -> None:
    """One stopped 2-rank run and its resume. `forward`: SIGTERM goes to torchrun while rank 0 is paused at the
    fault point (`stop`), and torchrun forwards it to both ranks; otherwise `env`'s fault point sends it."""
    out = ws.fresh("sigterm-torchrun")
    tr = _Torchrun(_train_argv(ws, out), env, ws.fresh("logs"))
    problems = []
    if forward:
        pid = tr.stopped_worker()
        if pid is None:
            problems.append("rank 0 never paused")
        else:
            os.kill(tr.proc.pid, signal.SIGTERM)
            time.sleep(1.0)  # torchrun forwards it to both ranks (rank 0's waits until it runs again)
            os.kill(pid, signal.SIGCONT)
    code, output, wall = tr.wait()
    problems += _ranks_stopped(tr, code, output, "--resume")
    lines = tr.rank_errors()
    done, more = _stage_two_after(lines.get(0, ""), out, None)
    problems += more
    steps = {int(m.group(1)) for m in re.finditer(r"at step (\d+) ", "\n".join(lines.values()))}
    if steps != {done}:
        problems.append(f"the ranks stopped at steps {sorted(steps)}, the run logged {done}")
    lost, dup, final = _resume_two_ranks(ws, out, done)
    row.notes.append(f"{label}: stopped at step {done} in {wall:.0f}s; {lines.get(0)}")
    row.record(label, problems + final, lost, dup)


def _stage_one_torchrun(ws: Workspace, row: Row) -> None:
    """SIGTERM to torchrun while rank 0 is paused in its third teacher step: both ranks stop (exit 143), each
    recording what it finished; the rerun equals a 2-part cache made without torchrun."""
    label = "stage 1: SIGTERM to torchrun"
    ref = ws.root / "ref-cache-2parts"
    if not ref.exists():
        for part in (0, 1):
            ws.must(run_cli(ws.stage_one(ref, part=part, num_parts=2)))
    out = ws.fresh("sigterm-cache-torchrun")
    argv = ws.stage_one(out, samples_per_shard=SHARD)
    tr = _Torchrun(argv, {KILL_AT_ENV: "denoise_step:3:stop", KILL_RANK_ENV: "0"}, ws.fresh("logs"))
    pid = tr.stopped_worker()
    problems = [] if pid is not None else ["rank 0 never paused"]
    if pid is not None:
        os.kill(tr.proc.pid, signal.SIGTERM)
        time.sleep(1.0)
        os.kill(pid, signal.SIGCONT)
    code, output, wall = tr.wait()
    problems += _ranks_stopped(tr, code, output, "rerun the same command")
    problems += progress_problems(out) + [f"temporary file left after the stop: {t}" for t in temp_files(out)]
    lines, done = tr.rank_errors(), _done(out)
    # Rank 0 finished block 0 before the signal (its third teacher step is block 1's first): it must be recorded.
    lost = 0 if 0 in done.get(0, ()) else BLOCK_SAMPLES
    dup = 0
    code, output, _ = _Torchrun(argv, {}, ws.fresh("logs")).wait()
    if code != 0:
        problems.append(f"the rerun failed:\n{output[-3000:]}")
    else:
        more_lost, dup, diff = compare_caches(ref, out)
        problems += manifest_problems(out) + diff
        lost += more_lost
    row.notes.append(f"{label}: {wall:.0f}s; blocks recorded per part {({p: len(b) for p, b in done.items()})}; "
                     f"{lines}")
    row.record(label, problems, lost, dup)


def torchrun(ws: Workspace, rng: random.Random) -> Row:
    row = Row("SIGTERM under torchrun", min_attempts=3)
    t0 = time.perf_counter()
    _ref_two_ranks(ws)
    _stage_two_torchrun(ws, row, "stage 2: SIGTERM to rank 1 as step 5 begins",
                        {KILL_AT_ENV: "train_step:5:term", KILL_RANK_ENV: "1"}, forward=False)
    _stage_two_torchrun(ws, row, "stage 2: SIGTERM to torchrun",
                        {KILL_AT_ENV: "train_step:5:stop", KILL_RANK_ENV: "0"}, forward=True)
    _stage_one_torchrun(ws, row)
    row.wall_s = time.perf_counter() - t0
    return row
