"""Result records, the results file and the printed table shared by every benchmark."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results.json"
RESULTS_CUDA = ROOT / "bench" / "results-cuda.json"  # the same rows measured with --device cuda


def results_path(device: torch.device, quick: bool = False) -> Path:
    """Where a run on `device` records its figures: CPU and GPU runs keep separate files, and a `--quick` smoke
    run writes beside them (`results-quick.json`, not kept in git), never over the measured figures."""
    path = RESULTS_CUDA if device.type == "cuda" else RESULTS
    return path.with_name(f"{path.stem}-quick.json") if quick else path


def cli_results_path(argv: list[str]) -> Path:
    """`results_path` of a benchmark run as `python -m bench.NAME ARGV` (its --device, its --quick)."""
    device = next((a.split("=", 1)[1] for a in argv if a.startswith("--device=")), None)
    if device is None and "--device" in argv[:-1]:
        device = argv[argv.index("--device") + 1]
    return results_path(pick_device(device or "auto"), quick="--quick" in argv)


def result(name: str, value: float, baseline: float, unit: str, target: float | None, better: str,
           ratio: float | None = None, note: str = "") -> dict:
    """One figure: `ratio` = value / baseline unless given; `better` is '<=' or '>=' (how ratio meets target), or
    'info': a figure shown beside the targets, with none of its own (always met)."""
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    if better == "info":
        met, shown = True, "info"
    else:
        met, shown = ((ratio <= target) if better == "<=" else (ratio >= target)), f"{better} {target}"
    return {"name": name, "value": round(value, 6), "baseline": round(baseline, 6), "ratio": round(ratio, 4),
            "target": shown, "met": bool(met and not math.isnan(ratio)), "unit": unit, "note": note}


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None, "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def save(results: list[dict], path: Path = RESULTS) -> None:
    """Merge `results` into the results file by name (so benchmarks can run one at a time)."""
    old = json.loads(path.read_text()) if path.exists() else []
    if isinstance(old, dict):
        old = old.get("results", [])
    by_name = {r["name"]: r for r in old}
    by_name.update({r["name"]: r for r in results})
    path.write_text(json.dumps(list(by_name.values()), indent=2) + "\n")


def table(results: list[dict]) -> str:
    rows = [("name", "value", "baseline", "unit", "ratio", "target", "met")]
    for r in results:
        rows.append((r["name"], f"{r['value']:.4g}", f"{r['baseline']:.4g}", r["unit"], f"{r['ratio']:.3f}",
                     r["target"], "-" if r["target"] == "info" else "yes" if r["met"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exponent(sizes: list[float], times: list[float]) -> float:
    """Least-squares slope of log(time) on log(size): 1 = linear cost."""
    xs, ys = [math.log(s) for s in sizes], [math.log(t) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


# --- devices and timing -------------------------------------------------------------------------------------------

def pick_device(name: str = "auto") -> torch.device:
    """'auto' (CUDA when visible), 'cpu' or 'cuda[:i]'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA device is visible")
        torch.cuda.set_device(dev.index or 0)
    return dev


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer around it measures the work and not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, synchronised with the device on both sides."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def interleaved(fns: dict, reps: int, device: torch.device) -> dict[str, list[float]]:
    """Time every `fns[name]()` `reps` times, alternating them (the order rotates each round) so that all
    see the same machine state; returns every time, per name. Take the min (best-of-N) for the figure."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(timed(fns[n], device))
    return out


# --- files and processes ------------------------------------------------------------------------------------------

def drop_page_cache(path: Path) -> bool:
    """Flush `path` to disk (fsync) and ask the kernel to drop its cached pages, so the next read comes from
    the disk (DONTNEED drops clean pages only: hence the fsync). False where the OS has no posix_fadvise; on
    tmpfs the call succeeds and changes nothing."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def drop_tree(path: Path) -> bool:
    """Flush every file under `path` to disk and drop it from the page cache: one `os.sync()` (one journal
    commit, not one per file: a prompt store holds a few files per prompt), then posix_fadvise(DONTNEED) on
    each file. False where the OS has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    for f in Path(path).rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def tree_bytes(path: Path) -> int:
    """Apparent size of every file under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_CHILD_TAG = "BENCH-CHILD-JSON "


def in_child(target: str, **kwargs) -> dict:
    """Run `target` ("module:function", called with `kwargs`, returning a JSON-able dict) in a fresh
    interpreter, so its peak RSS and its imports are its own; returns what it returned."""
    import subprocess
    import sys

    mod, fn = target.split(":")
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from {mod} import {fn}; "
            f"print({_CHILD_TAG!r} + json.dumps({fn}(**json.loads(sys.argv[1]))), flush=True)")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(_CHILD_TAG)]
    if res.returncode or not lines:
        raise RuntimeError(f"{target} failed in its child process (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len(_CHILD_TAG):])


def machine_line(m: dict | None = None) -> str:
    m = m or machine()
    return (f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, "
            f"{m['cuda'] or 'no GPU'}, torch {m['torch']}, Python {m['python']}, {m['date']}")


# --- inputs shared by the benchmarks ------------------------------------------------------------------------------

def prompt_file(work: Path, n: int) -> Path:
    """`n` distinct prompts: data/prompts.txt, then numbered variations of it."""
    from pipeline.prompts import read_prompt_file

    base = read_prompt_file(ROOT / "data" / "prompts.txt")
    p = work / f"prompts-{n}.txt"
    p.write_text("\n".join(base[i] if i < len(base) else f"{base[i % len(base)]} (variation {i // len(base)})"
                           for i in range(n)) + "\n")
    return p


def stage_one_placement(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def wide_teacher(out: Path, dim: int, ffn: int, layers: int, head_dim: int = 16, seed: int = 0) -> Path:
    """The embedded tiny Wan 2.2 teacher (same encoder, tokenizer, VAE, scheduler) with both experts
    replaced by `WanTransformer3DModel`s of the given width and depth. Seeded: same arguments, same bytes."""
    from diffusers import WanTransformer3DModel

    from pipeline.tiny_teacher import SPECS, TEXT_DIM, write_tiny_teacher

    write_tiny_teacher(out, "wan2.2", seed)
    for i, comp in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(seed + 100 + i)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=dim // head_dim, attention_head_dim=head_dim,
            in_channels=SPECS["wan2.2"].z_dim, out_channels=SPECS["wan2.2"].z_dim, text_dim=TEXT_DIM, freq_dim=32,
            ffn_dim=ffn, num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        for f in (out / comp).iterdir():
            f.unlink()
        model.save_pretrained(out / comp, safe_serialization=True)
    return out


def student_config(out: Path, dim: int, ffn: int, layers: int, head_dim: int = 16) -> Path:
    """A student JSON config for the tiny teachers (16 latent channels, text_dim 32)."""
    base = json.loads((ROOT / "configs" / "student-tiny.json").read_text())
    base.update(num_attention_heads=dim // head_dim, attention_head_dim=head_dim, ffn_dim=ffn, num_layers=layers)
    out.write_text(json.dumps(base, indent=2))
    return out


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
