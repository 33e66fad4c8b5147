"""Checkpoints that can be trusted: each records the size and sha256 of its files (digests.json), and
`train-student --resume` checks the newest against that record. A damaged one (empty, truncated, a flipped
byte that safetensors itself would load) is named in one warning line and the run resumes from the newest
sound older one, ending bit-equal to an uninterrupted run; when none is sound the command exits 2 with one
line. A checkpoint without a record (one of a version before digests) is damaged like any other.

Every run is a real `wandistiller train-student` through click's CliRunner, on the session's tiny cache."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.cli import main
from stages.train_student import checkpoint
from test_train_student import assert_same_students, metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "student-tiny.json")
# 28 samples, batch 4: 7 steps an epoch; 10 steps cross into the second; checkpoints at 3, 6 and 9.
ARGS = dict(max_steps=10, checkpoint_every=3, keep_checkpoints=3, batch_size=4, lr=1e-3, warmup_steps=2,
            ema_decay=0.8, eval_every=0, log_every=1, num_workers=0, seed=5, device="cpu")
NEWEST, OLDER = "step-00000009", "step-00000006"


def invoke(cache: Path, out: Path, *extra: str, env: dict | None = None):
    args = ["train-student", "--cache", str(cache), "--student-config", TINY, "--out", str(out)]
    for k, v in ARGS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return CliRunner().invoke(main, args + list(extra), env=env)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out)]


@pytest.fixture(scope="module")
def runs(tiny_cache, tmp_path_factory) -> tuple[Path, Path]:
    """(an uninterrupted run, the same run killed as step 10 begins: checkpoints 3, 6 and 9, no student)."""
    root = tmp_path_factory.mktemp("trust")
    full, cut = root / "full", root / "cut"
    r = invoke(tiny_cache, full)
    assert r.exit_code == 0, r.output
    r = invoke(tiny_cache, cut, env={"WANDISTILLER_FAIL_AT": "0:10"})
    assert isinstance(r.exception, RuntimeError) and "injected failure" in str(r.exception), r.output
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000003", OLDER, NEWEST]
    assert not (cut / "student").exists()
    return full, cut


def interrupted(runs, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs[1], out)
    return out


def assert_equals_uninterrupted(out: Path, full: Path) -> None:
    assert_same_students(out, full)
    assert losses(out) == losses(full)


def flip_byte(path: Path) -> None:
    """Flip one bit of the last byte: tensor data of a safetensors file, which still loads afterwards."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def test_a_checkpoint_records_the_size_and_sha256_of_each_of_its_files(runs):
    ckpt = runs[1] / "checkpoints" / NEWEST
    record = json.loads((ckpt / checkpoint.DIGESTS).read_text())
    assert record["format"] == 1
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != checkpoint.DIGESTS)
    assert sorted(record["files"]) == on_disk == sorted(["model.safetensors", "ema.safetensors", "optimizer.pt",
                                                          "trainer_state.json"])
    for name, want in record["files"].items():  # read independently of the code that wrote them
        assert want == {"bytes": (ckpt / name).stat().st_size, "sha256": sha256(ckpt / name)}, name
    assert json.loads((ckpt / "trainer_state.json").read_text())["digests"] == checkpoint.DIGESTS
    assert checkpoint.check(ckpt) is None
    assert not list((runs[1] / "checkpoints").glob("*.tmp")), "a temporary folder was left behind"


