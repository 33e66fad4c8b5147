"""The import structure the architecture promises (docs/architecture.md, "Layout"): no module of ours imports itself
back through others at load, `cache/` imports nothing of ours outside `cache/`, and the CLI loads without torch, so
that `wandistiller --help` answers in well under a second.

The module graph is read from the source with `ast`, never by importing. Every import is an edge, at the top of a
module or inside a function: an import inside a function cannot make a half-loaded module, but two modules that
need each other are one module in two files all the same, and moving an import into a function only hides that.
"""

from __future__ import annotations

import ast
import os
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


def _import_nodes(tree: ast.Module):
    """Every statement that may run: the module's body and its function bodies alike (`if TYPE_CHECKING:` blocks
    never run)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports, at load or in a function (a package's `__init__` counts for its
    submodules)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
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
    assert _cycles(graph) == [], "import circles among our modules (break each by moving what both sides need down)"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


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
