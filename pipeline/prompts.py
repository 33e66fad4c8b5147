"""Prompt files: `.txt` (one prompt a line; blank lines and `#` comments skipped) or `.jsonl`
(docs/usage.md). A control character or an over-long prompt is refused with its line, before anything tokenizes it."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
import re
from pathlib import Path

from cache import safe_open
from cache.cache_error import UnsafeFileError
from cache.safe_open import CAPS

from .errors import UserError

# A prompt's length in characters: any real caption many times over, even at config.MAX_SEQUENCE_LENGTH tokens (~4-5
# characters a token), and still a refusal of a megabyte pasted by mistake (a 10 MB line took 65 s and 6.45 GiB).
MAX_PROMPT_CHARS = 65_536
# A line's bytes, checked before it is decoded: a .jsonl line holds JSON escapes (up to 12 bytes a character).
MAX_LINE_BYTES = 1 << 20
# Unicode's control characters (Cc) but tab, vertical tab and form feed, which the tokenizer reads as a space.
_CONTROL = re.compile("[\x00-\x08\x0d-\x1f\x7f-\x9f]")
_CONTROL_NAMES = {"\x00": "NUL", "\r": "CARRIAGE RETURN", "\x1b": "ESCAPE", "\x7f": "DELETE", "\x85": "NEXT LINE"}
_FIX = "pass a .txt or .jsonl file to --prompts"
# Files that hold a table, not one prompt a line: their header and columns would become prompts.
_TABLES = {".csv": "a CSV table", ".tsv": "a TSV table", ".json": "a JSON document", ".parquet": "a Parquet table"}


def read_prompt_file(path: str | os.PathLike) -> list[str]:
    """All prompts of a file in order (duplicates kept); UserError with the line number on bad input."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in _TABLES and p.is_file():
        raise UserError(f"prompt file {p} is {_TABLES[suffix]} ({suffix}), which would be read as one prompt a line "
                        "(its header too); write the prompts to a .txt file, one a line, or a .jsonl file of "
                        '{"prompt": "..."} lines')
    jsonl = suffix == ".jsonl"
    prompts: list[str] = []
    for n, text in file_lines(p):
        s = text.strip()
        if not s or (not jsonl and s.startswith("#")):
            continue
        if jsonl:
            s = _json_prompt(p, n, s)
        check_prompt(p, n, s)
        prompts.append(s)
    if not prompts:
        raise UserError(f"prompt file {p} holds no prompts (only blank or comment lines); add one prompt per line")
    return prompts


def file_lines(p: Path, what: str = "prompt file", fix: str = _FIX):
    """(line number, line) of the file a user named, a prompt file or another of one entry a line (`what`): opened
    through safe_open (a FIFO or a folder is refused, never waited on), capped (CAPS["prompts"]), read by `_lines`."""
    try:
        fd = safe_open.open_named(p, what, fix)
    except FileNotFoundError:
        raise UserError(f"{what} {p} does not exist; {fix}") from None
    except UnsafeFileError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"{what} {p} cannot be read ({e.strerror or e}); {fix}") from e
    with os.fdopen(fd, "rb") as f:
        if (size := os.fstat(fd).st_size) > CAPS["prompts"]:
            raise UserError(f"{what} {p} is {size:,} bytes, more than the {CAPS['prompts']:,} a {what} may hold; "
                            f"split the prompts over several files, or check that it is the {what}")
        yield from _lines(p, f, what)


def _lines(p: Path, f, what: str):
    """(line number, decoded line without its ending) of `f`, a line at a time (one past MAX_LINE_BYTES is refused
    unread; a UTF-8 byte-order mark before line 1 is dropped). A line ends at `\\n` alone, as an editor numbers
    them: `str.splitlines` would also split at a form feed."""
    offset = 0
    for n in itertools.count(1):
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            raise UserError(f"{what} {p} line {n} is longer than {MAX_LINE_BYTES:,} bytes (a prompt holds at most "
                            f"{MAX_PROMPT_CHARS:,} characters); shorten that line, or check that the file is one "
                            "prompt a line")
        body = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
        bom = 3 if n == 1 and body.startswith(codecs.BOM_UTF8) else 0  # "UTF-8 with BOM": no part of prompt 1
        try:
            text = body[bom:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{what} {p} is not UTF-8 (line {n}, byte {offset + bom + e.start}); re-save it as "
                            "UTF-8") from e
        offset += len(raw)
        yield n, text


def _json_prompt(p: Path, n: int, line: str) -> str:
    where = f"prompt file {p} line {n}"
    try:
        # (nesting capped: 10^6 brackets are refused, not recursed into)
        obj = safe_open.parse_json(line, where, 'each line must be {"prompt": "..."}')
    except UnsafeFileError as e:  # not JSON, or nested too deep: said as this file's other lines are ("line N: ...")
        why = str(e).removeprefix(where).removeprefix(" is").strip()
        raise UserError(f"{where}: {why}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
        raise UserError(f'prompt file {p} line {n}: expected {{"prompt": "<non-empty text>"}}')
    return obj["prompt"].strip()


def check_prompt(p: Path, n: int, s: str, what: str = "prompt file") -> None:
    """A prompt is text of at most MAX_PROMPT_CHARS characters, without control characters (_CONTROL)."""
    if len(s) > MAX_PROMPT_CHARS:
        raise UserError(f"{what} {p} line {n}: the prompt is {len(s):,} characters long, more than the "
                        f"{MAX_PROMPT_CHARS:,} a prompt may hold; shorten it (the text encoder reads at most "
                        "--max-sequence-length tokens of it anyway)")
    bad = _CONTROL.search(s)
    if bad is not None:
        ch = bad.group()
        name = _CONTROL_NAMES.get(ch, "a control character")
        fix = ("save the file with \\n (or \\r\\n) line endings: a lone carriage return ends no line"
               if ch == "\r" else "remove it: a prompt is text")
        raise UserError(f"{what} {p} line {n} holds the control character U+{ord(ch):04X} ({name}); {fix}")


def dedupe(prompts: list[str]) -> tuple[list[str], int]:
    """Unique prompts in order of first appearance (that order is `prompt_idx`), and how many were dropped."""
    unique = list(dict.fromkeys(prompts))
    return unique, len(prompts) - len(unique)


def prompt_set_sha256(prompts: list[str]) -> str:
    """The prompt set's identity in the cache's fingerprint."""
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()
