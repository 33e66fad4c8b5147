"""A downloaded cache's prompt stores are read as untrusted: a zarr v2 store or a codec stage one never writes (a
pickle that would run its payload) is refused before a chunk is decoded, a chunk is never decoded past what its array
holds (a 30-byte chunk claiming 2^31 strings, a zstd frame of gigabytes, a 16 GiB sparse file), and a manifest claiming
10^8 prompts is refused before anything is allocated per prompt. Each refusal is one line, exit 2, no payload run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from numcodecs import zstd

from cache import format as F
from cache.cache_error import CacheError, UnsafeFileError
from cache.checksum import crc32c
from cache.prompt_store import PartRows, prompt_texts
from cache.reader import open_caches
from cache.records import Manifest
from cache.store_checks import count_problem
from pipeline.cli import main
from test_hostile_cache import _info, _one_line
from test_verify import _verify, cache_copy  # noqa: F401  (cache_copy: a fixture, a copy of tiny_cache)

ROOT = Path(__file__).resolve().parents[1]
STORE = f"{F.PARTS_DIR}/{F.part_dirname(0)}/{F.PROMPTS_ZARR}"
TEXT_CHUNK = f"{STORE}/{F.Z_TEXT}/c/0"
ROWS = 7  # the tiny cache's prompts, all in part 0, one chunk of `text`

pytestmark = pytest.mark.timeout(120)


class _Payload:
    """Unpickled, it runs `touch MARKER`: what a planted codec's chunk carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def unsafe(monkeypatch):
    """numcodecs as before 0.16.6 unpickled: what a reader must not rely on the installed numcodecs for."""
    monkeypatch.setattr(numcodecs.pickles, "ALLOW_UNSAFE_PICKLE_DECODE", True)


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    from stages.students.compact import build_student, load_student_config

    tiny = str(ROOT / "configs" / "student-tiny.json")
    out = tmp_path_factory.mktemp("student") / "student"
    build_student(load_student_config(tiny), tiny, 0).save_pretrained(out)
    return out


def _eval(cache: Path, student: Path):
    return CliRunner().invoke(main, ["eval", "--student", str(student), "--cache", str(cache), "--no-teacher-timing"],
                             catch_exceptions=False)


def _edit(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _v2_store(cache: Path, marker: Path) -> None:
    """Part 0's store rewritten as zarr v2, every array as it was but `text`: strings whose one chunk decodes through
    a pickle compressor, the payload inside."""
    store = cache / STORE
    old = zarr.open_group(str(store), mode="r")
    arrays = {f"{g}{n}": a for g, grp in (("", old), (f"{F.Z_ROW_CRC32C}/", old[F.Z_ROW_CRC32C]))
              for n, a in grp.arrays()}
    held = {name: (a[...], dict(a.attrs)) for name, a in arrays.items() if name != F.Z_TEXT}
    shutil.rmtree(store)
    g = zarr.open_group(str(store), mode="w", zarr_format=2)
    for name, (data, attrs) in held.items():
        g.create_array(name, data=np.asarray(data), chunks=data.shape).attrs.update(attrs)
    (store / F.Z_TEXT).mkdir()
    (store / F.Z_TEXT / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [ROWS], "chunks": [ROWS], "dtype": "|O", "fill_value": None, "order": "C",
        "filters": [{"id": "vlen-utf8"}], "compressor": {"id": "pickle", "protocol": 5}}))
    (store / F.Z_TEXT / "0").write_bytes(pickle.dumps(_Payload(marker)))


def _assert_no_payload(r, marker: Path, *needles: str) -> str:
    line = _one_line(r, *needles)
    assert "unsafe" not in r.output.lower() and "ALLOW_UNSAFE" not in r.output, r.output
    assert not marker.exists(), "the payload ran"
    return line


def test_a_zarr_v2_store_with_a_pickle_codec_is_refused_before_a_chunk_is_decoded(cache_copy, student, tmp_path,
                                                                                   unsafe):
    marker = tmp_path / "MARKER"
    _v2_store(cache_copy, marker)
    with pytest.raises(Exception):  # the store is live: plain zarr, given it, runs the payload
        zarr.open_group(str(cache_copy / STORE), mode="r")[F.Z_TEXT][:]
    assert marker.exists()
    marker.unlink()
    _assert_no_payload(_verify(cache_copy), marker, F.PROMPTS_ZARR, "zarr format 2", "--overwrite")
    _assert_no_payload(_eval(cache_copy, student), marker, F.PROMPTS_ZARR, "zarr format 2")
    for read in (lambda: prompt_texts(cache_copy, 1), lambda: open_caches([cache_copy]),
                 lambda: PartRows(cache_copy, 0, 1).seq_lens):
        with pytest.raises(UnsafeFileError, match="zarr format 2"):
            read()
    assert not marker.exists()


