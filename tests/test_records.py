"""The typed JSON records (cache/records.py, pipeline/artifact.py DistillRecord): each round-trips, refuses an
unknown or mistyped key in one line, and a manifest stage one wrote reads back and rewrites to the same bytes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cache import format as F
from cache.atomic import atomic_write_json
from cache.manifest import load_manifest
from cache.part_progress import PartProgress
from cache.records import CacheHeader, Manifest, PartEntry, ShardRecord
from conftest import sample_distill, sample_header
from pipeline.artifact import DistillRecord, LoraRecord

SHARD = ShardRecord(path="shards/part-00000-000000.tar", part=0, samples=4, bytes=100, crc32c=7, blocks=[0, 1])
LORA = LoraRecord(teacher="wan", revision=None, experts=["transformer", "transformer_2"], trained=["transformer"],
                  files={"transformer": "high_noise_model.safetensors"}, boundary_ratio=0.875, boundary_timestep=875.0,
                  rank=4, alpha=4.0, targets=["to_q", "to_k"])


def _records():
    header = sample_header(record_steps=2, recorded_steps=[0, 2], record_seed=0, keep_steps=[])
    manifest = Manifest(**vars(header), format_version=F.FORMAT_VERSION, fingerprint=header.settings_fingerprint(),
                        sample_fields=["x_t", "target"], num_parts=1, samples=4, bytes=100,
                        parts=[PartEntry(part=0, prompts=2, blocks=1)], shards=[SHARD], created="2026-01-01T00:00:00Z",
                        negative_sha256="0" * 64)
    return [SHARD, header, sample_header(), manifest, sample_distill(), LORA, sample_distill(lora=LORA)]


@pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
def test_each_record_round_trips_through_its_json(record):
    text = json.dumps(record.to_json())
    assert type(record).from_json(json.loads(text)) == record
    assert json.dumps(type(record).from_json(json.loads(text)).to_json()) == text


def test_optional_settings_are_written_only_when_set():
    assert "record_features" not in sample_header().to_json() and "recorded_steps" not in sample_header().to_json()
    keys = list(sample_header(record_steps=2, recorded_steps=[0, 2], record_seed=0, keep_steps=[]).to_json())
    assert keys[-5:] == ["recorded_steps", "record_steps", "record_seed", "keep_steps", "teacher_identity"]


@pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
def test_an_unknown_key_is_refused_in_one_line(record):
    with pytest.raises(ValueError, match="unknown field 'evil'") as e:
        type(record).from_json(record.to_json() | {"evil": 1})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind,key,value,needle", [
    (CacheHeader, "steps", "4", "'steps' is '4', expected a whole number in 1..1000"),
    (CacheHeader, "guidance", None, "'guidance' is None, expected a number"),
    (CacheHeader, "teacher_identity", [], "'teacher_identity' is [], expected an object"),
    (ShardRecord, "crc32c", 2**40, "'crc32c' is 1099511627776, expected a whole number in 0..4294967295"),
    (DistillRecord, "cfg", "yes", "'cfg' is 'yes', expected true or false"),
    (LoraRecord, "rank", 4.5, "'rank' is 4.5, expected a whole number"),
])
def test_a_wrong_type_is_refused_in_one_line(kind, key, value, needle):
    good = next(r for r in _records() if type(r) is kind).to_json()
    with pytest.raises(ValueError, match="lacks the field") as missing:
        kind.from_json({k: v for k, v in good.items() if k != key})
    with pytest.raises(ValueError) as e:
        kind.from_json(good | {key: value})
    assert needle in str(e.value) and "\n" not in str(e.value) + str(missing.value)


def test_the_fingerprint_leaves_out_where_the_teacher_was_found():
    header = sample_header()
    moved = dataclasses.replace(header, teacher="elsewhere", teacher_path="/moved", revision="abc")
    assert moved.settings_fingerprint() == header.settings_fingerprint()
    assert dataclasses.replace(header, guidance=5.0).settings_fingerprint() != header.settings_fingerprint()


def test_a_manifest_stage_one_wrote_reads_back_and_rewrites_byte_identical(tiny_cache, tmp_path):
    raw = (tiny_cache / F.MANIFEST).read_bytes()
    m = load_manifest(tiny_cache)
    atomic_write_json(tmp_path / F.MANIFEST, m.to_json())
    assert (tmp_path / F.MANIFEST).read_bytes() == raw
    assert m.fingerprint == m.settings_fingerprint() == m.header().settings_fingerprint()
    prog = PartProgress.load(tiny_cache, 0)
    assert prog.header == m.header() and prog.shards == m.shards
    prog.save(tmp_path)
    assert PartProgress.path(tmp_path, 0).read_bytes() == PartProgress.path(tiny_cache, 0).read_bytes()


def test_a_distill_record_refuses_a_mistyped_lora_entry_in_one_line():
    good = sample_distill(lora=LORA).to_json()
    assert list(good["lora"]) == [f.name for f in dataclasses.fields(LoraRecord)]
    with pytest.raises(ValueError, match="its lora: its field 'files' is 1, expected an object") as e:
        DistillRecord.from_json(good | {"lora": good["lora"] | {"files": 1}})
    assert "\n" not in str(e.value)
