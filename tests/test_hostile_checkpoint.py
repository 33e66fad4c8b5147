"""Checkpoints and run folders built as an attacker (or a careless colleague) would build them, and the resume road
a new user walks (issue 41: D1, D8, D11 and the resume items).

- A pickled payload planted in a checkpoint, its digest record rewritten to match (the record alone cannot tell):
  in a sharded checkpoint's DCP index (`sharded/.metadata`, which DCP itself reads with plain `pickle.load`), in one
  of its non-tensor values (which DCP reads with `torch.load(weights_only=False)`), or in a ddp `optimizer.pt`.
  Each is refused in one `error:` line naming the file, exit 2, and the payload never runs (its marker file stays
  absent); a genuine sharded checkpoint still resumes, bit-equal.
- `--out` on a folder that is not a run of ours, or on / in / around the cache: one line, nothing written.
- `--resume` of a finished run is a no-op; a changed --lr is refused naming the flag; --max-steps below the
  checkpoint is refused; a longer --max-steps continues and says what it does to the schedule.

Every run is a real `wandistiller train-student` through click's CliRunner, on the session's tiny cache."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline import artifact, lock
from pipeline.cli import main
from stages.sample import evaluate
from stages.train_student import checkpoint
from test_train_student import assert_same_students

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "student-tiny.json")
# 28 samples, batch 4: 7 steps an epoch; killed as step 6 begins: checkpoints 2 and 4.
ARGS = dict(max_steps=6, checkpoint_every=2, keep_checkpoints=2, batch_size=4, lr=1e-3, warmup_steps=1,
            ema_decay=0.8, eval_every=0, log_every=1, num_workers=0, seed=5, device="cpu", report_to="none")


def invoke(cache: Path, out: Path, *extra: str, env: dict | None = None, **over):
    args = ["train-student", "--cache", str(cache), "--student-config", TINY, "--out", str(out)]
    for k, v in (ARGS | over).items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return CliRunner().invoke(main, args + list(extra), env=env)


def one_error(r, *needles: str) -> str:
    """The refusal's one line: exit 2, one `error:` line holding every needle, no traceback."""
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class Payload:
    """Pickled, it runs `cmd` through os.system when unpickled: what a planted checkpoint file carries."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def rerecord(ckpt: Path, rel: str) -> None:
    """Record `rel`'s current size and sha256 in the checkpoint's digests.json, as an attacker who read the format."""
    rec = json.loads((ckpt / checkpoint.DIGESTS).read_text())
    data = (ckpt / rel).read_bytes()
    rec["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / checkpoint.DIGESTS).write_text(json.dumps(rec))


def plant(run: Path, rel: str, data: bytes) -> None:
    for ckpt in sorted((run / "checkpoints").iterdir()):
        (ckpt / rel).write_bytes(data)
        rerecord(ckpt, rel)


@pytest.fixture(scope="module")
def runs(tiny_cache, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted and killed (as step 6 begins) runs, ddp and fsdp (one process)."""
    root = tmp_path_factory.mktemp("hostile-ckpt")
    made = {}
    for strategy in ("ddp", "fsdp"):
        full, cut = root / f"{strategy}-full", root / f"{strategy}-cut"
        r = invoke(tiny_cache, full, "--strategy", strategy)
        assert r.exit_code == 0, r.output
        r = invoke(tiny_cache, cut, "--strategy", strategy, env={"WANDISTILLER_FAIL_AT": "0:6"})
        assert isinstance(r.exception, RuntimeError), r.output
        assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
        made[strategy], made[f"{strategy}-cut"] = full, cut
    return made


def copy(src: Path, tmp_path: Path, name: str = "run") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


# -- D1: the sharded checkpoint's pickles ----------------------------------------------------------------------

def test_a_payload_in_the_dcp_index_is_refused_and_never_runs(tiny_cache, runs, tmp_path):
    out = copy(runs["fsdp-cut"], tmp_path)
    marker = tmp_path / "PWNED"
    plant(out, "sharded/.metadata", pickle.dumps(Payload(f"touch {marker}")))
    before = tree(out)
    line = one_error(invoke(tiny_cache, out, "--strategy", "fsdp", "--resume"), "step-00000004",
                     "sharded/.metadata references posix.system", "delete", "resume only from checkpoints")
    assert "weights_only=False" not in line
    assert not marker.exists()
    assert tree(out) == before  # nothing written (the lock file taken is gone again)


