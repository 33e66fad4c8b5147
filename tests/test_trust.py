"""The trust boundary's two modules on their own: what a reader of a foreign folder refuses (cache/safe_open.py) and
how an output is written (cache/safe_write.py). The commands' own cases are in tests/test_hostile_*.py and the
fault suite's `hostile-folders` rows."""

from __future__ import annotations

import json
import os

import pytest

from cache import safe_open, safe_write
from cache.cache_error import UnsafeFileError


@pytest.fixture
def victim(tmp_path):
    """A file outside every folder the tests read or write: links point at it; it must never change."""
    v = tmp_path / "home" / ".bashrc"
    v.parent.mkdir()
    v.write_text("export PATH=$HOME/bin:$PATH\n")
    return v


def test_a_link_anywhere_below_the_folder_is_refused_never_followed(tmp_path, victim):
    root = tmp_path / "run"
    (root / "student").mkdir(parents=True)
    (root / "distill.json").symlink_to(victim)
    (root / "linked").symlink_to(victim.parent, target_is_directory=True)
    for rel in ("distill.json", "linked/.bashrc"):
        with pytest.raises(UnsafeFileError, match="is a symbolic link"):
            safe_open.read_bytes(root, rel, fix="remove it")
    for rel in ("../home/.bashrc", "/etc/passwd", "student/../../home/.bashrc"):
        with pytest.raises(UnsafeFileError, match="not a path inside the folder"):
            safe_open.read_bytes(root, rel)


def test_a_fifo_is_refused_at_once_and_a_named_one_too(tmp_path):
    os.mkfifo(tmp_path / "lora.json")
    with pytest.raises(UnsafeFileError, match="is a FIFO, not a regular file"):
        safe_open.read_json(tmp_path, "lora.json")
    with pytest.raises(UnsafeFileError, match="the prompt file .* is a FIFO"):
        safe_open.read_named(tmp_path / "lora.json", "the prompt file", 100)


def test_reads_are_capped_before_a_byte_is_read(tmp_path):
    big = tmp_path / "distill.json"
    with open(big, "wb") as f:
        f.truncate(16 << 30)  # 16 GiB, sparse: reading it whole would take the machine's memory
    with pytest.raises(UnsafeFileError, match="17,179,869,184 bytes, more than the 16,777,216"):
        safe_open.read_json(tmp_path, "distill.json")
    with pytest.raises(UnsafeFileError, match="more than"):
        safe_open.read_named(big, "the config file", safe_open.CAPS["config"])


def test_json_and_toml_nested_deeper_than_any_record_are_refused_not_recursed(tmp_path):
    for depth in (safe_open.MAX_DEPTH + 1, 100_000):
        with pytest.raises(UnsafeFileError, match="nests deeper than the 32 levels"):
            safe_open.parse_json("[" * depth + "]" * depth, "x.json")
        with pytest.raises(UnsafeFileError, match="nests deeper"):
            safe_open.parse_toml("a = " + "[" * depth + "]" * depth, "x.toml")
    assert safe_open.parse_json(json.dumps({"a": [[1]]}), "x.json") == {"a": [[1]]}
    assert safe_open.parse_json("null", "x.json") is None
    with pytest.raises(UnsafeFileError, match="not valid JSON"):
        safe_open.parse_json(b"\xff{", "x.json")


def test_walk_lists_regular_files_and_refuses_links_out_loops_and_fifos(tmp_path, victim):
    root = tmp_path / "teacher"
    (root / "vae").mkdir(parents=True)
    (root / "vae" / "config.json").write_text("{}")
    assert list(safe_open.walk(root, "fix")) == ["vae/config.json"]
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(UnsafeFileError, match="loop is a symbolic link"):
        list(safe_open.walk(root, "fix"))
    (root / "loop").unlink()
    os.mkfifo(root / "vae" / "weights.safetensors")
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        list(safe_open.walk(root, "fix"))


def test_a_hub_snapshot_may_link_into_its_own_blobs_only(tmp_path, victim):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "model_index.json").symlink_to("../../blobs/abc")
    assert list(safe_open.walk(snap, "fix", links_into=repo / "blobs")) == ["model_index.json"]
    (snap / "leak.json").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="leak.json is a symbolic link"):
        list(safe_open.walk(snap, "fix", links_into=repo / "blobs"))


def test_a_write_replaces_a_planted_link_instead_of_writing_through_it(tmp_path, victim):
    before = victim.read_bytes()
    (tmp_path / "eval.png").symlink_to(victim)
    (tmp_path / f"grid.png.{os.getpid()}.tmp").symlink_to(victim)  # the temporary name, planted in advance
    safe_write.write_file(tmp_path / "eval.png", b"png")
    safe_write.write_file(tmp_path / "grid.png", writer=lambda f: f.write(b"grid"))
    assert victim.read_bytes() == before
    assert not (tmp_path / "eval.png").is_symlink() and (tmp_path / "eval.png").read_bytes() == b"png"
    assert (tmp_path / "grid.png").read_bytes() == b"grid"
    linked = tmp_path / "frames"
    linked.symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        safe_write.write_file(linked / "clip.webp", b"x")
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        safe_write.ensure_folder(linked, "--out")
    assert sorted(p.name for p in victim.parent.iterdir()) == [".bashrc"]


def test_an_output_folder_is_replaced_only_when_it_holds_nothing_but_what_its_command_wrote(tmp_path, victim):
    out = tmp_path / "export"
    assert safe_write.claim_folder(out, "export", replace=False) is False  # missing: its parent made now
    with safe_write.building(out, "export") as tmp:
        (tmp / "transformer").mkdir()
        (tmp / "transformer" / "config.json").write_text("{}")
        (tmp / "vae").symlink_to(victim.parent, target_is_directory=True)  # an export's own link: listed, kept
    marker = json.loads((out / safe_write.MARKER).read_text())
    assert marker == {"written_by": "export", "entries": ["transformer/config.json", "vae"]}
    with pytest.raises(UnsafeFileError, match="holds an earlier export output; choose a new folder or add"):
        safe_write.claim_folder(out, "export", replace=False, hint=" or add --overwrite")
    with pytest.raises(UnsafeFileError, match="did not write"):  # another command's output is not export's
        safe_write.claim_folder(out, "tiny-teacher", replace=True)
    assert safe_write.claim_folder(out, "export", replace=True) is True
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with pytest.raises(UnsafeFileError, match=r"holds \.git/HEAD, which `wandistiller export` did not write"):
        safe_write.claim_folder(out, "export", replace=True)
    foreign = tmp_path / "someone"
    foreign.mkdir()
    (foreign / "lora.json").write_text(json.dumps({"_wandistiller": {}}))  # a key any JSON may hold: not ownership
    with pytest.raises(UnsafeFileError, match="did not write"):
        safe_write.claim_folder(foreign, "export", replace=True)
    os.mkfifo(tmp_path / "fifo-out")
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        safe_write.claim_folder(tmp_path / "fifo-out", "export", replace=True)
    assert victim.read_text().startswith("export PATH")
