"""The import structure the architecture promises (docs/architecture.md, "Layout"): no module of ours imports itself
back through others at load, `cache/` imports nothing of ours outside `cache/`, and the CLI loads without torch, so
that `wandistiller --help` answers in well under a second.

The module graph is read from the source with `ast`, never by importing. Every import is an edge, at the top of a
module, inside a function or under `if TYPE_CHECKING:`, and so is an import path in a string (a constant passed to
`importlib.import_module` or `__import__`, or one naming a module of ours, `pkg.module` or `pkg.module:Name`): an
import inside a function or one made for the annotations alone cannot make a half-loaded module, but two modules that
need each other are one module in two files all the same, and moving an import into a function, a type-checking
block or a string only hides that. A registry entry's `impl=` (pipeline/registries.py) is the one string that is no
edge: it is how a declaration the CLI reads names its implementation without loading it, and the implementation
importing its declaration is the design (docs/architecture.md, "Settings and registries").
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "cache", "stages")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


_PATH = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+(?::\w+)?")  # a dotted module path, maybe with its ":Name"
_IMPORTERS = ("import_module", "__import__")


def _string_paths(tree: ast.Module) -> list[str]:
    """The import paths a module spells as strings: what `import_module` or `__import__` is given, and every
    constant spelled as a dotted path, but a registry entry's `impl=` (the module docstring says why)."""
    skip = {id(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "impl"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in _IMPORTERS:
            found += [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and _PATH.fullmatch(node.value)):
            found.append(node.value.partition(":")[0])
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports, at load, in a function, for its annotations or by a string path (a
    package's `__init__` counts for its submodules)."""
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    targets = [t for t in _string_paths(tree) if t in modules]  # ("config.json" is no module of ours)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != name:
                found.add(prefix)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_init_of(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def test_no_module_imports_itself_back():
    graph = _graph()
    # A package's __init__ that imports its own submodules is the usual way a package exposes them, not a circle:
    # the submodule importing its package (which Python runs first anyway) is not an edge back.
    graph = {m: {d for d in deps if not _is_package_init_of(d, m)} for m, deps in graph.items()}
    cycles = _cycles(graph)
    assert cycles == [], f"import circles among our modules (break each by moving what both sides need down): {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_for_annotations_or_by_a_string_path_is_an_edge(tmp_path):
    files = {"p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
             "p.b": "from . import a\n",
             "p.c": "import importlib\n\ndef kind():\n    return importlib.import_module('p.d').D\n",
             "p.d": "KINDS = ('p.c:kind', 'config.json')\n",
             "p.e": "E = Entry('e', impl='p.a:A')\n"}
    modules = {name: tmp_path / f"{name.split('.')[1]}.py" for name in files}
    for name, text in files.items():
        modules[name].write_text(text)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["p.e"] == set()  # (a registry entry's impl: no edge)
    assert _cycles(graph) == [["p.a", "p.b"], ["p.c", "p.d"]]


def test_cache_imports_nothing_of_ours_outside_cache():
    graph = _graph()
    outside = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.split(".")[0] == "cache"
                     for d in deps if d.split(".")[0] != "cache")
    # the architecture's rule: the bottom floor must not reach up
    assert outside == [], "cache/ imports these modules of ours outside cache/ (issue 34, item 1): " + ", ".join(outside)


def test_the_cli_loads_without_torch_or_a_stage():
    code = ("import sys, pipeline.cli; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'diffusers', 'transformers', 'stages', 'numpy') or m.startswith('cache.') and m not in "
            "('cache.cache_error', 'cache.safe_open')); print(','.join(bad))")
    # (cache.cache_error: the CacheError that exits 2; cache.safe_open: the trust boundary the CLI reads its config
    # files through; both import only the standard library)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert r.stdout.strip() == "", f"pipeline.cli imports at load: {r.stdout.strip()}"


def test_help_answers_within_a_second():
    """`wandistiller --help` in a fresh process, the best of 3 (the CI machine is a shared 2-core VM)."""
    exe = Path(sys.executable).parent / "wandistiller"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline.cli"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        r = subprocess.run([*cmd, "--help"], capture_output=True, text=True, cwd=ROOT, env=env)
        best = min(best, time.perf_counter() - t)
        assert r.returncode == 0 and "teacher-cache" in r.stdout, r.stderr
    assert best < 1.0, f"wandistiller --help took {best:.2f} s (best of 3); keep torch and the stages out of the CLI's load"