def _index(ckpt: Path):
    """The index of a checkpoint we wrote, read with plain pickle (a test's own file)."""
    with open(ckpt / "sharded" / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_index(ckpt: Path, index) -> None:
    with open(ckpt / "sharded" / ".metadata", "wb") as f:
        pickle.dump(index, f)
    rerecord(ckpt, "sharded/.metadata")


def test_a_payload_in_a_non_tensor_value_of_a_shard_is_refused_and_never_runs(tiny_cache, runs, tmp_path):
    """DCP reads a value that is not a tensor (an optimizer setting) with torch.load(weights_only=False): the payload
    appended to a shard file and the index pointed at it (index classes only) must not run either."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out = copy(runs["fsdp-cut"], tmp_path)
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save(Payload(f"touch {marker}"), buf)
    for ckpt in sorted((out / "checkpoints").iterdir()):
        index = _index(ckpt)
        key = next(k for k in index.storage_data if k.fqn == "optimizer.param_groups.0.lr")
        shard = ckpt / "sharded" / index.storage_data[key].relative_path
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(buf.getvalue())
        index.storage_data[key] = _StorageInfo(shard.name, offset, len(buf.getvalue()))
        _write_index(ckpt, index)
        rerecord(ckpt, f"sharded/{shard.name}")
    line = one_error(invoke(tiny_cache, out, "--strategy", "fsdp", "--resume"), "step-00000004",
                     "sharded/__0_0.distcp references posix.system", "delete")
    assert "weights_only=False" not in line
    assert not marker.exists()


def test_an_index_pointing_outside_its_folder_is_refused(tiny_cache, runs, tmp_path):
    out = copy(runs["fsdp-cut"], tmp_path)
    (tmp_path / "elsewhere.distcp").write_bytes(b"x" * 64)
    for ckpt in sorted((out / "checkpoints").iterdir()):
        index = _index(ckpt)
        for info in index.storage_data.values():
            info.relative_path = "../../../../elsewhere.distcp"
        _write_index(ckpt, index)
    one_error(invoke(tiny_cache, out, "--strategy", "fsdp", "--resume"), "sharded/.metadata references "
              "'../../../../elsewhere.distcp'", "delete")


def test_a_genuine_sharded_checkpoint_still_resumes_bit_equal(tiny_cache, runs, tmp_path):
    out = copy(runs["fsdp-cut"], tmp_path)
    index = checkpoint.read_index(out / "checkpoints" / "step-00000004")  # the safe reader takes what DCP writes
    assert checkpoint.sharded_keys(out / "checkpoints" / "step-00000004", index) == {"model", "optimizer", "ema"}
    r = invoke(tiny_cache, out, "--strategy", "fsdp", "--resume")
    assert r.exit_code == 0, r.output
    assert "(step 4," in r.output
    assert_same_students(out, runs["fsdp"])


# -- D11: a ddp checkpoint's optimizer.pt ----------------------------------------------------------------------

def test_a_payload_in_optimizer_pt_is_one_line_without_weights_only_advice(tiny_cache, runs, tmp_path):
    out = copy(runs["ddp-cut"], tmp_path)
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save({"state": {}, "param_groups": [Payload(f"touch {marker}")]}, buf)
    plant(out, "optimizer.pt", buf.getvalue())
    line = one_error(invoke(tiny_cache, out, "--resume"), "step-00000004", "optimizer.pt references posix.system",
                     "delete")
    assert "weights_only" not in line
    assert not marker.exists()
    # without its record (a version before digests) it is damaged: refused before anything of it is read
    for ckpt in (out / "checkpoints").iterdir():
        (ckpt / checkpoint.DIGESTS).unlink()
        state = json.loads((ckpt / checkpoint.STATE).read_text())
        del state["digests"]
        (ckpt / checkpoint.STATE).write_text(json.dumps(state))
    one_error(invoke(tiny_cache, out, "--resume"), "step-00000004 (digests.json: missing)")
    assert not marker.exists()


# -- D8: --out ---------------------------------------------------------------------------------------------

def test_out_on_a_folder_that_is_not_a_run_is_refused_before_anything_is_written(tiny_cache, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"mine": true}\n')
    (project / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree(project)
    one_error(invoke(tiny_cache, project), f"--out {project} is not a train-student run folder",
              "config.json (not a train-student config)", "metrics.jsonl (not train-student metrics)",
              "choose a new or empty folder for --out")
    assert tree(project) == before and sorted(p.name for p in project.iterdir()) == ["config.json", "metrics.jsonl"]
    (project / "thesis.tex").write_text("four years\n")
    one_error(invoke(tiny_cache, project, "--resume"), "thesis.tex")
    assert artifact.RUN_LOCK == lock.RUN_LOCK and artifact.EVAL_REPORT == evaluate.REPORT_NAME  # (one spelling)


@pytest.mark.parametrize("where", ["equal", "inside", "holding"])
def test_out_on_in_or_around_the_cache_is_refused(tiny_cache, tmp_path, where):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    before = tree(tmp_path)
    out = {"equal": cache, "inside": cache / "run", "holding": tmp_path}[where]
    how = {"equal": "is", "inside": "is inside", "holding": "holds"}[where]
    one_error(invoke(cache, out), f"--out {out} {how} the --cache folder {cache}", "outside every --cache folder")
    assert tree(tmp_path) == before and not (cache / "run").exists()


def test_a_run_of_ours_that_died_before_its_first_checkpoint_may_be_rerun(tiny_cache, tmp_path):
    out = tmp_path / "run"
    r = invoke(tiny_cache, out, env={"WANDISTILLER_FAIL_AT": "0:2"}, checkpoint_every=0)
    assert isinstance(r.exception, RuntimeError)
    assert {"config.json", "metrics.jsonl"} <= {p.name for p in out.iterdir()}
    assert artifact.RunLayout(out).foreign() == []
    r = invoke(tiny_cache, out, max_steps=2)
    assert r.exit_code == 0, r.output


# -- the resume road ----------------------------------------------------------------------------------------

def test_resume_of_a_finished_run_is_a_no_op(tiny_cache, runs, tmp_path):
    out = copy(runs["ddp"], tmp_path)
    weights = out / "student" / "diffusion_pytorch_model.safetensors"
    stat = weights.stat()
    before = tree(out)
    r = invoke(tiny_cache, out, "--resume")
    assert r.exit_code == 0, r.output
    assert f"train-student: {out} is finished (6 steps" in r.output and "nothing to do" in r.output
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert tree(out) == before


def test_resume_with_another_lr_is_refused_naming_the_flag(tiny_cache, runs, tmp_path):
    out = copy(runs["ddp-cut"], tmp_path)
    before = tree(out)
    one_error(invoke(tiny_cache, out, "--resume", lr=5e-4), "made with another --lr (--lr 0.001 then, 0.0005 now)",
              "rerun with --lr 0.001", "new --out")
    one_error(invoke(tiny_cache, out, "--resume", seed=6), "another seed (--seed 5 then, 6 now)", "--seed 5")
    one_error(invoke(tiny_cache, out, "--resume", "--holdout-prompts", "1"),
              "(--holdout-prompts 0 then, 1 now)", "rerun with --holdout-prompts 0")
    assert tree(out) == before


def test_resume_with_max_steps_below_the_checkpoint_is_refused(tiny_cache, runs, tmp_path):
    out = copy(runs["ddp-cut"], tmp_path)
    before = tree(out)
    one_error(invoke(tiny_cache, out, "--resume", max_steps=2), "step-00000004, is at step 4",
              "(--max-steps 2)", "pass --max-steps 4 or more", "new --out")
    assert tree(out) == before


def test_a_longer_resume_says_what_it_does_to_the_schedule(tiny_cache, runs, tmp_path):
    out = copy(runs["ddp-cut"], tmp_path)
    r = invoke(tiny_cache, out, "--resume", max_steps=8)
    assert r.exit_code == 0, r.output
    assert "note: --resume: the run now ends at step 8 (--max-steps 8), not 6: from step 5" in r.output
    assert json.loads((out / "distill.json").read_text())["optimizer_steps"] == 8


def test_a_checkpoint_from_before_the_kept_settings_is_refused_in_one_line(tiny_cache, runs, tmp_path):
    """A trainer state without `settings` (nor `total`) was written by an earlier version: refused, not guessed."""
    out = copy(runs["ddp-cut"], tmp_path)
    for ckpt in (out / "checkpoints").iterdir():
        state = json.loads((ckpt / checkpoint.STATE).read_text())
        del state["extra"]["settings"], state["total"]
        (ckpt / checkpoint.STATE).write_text(json.dumps(state, indent=1) + "\n")
        rerecord(ckpt, checkpoint.STATE)
    before = tree(out)
    one_error(invoke(tiny_cache, out, "--resume"), "was written by another version of train-student",
              "new --out")
    assert tree(out) == before