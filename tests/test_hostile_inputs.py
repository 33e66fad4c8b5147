"""Inputs, plan and dry run under careless or hostile input (issue 41: D9, D16, D18, D19 and the user's road): each
ends in exit 2 and one `error:` line naming the line, value or flag and the fix, through the real CLI; where the
answer is to go on, the figures it prints are right."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import ROOT, TINY_CACHE_ARGS
from pipeline.cli import main
from pipeline.config import MAX_SEQUENCE_LENGTH
from pipeline.errors import UserError
from pipeline.prompts import MAX_PROMPT_CHARS, read_prompt_file

TINY_TOML = ROOT / "configs" / "tiny-teacher-cache.toml"
TINY_STUDENT = ROOT / "configs" / "student-tiny.json"


def _cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv], catch_exceptions=False)


def one_line(r, *needles: str, forbid: tuple[str, ...] = ()) -> str:
    """Exit 2, exactly one `error:` line holding every needle (and none of `forbid`), no traceback."""
    text = r.stdout + r.stderr
    said = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(said) == 1 and "Traceback" not in text, text[-2000:]
    assert all(n in said[0] for n in needles), (needles, said[0])
    assert not any(f in said[0] for f in forbid), (forbid, said[0])
    return said[0]


def _stage_one(teacher, prompts, out, *extra):
    return _cli("teacher-cache", "--teacher", teacher, "--prompts", prompts, "--out", out, "--placement", "cpu",
                *[f"--{k.replace('_', '-')}={v}" for k, v in TINY_CACHE_ARGS.items()], *extra)


def _file(tmp_path: Path, name: str, data: bytes | str) -> Path:
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


# --- D9: a prompt of megabytes, a padding length of 10^8 ---------------------------------------------------------

def test_a_10_mb_line_is_refused_before_it_is_read_whole(tiny_teacher, tmp_path):
    huge = _file(tmp_path, "huge.txt", "a red circle\n" + "a" * 10_000_000 + "\n")
    one_line(_stage_one(tiny_teacher, huge, tmp_path / "c"), "line 2", "1,048,576 bytes", f"{MAX_PROMPT_CHARS:,}")
    assert not (tmp_path / "c").exists()


def test_a_prompt_past_the_character_cap(tmp_path):
    ok = _file(tmp_path, "ok.txt", "b" * MAX_PROMPT_CHARS + "\n")
    assert read_prompt_file(ok) == ["b" * MAX_PROMPT_CHARS]
    long = _file(tmp_path, "long.jsonl", json.dumps({"prompt": "b" * (MAX_PROMPT_CHARS + 1)}) + "\n")
    with pytest.raises(UserError, match="line 1: the prompt is 65,537 characters long, more than the 65,536"):
        read_prompt_file(long)


def test_max_sequence_length_is_capped(tiny_teacher, prompts_file, tmp_path):
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--max-sequence-length", "100000000"),
             "max-sequence-length must be an integer from 1 to 4,096", "got 100000000")
    assert MAX_SEQUENCE_LENGTH == 4096
    r = _cli("plan", "--teacher", tiny_teacher, "--max-sequence-length", "4097")  # plan: the same declaration
    one_line(r, "max-sequence-length must be an integer from 1 to 4,096")


# --- D16: lines as an editor numbers them; control characters refused --------------------------------------------

@pytest.mark.parametrize("name,data,line", [
    ("u2028.txt", "a red circle\u2028on blue\n\x00\n", 2),
    ("formfeed.txt", "a red\fcircle\n\x00\n", 2),
    ("crlf.txt", "one\r\ntwo\r\n\x00\r\n", 3),
    ("nel.txt", "one\x85two\n", 1),
    ("lone-cr.txt", "one\rtwo\n", 1),
    ("escape.jsonl", '{"prompt": "ok"}\n{"prompt": "a \\u001b[31m red"}\n', 2),
])
def test_control_characters_are_refused_at_the_editors_line(tmp_path, name, data, line):
    with pytest.raises(UserError, match=rf"line {line} holds the control character U\+00"):
        read_prompt_file(_file(tmp_path, name, data))


def test_whitespace_and_line_separators_stay_inside_one_prompt(tmp_path):
    p = _file(tmp_path, "p.txt", "a red\fcircle\r\n  a blue\tsquare\u2028on white  \n# note\n")
    assert read_prompt_file(p) == ["a red\fcircle", "a blue\tsquare\u2028on white"]


def test_nul_line_through_the_cli(tiny_teacher, tmp_path):
    p = _file(tmp_path, "nul.txt", "a red circle\u2028on blue\n\x00\n")
    one_line(_stage_one(tiny_teacher, p, tmp_path / "c"), f"prompt file {p} line 2", "U+0000 (NUL)")


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".json"])
def test_a_table_is_not_a_prompt_file(tiny_teacher, tmp_path, suffix):
    p = _file(tmp_path, f"prompts{suffix}", "prompt,seed\na red circle,1\n")
    one_line(_stage_one(tiny_teacher, p, tmp_path / "c"), suffix, ".txt file, one a line", ".jsonl")


# --- D18: DataLoader workers at most one per core ----------------------------------------------------------------

def test_num_workers_beyond_the_cores(tmp_path):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # as config counts
    argv = ["train-student", "--cache", tmp_path / "none", "--student-config", TINY_STUDENT, "--out", tmp_path / "r"]
    one_line(_cli(*argv, "--num-workers", "500"), "num-workers 500", f"the {cores} CPU core(s)", f"at most {cores}")
    one_line(_cli(*argv, "--num-workers", cores), "cache")  # the cap itself passes: the missing cache is refused


# --- D19 and the Hub: the dry run checks what the run checks --------------------------------------------------

def test_dry_run_reads_the_device_map_as_the_run_does(tiny_teacher, prompts_file, tmp_path):
    bad = _file(tmp_path, "map.json", "{transformer: cuda}")
    for extra in ((), ("--dry-run",)):
        one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--placement", bad, *extra),
                 f"device map {bad} is not valid JSON")
    typo = _file(tmp_path, "typo.json", json.dumps({"blocks": "cpu", "bogus": "cpu"}))
    one_line(_stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--placement", typo, "--dry-run"),
             "unknown module(s) 'bogus'")
    fine = _file(tmp_path, "fine.json", json.dumps({"": "cpu"}))
    r = _stage_one(tiny_teacher, prompts_file, tmp_path / "c", "--placement", fine, "--dry-run")
    assert r.exit_code == 0 and f"placement  {fine} (a device map of 1 entries, computing on cpu" in r.output, r.output
    assert not (tmp_path / "c").exists()


def test_dry_run_of_a_hub_id_resolves_it(tiny_teacher, prompts_file, tmp_path, monkeypatch):
    from hub_cache import add_snapshot, use_hub_here

    home = tmp_path / "hf"
    add_snapshot(home, "wandistiller-test/tiny-wan", tiny_teacher, "a" * 40)
    use_hub_here(monkeypatch, home)
    r = _stage_one("no-such-org/no-such-model", prompts_file, tmp_path / "c", "--dry-run")
    one_line(r, "--teacher no-such-org/no-such-model is not in the local Hub cache", "HF_HUB_OFFLINE is set",
             "`hf download no-such-org/no-such-model`", forbid=("--include",))
    r = _stage_one("wandistiller-test/tiny-wan", prompts_file, tmp_path / "c", "--dry-run")
    assert r.exit_code == 0, r.output
    # offline, the dry run checks the snapshot the run will read (its weight files too: nothing can be fetched)
    assert "configs checked" in r.output and "latent 16x1x8x8" in r.output
    one_line(_stage_one("wandistiller-test/tiny-wan", prompts_file, tmp_path / "c", "--dry-run", "--frames", "3"),
             "--frames 3 must be 1 or 4k+1")


# --- plan: sizes with units, the run's checks, the command with its --config --------------------------------------

@pytest.mark.parametrize("flag,value,needles", [
    ("--gpu-memory", "80", ("--gpu-memory '80' has no unit", "80GiB", "80GB")),
    ("--assume-ram", "256", ("--assume-ram '256' has no unit", "256GiB")),
    ("--assume-gpus", "4x24", ("--assume-gpus '4x24'", "has no unit", "24GiB")),
    ("--frames", "80", ("--frames 80 must be 1 or 4k+1",)),
    ("--steps", "0", ("steps must be an integer >= 1",)),
])
def test_plan_refuses_what_teacher_cache_refuses(tiny_teacher, flag, value, needles):
    one_line(_cli("plan", "--teacher", tiny_teacher, "--height", "64", "--width", "64", flag, value), *needles)


def test_plan_prints_the_command_with_its_config(tiny_teacher):
    r = _cli("plan", "--config", TINY_TOML, "--teacher", tiny_teacher, "--assume-gpus", "none", "--batch-size", "2",
             "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    argv = p["launch"]["commands"][0]["argv"]
    assert argv[argv.index("--config") + 1] == str(TINY_TOML) and argv[argv.index("--batch-size") + 1] == "2"
    assert p["height"] == 64 and p["cache"]["max_sequence_length"] == 64 and p["cache"]["steps"] == 8  # the file's
    r = _cli("plan", "--teacher", tiny_teacher, "--assume-gpus", "none", "--height", "64", "--width", "64",
             "--batch-size", "4", "--json")
    argv = json.loads(r.output)["launch"]["commands"][0]["argv"]
    assert "--config" not in argv and "--batch-size" not in argv and argv[argv.index("--height") + 1] == "64"


# --- where a refused value came from -------------------------------------------------------------------------

def test_part_out_of_range_names_where_it_came_from(tiny_teacher, prompts_file, tmp_path):
    args = ("teacher-cache", "--teacher", tiny_teacher, "--prompts", prompts_file, "--out", tmp_path / "c",
            "--placement", "cpu")
    one_line(_cli(*args, "--config", TINY_TOML, "--part", "32", "--num-parts", "32"), "--part 32", "--num-parts 32",
             "parts are numbered 0 to 31", "(given on the command line)", forbid=(".toml",))
    toml = _file(tmp_path, "parts.toml", "[teacher_cache]\npart = 3\nnum-parts = 2\n")
    one_line(_cli(*args, "--config", toml), f"(config file {toml})")
    one_line(_cli(*args, "--config", toml, "--part", "5"),
             f"(num-parts from config file {toml}, part from the command line)")


# --- stage one's progress: the bytes on the bar's last line ------------------------------------------------------

def test_a_one_shard_part_ends_its_bar_on_the_bytes_written():
    from cache.records import ShardRecord
    from pipeline.progress_bar import progress_bar
    from stages.teacher_cache.blocks import StageOneProgress

    log = io.StringIO()  # a log file: one whole line per state
    bar = progress_bar(total=24, desc="teacher-cache part 0", unit="sample", file=log)
    progress = StageOneProgress(bar, part=0, steps=8, seeds=1, cache_samples=24, shards=[])
    progress.block(24)  # the part's one block, then its one shard closes
    progress.shard(ShardRecord(path="shards/part-00000-000000.tar", part=0, samples=24, bytes=256_000, crc32c=0,
                               blocks=[0]))
    bar.close()
    last = log.getvalue().splitlines()[-1]
    assert "24/24" in last and "written=250.0 KiB" in last and "cache=~250.0 KiB]" in last, last
    assert re.search(r"written=0 B", last) is None