@pytest.mark.parametrize("array,edit,needle", [
    (F.Z_TEXT, lambda d: d.update(codecs=[{"name": "numcodecs.pickle", "configuration": {"protocol": 5}}]),
     "codecs numcodecs.pickle"),
    (F.Z_TEXT, lambda d: d["codecs"].insert(1, {"name": "numcodecs.pickle"}), "codecs vlen-utf8, numcodecs.pickle"),
    (F.Z_TEXT, lambda d: d.update(data_type="variable_length_bytes",
                                  codecs=[{"name": "vlen-bytes"}, *d["codecs"][1:]]), "'variable_length_bytes'"),
    (F.Z_SEQ_LENS, lambda d: d.update(data_type="string"), "'string'"),
    (F.Z_EMBEDS, lambda d: d["codecs"][0]["configuration"]["codecs"].insert(0, {"name": "transpose",
                                                                                 "configuration": {"order": [1, 0]}}),
     "sharding_indexed of transpose, bytes, crc32c"),
])
def test_a_codec_or_data_type_stage_one_never_writes_is_refused_naming_the_array(cache_copy, student, tmp_path,
                                                                                   unsafe, array, edit, needle):
    """A v3 store whose array declares another codec chain or data type: refused from its zarr.json, whatever the codec
    (a pickle, or harmless ones stage one does not write), before any chunk of it is read."""
    marker = tmp_path / "MARKER"
    _edit(cache_copy / STORE / array / "zarr.json", edit)
    if array == F.Z_TEXT:
        (cache_copy / TEXT_CHUNK).write_bytes(pickle.dumps(_Payload(marker)))
    line = _assert_no_payload(_verify(cache_copy), marker, f"its {array} array declares", needle, "where stage one "
                              "writes", "--overwrite")
    assert "Traceback" not in line
    _assert_no_payload(_eval(cache_copy, student), marker, f"its {array} array declares", needle)
    _assert_no_payload(_info(cache_copy), marker, f"its {array} array declares")


def test_consolidated_metadata_is_refused_not_used(cache_copy):
    """zarr would read the children's metadata from the root's zarr.json instead of theirs: refused whole."""
    _edit(cache_copy / STORE / "zarr.json", lambda d: d.update(consolidated_metadata={
        "kind": "inline", "must_understand": False, "metadata": {}}))
    _one_line(_verify(cache_copy), "consolidated metadata")


def _frame(values: bytes) -> bytes:
    """A chunk of a zstd-packed array as zarr writes it: the zstd frame of its bytes, then their crc32c (uint32, little
    endian, `zarr.codecs.Crc32cCodec`): sound to every check but this reader's."""
    body = zstd.compress(values, 0)
    return body + crc32c(body).to_bytes(4, "little")


def _lying_text_chunk(kind: str) -> bytes:
    """A `text` chunk, its crc32c valid: a vlen-utf8 buffer claiming 2^31 strings (one of 3 bytes given) packed as
    zarr packs it ("count"), the same 30 bytes not packed at all ("raw"), or a frame whose header says 8 GiB
    ("size")."""
    claim = (2**31).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    if kind == "count":
        return _frame(claim)
    if kind == "raw":
        return claim + bytes(15) + crc32c(claim + bytes(15)).to_bytes(4, "little")  # 30 bytes
    frame = zstd.compress(ROWS.to_bytes(4, "little") + bytes(4 * ROWS), 0)
    assert frame[4] & 0x23 == 0x20  # (single segment, no dictionary: the content size follows the descriptor)
    fcs = (1, 2, 4, 8)[frame[4] >> 6]
    frame = frame[:4] + bytes([frame[4] | 0xC0]) + (8 << 30).to_bytes(8, "little") + frame[5 + fcs:]
    return frame + crc32c(frame).to_bytes(4, "little")


@pytest.mark.parametrize("kind,needle", [("count", "claims 2,147,483,648 strings, where a chunk of its array holds 7"),
                                         ("raw", "does not decode"), ("size", "does not decode")])
def test_a_text_chunk_claiming_more_strings_than_it_holds_is_refused_before_it_is_decoded(cache_copy, kind, needle):
    (cache_copy / TEXT_CHUNK).write_bytes(_lying_text_chunk(kind))
    start = time.monotonic()
    _one_line(_verify(cache_copy), f"{F.Z_TEXT}/c/0", needle, "nothing of it was decoded", "--overwrite")
    with pytest.raises(UnsafeFileError, match=needle):
        prompt_texts(cache_copy, 1)
    assert time.monotonic() - start < 30


