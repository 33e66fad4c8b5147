"""The design's figures, measured from the source: `python -m tests.design_figures` prints them, and
tests/test_design.py holds each to its bound.

- lines: `wc -l` of pipeline/ cache/ stages/ (*.py)
- record lookups: subscripts and `.get(...)` keyed by a record's field name, on something named as a record
  (manifest, header, distill, progress, ...), outside the modules that define the records
- name comparisons: a registry entry's name (a placement, objective, strategy or student kind) compared with `==`,
  `!=` or `in` to something that holds a chosen component, or a table keyed by entries' names, outside
  pipeline/registries.py
- student-kind branches: an `if` (or conditional expression) that asks whether the student is a LoRA one, outside
  the student-kind modules
- repeated file names: basenames (other than `__init__.py`) used more than once
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "cache", "stages")
# The modules that define the records: the only ones that read a record's JSON keys.
RECORD_MODULES = {"cache/format.py", "cache/records.py", "cache/part_progress.py", "cache/schema.py",
                  "pipeline/artifact.py"}
# The student-kind modules: the only ones that know compact from LoRA.
# (stages/students/: the kinds; pipeline/lora_experts.py: the LoRA student as one model; export_lora.py: its export)
STUDENT_KIND_MODULES = {"stages/students/student_kind.py", "stages/students/compact.py", "stages/students/lora.py",
                        "pipeline/lora_experts.py", "stages/sample/export_lora.py"}
REGISTRY_MODULE = "pipeline/registries.py"
COMPONENT_WORDS = ("placement", "objective", "strategy", "name", "kind")
STUDENT_KIND_WORDS = ("lora", "_frozen")
TEACHER_LORA = re.compile(r"teacher_lora\w*")  # the LoRAs fused into the teacher (stage one's), not the student kind


def sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def lines(src: dict[str, str]) -> int:
    return sum(t.count("\n") for t in src.values())


def _field_names() -> set[str]:
    sys.path.insert(0, str(ROOT))
    from dataclasses import fields

    from cache import records  # the cache's JSON records, one field per key

    return {f.name for r in (records.Manifest, records.ShardRecord, records.PartEntry) for f in fields(r)}


def _is_field_key(node: ast.AST, fields: set[str]) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr[:2] in ("F_", "S_")
    if isinstance(node, ast.Name):
        return node.id[:2] in ("F_", "S_")
    return isinstance(node, ast.Constant) and node.value in fields


# What a record read as a raw dict is called where it is read (a plan's result, a diffusers config or a safetensors
# header keyed by the same words is no record).
_RECORD_NAMES = re.compile(r"manifest|header|distill|record|progress|\bprog\b|\bm\b|saved")


def _a_record(node: ast.AST) -> bool:
    return bool(_RECORD_NAMES.search(ast.unparse(node).lower()))


def record_lookups(src: dict[str, str]) -> dict[str, int]:
    fields, found = _field_names(), Counter()
    for rel, text in src.items():
        if rel in RECORD_MODULES:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Subscript) and _is_field_key(node.slice, fields) and _a_record(node.value):
                found[rel] += 1
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and _is_field_key(node.args[0], fields) and _a_record(node.func.value)):
                found[rel] += 1
    return dict(found)


def _entry_names() -> set[str]:
    sys.path.insert(0, str(ROOT))
    from pipeline import registries

    return {e.name for r in (registries.PLACEMENTS, registries.OBJECTIVES, registries.STRATEGIES,
                              registries.STUDENTS) for e in r.entries()}


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def name_comparisons(src: dict[str, str]) -> dict[str, int]:
    names, found = _entry_names(), Counter()
    for rel, text in src.items():
        if rel == REGISTRY_MODULE:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Dict):  # a table keyed by entries' names: {"cuda": ..., "offload": ...}
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if len(keys & names) >= 2:
                    found[rel] += 1
                continue
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            said = " ".join(ast.unparse(s).lower() for s in sides if not _strings(s))
            if any(_strings(s) & names for s in sides) and any(w in said for w in COMPONENT_WORDS):
                found[rel] += 1
    return dict(found)


def student_kind_branches(src: dict[str, str]) -> dict[str, int]:
    found = Counter()
    for rel, text in src.items():
        if rel in STUDENT_KIND_MODULES or rel == "pipeline/teacher_lora.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                test = TEACHER_LORA.sub("", ast.unparse(node.test).lower())
                if any(w in test for w in STUDENT_KIND_WORDS):
                    found[rel] += 1
    return dict(found)


def repeated_file_names(src: dict[str, str]) -> list[str]:
    names = Counter(Path(rel).name for rel in src if Path(rel).name != "__init__.py")
    return sorted(n for n, c in names.items() if c > 1)


def readme_lines() -> int:
    return (ROOT / "README.md").read_text().count("\n")


def figures() -> dict:
    src = sources()
    return {"lines": lines(src), "record lookups": record_lookups(src), "name comparisons": name_comparisons(src),
            "student-kind branches": student_kind_branches(src), "repeated file names": repeated_file_names(src),
            "README lines": readme_lines()}


def main() -> None:
    for name, value in figures().items():
        if isinstance(value, dict):
            where = ", ".join(f"{k} {v}" for k, v in sorted(value.items(), key=lambda kv: -kv[1]))
            print(f"{name:24s} {sum(value.values()):6d}  {where}")
        elif isinstance(value, list):
            print(f"{name:24s} {len(value):6d}  {' '.join(value)}")
        else:
            print(f"{name:24s} {value:6d}")


if __name__ == "__main__":
    main()
