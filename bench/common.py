"""Result records, the results file and the printed table shared by every benchmark."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results.json"


def result(name: str, value: float, baseline: float, unit: str, target: float, better: str,
           ratio: float | None = None, note: str = "") -> dict:
    """One figure: `ratio` = value / baseline unless given; `better` is '<=' or '>=' (how ratio meets target)."""
    if ratio is None:
        ratio = value / baseline if baseline else float("nan")
    met = (ratio <= target) if better == "<=" else (ratio >= target)
    return {"name": name, "value": round(value, 6), "baseline": round(baseline, 6), "ratio": round(ratio, 4),
            "target": f"{better} {target}", "met": bool(met and not math.isnan(ratio)), "unit": unit, "note": note}


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
                     r["target"], "yes" if r["met"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exponent(sizes: list[float], times: list[float]) -> float:
    """Least-squares slope of log(time) on log(size): 1 = linear cost."""
    xs, ys = [math.log(s) for s in sizes], [math.log(t) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