def test_a_text_chunk_failing_its_crc32c_is_damage_listed_not_refused(cache_copy):
    """Bit rot is not an attack: a chunk whose crc32c fails is left to zarr's check, and verify lists it (exit 1)."""
    data = bytearray((cache_copy / TEXT_CHUNK).read_bytes())
    data[-1] ^= 1
    (cache_copy / TEXT_CHUNK).write_bytes(bytes(data))
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "fail their crc32c" in r.output, r.output


def test_a_zstd_bomb_or_a_sparse_chunk_file_is_refused_not_read(cache_copy):
    """seq_lens' chunk (7 values) replaced by a valid frame of 16 MiB of zeros (a few hundred bytes on disk, within
    what a file of it may hold), then by a 16 GiB sparse file."""
    chunk = cache_copy / STORE / F.Z_SEQ_LENS / "c" / "0"
    chunk.write_bytes(_frame(bytes(16 << 20)))
    assert chunk.stat().st_size < 1024
    _one_line(_verify(cache_copy), f"{F.Z_SEQ_LENS}/c/0 does not decode to the {ROWS} values")
    os.truncate(chunk, 16 << 30)
    start = time.monotonic()
    _one_line(_verify(cache_copy), f"{F.Z_SEQ_LENS}/c/0 is 17,179,869,184 bytes, more than the")
    assert time.monotonic() - start < 30


def _rerecord(cache: Path, edit) -> None:
    """The manifest edited and its fingerprint made to agree, as a tool that knows the format would."""
    m = json.loads((cache / F.MANIFEST).read_text())
    edit(m)
    m["fingerprint"] = Manifest.from_json(m).settings_fingerprint()
    (cache / F.MANIFEST).write_text(json.dumps(m))


def _claim(cache: Path, prompts: int, stores_too: bool) -> None:
    """The manifest claims `prompts`; with `stores_too` the store's arrays (metadata only) and a shard record's
    samples and bytes claim them as well, so that only the shards' sizes on disk disagree."""
    def edit(m):
        m["prompts"] = prompts
        if stores_too:
            extra = prompts * m["seeds_per_prompt"] * m["steps"] - m["samples"]
            m["shards"][0].update(samples=m["shards"][0]["samples"] + extra, bytes=10**15)
            m["samples"] += extra
    _rerecord(cache, edit)
    if stores_too:
        for p in (cache / STORE).rglob("zarr.json"):
            d = json.loads(p.read_text())
            if d.get("node_type") == "array":
                rows = prompts * (d["shape"][0] // ROWS)  # (embeds: rows x the padded length)
                d["shape"][0] = rows
                p.write_text(json.dumps(d))


def _in_bounded_memory(argv: list[str], extra: int = 2 << 30) -> subprocess.CompletedProcess:
    """The CLI in a child whose address space may grow `extra` bytes past what its imports took (`RLIMIT_AS`)."""
    code = ("import resource, sys\nfrom pipeline.cli import main\n"
            "vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (vm + {extra}, resource.RLIM_INFINITY))\n"
            f"main({argv!r})\n")
    env = os.environ | {"MALLOC_ARENA_MAX": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


@pytest.mark.parametrize("stores_too", [False, True])
def test_a_manifest_claiming_10_8_prompts_is_refused_before_anything_is_allocated_per_prompt(cache_copy, student,
                                                                                           stores_too):
    _claim(cache_copy, 10**8, stores_too)
    needles = (F.MANIFEST, "100,000,000 prompts", "more than the", "bytes of its shards on disk could hold")
    for argv in (["cache", "info", str(cache_copy)], ["cache", "verify", str(cache_copy)]):
        start = time.monotonic()
        r = _in_bounded_memory(argv)
        said = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(said) == 1 and all(n in said[0] for n in needles), (argv, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and time.monotonic() - start < 60
    _one_line(_eval(cache_copy, student), *needles)
    with pytest.raises(CacheError, match="100,000,000 prompts"):
        open_caches([cache_copy])


def test_the_count_bound_passes_sound_and_merely_incomplete_caches(cache_copy):
    """A sound cache, or one whose manifest lost a shard record (verify lists it, exit 1, as before), is in bounds."""
    assert count_problem(cache_copy, open_caches([cache_copy])[0].manifest) is None

    def drop(m):
        m["shards"] = m["shards"][1:]
        m["samples"] = sum(s["samples"] for s in m["shards"])
    _rerecord(cache_copy, drop)
    r = _verify(cache_copy)
    assert r.exit_code == 1 and "the cache is incomplete" in r.output, r.output
