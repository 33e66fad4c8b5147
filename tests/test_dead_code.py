"""No dead definitions: every top-level function, class, method and constant of `pipeline/ cache/ stages/` is used by
the code itself, not only by tests (then it is a test helper living in the product) nor by nothing at all.

Read with `ast`, never by importing. A definition is used when its name is referenced anywhere else in the three
packages: as a name, an attribute, an imported name, or a string naming it (`getattr(x, "name")`, `__all__`, an
import path "pkg.module:Name"). Allowed by rule, not by list: dunder names; a method of a class that derives from a
library's class (it overrides the library's protocol: click's `invoke`, DCP's `load_bytes`); and a definition
whose decorator registers it (`@main.command`, `@register`, `@OBJECTIVES.settings`: the decorator is its use).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "cache", "stages")
# Decorators that only wrap a definition (they do not register or call it).
_WRAPPERS = {"property", "staticmethod", "classmethod", "cache", "lru_cache", "cached_property", "contextmanager",
             "dataclass", "wraps", "setter", "override", "abstractmethod"}
_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
_PATH_TAIL = re.compile(r"^[\w.]+[:.](\w+)$")


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(encoding="utf-8")) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _decorator_name(d: ast.expr) -> str:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")


def _registered(node) -> bool:
    return any(_decorator_name(d) not in _WRAPPERS for d in node.decorator_list)


def _definitions(trees: dict[Path, ast.Module], ours: set[str]):
    """(where, name, the node) of every top-level definition that no rule allows."""
    for path, tree in trees.items():
        where = path.relative_to(ROOT).as_posix()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not _registered(node):
                yield where, node.name, node
            if isinstance(node, ast.ClassDef):
                library_base = any(_decorator_name(b) not in ours for b in node.bases)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not library_base \
                            and not _registered(item):
                        yield where, f"{node.name}.{item.name}", item
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name) and _CONSTANT.match(t.id):
                        yield where, t.id, node


def _references(trees: dict[Path, ast.Module]) -> Counter:
    refs: Counter = Counter()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                refs[node.id] += 1
            elif isinstance(node, ast.Attribute):
                refs[node.attr] += 1
            elif isinstance(node, ast.alias):
                refs[node.name.split(".")[-1]] += 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = _PATH_TAIL.match(node.value)
                refs[m.group(1) if m else node.value] += 1
    return refs


def _defining_stores(trees: dict[Path, ast.Module]) -> Counter:
    """How often each name is *defined* as a Name (a constant's own assignment counts as a reference above)."""
    out: Counter = Counter()
    for tree in trees.values():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def dead_definitions() -> list[str]:
    trees = _sources()
    ours = {n.name for t in trees.values() for n in t.body if isinstance(n, ast.ClassDef)}
    refs, stores = _references(trees), _defining_stores(trees)
    dunder = re.compile(r"^__\w+__$")
    return sorted(f"{where}: {name}" for where, name, _ in _definitions(trees, ours)
                  if not dunder.match(name.split(".")[-1]) and refs[name.split(".")[-1]] - stores[name] <= 0)


def test_no_definition_is_used_only_by_tests_or_by_nothing():
    dead = dead_definitions()
    assert dead == [], ("defined in pipeline/ cache/ stages/ but used by no code there (only tests, or nothing): "
                        "delete each, or use it: " + ", ".join(dead))


def test_the_finder_finds_a_dead_function(tmp_path, monkeypatch):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "m.py").write_text(
        "LIMIT = 3\n\n\ndef used():\n    return LIMIT\n\n\ndef unused():\n    return used()\n\n\n"
        "class K:\n    def go(self):\n        pass\n\n    def __len__(self):\n        return 0\n\n\n"
        "@main.command('x')\ndef cmd():\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert dead_definitions() == ["pipeline/m.py: K", "pipeline/m.py: K.go", "pipeline/m.py: unused"]
