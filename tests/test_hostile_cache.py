"""A cache handed over by someone else is read as untrusted (issue 41, the cache readers: D4, D5, D6, D10, D14, D15):
every refusal is one line, exit 2, and nothing outside the cache is opened, nothing hangs, nothing is allocated by
the terabyte."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from cache import format as F
from cache.checksum import crc32c
from cache.cache_error import CacheError, UnsafeFileError
from cache.manifest import load_manifest
from cache.part_progress import PartProgress
from cache.reader import ShardError, open_caches, open_index, scan_shard
from cache.safe_open import open_fd
from pipeline.cli import main
from test_verify import _verify, cache_copy  # noqa: F401  (cache_copy: a fixture, a copy of tiny_cache)

PROGRESS = f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROGRESS}"
STORE = f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROMPTS_ZARR}"


def _edit(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _one_line(r, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.exit_code, r.output)
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def _info(cache):
    return CliRunner().invoke(main, ["cache", "info", str(cache)], catch_exceptions=False)


def _unfinished(cache: Path) -> Path:
    """The cache as a SIGKILLed stage one leaves it: no manifest, part 0 not complete."""
    (cache / F.MANIFEST).unlink()
    _edit(cache / PROGRESS, lambda d: d.update(complete=False))
    return cache


def test_a_tar_member_claiming_a_petabyte_is_refused_not_skipped_for_ever(cache_copy):
    """D4: tarfile's stream mode would skip 10^15 bytes a block at a time; the member's end lies past the shard's."""
    rec = load_manifest(cache_copy).shards[0]
    shard = cache_copy / rec.path
    data = bytearray(shard.read_bytes())
    data[124:136] = b"\x80" + (10**15).to_bytes(11, "big")  # GNU base-256 size, with a valid header checksum
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    shard.write_bytes(bytes(data))
    _edit(cache_copy / F.MANIFEST, lambda m: m["shards"][0].update({"crc32c": crc32c(bytes(data))}))
    for checksum in (True, False):
        with pytest.raises(ShardError, match=f"{shard.name}.*past the shard's"):
            scan_shard(cache_copy, dataclasses.replace(rec, crc32c=crc32c(bytes(data))), checksum=checksum)
    assert _verify(cache_copy).exit_code == 1


@pytest.mark.parametrize("rel", [F.MANIFEST, PROGRESS, f"{STORE}/{F.Z_SEQ_LENS}/zarr.json"])
def test_a_fifo_is_named_not_waited_on(cache_copy, rel):
    """D5: every file a reader opens goes through `safe_open` (O_NONBLOCK, then fstat): a FIFO is refused."""
    (cache_copy / rel).unlink()
    os.mkfifo(cache_copy / rel)
    for r in (_info(cache_copy), *([] if rel == PROGRESS else [_verify(cache_copy)])):  # (verify reads no record)
        _one_line(r, rel, "is a FIFO, not a regular file", "rerun the same `wandistiller teacher-cache` command")
    with pytest.raises(UnsafeFileError, match="FIFO"):
        open_caches([cache_copy]) if rel != PROGRESS else PartProgress.load(cache_copy, 0)


def test_a_billion_parts_are_refused_before_anything_is_counted(cache_copy):
    """D6: `cache info` would have built a set of 10^9 part numbers; the format names at most 10^5 parts."""
    _unfinished(cache_copy)
    _edit(cache_copy / PROGRESS, lambda d: d.update(num_parts=10**9))
    _one_line(_info(cache_copy), PROGRESS, "'num_parts' is 1000000000, expected a whole number in 1..100000",
              "--overwrite")
    _edit(cache_copy / PROGRESS, lambda d: d.update(num_parts=10**5, prompts=10**8, done_blocks=[0]))
    _one_line(_info(cache_copy), "'num_parts' is 100000, more parts than its")  # (its header's prompts)


