"""Prompt files: `.txt` (one prompt a line; blank lines and `#` comments skipped) or `.jsonl`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .errors import UserError


def read_prompt_file(path: str | os.PathLike) -> list[str]:
    """All prompts of a file in order (duplicates kept); UserError with the line number on bad input."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompt file {p} does not exist; pass a .txt or .jsonl file to --prompts")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"prompt file {p} is not UTF-8 (line {line}, byte {e.start}); re-save it as UTF-8") from e
    prompts: list[str] = []
    jsonl = p.suffix.lower() == ".jsonl"
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or (not jsonl and s.startswith("#")):
            continue
        if jsonl:
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise UserError(f"prompt file {p} line {n}: not valid JSON ({e.msg}); "
                                'each line must be {"prompt": "..."}') from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise UserError(f'prompt file {p} line {n}: expected {{"prompt": "<non-empty text>"}}')
            s = obj["prompt"].strip()
        prompts.append(s)
    if not prompts:
        raise UserError(f"prompt file {p} holds no prompts (only blank or comment lines); add one prompt per line")
    return prompts


def dedupe(prompts: list[str]) -> tuple[list[str], int]:
    """Unique prompts in order of first appearance (that order is `prompt_idx`), and how many were dropped."""
    unique = list(dict.fromkeys(prompts))
    return unique, len(prompts) - len(unique)


def prompt_set_sha256(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()
