"""Configs, prompt files, device maps and settings a careless colleague or an attacker hands over: a FIFO where a file
should be, a sparse file of gigabytes, JSON/TOML nested 100,000 deep, a byte-order mark, a negative prompt of
megabytes, a weight index pointing out of the teacher folder. Each is refused at once in one `error:` line naming the
file or flag (exit 2), never waited on, read whole or recursed into; host memory running out is said as the host's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from cache import safe_open
from cache.cache_error import UnsafeFileError
from conftest import ROOT, TINY_CACHE_ARGS
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.prompts import MAX_PROMPT_CHARS, read_prompt_file
from stages.teacher_cache import group_offload
from stages.teacher_cache.placements.device_map import read_device_map

pytestmark = pytest.mark.timeout(60)  # a FIFO opened the old way blocks forever: fail instead

TINY_STUDENT = ROOT / "configs" / "student-tiny.json"
DEEP = 100_000


def _cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv], catch_exceptions=False)


def one_line(r, *needles: str, code: int = 2) -> str:
    """Exit `code`, exactly one `error:` line holding every needle, no traceback, nothing echoed at length."""
    text = r.stdout + r.stderr
    said = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert r.exit_code == code and len(said) == 1 and "Traceback" not in text, text[-2000:]
    assert all(n in said[0] for n in needles), (needles, said[0])
    assert len(text) < 4000, text[:500]
    return said[0]


def _stage_one(teacher, prompts, out, *extra):
    return _cli("teacher-cache", "--teacher", teacher, "--prompts", prompts, "--out", out, "--placement", "cpu",
                *[f"--{k.replace('_', '-')}={v}" for k, v in TINY_CACHE_ARGS.items()], *extra)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _sparse(path: Path, size: int = 2 << 30) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # 2 GiB, no block of it on disk: reading it whole would take the machine's memory
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- config files (--config TOML, --student-config JSON) --------------------------------------------------------

def test_a_fifo_config_is_refused_not_waited_on(tiny_teacher, prompts_file, tmp_path):
    fifo = _fifo(tmp_path / "c.toml")
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--config", fifo),
             f"config file {fifo} is a FIFO", "--config")
    assert not (tmp_path / "c").exists()


def test_a_sparse_2_gib_config_is_refused_before_it_is_read(tiny_teacher, prompts_file, tmp_path):
    big = _sparse(tmp_path / "c.toml")
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--config", big),
             f"config file {big} is 2,147,483,648 bytes", f"more than the {safe_open.CAPS['config']:,}", "--config")


@pytest.mark.parametrize("text", ["steps = " + "[" * DEEP + "]" * DEEP, "x = " + "{a = " * DEEP + "1" + "}" * DEEP])
def test_a_toml_nested_100000_deep_is_one_line(tiny_teacher, prompts_file, tmp_path, text):
    deep = _write(tmp_path / "deep.toml", text)
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--config", deep),
             f"config file {deep} nests deeper than the {safe_open.MAX_DEPTH} levels", "--config")


@pytest.mark.parametrize("kind", ["fifo", "sparse", "deep", "folder"])
def test_a_hostile_student_config(tiny_cache, tmp_path, kind):
    path = tmp_path / "student.json"
    if kind == "fifo":
        _fifo(path)
    elif kind == "sparse":
        _sparse(path)
    elif kind == "deep":
        _write(path, "[" * DEEP + "]" * DEEP)
    else:
        path.mkdir()
    said = {"fifo": "is a FIFO", "sparse": "is 2,147,483,648 bytes", "deep": "nests deeper", "folder": "is a folder"}
    one_line(_cli("train-student", "--cache", tiny_cache, "--student-config", path, "--out", tmp_path / "out",
                  "--device", "cpu", "--max-steps", "1"), f"student config {path} {said[kind]}", "student-tiny.json")
    assert not (tmp_path / "out").exists()


def test_a_config_value_of_megabytes_is_not_echoed(tiny_teacher, prompts_file, tmp_path):
    cfg = _write(tmp_path / "c.toml", f'seed = "{"9" * 10_000_000}"\n')
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--config", cfg), "seed must be an integer",
             str(cfg))


# --- prompt files ----------------------------------------------------------------------------------------------

def test_a_fifo_prompt_file_says_it_is_a_fifo(tiny_teacher, tmp_path):
    fifo = _fifo(tmp_path / "prompts.txt")
    line = one_line(_stage_one(tiny_teacher, fifo, tmp_path / "c", "--dry-run"), f"prompt file {fifo} is a FIFO",
                    "--prompts")
    assert "does not exist" not in line
    with pytest.raises(UserError, match="is a FIFO"):
        read_prompt_file(fifo)


def test_a_sparse_2_gib_prompt_file_is_refused_before_it_is_read(tiny_teacher, tmp_path):
    big = _sparse(tmp_path / "prompts.txt")
    one_line(_stage_one(tiny_teacher, big, tmp_path / "c", "--dry-run"), f"prompt file {big} is 2,147,483,648 bytes",
             f"{safe_open.CAPS['prompts']:,}")


def test_a_prompt_folder_is_refused(tiny_teacher, tmp_path):
    (tmp_path / "prompts.txt").mkdir()
    one_line(_stage_one(tiny_teacher, tmp_path / "prompts.txt", tmp_path / "c", "--dry-run"), "is a folder",
             "--prompts")


@pytest.mark.parametrize("name, data", [("p.txt", "a cat\na dog\n"), ("p.jsonl", '{"prompt": "a cat"}\n'
                                                                                    '{"prompt": "a dog"}\n')])
def test_a_byte_order_mark_is_no_part_of_prompt_1(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(b"\xef\xbb\xbf" + data.encode())
    assert read_prompt_file(p) == ["a cat", "a dog"]
    p = tmp_path / "p.txt"
    p.write_bytes(b"\xef\xbb\xbfa cat\n\xff\n")  # the byte a decode error names counts the mark
    with pytest.raises(UserError, match=r"line 2, byte 9\)"):
        read_prompt_file(p)


def test_a_jsonl_line_nested_100000_deep_is_one_line(tiny_teacher, tmp_path):
    p = _write(tmp_path / "p.jsonl", '{"prompt": "a cat"}\n' + "[" * DEEP + "]" * DEEP + "\n")
    one_line(_stage_one(tiny_teacher, p, tmp_path / "c", "--dry-run"), f"prompt file {p} line 2: nests deeper",
             '{"prompt": "..."}')


# --- the negative prompt -----------------------------------------------------------------------------------------

def test_a_10_mb_negative_prompt_is_refused_as_a_prompt_line_is(tiny_teacher, prompts_file, tmp_path):
    huge = "blurry " * (10_000_000 // 7)
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--negative-prompt", huge),
             "--negative-prompt is 9,999,997 characters long", f"the {MAX_PROMPT_CHARS:,} a prompt may hold")
    cfg = _write(tmp_path / "c.toml", f'negative_prompt = "{huge}"\n')
    one_line(_cli("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", tmp_path / "c",
                  "--config", cfg), "--negative-prompt is 9,999,997 characters", f"(config file {cfg})")
    one_line(_cli("sample", "--student", tmp_path / "none", "--prompts", prompts_file, "--out", tmp_path / "g.png",
                  "--negative-prompt", huge), "--negative-prompt is 9,999,997 characters long")
    assert not (tmp_path / "c").exists()
    ok = _stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--negative-prompt", "b" * MAX_PROMPT_CHARS,
                    "--dry-run")
    assert ok.exit_code == 0, ok.output[-2000:]


# --- host memory -----------------------------------------------------------------------------------------------

def test_host_memory_running_out_is_said_as_the_hosts(tiny_teacher, prompts_file, tmp_path, monkeypatch):
    from pipeline import prompts

    def exhausted(*_):
        raise MemoryError()  # as reading a foreign file larger than the memory left would end

    monkeypatch.setattr(prompts, "_lines", exhausted)
    r = _stage_one(tiny_teacher, prompts_file, tmp_path / "c")
    err = r.stderr
    assert r.exit_code == 3 and "Traceback" not in err, err
    assert "error: out of host memory in teacher-cache: MemoryError" in err and "memory: peak host RSS" in err
    assert "--placement disk" in err and "far larger than its kind" in err
    assert "--placement offload" not in err and "CUDA" not in err


# --- device maps ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "sparse", "deep"])
def test_a_hostile_device_map(tiny_teacher, prompts_file, tmp_path, kind):
    path = tmp_path / "map.json"
    {"fifo": _fifo, "sparse": _sparse, "deep": lambda p: _write(p, "[" * DEEP + "]" * DEEP)}[kind](path)
    said = {"fifo": "is a FIFO", "sparse": "is 2,147,483,648 bytes", "deep": "nests deeper"}[kind]
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--placement", path, "--dry-run"),
             f"device map {path} {said}", "docs/placements.md")


@pytest.mark.parametrize("value", [["cpu"], True, {"a": 1}, "cuda:" + "9" * 4000, "cuda:\u0663"])
def test_a_device_map_value_of_another_type_is_no_device(tmp_path, value):
    path = _write(tmp_path / "map.json", json.dumps({"": value}))
    with pytest.raises(UserError, match="is not a device") as e:
        read_device_map(str(path), check_devices=False)
    assert len(str(e.value)) < 300


# --- the offload folder and the teacher's weight index ------------------------------------------------------------

def _sharded(tmp_path: Path, weight_map) -> Path:
    teacher = tmp_path / "teacher"
    (teacher / "transformer").mkdir(parents=True, exist_ok=True)
    _write(teacher / "transformer" / "diffusion_pytorch_model.safetensors.index.json",
           json.dumps({"weight_map": weight_map}))
    return teacher


def test_a_weight_index_is_read_inside_the_teacher_folder(tmp_path):
    victim = _write(tmp_path / "victim.safetensors", "x")
    teacher = _sharded(tmp_path, {"a.weight": "../../victim.safetensors"})
    with pytest.raises(UnsafeFileError, match="not a path inside the folder"):
        group_offload.checkpoint_files(teacher, "transformer")
    (teacher / "transformer" / "w.safetensors").symlink_to(victim)
    teacher = _sharded(tmp_path, {"a.weight": "w.safetensors"})
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        group_offload.checkpoint_files(teacher, "transformer")
    teacher = _sharded(tmp_path, {"a.weight": ["w.safetensors"]})
    with pytest.raises(UserError, match="no weight_map"):
        group_offload.checkpoint_files(teacher, "transformer")
    teacher = _sharded(tmp_path, {"a.weight": "gone.safetensors"})
    with pytest.raises(UserError, match="gone.safetensors, which is missing"):
        group_offload.checkpoint_files(teacher, "transformer")
    index = teacher / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index.unlink()
    _fifo(index)
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        group_offload.checkpoint_files(teacher, "transformer")


def test_a_hub_snapshots_index_may_link_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    _write(repo / "blobs" / "idx", json.dumps({"weight_map": {"a.weight": "w.safetensors"}}))
    _write(repo / "blobs" / "w", "x")
    snap = repo / "snapshots" / "0123"
    (snap / "transformer").mkdir(parents=True)
    (snap / "transformer" / "diffusion_pytorch_model.safetensors.index.json").symlink_to("../../../blobs/idx")
    (snap / "transformer" / "w.safetensors").symlink_to("../../../blobs/w")
    files = group_offload.checkpoint_files(snap, "transformer")
    assert files == {"a.weight": snap / "transformer" / "w.safetensors"}


def test_an_offload_marker_it_did_not_write_means_rebuild(tmp_path):
    folder = tmp_path / "transformer-0123456789abcdef"
    folder.mkdir()
    victim = _write(tmp_path / "victim.json", json.dumps({"fingerprint": "f", "files": {}}))
    (folder / group_offload.MARKER).symlink_to(victim)
    assert not group_offload._folder_ok(folder, "f")  # a link: not the folder's own marker
    (folder / group_offload.MARKER).unlink()
    _fifo(folder / group_offload.MARKER)
    assert not group_offload._folder_ok(folder, "f")  # at once, not waited on
    (folder / group_offload.MARKER).unlink()
    for files in ({"../victim.json": victim.stat().st_size}, {"g": "1"}, ["g"]):
        _write(folder / group_offload.MARKER, json.dumps({"fingerprint": "f", "files": files}))
        assert not group_offload._folder_ok(folder, "f"), files
    _write(folder / group_offload.MARKER, "[" * DEEP + "]" * DEEP)
    assert not group_offload._folder_ok(folder, "f")
    _write(folder / "g", "12")
    _write(folder / group_offload.MARKER, json.dumps({"fingerprint": "f", "files": {"g": 2}}))
    assert group_offload._folder_ok(folder, "f") and not group_offload._folder_ok(folder, "other")
    assert victim.read_text() == json.dumps({"fingerprint": "f", "files": {}})
