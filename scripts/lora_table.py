"""The LoRA table of docs/results.md from a `scripts/measure_lora.sh` run: the `eval` report's rows (final-latent error,
attribute scores, time per image) beside each model's training: trained parameters (train-student's first line),
optimizer steps, wall time (`/usr/bin/time`) and the time at the run's median rate (the median of its logged
samples/s: the 2-core VM is shared, and another job slows some stretches of a run, not the model).

    python scripts/lora_table.py runs/lora-m
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def training(out: Path, name: str) -> dict:
    """What the run NAME in OUT cost to train."""
    log = (out / f"{name}.log").read_text()
    wall = re.search(rf"^{re.escape(name)} ([\d.]+) s$", log, re.M)
    params = re.search(r"([\d.]+)M-parameter student(?: \(([\d.]+)M trained)?", log)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("type") == "train"]
    samples = train[-1]["samples"]
    median = statistics.median(r["samples_per_s"] for r in train)
    return {"steps": train[-1]["step"], "wall_s": float(wall.group(1)) if wall else None,
            "median_s": samples / median,
            "trained_m": float(params.group(2) or params.group(1)) if params else None}


def name_of(path: str) -> str:
    """The run's name: its folder in OUT (the report names the weights folder inside it, student/ or student_ema/)."""
    p = Path(path)
    return p.parent.name if p.name in ("student", "student_ema") else p.name


def label(name: str) -> str:
    """measure_lora.sh's run names, as docs/results.md says them."""
    if m := re.fullmatch(r"lora(\d+)-r(\d+)", name):
        return f"LoRA of the teacher, rank {m[2]}, K = {m[1]}"
    if m := re.fullmatch(r"seg(\d+)", name):
        return f"compact segment student, K = {m[1]}"
    return "compact velocity student" if name == "velocity" else name


def main(out: Path) -> None:
    report = json.loads((out / "eval-lora.json").read_text())
    head = ("| model | steps | trained params | training steps | training time (median rate; wall) | "
            "final-latent MSE | attribute acc. | all right | kept | denoise s | x faster |")
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for r in report["table"]:
        if r["label"] == "teacher":
            cost = "| – | – | – |"
        else:
            t = training(out, name_of(r["path"]))
            wall = f"{t['wall_s'] / 60:.1f}" if t["wall_s"] else "?"
            cost = (f"| {t['trained_m']:.2f}M | {t['steps']} | {t['median_s'] / 60:.1f} min; {wall} min |")
        model = "teacher (CFG, 2 experts)" if r["label"] == "teacher" else label(name_of(r["path"]))
        kept = r.get("all_right_ratio")  # (the ratio of all-right rates these tables printed as kept)
        print(f"| {model} | {r['steps']} {cost} {r['final_latent_mse']:.4f} | {r['attribute_accuracy']:.1%} | "
              f"{r['all_right']:.1%} | {'–' if kept is None else f'{kept:.0%}'} | {r['denoise_s_per_image']:.4f} | "
              f"{r.get('speedup_denoise') or 1:.1f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/lora-m"))
