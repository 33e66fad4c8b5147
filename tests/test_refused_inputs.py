"""Inputs that used to end in a traceback (issue 21, item 7, and what the previous review left): each now ends in
exit 2 and exactly one `error:` line naming the problem and the fix, through the real CLI. The same inputs are rows
of the fault suite's bad-input table (tests/faults/bad_input.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from cache import format as F
from cache.reader import decode_sample
from cache.writer import ShardWriter
from conftest import TINY_CACHE_ARGS
from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "student-tiny.json")
A14B = ROOT / "tests" / "data" / "wan22-a14b-configs"


def _cli(*argv) -> object:
    return CliRunner().invoke(main, [str(a) for a in argv], catch_exceptions=False)


def one_line(r, *needles: str) -> str:
    """Exit 2, exactly one `error:` line holding every needle, no traceback; returns the line."""
    text = r.stdout + r.stderr
    said = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(said) == 1 and "Traceback" not in text, text[-2000:]
    assert all(n in said[0] for n in needles), (needles, said[0])
    return said[0]


def _train(cache: Path, out: Path, *extra) -> object:
    return _cli("train-student", "--cache", cache, "--student-config", TINY, "--out", out, "--num-workers", "0",
                "--max-steps", "2", "--batch-size", "4", "--device", "cpu", "--warmup-steps", "0", *extra)


@pytest.fixture
def cache_copy(tiny_cache, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(tiny_cache, dst)
    return dst


# --- train-student: --out, --lr, a loss that is not finite ----------------------------------------------------

def test_out_below_a_file(tiny_cache, tmp_path):
    (tmp_path / "somefile").write_text("x")
    one_line(_train(tiny_cache, tmp_path / "somefile" / "run"), "cannot write to", "choose a writable --out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission")
def test_out_in_a_folder_without_write_permission(tiny_cache, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    one_line(_train(tiny_cache, locked / "run"), "Permission denied", "choose a writable --out")


def test_permission_denied_inside_out_midway(tiny_cache, tmp_path, monkeypatch):
    """A write refused inside --out after training started (a checkpoint folder someone made read-only): one line,
    not a PermissionError traceback (any user: the refusal is simulated)."""
    from stages.train_student import checkpoint

    def refused(out, step, *a, **k):
        path = Path(out) / "checkpoints" / f"step-{step:08d}.1.tmp"
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "save", refused)
    out = tmp_path / "run"
    one_line(_train(tiny_cache, out, "--checkpoint-every", "1"), f"cannot write {out}/checkpoints/step-00000001",
             "Permission denied", "make", "writable", "--resume")


@pytest.mark.parametrize("lr", ["nan", "inf"])
def test_lr_not_finite(tiny_cache, tmp_path, lr):
    one_line(_train(tiny_cache, tmp_path / "run", "--lr", lr), f"lr must be a finite number, got {lr}")
    assert not (tmp_path / "run").exists()


def _nan_in_sample(cache: Path) -> str:
    """Rewrite the cache's first shard with NaN in x_t of its second sample, recorded as if stage one wrote it (the
    shard's size and checksum in the manifest): what a teacher that overflowed would leave. Returns the key."""
    m = json.loads((cache / F.MANIFEST).read_text())
    rec = m["shards"][0]
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(cache / rec["path"]) as tar:
        for info in tar:
            key, _, ext = info.name.partition(".")
            samples.setdefault(key, {})[ext] = tar.extractfile(info).read()
    writer = ShardWriter(cache, rec["part"], int(Path(rec["path"]).stem.rsplit("-", 1)[1]))
    bad = list(samples)[1]
    for key, members in samples.items():
        tensors, meta = decode_sample(members)
        if key == bad:
            tensors[F.T_X_T] = tensors[F.T_X_T].clone()
            tensors[F.T_X_T].view(-1)[3] = float("nan")
        writer.write(key, tensors, meta)
    new = writer.close(rec["blocks"])
    m["bytes"] += new.bytes - rec["bytes"]
    rec.update({"bytes": new.bytes, "crc32c": new.crc32c})
    (cache / F.MANIFEST).write_text(json.dumps(m, indent=2))
    return bad


@pytest.mark.slow
def test_nan_loss_from_the_cache_names_the_sample(cache_copy, tmp_path):
    key = _nan_in_sample(cache_copy)
    p, s, k = F.parse_key(key)
    # every sample in one step: the NaN sample is in step 1's batch
    line = one_line(_train(cache_copy, tmp_path / "run", "--batch-size", "28", "--max-steps", "1"),
                    "loss became nan at step 1", f"NaN in x_t of sample {key} (prompt {p}, seed {s}, step {k})",
                    f"wandistiller cache verify {cache_copy}")
    assert "--lr" not in line


