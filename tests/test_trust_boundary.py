"""The trust boundary is one place: no module of the package opens, parses, copies or writes a file by itself; it
goes through cache/safe_open.py (reads of what the program did not just write) and cache/safe_write.py (outputs),
which cache/atomic.py's temp+rename serves. The code is walked, not grepped: a call is what the AST says it is.

What may still call these directly is listed below with why; a new entry needs as good a reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "cache", "stages")
BOUNDARY = {"cache/safe_open.py", "cache/safe_write.py", "cache/atomic.py"}

# Calls that read or write a file by path: the builtin open, pathlib's whole-file reads and writes, matplotlib's and
# PIL's savers, shutil's copies, the parsers that take a file, and safetensors' and torch's file loaders.
ATTRS = {"read_text", "read_bytes", "write_text", "write_bytes", "savefig", "load_file", "save_file"}
QUALIFIED = {("json", "load"), ("tomllib", "load"), ("torch", "load"), ("shutil", "copyfile"), ("shutil", "copy"),
             ("shutil", "copy2"), ("shutil", "copytree"), ("shutil", "move")}
NAMES = {"open", "load_file", "save_file"}  # (safetensors.torch's, imported by name)
TRUST = ("safe_open", "safe_write")

# (module, function) -> why the direct call is safe there.
_FRESH_CHECKPOINT = "into the new step-N.<pid>.tmp folder this save just made (os.mkdir: never an existing one)"
_HASHED = "files `check` has just opened without a link and hashed against digests.json"
ALLOWED = {
    ("cache/writer.py", "_Checksummed.__init__"): "stage one's own shard, a new name in the cache it locks, whose "
                                                  "folders it walked for links first (stages/teacher_cache/outdir.py)",
    ("pipeline/faults.py", "children"): "the kernel's /proc files, not a user's",
    ("stages/teacher_cache/placement_choice.py", "_available_ram"): "/proc/meminfo, the kernel's",
    ("stages/teacher_cache/group_offload.py", "_write_groups"): "into the offload folder's new build folder, made "
                                                               "empty just before",
    ("stages/sample/export_lora.py", "run"): "an adapter `_adapter` found inside the run without a link, its header "
                                            "checked against lora.json first (lora_experts.check_files)",
    ("stages/train_student/checkpoint.py", "_fsync_and_digest"): _FRESH_CHECKPOINT,
    ("stages/train_student/checkpoint.py", "_torch_save"): _FRESH_CHECKPOINT,
    ("stages/train_student/checkpoint.py", "save"): _FRESH_CHECKPOINT,
    ("stages/train_student/checkpoint.py", "_seal"): _FRESH_CHECKPOINT,
    ("stages/train_student/checkpoint.py", "load"): _HASHED + " (optimizer.pt with weights_only=True)",
    ("stages/train_student/checkpoint.py", "load_sharded.load"): _HASHED + " (weights_only=True)",
}


def _calls(path: Path):
    """(qualified function name, call text) of every file call in `path` that the rules above cover."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in TRUST:
                    continue  # the boundary's own call; a writer it is handed writes to the file it opened
                if (isinstance(f, ast.Name) and f.id in NAMES) or (isinstance(f, ast.Attribute) and (
                        f.attr in ATTRS or (isinstance(f.value, ast.Name) and (f.value.id, f.attr) in QUALIFIED))):
                    found.append((where or "<module>", ast.unparse(f)))
            visit(child, where)

    visit(tree, "")
    return found


def test_no_module_opens_parses_copies_or_writes_a_file_outside_the_trust_modules():
    seen, stray = set(), []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in BOUNDARY:
                continue
            for where, call in _calls(path):
                seen.add((rel, where))
                if (rel, where) not in ALLOWED:
                    stray.append(f"{rel}: {where}: {call}(...)")
    assert not stray, ("files opened outside cache/safe_open.py and cache/safe_write.py (go through them, or add "
                       "an entry to ALLOWED with why):\n  " + "\n  ".join(stray))
    assert not (stale := set(ALLOWED) - seen), f"ALLOWED names calls that are gone: {sorted(stale)}"


def test_the_walker_sees_what_it_looks_for(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import json, shutil\n"
                   "def f(p):\n    return open(p).read() + p.read_text()\n"
                   "class C:\n    def g(self, a, b):\n        shutil.copyfile(a, b)\n        json.load(a)\n"
                   "def ok(root, fig):\n    safe_write.write_file(root, writer=lambda f: fig.savefig(f))\n"
                   "    return safe_open.read_bytes(root, 'x') + counts.copy()\n")
    assert _calls(src) == [("f", "open"), ("f", "p.read_text"), ("C.g", "shutil.copyfile"), ("C.g", "json.load")]