@pytest.mark.parametrize("what,edit,needle", [
    ("shard bytes a string", lambda m: m["shards"][0].update({"bytes": "lots"}), "'bytes' is 'lots'"),
    ("samples missing", lambda m: m.pop("samples"), "lacks the field 'samples'"),
    ("prompts a string", lambda m: m.update({"prompts": "235"}), "'prompts' is '235'"),
    ("shards an object", lambda m: m.update({"shards": {}}), "'shards' is {}"),
    ("latent_shape negative", lambda m: m.update({"latent_shape": [16, -1, 8, 8]}), "'latent_shape'"),
    ("patch_size zero", lambda m: m.update({"patch_size": [1, 0, 2]}), "'patch_size'"),
    ("teacher_shape lacking a key", lambda m: m.update({"teacher_shape": {"num_layers": 2}}), "'teacher_shape'"),
    ("a shard of another name", lambda m: m["shards"][0].update({"path": "shards/x.tar"}),
     "not of the form shards/part-PPPPP-SSSSSS.tar"),
])
def test_malformed_manifest_fields_are_one_line(cache_copy, what, edit, needle):
    """D10: each field a reader computes with has its type and range checked when the manifest is read."""
    _edit(cache_copy / F.MANIFEST, edit)
    _one_line(_info(cache_copy), F.MANIFEST, needle, "rerun the same `wandistiller teacher-cache` command")
    with pytest.raises(CacheError, match=needle.replace("[", r"\[").replace("{", r"\{")):
        open_caches([cache_copy])


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(done_blocks=5), "'done_blocks' is 5"),
    (lambda d: d.update(done_blocks=[10**6]), "'done_blocks' lists blocks past"),
    (lambda d: d.pop("header"), "lacks the field 'header'"),
    (lambda d: d["header"].update({"seeds_per_prompt": 10**9}), "its header: its field 'seeds_per_prompt'"),
    (lambda d: d.update(evil=1), "unknown field 'evil'"),
])
def test_malformed_progress_fields_are_one_line(cache_copy, edit, needle):
    _unfinished(cache_copy)
    _edit(cache_copy / PROGRESS, edit)
    _one_line(_info(cache_copy), PROGRESS, needle, "--overwrite")
    with pytest.raises(CacheError, match=needle):
        PartProgress.load(cache_copy, 0)


@pytest.mark.parametrize("array,edit,needle", [
    (F.Z_FINAL_LATENTS, lambda d: d.update(shape=[d["shape"][0], 1, 16, 10**5, 10**5, 8]), "final_latents is"),
    (F.Z_EMBEDS, lambda d: d["attributes"].update({F.Z_ATTR_TORCH_DTYPE: "float64"}), "'float64' values"),
    (F.Z_SEQ_LENS, lambda d: d.update(data_type="int64"), "seq_lens is int64"),
])
def test_a_prompt_store_of_another_shape_or_dtype_is_refused_before_a_row_is_read(cache_copy, array, edit, needle):
    """D10 (eval): `open_caches`, which stage two and eval both open a cache with, compares every array's metadata
    with the manifest; `cache verify` names it and reads no row of it (a row would be terabytes)."""
    _edit(cache_copy / STORE / array / "zarr.json", edit)
    with pytest.raises(CacheError, match=needle):
        open_caches([cache_copy])
    r = _verify(cache_copy)
    assert r.exit_code == 1 and needle in r.output and "--overwrite" in r.output


@pytest.mark.parametrize("rel", ["shard", F.SHARDS_DIR, STORE, F.NEGATIVE])
def test_links_out_of_the_cache_are_refused_never_followed(cache_copy, tmp_path, rel):
    """D14: a shard, shards/, a prompt store, the negative prompt: links to copies outside the cache, which would read
    as sound. Each is named, whoever reads it."""
    if rel == "shard":
        rel = load_manifest(cache_copy).shards[0].path
    outside = tmp_path / "outside" / Path(rel).name
    outside.parent.mkdir()
    shutil.move(cache_copy / rel, outside)
    (cache_copy / rel).symlink_to(outside)
    line = _one_line(_verify(cache_copy), f"{cache_copy / rel} is a symbolic link (to {outside})",
                     "replace the link with a copy")
    with pytest.raises(CacheError, match=f"{rel} is a symbolic link"):  # (a shard's: ShardError, code SHARD_UNSAFE)
        index = open_index([cache_copy], checksum=True)
        from cache.manifest import negative_embeds
        negative_embeds(index.caches[0].path)
    assert "Traceback" not in line


def test_the_cache_folder_itself_may_be_a_link(cache_copy, tmp_path):
    """Only what lies below the cache folder must be its own: the folder the user names may be reached any way."""
    link = tmp_path / "linked"
    link.symlink_to(cache_copy)
    assert _verify(link).exit_code == 0
    assert len(open_index([link], checksum=True)) > 0


@pytest.mark.parametrize("path", ["/etc/hostname", "../outside.tar", "shards/part-00001-000000.tar",
                                  "parts/part-00000/progress.json"])
def test_a_progress_record_naming_a_file_outside_as_a_shard_is_refused(cache_copy, path):
    """D15: stage one read a progress record's shard paths as it found them (and said "cache complete" over
    /etc/hostname); the same check as the manifest's refuses one that is not a shard of that part."""
    _unfinished(cache_copy)
    _edit(cache_copy / PROGRESS, lambda d: d["shards"].append(
        {"path": path, "part": 0, "samples": 4, "bytes": 10, "crc32c": 0, "blocks": [0]}))
    _one_line(_info(cache_copy), PROGRESS, f"shard path {path!r}")


def test_open_fd_refuses_a_path_leaving_the_folder(tmp_path):
    (tmp_path / "a").write_text("x")
    for rel in ("/etc/hostname", "../a", "b/../../a"):
        with pytest.raises(UnsafeFileError, match="not a path inside"):
            open_fd(tmp_path, rel)
    with pytest.raises(FileNotFoundError):
        open_fd(tmp_path, "b/c")
    os.close(open_fd(tmp_path, "a"))