@pytest.mark.slow
def test_nan_loss_with_finite_inputs_blames_the_training(tiny_cache, tmp_path):
    line = one_line(_train(tiny_cache, tmp_path / "run", "--lr", "1e30", "--max-steps", "4"),
                    "with finite inputs", "lower --lr (now 1e+30)")
    assert "cache verify" not in line


# --- teacher-cache, cache verify, plan ------------------------------------------------------------------------

def test_size_beyond_the_teachers_rotary_positions(tiny_teacher, prompts_file, tmp_path):
    """The tiny teacher's rope_max_seq_len is 32 positions per axis: 33 patches of 2 x VAE 8 = 528 pixels do not fit;
    refused before anything is encoded or written."""
    out = tmp_path / "cache"
    one_line(_cli("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", out, "--placement",
                  "cpu", "--height", "528", "--width", "64", "--steps", "2"),
             "--height 528 is 33 patches", "rope_max_seq_len 32", "the maximum is --height 512")
    one_line(_cli("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", out, "--placement",
                  "cpu", "--height", "64", "--width", "64", "--frames", "129", "--steps", "2"),
             "--frames 129 is 33 patches", "the maximum is --frames 125")
    assert not out.exists()


def test_student_rotary_table_smaller_than_the_cache(tiny_cache, tmp_path):
    """A student whose rope_max_seq_len holds fewer positions than the cache's latents have patches along an axis
    failed in its first forward; refused with the figure before training starts."""
    cfg = json.loads(Path(TINY).read_text()) | {"rope_max_seq_len": 1}
    manifest = json.loads((tiny_cache / F.MANIFEST).read_text())
    c, f, h, w = manifest["latent_shape"]
    _, ph, pw = cfg["patch_size"]
    assert max(h // ph, w // pw) > 1
    path = tmp_path / "student.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    one_line(_cli("train-student", "--cache", tiny_cache, "--student-config", path, "--out", out, "--device", "cpu",
                  "--max-steps", "1"),
             "rope_max_seq_len 1 is fewer positions", f"set rope_max_seq_len to at least {max(h // ph, w // pw)}")
    assert not (out / "student").exists()


def test_verify_a_missing_folder(tmp_path):
    one_line(_cli("cache", "verify", tmp_path / "none"), "does not exist", "teacher-cache --out")
    (tmp_path / "file").write_text("x")
    one_line(_cli("cache", "verify", tmp_path / "file"), "is a file, not a cache folder")


def test_plan_where_nothing_fits_shows_the_figures():
    r = _cli("plan", "--teacher", A14B, "--assume-gpus", "8GiB", "--assume-ram", "16GiB", "--assume-disk", "20GiB")
    one_line(r, "the teacher fits nowhere on this machine", "53.34 GiB of disk (19.00 GiB free)")
    lines = r.stderr.splitlines()
    table = next(ln for ln in lines if "component" in ln)
    assert "bfloat16" in table and "float32" in table  # each component at each dtype
    assert any(ln.split()[:1] == ["transformer_2"] and "26.67 GiB" in ln and "53.23 GiB" in ln for ln in lines)
    assert any("would fit at bfloat16 (this run)" in ln for ln in lines)
    assert any(ln.strip().startswith("- offload: a GPU of") for ln in lines)
    assert any(ln.strip().startswith("- cpu (no GPU): ") for ln in lines)


def test_plan_json_where_nothing_fits_is_json():
    r = _cli("plan", "--teacher", A14B, "--assume-gpus", "8GiB", "--assume-ram", "16GiB", "--assume-disk", "20GiB",
             "--json")
    assert r.exit_code == 2
    out = json.loads(r.stdout)
    assert out["fits"] is False and out["error"].startswith("the teacher fits nowhere on this machine")
    t2 = next(c for c in out["components"] if c["name"] == "transformer_2")
    assert 1.9 < t2["bytes"]["float32"] / t2["bytes"]["bfloat16"] <= 2  # each dtype (norms may stay float32)
    assert any(m.startswith("offload: a GPU of") for m in out["would_fit"]["bfloat16"])


# --- stage one resumes a damaged part; eval checks the manifest; verify's notes ---------------------------------