@pytest.mark.parametrize("damage, file, why", [
    (empty, "model.safetensors", "model.safetensors: empty (0 of "),
    (truncate, "optimizer.pt", "optimizer.pt: truncated ("),
    (flip_byte, "model.safetensors", "model.safetensors: sha256 mismatch"),
], ids=["empty", "truncated", "flipped-byte"])
def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_older_one(tiny_cache, runs, tmp_path, damage,
                                                                                     file, why):
    full = runs[0]
    out = interrupted(runs, tmp_path)
    newest = out / "checkpoints" / NEWEST
    damage(newest / file)
    if damage is flip_byte:  # safetensors alone would have resumed from it: only the digest tells
        load_file(newest / file)
    r = invoke(tiny_cache, out, "--resume")
    assert r.exit_code == 0, r.output
    warnings = [ln for ln in r.output.splitlines() if "warning:" in ln]
    assert len(warnings) == 1, r.output
    assert warnings[0].startswith(f"warning: checkpoint {NEWEST} is damaged ({why}"), warnings
    assert warnings[0].endswith(f"); resuming from {OLDER}"), warnings
    assert "(step 6," in r.output and "Traceback" not in r.output
    assert_equals_uninterrupted(out, full)
    # The resumed run wrote step 9 again, whole: it replaces the damaged folder, byte for byte the reference's.
    assert checkpoint.check(newest) is None
    assert sha256(newest / file) == sha256(full / "checkpoints" / NEWEST / file)
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_every_checkpoint_damaged_is_one_line_exit_2_and_changes_nothing(tiny_cache, runs, tmp_path):
    out = interrupted(runs, tmp_path)
    ckpts = out / "checkpoints"
    flip_byte(ckpts / NEWEST / "model.safetensors")
    empty(ckpts / OLDER / "optimizer.pt")
    (ckpts / "step-00000003" / checkpoint.DIGESTS).unlink()  # written with one: its loss is damage
    before = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    r = invoke(tiny_cache, out, "--resume")
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    line = errors[0]
    for name, why in ((NEWEST, "model.safetensors: sha256 mismatch"), (OLDER, "optimizer.pt: empty"),
                      ("step-00000003", "digests.json: missing")):
        assert f"{name} ({why}" in line, line
    assert "delete the damaged checkpoint folders" in line and "without --resume in a new --out" in line
    after = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before  # nothing written, nothing removed (the lock file it took is gone again)


def test_a_checkpoint_of_a_version_before_digests_is_refused_in_one_line(tiny_cache, runs, tmp_path):
    """No record and no `digests` key in its trainer state: 0.1 resumes only the checkpoints it writes."""
    out = interrupted(runs, tmp_path)
    for d in (out / "checkpoints").iterdir():
        (d / checkpoint.DIGESTS).unlink()
        state = json.loads((d / "trainer_state.json").read_text())
        del state["digests"]
        (d / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
    r = invoke(tiny_cache, out, "--resume")
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"{NEWEST} (digests.json: missing)" in errors[0], r.output


def test_a_deleted_record_or_trainer_state_is_damage_not_a_silent_skip(runs, tmp_path):
    ckpts = interrupted(runs, tmp_path) / "checkpoints"
    (ckpts / NEWEST / checkpoint.DIGESTS).unlink()
    assert checkpoint.check(ckpts / NEWEST) == "digests.json: missing"
    (ckpts / OLDER / "trainer_state.json").unlink()  # no longer "complete": still a candidate, reported
    (ckpts / "step-00000003" / checkpoint.DIGESTS).write_text('{"format": 1, "files": {"model.saf')
    with pytest.raises(checkpoint.UserError) as e:
        checkpoint.pick(ckpts.parent)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{NEWEST} (digests.json: missing)" in msg and f"{OLDER} (trainer_state.json: missing)" in msg
    assert "step-00000003 (digests.json: unreadable (UnsafeFileError: " in msg and "is not valid JSON" in msg


def test_a_kill_while_pruning_leaves_no_partial_checkpoint_under_a_final_name(tmp_path, monkeypatch):
    """CI's random SIGKILL once landed inside prune's delete of an old checkpoint: its final-named folder was left
    half deleted. prune renames it to a temporary name first; the delete, killed after one file, leaves only that."""
    root = tmp_path / checkpoint.CHECKPOINTS
    for step in (3, 6, 9):
        d = root / checkpoint.step_dirname(step)
        d.mkdir(parents=True)
        for name in ("model.safetensors", "optimizer.pt", checkpoint.STATE):
            (d / name).write_text("x")

    def killed_after_one_file(path, ignore_errors=False):
        files = sorted(Path(path).iterdir()) if Path(path).is_dir() else []
        if files:
            files[0].unlink()
            raise KeyboardInterrupt  # the kill, mid-delete

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(tmp_path, keep=2, step=9)
    named = [d for d in root.iterdir() if not d.name.endswith(checkpoint.TMP)]
    assert sorted(d.name for d in named) == ["step-00000006", NEWEST]
    assert all(len(list(d.iterdir())) == 3 for d in named)
    assert [d.name for d in checkpoint.complete(tmp_path)] == ["step-00000006", NEWEST]