def _unfinished(cache: Path) -> None:
    """As a killed stage one leaves it: no manifest, the last shard gone (its blocks run again on resume)."""
    m = json.loads((cache / F.MANIFEST).read_text())
    (cache / F.MANIFEST).unlink()
    (cache / m["shards"][-1]["path"]).unlink()


def _resume(teacher: Path, prompts: Path, cache: Path):
    args = dict(TINY_CACHE_ARGS)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    return _cli("teacher-cache", "--teacher", teacher, "--prompts", prompts, "--out", cache, "--placement", "cpu",
                *flags)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_resume_refuses_a_damaged_prompt_store_and_the_remedy_works(tiny_teacher, prompts_file, cache_copy,
                                                                      tiny_cache):
    _unfinished(cache_copy)
    from faults.damage import chunk_location

    part_dir = cache_copy / F.PARTS_DIR / F.part_dirname(0)
    path, start, _ = chunk_location(part_dir / F.PROMPTS_ZARR, F.Z_EMBEDS, 6)  # in its file of 64
    _flip(path, start + 8)
    one_line(_resume(tiny_teacher, prompts_file, cache_copy), "part 0 of", "is damaged",
             "embeds of rows 6-6 of parts/part-00000/prompts.zarr fail their chunk's crc32c", f"delete {part_dir}",
             "--overwrite")
    shutil.rmtree(part_dir)  # the remedy: that part is computed again, equal to the reference
    assert _resume(tiny_teacher, prompts_file, cache_copy).exit_code == 0
    want = {s["path"]: s["crc32c"] for s in json.loads((tiny_cache / F.MANIFEST).read_text())["shards"]}
    got = {s["path"]: s["crc32c"] for s in json.loads((cache_copy / F.MANIFEST).read_text())["shards"]}
    assert got == want


@pytest.mark.slow
def test_resume_refuses_a_changed_part_negative(tiny_teacher, prompts_file, cache_copy):
    _unfinished(cache_copy)
    neg = cache_copy / F.PARTS_DIR / F.part_dirname(0) / F.NEGATIVE
    _flip(neg, neg.stat().st_size - 3)  # tensor data: it still decodes, to other values
    shards = sorted(p.name for p in (cache_copy / F.SHARDS_DIR).iterdir())
    one_line(_resume(tiny_teacher, prompts_file, cache_copy), "part 0 of",
             "parts/part-00000/negative.safetensors fails its sha256 check", "--overwrite")
    assert sorted(p.name for p in (cache_copy / F.SHARDS_DIR).iterdir()) == shards  # nothing computed with it


def test_part_negative_is_checked_against_its_sha256(cache_copy):
    import hashlib

    from cache.cache_error import CacheError
    from cache.prompt_store import part_negative

    path = cache_copy / F.PARTS_DIR / F.part_dirname(0) / F.NEGATIVE
    assert part_negative(cache_copy, 0, hashlib.sha256(path.read_bytes()).hexdigest()).ndim == 2
    path.write_bytes(b"not safetensors")
    with pytest.raises(CacheError, match="negative.safetensors fails its sha256 check"):
        part_negative(cache_copy, 0, "0" * 64)
    with pytest.raises(CacheError, match="negative.safetensors does not decode"):
        part_negative(cache_copy, 0, hashlib.sha256(b"not safetensors").hexdigest())


def test_eval_refuses_a_manifest_edited_after_stage_one(cache_copy, tmp_path):
    from stages.students.compact import build_student, load_student_config

    build_student(load_student_config(TINY), TINY, 0).save_pretrained(tmp_path / "student")
    m = json.loads((cache_copy / F.MANIFEST).read_text())
    m["guidance"] = 7.5
    (cache_copy / F.MANIFEST).write_text(json.dumps(m, indent=2))
    one_line(_cli("eval", "--student", tmp_path / "student", "--cache", cache_copy, "--no-teacher-timing"),
             "no longer hash to its fingerprint", "guidance is 7.5 there")
    assert not (tmp_path / "student" / "eval.json").exists()


def test_verify_refuses_a_manifest_without_negative_sha256(cache_copy):
    """This format records the negative prompt's sha256: a manifest without it (edited) is named, not noted."""
    m = json.loads((cache_copy / F.MANIFEST).read_text())
    del m["negative_sha256"]
    (cache_copy / F.MANIFEST).write_text(json.dumps(m, indent=2))
    r = _cli("cache", "verify", cache_copy)
    assert r.exit_code == 1 and not [ln for ln in r.stdout.splitlines() if ln.startswith("NOTE ")]
    assert any(ln.startswith("BAD ") for ln in r.stdout.splitlines())
